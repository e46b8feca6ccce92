"""A pointer over the shopper's words: which word of the prompt a reply's string value starts with.

The pointer itself (what it reads, its net, ``Pointer.load`` and ``pick``) is ``drafting.pointer``, which
the hybrid rule ``pointer`` runs in the simulator and in vLLM. This module trains one: ``train_pointer`` on
the training split's gold replies (``sequences_from_gold``), through ``cartspec draft pointer``.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
import json
from typing import Any, Callable, Sequence

import numpy as np
import torch

# Pointer and PointerConfig: its callers import them from here too
from ..drafting.pointer import (FLAGS, N_SLOTS, NUMBER, NUMBER_PREFIX, Pointer, PointerConfig,  # noqa: F401
                                PointerNet, candidates, continuation, number_candidates, number_text, save,
                                value_key)
from ..drafting.tokens import SPECIAL_TEXT, number_open, value_open

# --- training -------------------------------------------------------------------------------------

@dataclass
class Example:
    tokens: np.ndarray
    flags: np.ndarray
    key_ids: list[int]
    quote: int
    positive: list[int]  # indices into the output (0: no copy)
    number: bool = False  # a number value's start (its candidates: the prompt's numbers only)


NUMBER_TOKENS = 12  # reply tokens read for a number value (``119.99`` is 6 on SmolLM2)


def examples(sequences: Sequence[tuple[Sequence[int], int]], info: Any) -> list[Example]:
    """One example per value start of every reply: at a string value's opening quote
    (``drafting.tokens.value_open`` at the context's last token) the candidates whose drafted first token is
    the reply's are positive; at a number value's start (``drafting.tokens.number_open``, the reply's next
    token a digit) the prompt's numbers (``number_candidates``) equal to the reply's number; else "no copy"."""
    out = []
    for toks, P in sequences:
        firsts = None  # each candidate's first drafted token: the same for every value of this prompt
        for j in range(P + 1, len(toks)):
            ctx = toks[:j]
            number = bool(info.digit[toks[j]]) and number_open(ctx, P, info)
            if not number and value_open(ctx, P, info) != j - 1:
                continue
            key = value_key(ctx, P, j - 1, info.texts)
            c = candidates(ctx, P, j - 1, key, info.texts, SPECIAL_TEXT)
            key_ids = info.encode(key) if key else []
            if number:
                idx = np.flatnonzero(number_candidates(c))
                m = NUMBER.match("".join(info.texts[t] for t in toks[j:j + NUMBER_TOKENS]))
                pos = [n + 1 for n, i in enumerate(idx) if number_text(c, int(i)) == m.group()]
                out.append(Example(c.tokens[idx], c.flags[idx], key_ids, int(ctx[-1]), pos or [0], True))
                continue
            if firsts is None:
                firsts = [continuation(c, n, 1, info.encode)[:1] for n in range(len(c.starts))]
            pos = [n + 1 for n, f in enumerate(firsts) if f == [toks[j]]]
            out.append(Example(c.tokens, c.flags, key_ids, int(ctx[-1]), pos or [0]))
    return out


def _batch(ex: Sequence[Example]) -> tuple[torch.Tensor, ...]:
    B, n = len(ex), max(len(e.tokens) for e in ex) or 1
    m = max(len(e.key_ids) for e in ex) or 1
    tokens = torch.full((B, n, N_SLOTS), -1, dtype=torch.long)
    flags = torch.zeros(B, n, len(FLAGS))
    mask = torch.zeros(B, n, dtype=torch.bool)
    keys = torch.full((B, m), -1, dtype=torch.long)
    pos = torch.zeros(B, 1 + n, dtype=torch.bool)
    for b, e in enumerate(ex):
        c = len(e.tokens)
        tokens[b, :c] = torch.from_numpy(e.tokens)
        flags[b, :c] = torch.from_numpy(e.flags)
        mask[b, :c] = True
        keys[b, :len(e.key_ids)] = torch.tensor(e.key_ids, dtype=torch.long)
        pos[b, e.positive] = True
    quote = torch.tensor([e.quote for e in ex], dtype=torch.long)
    return tokens, flags, mask, keys, quote, pos


def initial_nets(init: Path | None, embed_dim: int,
                 target: dict[str, Any] | None) -> tuple[PointerConfig, PointerNet, PointerNet | None]:
    """The nets training starts from: a trained pointer's (``init``: its weights and settings, its number net
    where it has one; a warm start), else random ones. The config records ``target``. Raises ValueError for a
    pointer trained for another hidden size than ``embed_dim``."""
    if init is None:
        cfg = PointerConfig(embed_dim=embed_dim, cartspec={"target": target or {}})
        return cfg, PointerNet(cfg), None
    from safetensors.torch import load_file

    init = Path(init)
    conf = json.loads((init / "config.json").read_text())
    cfg = PointerConfig(**{**conf, "cartspec": {"target": target or {}}, "log": {}})
    if cfg.embed_dim != embed_dim:
        raise ValueError(f"the pointer in {init} was trained for a hidden size of {cfg.embed_dim}; the target's "
                         f"embedding has {embed_dim}")
    state = load_file(str(init / "pointer.safetensors"))
    net = PointerNet(cfg)
    net.load_state_dict({k: v for k, v in state.items() if not k.startswith(NUMBER_PREFIX)})
    number = {k[len(NUMBER_PREFIX):]: v for k, v in state.items() if k.startswith(NUMBER_PREFIX)}
    number_net = None
    if number:
        number_net = PointerNet(cfg)
        number_net.load_state_dict(number)
    return cfg, net, number_net


def train_pointer(model_dir: Path, sequences: Sequence[tuple[Sequence[int], int]], info: Any, out: Path,
                  epochs: int = 20, lr: float = 3e-3, batch: int = 64, seed: int = 0,
                  dev: Sequence[tuple[Sequence[int], int]] = (), target: dict[str, Any] | None = None,
                  init: Path | None = None, keep_best: bool = False,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train on ``sequences`` (prompt + reply token ids, prompt length), check on ``dev``, save to ``out``
    (``target``: what the config records of the model trained for). Two nets of one shape: one on the string
    values' starts, then one on the number values' (``Pointer``'s ``numbers``; none where the replies have
    no number value and ``init`` has none). ``init``: a pointer directory to start from (``initial_nets``; its
    accuracy on ``dev`` before training is the log's ``start``); 0 ``epochs`` keeps its weights as they are.
    ``keep_best``: each net keeps the weights of its epoch that got the most ``dev`` value starts right
    (``correct``), not the last epoch's, and a net warm-started from ``init`` counts its start as epoch 0: a
    refresh never deploys a pointer that checks worse than the one it started from."""
    from ..model.weights import load_target_weights

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    embed = load_target_weights(Path(model_dir))["embed"].float()
    cfg, net, number_net = initial_nets(init, int(embed.shape[1]), target)
    ex = examples(sequences, info)
    dev_ex = examples(dev, info) if dev else []
    strings, numbers = [e for e in ex if not e.number], [e for e in ex if e.number]
    log(f"pointer: {len(strings)} string value starts to learn from ({sum(e.positive != [0] for e in strings)} "
        f"copied), {len(numbers)} number value starts ({sum(e.positive != [0] for e in numbers)} copied); "
        f"{len(dev_ex)} to check")
    dev_strings, dev_numbers = [e for e in dev_ex if not e.number], [e for e in dev_ex if e.number]
    start = ({**accuracy(net, embed, dev_strings),
              **(accuracy(number_net, embed, dev_numbers) if number_net is not None else {})}
             if init is not None else {})
    hist = _fit(net, embed, strings, dev_strings, epochs, lr, batch, seed,
                lambda row: log("pointer: " + " ".join(f"{k}={v}" for k, v in row.items())), keep_best,
                init is not None)
    number_hist: list[dict[str, Any]] = []
    if any(e.positive != [0] for e in numbers):
        warm_numbers = number_net is not None
        number_net = number_net if number_net is not None else PointerNet(cfg)
        number_hist = _fit(number_net, embed, numbers, [e for e in dev_ex if e.number], epochs, lr, batch, seed,
                           lambda row: log("pointer, numbers: " + " ".join(f"{k}={v}" for k, v in row.items())),
                           keep_best, warm_numbers)
    cfg.log = {"examples": len(strings), "copied": sum(e.positive != [0] for e in strings),
               "dev_examples": sum(not e.number for e in dev_ex), "epochs": hist,
               "numbers": {"examples": len(numbers), "copied": sum(e.positive != [0] for e in numbers),
                           "dev_examples": sum(e.number for e in dev_ex), "epochs": number_hist},
               "start": start, "seconds": round(time.perf_counter() - t0, 1)}
    save(net, cfg, out, number_net)
    return cfg.log


