"""Named request sets: the task requests a study point, the quality study and the analysis share.

``commerce`` is the task's test split (search and support mixed), ``search`` and ``support``
its halves; any other name is a JSONL request file (``task/data.py`` says what a line holds).
The same name and size give the same requests every time, so replies recorded by a study can be
paired with their gold answers later by regenerating the set.
"""

from __future__ import annotations

from .data import Request, read_requests
from .generator import generate

BUILTIN_SETS = ("commerce", "search", "support")
SPARE = 16  # requests past ``n``: a point's warm-up takes its requests from the end


def load_request_set(name: str, n: int) -> list[Request]:
    """The first ``max(n, 1) + SPARE`` requests of set ``name`` (fewer when a file holds fewer)."""
    if name in BUILTIN_SETS:
        reqs = generate("test", max(4 * n, 64))
        if name != "commerce":
            reqs = [r for r in reqs if r.task == name]
    else:
        reqs = read_requests(name)
    return reqs[: max(n, 1) + SPARE]
