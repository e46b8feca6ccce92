"""Named request sets: the task requests a study point, the quality study and the analysis share.

``commerce`` is the task's test split (search and support mixed), ``search`` and ``support``
its halves; ``handwritten`` the 40 search requests written by hand (``HANDWRITTEN``: phrasings and
values no generator produced, with gold written by hand); ``real`` and ``real-traffic`` real shoppers'
product-search queries (``REAL``: Wayfair's WANDS queries, no gold); any other name is a JSONL request file
(``task/data.py`` says what a line holds).
The same name and size give the same requests every time, so replies recorded by a study can be
paired with their gold answers later by regenerating the set.
"""

from __future__ import annotations

from ..paths import ASSETS
from .data import Request, read_requests
from .generator import generate

# 40 search, compare and refine requests written by hand, not by ``task.generator``: how a shopper types
# (abbreviations, other currencies, brands and products outside the generator's lists); provenance in
# assets/requests/README.md
HANDWRITTEN = ASSETS / "requests" / "handwritten.jsonl"
# 480 real shoppers' product-search queries (Wayfair's WANDS, MIT licence; provenance in
# assets/requests/README.md), as search requests without gold. The first REAL_TRAFFIC (by query id) are a
# shop's first recorded traffic (``real-traffic``: what a refresh may learn from); the rest are ``real``, the
# held-out evaluation set that nothing trains on
REAL = ASSETS / "requests" / "wands.jsonl"
REAL_TRAFFIC = 300
REAL_SETS = ("real", "real-traffic")
BUILTIN_SETS = ("commerce", "search", "support", "handwritten", *REAL_SETS)
SPARE = 16  # requests past ``n``: a point's warm-up takes its requests from the end


def load_request_set(name: str, n: int) -> list[Request]:
    """The first ``max(n, 1) + SPARE`` requests of set ``name`` (fewer when a file holds fewer)."""
    if name == "handwritten":
        reqs = read_requests(HANDWRITTEN)
    elif name in REAL_SETS:
        reqs = real_requests(name)
    elif name in BUILTIN_SETS:
        reqs = generate("test", max(4 * n, 64))
        if name != "commerce":
            reqs = [r for r in reqs if r.task == name]
    else:
        reqs = read_requests(name)
    return reqs[: max(n, 1) + SPARE]


def real_requests(part: str = "real") -> list[Request]:
    """The real queries' part ``real`` (held out: never trained on) or ``real-traffic`` (the first
    ``REAL_TRAFFIC``, a shop's first recorded traffic), in query-id order."""
    if part not in REAL_SETS:
        raise ValueError(f"the real queries' parts are {REAL_SETS}, got {part!r}")
    reqs = read_requests(REAL)
    return reqs[REAL_TRAFFIC:] if part == "real" else reqs[:REAL_TRAFFIC]
