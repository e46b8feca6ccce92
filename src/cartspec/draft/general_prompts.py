"""A built-in set of general, non-commerce chat prompts (for the ``generic`` head).

The study's off-the-shelf head was trained on general chat data answered by
the base model; nothing may be downloaded, so the prompts are composed here
from task templates and topics (deterministic for a seed). None of them is
about shopping, orders or products.
"""

from __future__ import annotations

import random

TOPICS = [
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "volcanoes", "machine learning",
    "the immune system", "climate change", "the printing press", "plate tectonics", "the Roman Empire",
    "electric circuits", "gravity", "the human heart", "ancient Egypt", "the internet", "rainbows",
    "the moon landing", "honey bees", "the solar system", "DNA", "earthquakes", "the Renaissance",
    "renewable energy", "the stock market", "vaccines", "the Great Wall of China", "tides", "sleep",
    "the Industrial Revolution", "coral reefs", "prime numbers", "the theory of evolution", "magnetism",
    "the Olympic Games", "jazz music", "the periodic table", "glaciers", "bird migration", "the printing of money",
    "quantum computers", "the Silk Road", "hurricanes", "the nervous system", "algebra", "the Amazon rainforest",
    "chess", "the history of writing", "recycling", "telescopes", "meditation", "the speed of light",
    "dinosaurs", "the Pythagorean theorem", "democracy", "the seasons", "fermentation", "lightning",
    "the human brain", "cloud computing", "the Mona Lisa", "deserts", "antibiotics", "compound interest",
]

ACTIVITIES = [
    "learn a new language", "start running", "bake bread", "improve my sleep", "write a cover letter",
    "prepare for a job interview", "plant a vegetable garden", "learn to play guitar", "study for an exam",
    "make a budget", "reduce stress", "take better photos", "learn to code in Python", "cook rice",
    "organize my week", "write a short story", "give a presentation", "train a puppy", "start journaling",
    "learn to swim", "make friends in a new city", "keep houseplants alive", "save energy at home",
]

PLACES = ["Paris", "Japan", "Canada", "Kenya", "Peru", "Norway", "Egypt", "Australia", "India", "Mexico",
          "Iceland", "Italy", "Vietnam", "Chile", "Morocco", "Scotland"]

THINGS = ["the ocean", "autumn", "a lighthouse", "friendship", "the city at night", "a rainy day", "mountains",
          "an old library", "the first snow", "a cat", "the stars", "a train journey", "coffee", "a garden"]

TEMPLATES = [
    "Explain {topic} in simple terms.",
    "What is {topic}?",
    "Give me three interesting facts about {topic}.",
    "How would you explain {topic} to a ten-year-old?",
    "Why is {topic} important?",
    "Summarize the main ideas of {topic} in a few sentences.",
    "What are common misconceptions about {topic}?",
    "Write a short paragraph about {topic}.",
    "How do I {activity}?",
    "Give me a step-by-step plan to {activity}.",
    "What are some tips to {activity}?",
    "I want to {activity}. Where should I start?",
    "What mistakes should beginners avoid when they {activity}?",
    "Write a short poem about {thing}.",
    "Write a haiku about {thing}.",
    "Describe {thing} in three sentences.",
    "Write a two-sentence story about {thing}.",
    "What is the capital of {place}, and what is it known for?",
    "What should a first-time visitor know about {place}?",
    "Tell me about the history of {place} in a few sentences.",
    "What is the climate like in {place}?",
    "Compare {topic} and {topic2} in a few sentences.",
    "What is the difference between {topic} and {topic2}?",
]

