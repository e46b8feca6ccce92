"""Training requests with values the generator never uses, for a draft head that must copy, not recall.

A head trained only on the generator's training split meets the same few hundred products, brands, colours
and materials again and again, and learns them as words to recall. A shopper's own words (and the novel
set, ``task.novel``) are not in that list: there the head must follow the target, which copies them from
the request. ``substituted_requests`` gives search requests of the *training* split (training phrasings
only) in which every such value is replaced, in the request and in the gold, by a word of the pools below.
These pools are in no generator pool (seen or held) and in no novel pool, nor share a word with one (a test
checks), so training on them leaks nothing of the held-out words the test and novel sets measure.

Measured (docs/archive/2026-12-drafting-research.md, "Training on from a head"): 800 of them beside the 1,600
plain requests, trained on from the bundled head for two more epochs, gave the head 35.2% of copied values on the
novel set (τ 2.901) where the same training without them gave 32.9% (τ 2.880); with the hybrid's pointer, no gain
(τ 3.477 / 3.480).
"""

from __future__ import annotations

from .data import Request
from .novel import ValuePools, substituted

SUBSTITUTE_WORDS = ValuePools(
    products={
        "shoes": ("brogues", "mules", "oxfords", "wellingtons"),
        "clothing": ("anorak", "tunic", "sarong", "gilet", "culottes"),
        "electronics": ("projector", "turntable", "synthesizer", "thermostat"),
        "home": ("ladle", "teapot", "doormat", "ottoman", "sconce"),
        "beauty": ("bronzer", "tweezers", "cologne", "exfoliant"),
        "sports": ("paddleboard", "skateboard", "barbell", "carabiner"),
        "toys": ("pinwheel", "abacus", "dominoes", "harmonica"),
        "bags": ("knapsack", "holdall", "valise", "pouch"),
        "jewelry": ("medallion", "diadem", "barrette", "armlet"),
        "grocery": ("sauerkraut", "hummus", "couscous", "kimchi", "polenta"),
    },
    brands={
        "shoes": ("lowa", "scarpa", "camper"), "clothing": ("belstaff", "boden", "sezane"),
        "electronics": ("marshall", "fujifilm", "kobo"), "home": ("moccamaster", "staub", "mauviel"),
        "beauty": ("clarins", "lancome", "caudalie"), "sports": ("mammut", "ortovox", "bauer"),
        "toys": ("djeco", "haba", "lottie"), "bags": ("bellroy", "tortuga", "topo"),
        "jewelry": ("bering", "movado", "rolex"), "grocery": ("kusmi", "valrhona", "lurpak"),
    },
    colors=("amber", "jade", "scarlet", "cyan", "sepia", "umber", "mulberry", "pistachio"),
    materials={
        "shoes": ("vinyl",), "clothing": ("angora", "lyocell", "seersucker"), "home": ("terracotta", "acacia"),
        "bags": ("oilcloth", "sailcloth"), "jewelry": ("bronze", "onyx"), "sports": ("graphite", "latex"),
    },
)


def substituted_requests(n: int, seed: int = 0) -> list[Request]:
    """``n`` search requests of the training split whose values are words of ``SUBSTITUTE_WORDS`` (module
    doc); the same (n, seed) always gives the same list, drawn with another seed than ``generate("train",
    ..., seed=0)``'s."""
    return substituted("train", n, seed=5000 + seed, rng_seed=9_000_011 + seed, words=SUBSTITUTE_WORDS,
                       tag="substituted")
