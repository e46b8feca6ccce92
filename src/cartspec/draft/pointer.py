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
from ..drafting.pointer import (FLAGS, N_SLOTS, Pointer, PointerConfig, PointerNet, candidates,  # noqa: F401
                                continuation, save, value_key)
from ..drafting.tokens import SPECIAL_TEXT, value_open

# --- training -------------------------------------------------------------------------------------

@dataclass
class Example:
    tokens: np.ndarray
    flags: np.ndarray
    key_ids: list[int]
    quote: int
    positive: list[int]  # indices into the output (0: no copy)


def examples(sequences: Sequence[tuple[Sequence[int], int]], info: Any) -> list[Example]:
    """One example per value start of every reply (``drafting.tokens.value_open`` at the context's last token):
    the candidates whose drafted first token is the reply's are positive, else "no copy"."""


    out = []
    for toks, P in sequences:
        firsts = None  # each candidate's first drafted token: the same for every value of this prompt
        for j in range(P + 1, len(toks)):
            ctx = toks[:j]
            if value_open(ctx, P, info) != j - 1:
                continue
            key = value_key(ctx, P, j - 1, info.texts)
            c = candidates(ctx, P, j - 1, key, info.texts, SPECIAL_TEXT)
            if firsts is None:
                firsts = [continuation(c, n, 1, info.encode)[:1] for n in range(len(c.starts))]
            pos = [n + 1 for n, f in enumerate(firsts) if f == [toks[j]]]
            out.append(Example(c.tokens, c.flags, info.encode(key) if key else [], int(ctx[-1]), pos or [0]))
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


def train_pointer(model_dir: Path, sequences: Sequence[tuple[Sequence[int], int]], info: Any, out: Path,
                  epochs: int = 20, lr: float = 3e-3, batch: int = 64, seed: int = 0,
                  dev: Sequence[tuple[Sequence[int], int]] = (), target: dict[str, Any] | None = None,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train on ``sequences`` (prompt + reply token ids, prompt length), check on ``dev``, save to ``out``
    (``target``: what the config records of the model trained for)."""
    from ..model.weights import load_target_weights

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    embed = load_target_weights(Path(model_dir))["embed"].float()
    cfg = PointerConfig(embed_dim=int(embed.shape[1]), cartspec={"target": target or {}})
    net = PointerNet(cfg)
    ex = examples(sequences, info)
    dev_ex = examples(dev, info) if dev else []
    log(f"pointer: {len(ex)} value starts to learn from ({sum(e.positive != [0] for e in ex)} copied), "
        f"{len(dev_ex)} to check")
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    rng = random.Random(seed)
    hist = []
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
        hist.append(row)
        log("pointer: " + " ".join(f"{k}={v}" for k, v in row.items()))
    cfg.log = {"examples": len(ex), "copied": sum(e.positive != [0] for e in ex), "dev_examples": len(dev_ex),
               "epochs": hist, "seconds": round(time.perf_counter() - t0, 1)}
    save(net, cfg, out)
    return cfg.log


@torch.no_grad()
def accuracy(net: PointerNet, embed: torch.Tensor, ex: Sequence[Example]) -> dict[str, float]:
    """On ``ex``: the share of copied values whose first token the pick drafts right, and of the other
    values where it picks "no copy"."""
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
    return {"dev_copied_top1": round(hit / max(1, n_copy), 4), "dev_no_copy_kept": round(keep / max(1, n_keep), 4)}


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
