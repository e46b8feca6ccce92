"""Named request sets: the task requests a study point, the quality study and the analysis share.

``commerce`` is the task's test split (search and support mixed), ``search`` and ``support``
its halves; ``handwritten`` the 40 search requests written by hand (``HANDWRITTEN``: phrasings and
values no generator produced, with gold written by hand); any other name is a JSONL request file
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
BUILTIN_SETS = ("commerce", "search", "support", "handwritten")
SPARE = 16  # requests past ``n``: a point's warm-up takes its requests from the end


def load_request_set(name: str, n: int) -> list[Request]:
    """The first ``max(n, 1) + SPARE`` requests of set ``name`` (fewer when a file holds fewer)."""
    if name == "handwritten":
        reqs = read_requests(HANDWRITTEN)
    elif name in BUILTIN_SETS:
        reqs = generate("test", max(4 * n, 64))
        if name != "commerce":
            reqs = [r for r in reqs if r.task == name]
    else:
        reqs = read_requests(name)
    return reqs[: max(n, 1) + SPARE]
