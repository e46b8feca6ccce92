"""vLLM's n-gram lookup's index of a prompt (``PromptIndex``): built once per prompt and kept by the request's
``prompt.Prompt``, so the lookup (``drafting.lookup``, which re-exports it) costs a dictionary read per n-gram
size at each verify step instead of a scan of the whole context."""

from __future__ import annotations

from typing import Sequence


class PromptIndex:
    """For each n-gram size, each n-gram of the prompt -> the start of its earliest occurrence."""

    def __init__(self, prompt: Sequence[int], n_min: int, n_max: int):
        p = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
        self.size = len(p)
        self.first: dict[int, dict[tuple, int]] = {}
        for n in range(n_min, n_max + 1):
            d: dict[tuple, int] = {}
            for s in range(len(p) - n, -1, -1):  # from the end, so the earliest occurrence is written last
                d[tuple(p[s:s + n])] = s
            self.first[n] = d