# What a vendor's general chat mix (ShareGPT/UltraChat-style) also holds: code, structured output,
# rewriting, lists and extraction. Still nothing about shopping, orders or products.
STRUCTURED = [
    "Write a Python function that {code_task}.",
    "Write a JavaScript function that {code_task}.",
    "Explain what this Python code does: `{snippet}`",
    "Return a JSON object with the keys name, year and field for a famous scientist who worked on {topic}.",
    "List three facts about {place} as a JSON array of strings.",
    "Give me a JSON object describing {place} with keys capital, continent and language.",
    "Extract the people and the year from this sentence as JSON: \"{person} wrote about {topic} in {year}.\"",
    "Make a markdown table of three things to know about {topic}.",
    "Write a YAML config with a name of {word} and a version of {a}.{b}.",
    "Rewrite this sentence to be more formal: \"{casual}\"",
    "Fix the grammar in this sentence: \"{casual}\"",
    "Translate to simple English: \"{formal}\"",
    "Give me five words that rhyme with {word}.",
    "Write a SQL query that counts the rows of a table named {table} grouped by {column}.",
    "Turn this into a bulleted list: {topic}, {topic2}, {thing} and {place}.",
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the largest item of a list",
    "counts the vowels in a word", "computes the factorial of n", "merges two sorted lists",
    "removes duplicates from a list", "converts Celsius to Fahrenheit", "returns the n-th Fibonacci number",
    "checks whether a word is a palindrome", "sums the digits of a number", "flattens a nested list",
]
SNIPPETS = ["[x * x for x in range(10)]", "sorted(words, key=len)", "dict(zip(keys, values))",
            "sum(1 for c in s if c.isupper())", "' '.join(reversed(text.split()))", "max(d, key=d.get)"]
PEOPLE = ["Ada Lovelace", "Isaac Newton", "Marie Curie", "Alan Turing", "Rosalind Franklin", "Carl Sagan",
          "Hypatia", "Nikola Tesla", "Emmy Noether", "Charles Darwin"]
WORDS = ["light", "river", "stone", "dream", "orbit", "maple", "signal", "harbor", "echo", "lantern"]
TABLES = [("students", "grade"), ("flights", "airline"), ("books", "author"), ("trees", "species"),
          ("matches", "team"), ("patients", "ward")]
CASUAL = ["hey can u send me the notes from yesterday", "i dunno if the meeting is still on tmrw",
          "gonna be late, traffic is crazy", "that movie was kinda boring tbh", "pls check my essay when u can"]
FORMAL = ["The committee has resolved to postpone the deliberations until further notice.",
          "Attendance at the orientation session is mandatory for all incoming personnel.",
          "The aforementioned phenomenon remains insufficiently understood by contemporary science."]

MATH = [
    "What is {a} plus {b}?", "What is {a} times {b}?", "Is {a} a prime number? Explain.",
    "What is {a} percent of {b}?", "Solve for x: {a}x + {b} = {c}.",
]


def general_prompts(n: int = 800, seed: int = 0) -> list[str]:
    """``n`` distinct general prompts (deterministic)."""
    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < n and tries < n * 50:
        tries += 1
        r = rng.random()
        if r < 0.08:
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            p = rng.choice(MATH).format(a=a, b=b, c=a * rng.randint(1, 9) + b)
        elif r < 0.38:
            t1, t2 = rng.sample(TOPICS, 2)
            table, column = rng.choice(TABLES)
            p = rng.choice(STRUCTURED).format(
                code_task=rng.choice(CODE_TASKS), snippet=rng.choice(SNIPPETS), topic=t1, topic2=t2,
                place=rng.choice(PLACES), person=rng.choice(PEOPLE), year=rng.randint(1600, 2020),
                word=rng.choice(WORDS), a=rng.randint(0, 9), b=rng.randint(0, 20), casual=rng.choice(CASUAL),
                formal=rng.choice(FORMAL), table=table, column=column, thing=rng.choice(THINGS))
        else:
            t1, t2 = rng.sample(TOPICS, 2)
            p = rng.choice(TEMPLATES).format(topic=t1, topic2=t2, activity=rng.choice(ACTIVITIES),
                                             place=rng.choice(PLACES), thing=rng.choice(THINGS))
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def render_general(tokenizer, prompt: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
