"""Offline acceptance: chain drafting simulated on the target's greedy outputs.

At temperature 0 the target's output does not depend on the drafts, so one
greedy generation (vLLM offline, cached) plus one HF forward pass for the aux
states give everything a server would see. A verify step that starts after
output token ``o_j`` (sequence position ``p``) drafts from chain start
``i = p - 1``: step ``s`` reads the head's own draft of ``x[i+1+s]`` (the target's
token at ``s = 0``) and proposes ``x[i+2+s]``, as vLLM's chain drafting does. Drafts
are accepted while they equal the target's tokens; ``a`` accepted drafts emit
``a + 1`` tokens (the bonus), and the next step starts ``a + 1`` later. For the
head alone, reading the target's tokens instead would give the same acceptance
(the two agree up to the first rejection); a hybrid keeps the head's tokens after
a copy, and those vLLM drafted from the head's own. Before commit db79d80 the
chains read the target's tokens, and the hybrid's simulated τ ran 0.01–0.03 above
vLLM's; now both match it (on the novel set at γ=3, float32: τ 3.470 and every
class's count, equal to vLLM's). The first output token comes from prefill and is
never drafted, as in vLLM.

``summarize`` turns per-step records (accepted, drafted, classes of the drafted
positions) into the metric shape shared with ``acceptance``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..results import AcceptanceStats
from ..task.classes import CLASSES
from .features import FeatureSet
from .head import Eagle3Head


@dataclass
class Step:
    accepted: int
    drafted: int
    classes: list[str] = field(default_factory=list)  # class of each drafted position that has a true token
    # a replayed hybrid's step: how many of its leading positions the head's own draft, from the same chain
    # start, would have had accepted (None: not known, e.g. a step read from vLLM)
    head_accepted: int | None = None


def summarize(steps_per_request: Sequence[Sequence[Step]], gamma: int, tokens_by_class: dict[str, int] | None = None,
              source: str = "simulated") -> dict[str, Any]:
    """τ, acceptance rate, per-position and by-class acceptance from verify steps.

    The counts are an ``AcceptanceStats`` (``acceptance``), so τ and the rate are defined as everywhere
    else: None when no step drafted.

    ``by_class[c]``: ``reached`` = drafts of class ``c`` the verifier looked at
    (every draft up to and including the first rejected one), ``accepted`` =
    those accepted, ``acceptance`` = accepted / reached (the draft's hit rate
    on that kind of token). Two drafters reach different tokens: a step ends
    where a draft is rejected and the target's token (or, after γ accepted
    drafts, its bonus token) is never drafted, so a class's ``acceptance``
    also depends on which of its tokens a drafter's steps happen to reach.

    Steps replayed with the head's own draft beside the hybrid's (``Step.head_accepted``) add
    ``head_alone`` = of the ``reached`` drafts, those the head's own draft from the same chain start would
    have had accepted, and ``head_alone_acceptance`` = head_alone / reached: the head alone on exactly the
    tokens the hybrid's steps reached, a comparison per class that does not depend on which tokens each
    drafter's steps happen to reach.
    """
    n_steps = n_acc = n_draft = 0
    per_pos = [0] * gamma
    by: dict[str, dict[str, int]] = {c: {"reached": 0, "accepted": 0} for c in CLASSES}
    paired = any(st.head_accepted is not None for steps in steps_per_request for st in steps)
    if paired:
        for v in by.values():
            v["head_alone"] = 0
    for steps in steps_per_request:
        for st in steps:
            n_steps += 1
            n_acc += st.accepted
            n_draft += st.drafted
            for k in range(min(st.accepted, gamma)):
                per_pos[k] += 1
            for k, c in enumerate(st.classes[:st.accepted + 1]):
                if k >= st.drafted:
                    break
                by[c]["reached"] += 1
                if k < st.accepted:
                    by[c]["accepted"] += 1
                if paired and st.head_accepted is not None and k < st.head_accepted:
                    by[c]["head_alone"] += 1
    by_class = {c: {**v, "acceptance": (v["accepted"] / v["reached"]) if v["reached"] else None,
                    **({"head_alone_acceptance": v["head_alone"] / v["reached"] if v["reached"] else None}
                       if paired else {}),
                    **({"tokens": tokens_by_class.get(c, 0)} if tokens_by_class is not None else {})}
                for c, v in by.items()}
    stats = AcceptanceStats(drafted=n_draft, accepted=n_acc, steps=n_steps, per_position=per_pos, source=source)
    return {
        "tau": stats.tau,
        "acceptance_rate": stats.rate,
        "per_position": stats.per_position_rate,
        "acceptance": stats.model_dump(),
        "by_class": by_class,
        "verify_steps": n_steps,
        "accepted_tokens": n_acc,
        "draft_tokens": n_draft,
    }


def steps_from_vllm(per_step_accepted: Sequence[int], per_step_drafted: Sequence[int], classes: Sequence[str],
                    ) -> list[Step]:
    """Align vLLM's per-request counts to output tokens.

    Output token 0 comes from prefill; the step that follows output index ``q``
    drafts tokens ``q+1 ..``; ``a`` accepted -> the next step follows ``q+a+1``.
    """
    out, q = [], 0
    for a, d in zip(per_step_accepted, per_step_drafted):
        cls = [classes[q + 1 + k] for k in range(d) if q + 1 + k < len(classes)]
        out.append(Step(int(a), int(d), cls))
        q += int(a) + 1
    return out


@torch.no_grad()
def draft_predictions(head: Eagle3Head, embed: torch.Tensor, fs: FeatureSet, s: int, gamma: int,
                      with_probs: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """[n_starts, gamma] target ids proposed from every chain start ``i`` in
    ``[P-1, L-2]`` of sequence ``s``, each position drafted from the head's own token before it, as vLLM
    drafts (``Eagle3Head.unroll`` with ``own_tokens``: a hybrid that copies into the head's draft keeps
    the head's later tokens as vLLM drafted them); ``with_probs``: also the head's probability of
    each (softmax over its draft vocabulary, as vLLM's drafter has it: the rest of the vocabulary is -inf)."""
    sl = fs.seq(s)
    L = sl.stop - sl.start
    P = int(fs.prompt_lens[s])
    ids = fs.input_ids[sl].long()[None]
    aux = fs.aux[sl].float()[None]
    starts = torch.tensor([(0, i) for i in range(max(P - 1, 0), L - 1)], dtype=torch.long)
    if starts.numel() == 0:
        empty = torch.zeros(0, gamma, dtype=torch.long)
        return (empty, torch.zeros(0, gamma)) if with_probs else empty
    outs = head.unroll(embed, ids, aux, torch.tensor([L]), starts, gamma, own_tokens=True)
    pred = torch.stack([head.to_target(o["logits"].argmax(-1)) for o in outs], dim=1)
    if not with_probs:
        return pred
    return pred, torch.stack([o["logits"].float().softmax(-1).amax(-1) for o in outs], dim=1)


def simulate_sequence(pred: torch.Tensor, tokens: Sequence[int], prompt_len: int, gamma: int,
                      classes: Sequence[str] | None = None,
                      adjust: Callable[[int, list[int]], list[int]] | None = None) -> list[Step]:
    """Walk the verify steps of one greedy output, given proposals ``pred[i - (P-1)]``;
    ``adjust(i, row)`` may replace the proposal from chain start ``i`` (the hybrid); its steps then record
    how far the unreplaced proposal would have been accepted (``Step.head_accepted``)."""
    L = len(tokens)
    P = prompt_len
    steps: list[Step] = []

    def run(row) -> int:
        a = 0
        while a < min(gamma, len(row)) and i + 2 + a < L and int(row[a]) == int(tokens[i + 2 + a]):
            a += 1
        return a

    i = P - 1  # chain start: the last position the target has processed after prefill
    while i + 2 < L:  # x[i+1] is the newest token; something left to propose
        row = pred[i - (P - 1)]
        head_accepted = None
        if adjust is not None:
            head_accepted = run(row)
            row = adjust(i, [int(t) for t in row])
        drafted = min(gamma, len(row))  # a proposal may be shorter than γ (a draft cut per request)
        if not drafted:  # nothing proposed: not a verify step with drafts (as vLLM counts them)
            i += 1
            continue
        a = run(row)
        cls = []
        if classes is not None:
            cls = [classes[i + 2 + k - P] for k in range(drafted) if i + 2 + k < L]
        steps.append(Step(a, drafted, cls, head_accepted))
        i += a + 1
    return steps


def simulate(head: Eagle3Head, embed: torch.Tensor, fs: FeatureSet, gamma: int,
             classes: Sequence[Sequence[str]] | None = None,
             progress: Callable[[int, int], None] | None = None,
             stop_p: float | None = None) -> tuple[dict[str, Any], list[list[Step]]]:
    """Simulated chain drafting over every sequence of ``fs`` (greedy outputs); ``stop_p``: each draft cut
    where the head's path probability falls below it (``drafting.length``), as the ``draft_stop`` patch does."""
    from ..drafting.length import kept_lengths

    head.eval()
    all_steps = []
    for s in range(fs.n_seqs):
        sl = fs.seq(s)
        toks = fs.input_ids[sl].tolist()
        P = int(fs.prompt_lens[s])
        adjust = None
        if stop_p is None:
            pred = draft_predictions(head, embed, fs, s, gamma)
        else:
            pred, probs = draft_predictions(head, embed, fs, s, gamma, with_probs=True)
            lengths = kept_lengths(probs, stop_p)
            adjust = lambda i, row, lengths=lengths, P=P: row[:lengths[i - (P - 1)]]  # noqa: E731
        all_steps.append(simulate_sequence(pred, toks, P, gamma, classes[s] if classes is not None else None,
                                           adjust=adjust))
        if progress:
            progress(s + 1, fs.n_seqs)
    return summarize(all_steps, gamma), all_steps


def head_predictions(head: Eagle3Head, embed: torch.Tensor, fs: FeatureSet, gamma: int,
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The head's proposals from every chain start of every sequence and their probabilities
    (``draft_predictions``)."""
    head.eval()
    out = [draft_predictions(head, embed, fs, s, gamma, with_probs=True) for s in range(fs.n_seqs)]
    return [p for p, _ in out], [c for _, c in out]


def simulate_hybrid(preds: Sequence[torch.Tensor], fs: FeatureSet, gamma: int, cfg: Any,
                    classes: Sequence[Sequence[str]] | None = None, info: Any = None, pointer: Any = None,
                    probs: Sequence[torch.Tensor] | None = None, schema: Any = None, stop_p: float | None = None,
                    ) -> tuple[dict[str, Any], list[list[Step]]]:
    """The hybrid drafter (``drafting.rules``, config ``cfg``) replayed on greedy outputs: from
    chain start ``i`` the server's context is ``x[:i+2]`` (prompt + output up to the newest token)
    and the head's proposal is ``preds[s][i-(P-1)]``; ``hybrid.propose`` combines them, as in vLLM
    (``info``: ``hybrid.TokenInfo``, for the rules that read the tokens' text; ``pointer``: the trained
    pointer, for rule ``pointer``; ``probs``: the head's probability of each proposed token, for the gate,
    ``cfg.head_p``; None: no gate; ``schema``: the replies' ``SchemaGrammar``, for rule ``schema``; ``stop_p``:
    each draft cut where the head's path probability falls below it before the first copied token, as the
    ``draft_stop`` patch cuts a hybrid's, ``drafting.length.with_copy``; it needs ``probs``)."""
    from ..drafting.length import first_copy, kept_length, with_copy
    from ..drafting.rules import propose

    if stop_p is not None and probs is None:
        raise ValueError("a draft cut per request (stop_p) needs the head's probabilities (probs)")

    all_steps = []
    for s in range(fs.n_seqs):
        sl = fs.seq(s)
        toks = fs.input_ids[sl].tolist()
        P = int(fs.prompt_lens[s])
        pr = None if probs is None else probs[s].tolist()

        def adjust(i, row, toks=toks, P=P, pr=pr):
            conf = None if pr is None else pr[i - (P - 1)]
            new = propose(row, toks[:i + 2], P, cfg, info, pointer, conf, schema)
            if stop_p is None:
                return new
            return new[:with_copy(kept_length(conf[:len(row)], stop_p), first_copy(new, row), len(new))]
        all_steps.append(simulate_sequence(preds[s], toks, P, gamma, classes[s] if classes is not None else None,
                                           adjust=adjust))
    return summarize(all_steps, gamma), all_steps


# --- n-gram (prompt lookup), vLLM's method, simulated ---------------------------------

def ngram_propose(context: Sequence[int], gamma: int, n_min: int = 2, n_max: int = 4) -> list[int]:
    """vLLM's n-gram proposer: the longest suffix n-gram (``n_max`` down to ``n_min``)
    that occurred earlier; propose the tokens that followed its earliest occurrence."""
    L = len(context)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = list(context[L - n:])
        for st in range(0, L - n):
            if list(context[st:st + n]) == suffix:
                return list(context[st + n:st + n + gamma])
    return []


class _NgramTrack:
    """vLLM's n-gram proposer as a per-request track (``simulate_proposer``): it reads prompt + reply."""

    def __init__(self, prompt: Sequence[int], n_min: int, n_max: int):
        self.prompt, self.ctx, self.n_min, self.n_max = list(prompt), list(prompt), n_min, n_max

    def feed(self, reply: Sequence[int]) -> None:
        self.ctx = self.prompt + list(reply)

    def draft(self, k: int) -> list[int]:
        return ngram_propose(self.ctx, k, self.n_min, self.n_max)


def simulate_ngram(sequences: Sequence[tuple[Sequence[int], int]], gamma: int, n_min: int = 2, n_max: int = 4,
                   classes: Sequence[Sequence[str]] | None = None) -> tuple[dict[str, Any], list[list[Step]]]:
    """Prompt-lookup drafting on greedy outputs ``(tokens, prompt_len)``; steps with no
    match propose nothing (vLLM skips them: they are not verify steps with drafts)."""
    return simulate_proposer(sequences, gamma, lambda prompt: _NgramTrack(prompt, n_min, n_max), classes)


def simulate_proposer(sequences: Sequence[tuple[Sequence[int], int]], gamma: int,
                      track: Callable[[Sequence[int]], Any],
                      classes: Sequence[Sequence[str]] | None = None) -> tuple[dict[str, Any], list[list[Step]]]:
    """A model-free proposer with per-request state replayed on greedy outputs ``(tokens, prompt_len)``:
    ``track(prompt)`` starts a request's state, whose ``feed(reply)`` takes the reply so far and
    ``draft(k)`` proposes up to ``k`` tokens. Steps that propose nothing are not verify steps (as vLLM
    counts them), as for n-gram."""
    all_steps = []
    for s, (toks, P) in enumerate(sequences):
        toks = list(toks)
        L = len(toks)
        st = track(toks[:P])
        steps = []
        j = P  # last emitted position
        while j < L - 1:
            st.feed(toks[P:j + 1])
            prop = st.draft(gamma)
            if not prop:
                j += 1
                continue
            a = 0
            while a < len(prop) and j + 1 + a < L and prop[a] == toks[j + 1 + a]:
                a += 1
            cls = [classes[s][j + 1 + k - P] for k in range(len(prop)) if j + 1 + k < L] if classes else []
            steps.append(Step(a, len(prop), cls))
            j += a + 1
        all_steps.append(steps)
    return summarize(all_steps, gamma), all_steps
