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
        if rng.random() < 0.08:
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            p = rng.choice(MATH).format(a=a, b=b, c=a * rng.randint(1, 9) + b)
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
