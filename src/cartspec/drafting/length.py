"""Draft length per request: stop a request's draft where the head stops being sure.

vLLM drafts γ tokens for every request at every step (its schedule sets γ per batch size only). A token
drafted after the head's confidence has fallen is likely rejected, and the target verifies it anyway: at
a large batch, where a verify step's cost grows with the tokens it checks, that is time spent on nothing.
As in EAGLE-2 and SpecDec++, the draft of each request is cut at the first position ``j`` where the
head's probability of the path so far, ``p_1 · … · p_j`` (each ``p_i`` the head's softmax probability of
its own greedy token), falls below a threshold; a request may keep all γ tokens, or none.

The threshold follows the batch (``threshold_at``): ``STOP_P`` from ``FULL_BATCH`` requests in a step on,
falling linearly to nothing cut at one request. On a CPU a verify pass over a few tokens costs about what one
token does, so at one request a cut saves little and loses the tokens it cuts; from a few requests on each
verified token costs its share of the step, and a token is worth verifying only where it is likely to be kept.

``STOP_P`` and ``FULL_BATCH`` were chosen with a step-cost model (``analysis.cost_model``: α per step, β per
verified token, δ + ε·b per draft forward, fitted from a paper-preset study's fixed-γ points: α 33.1 ms, β 2.16
ms, δ 4.27 ms, ε 0.35 ms on a 2-core AMD EPYC with AVX2 in float32) over the simulator's replay of greedy
replies with the bundled head at γ = 5 (``scripts/draft_stop_sweep.py``): the predicted decoding rate b·τ(θ) /
(α + β·b·(1 + k(θ)) + 5(δ + ε·b)), with k the tokens kept a step and τ the tokens a step moves on, is highest at
θ ≈ 0.2 for one request, 0.6–0.7 at two to four, 0.85 at eight and 0.9–0.95 at 16–32; this rule comes within 1%
of that best at every batch (2% at four requests on the test split), where the earlier one (0.5 from eight
requests on, chosen by tokens a step alone) is predicted ×1.03 / ×1.06 / ×1.08 below it at 8 / 16 / 32 requests
(dev split; the test split's best thresholds are within 0.2 of these). The head is overconfident near the top
(of the tokens whose path probability lies between 0.9 and 0.98, about two thirds are accepted), so the best
threshold lies above the share of a step's time one verified token costs.

In a hybrid (the head's draft with the prompt's copies, ``drafting.rules``) the head's probabilities judge the
head's own tokens only: a copy replaces the head's draft from its first copied position on, and the head
never gave the copied tokens a probability. So a hybrid's draft is cut where the head's path falls below the
threshold before the first copied token, and kept whole where the head is sure enough up to it
(``with_copy``): the copy is then judged by the verifier alone, as in the hybrid without a cut.
"""

from __future__ import annotations

from typing import Sequence

# the one default threshold on the draft's path probability (module doc); ``Speculative.draft_stop`` carries it
STOP_P = 0.9
# the batch (requests in a step) from which the whole threshold applies; below it the threshold falls linearly to
# 0 at one request (nothing cut, no probability computed): a verify pass over a few tokens costs about what
# one token does, so there a token worth little still pays (module doc)
FULL_BATCH = 4
# the speculative methods whose drafts a threshold cuts: the ones an EAGLE-3 head drafts (its probabilities)
METHODS = ("eagle3", "hybrid")
# where a deployment's threshold travels into vLLM: its ``--additional-config``, as ``{KEY: {"p": θ}}``
KEY = "cartspec_draft_stop"


def check_stop_p(p: float) -> float:
    """``p`` if it is a usable threshold (0 < p < 1), else a ValueError that says so."""
    if not 0.0 < float(p) < 1.0:
        raise ValueError(f"a draft stop threshold is a probability strictly between 0 and 1, got {p}")
    return float(p)


def threshold_at(stop_p: float, batch: int, full_batch: int = FULL_BATCH) -> float:
    """The threshold a step of ``batch`` requests cuts at: ``stop_p`` from ``full_batch`` requests on, falling
    linearly to 0 (no cut) at one request."""
    if full_batch <= 1:
        return stop_p
    if batch <= 1:
        return 0.0
    return stop_p * min(1.0, (batch - 1) / (full_batch - 1))


def kept_length(probs: Sequence[float], stop_p: float) -> int:
    """How many leading draft tokens to keep: up to the first position whose path probability (the product
    of ``probs`` up to it) is below ``stop_p``."""
    path = 1.0
    for j, p in enumerate(probs):
        path *= float(p)
        if path < stop_p:
            return j
    return len(probs)


def with_copy(kept: int, first_copy: int | None, k: int) -> int:
    """A hybrid draft's kept length (module doc): ``kept`` (the head's cut, ``kept_length`` of its own
    probabilities) where it falls before ``first_copy`` (the first position whose token is not the head's;
    None: the draft is the head's), else all ``k`` tokens."""
    if first_copy is None or kept < first_copy:
        return kept
    return k


def first_copy(draft: Sequence[int], head: Sequence[int]) -> int | None:
    """The first position where ``draft`` is not the head's draft ``head`` (None: the head's draft, or a prefix of it)."""
    for j, (a, b) in enumerate(zip(draft, head)):
        if int(a) != int(b):
            return j
    return None


def kept_lengths(probs, stop_p: float) -> list[int]:
    """``kept_length`` for every row of ``probs`` (``[num_reqs, k]``: a tensor, an array or lists), vectorised
    over the batch where it is a tensor."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch ships with the package
        torch = None
    if torch is not None and isinstance(probs, torch.Tensor):
        if probs.numel() == 0:
            return [0] * probs.shape[0]
        below = probs.double().cumprod(dim=1) < stop_p  # [n, k]
        k = probs.shape[1]
        any_below = below.any(dim=1)
        first = below.int().argmax(dim=1)
        return torch.where(any_below, first, torch.full_like(first, k)).tolist()
    return [kept_length(row, stop_p) for row in probs]