def _fit(net: PointerNet, embed: torch.Tensor, ex: Sequence[Example], dev_ex: Sequence[Example], epochs: int,
         lr: float, batch: int, seed: int, log: Callable[[dict], None],
         keep_best: bool = False, from_start: bool = False) -> list[dict[str, Any]]:
    """Adam on ``ex`` (the loss: minus the log of the positives' share), ``accuracy`` on ``dev_ex`` after
    each epoch; the epochs' rows. ``keep_best`` (with ``dev_ex``): the net ends with the weights of the epoch
    with the most ``correct`` picks (``from_start``: as it started counts, as epoch 0), the last row saying
    which (``kept_epoch``)."""
    import copy

    opt = torch.optim.Adam(net.parameters(), lr=lr)
    rng = random.Random(seed)
    hist = []
    keep_best = keep_best and bool(dev_ex)
    best = None
    if keep_best:
        best = (correct(net, embed, dev_ex), 0, copy.deepcopy(net.state_dict())) if from_start else (-1, 0, None)
    for ep in range(epochs):
        net.train()
        order = list(range(len(ex)))
        rng.shuffle(order)
        total = 0.0
        for b in range(0, len(order), batch):
            tokens, flags, mask, keys, quote, pos = _batch([ex[i] for i in order[b:b + batch]])
            s = net.scores(net.proj(embed), tokens, flags, mask, keys, quote)
            loss = (torch.logsumexp(s, 1) - torch.logsumexp(s.masked_fill(~pos, float("-inf")), 1)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(order[b:b + batch])
        row = {"epoch": ep + 1, "loss": round(total / max(1, len(ex)), 4), **accuracy(net, embed, dev_ex)}
        if best is not None:
            right = correct(net, embed, dev_ex)
            if right > best[0]:
                best = (right, ep + 1, copy.deepcopy(net.state_dict()))
        hist.append(row)
        log(row)
    if best is not None and hist:
        net.load_state_dict(best[2])
        hist[-1]["kept_epoch"] = best[1]
        if best[1] != len(hist):
            log({"kept_epoch": best[1], "correct": best[0], "of": len(dev_ex)})
    return hist


@torch.no_grad()
def correct(net: PointerNet, embed: torch.Tensor, ex: Sequence[Example]) -> int:
    """How many of ``ex`` the pick gets right: a copied value's start drafted right, or "no copy" kept."""
    acc = accuracy(net, embed, ex)
    if not acc:
        return 0
    pre = "dev_number_" if ex[0].number else "dev_"
    n_keep = sum(e.positive == [0] for e in ex)
    return round(acc[pre + "copied_top1"] * (len(ex) - n_keep) + acc[pre + "no_copy_kept"] * n_keep)


@torch.no_grad()
def accuracy(net: PointerNet, embed: torch.Tensor, ex: Sequence[Example]) -> dict[str, float]:
    """On ``ex`` (one kind of value: ``train_pointer`` checks each net on its own): the share of copied values
    the pick drafts right (a string's first token, a number whole), and of the other values where it picks
    "no copy"; named ``dev_number_...`` for number values."""
    if not ex:
        return {}
    net.eval()
    table = net.proj(embed)
    hit = n_copy = keep = n_keep = 0
    for b in range(0, len(ex), 256):
        part = ex[b:b + 256]
        tokens, flags, mask, keys, quote, pos = _batch(part)
        best = net.scores(table, tokens, flags, mask, keys, quote).argmax(1)
        for e, p, bi in zip(part, pos, best.tolist()):
            if e.positive == [0]:
                n_keep += 1
                keep += bi == 0
            else:
                n_copy += 1
                hit += bool(p[bi])
    pre = "dev_number_" if ex[0].number else "dev_"
    return {pre + "copied_top1": round(hit / max(1, n_copy), 4), pre + "no_copy_kept": round(keep / max(1, n_keep), 4)}


def reply_text(req: Any) -> str | None:
    """The reply a request's sequence ends in: its gold JSON as the served model writes it (``json.dumps``),
    else the reference reply of a chat line (its last assistant message); None where it has neither."""
    if req.gold is not None:
        return json.dumps(req.gold, ensure_ascii=False)
    ref = (req.meta or {}).get("reference")
    return ref if isinstance(ref, str) and ref else None


def sequences_from_gold(tokenizer: Any, reqs: Sequence[Any]) -> list[tuple[list[int], int]]:
    """Prompt + reply token ids (``reply_text``, then the end of turn) and the prompt's length, for the
    requests that have a reply."""
    from ..task.prompts import render

    out = []
    eos = tokenizer.eos_token or ""
    for r in reqs:
        text = reply_text(r)
        if text is None:
            continue
        p = tokenizer(render(tokenizer, r), add_special_tokens=False).input_ids
        reply = tokenizer(text + eos, add_special_tokens=False).input_ids
        out.append((list(p) + list(reply), len(p)))
    return out
