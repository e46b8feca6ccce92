"""A pointer over the shopper's words: which word of the prompt a reply's string value starts with.

The EAGLE-3 head drafts a reply's JSON structure and keys well and the values it saw in training, but a
value copied from the request is mostly lost at its first token: the context ends in the value's opening
quote and the head drafts a word it knows (``ten`` where the shopper wrote ``jacket``). Prompt lookup
copies the rest of a word once its first token is there; nothing picks the word. This pointer does: at a
value's opening quote it scores every word start of the prompt's turns (not a system message's), and a
"no copy" choice, and its pick is drafted as the prompt's text from that word on (re-encoded with the
served tokenizer).

What it reads is token ids only, which is what vLLM's runner hands the hybrid drafter
(``vllm_plugin.hybrid``): the key whose value opens (``"brand": "`` -> ``brand``), and for every candidate
word its token and its neighbours', as rows of the target's input embedding through a learnt projection
(words it never saw still have the target's embedding), plus a few flags (capitalised, a number, already
in the reply, where in the chat it is, the word equals the key). A word is offered as written and, where
that differs, in lower case (replies often lower-case what the shopper wrote). A small MLP scores each
candidate; a second scores "no copy" from the key (``intent``, ``category``, ``sort``: enums the head
knows). Trained by ``cartspec draft pointer`` on the training split's gold replies (``draft.pointer``): the
target's replies are the gold JSON (``json.dumps``), so no generation is needed.

A number value (``"price_max": `` + the head's digit) is picked the same way by a second net of the same
shape, over the prompt's words that start with a digit, and drafted as that number alone
(``number_continuation``: ``5``, ``0`` for the shopper's "$50"); the head drafts a number's first digit
from the prices and ratings it saw in training, and ``copying.number_lookup`` copies only a number's rest.

Files (``save`` / ``Pointer.load``): ``pointer.safetensors`` (the projection and the two MLPs, and the number
net's as ``number.*``, a few hundred KB: the embedding is the target's, read from the model directory at
load time) and
``config.json`` (sizes, the target it was trained for, the training log).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from .copying import prompt_continuation
from .prompt import Prompt, prompt_of
from .prompt_words import (FLAGS, MAX_CANDIDATES, N_SLOTS, SPECIALS_AFTER,  # noqa: F401 (re-exported)
                           PromptWords, build_prompt_words)
from .tokens import fold

MEMO = 1024  # value starts whose scores are kept (``Pointer.probs``)
NUMBER = re.compile(r"\d+(?:\.\d+)?")  # a number as a reply writes it (``4.8`` of "4.8+ stars", ``250`` of "$250")
_DIGIT = FLAGS.index("digit")


@dataclass
class PointerConfig:
    dim: int = 32  # the projection of the target's embedding
    hidden: int = 64
    # the bundled pointer's: chosen in the simulator on the dev split's greedy replies (its PROVENANCE.md)
    min_p: float = 0.7  # ``pick`` drafts a copy only where its probability is at least this
    veto_p: float = 0.5  # the hybrid drops a text copy inside a value whose "no copy" is at least this likely
    embed_dim: int = 0  # the target's hidden size (set from its embedding)
    cartspec: dict[str, Any] = field(default_factory=dict)  # {"target": {"name", "digest"}}: the model trained for
    log: dict[str, Any] = field(default_factory=dict)


def value_key(context: Sequence[int], prompt_len: int, q: int, texts: Sequence[str]) -> str:
    """The key whose value opens at the quote ``context[q]``: the text between the last ``"`` before the
    last ``":`` of the reply so far (``{"brands": ["nike", "`` -> ``brands``); "" where none."""
    reply = "".join(texts[t] for t in context[prompt_len:q + 1])
    c = reply.rfind('":')
    if c < 0:
        return ""
    o = reply.rfind('"', 0, c)
    return reply[o + 1:c] if o >= 0 else ""


@dataclass
class Candidates:
    """The word starts of the prompt a value may copy: character offsets in ``text`` (the prompt's
    tokens' texts joined), whether offered in lower case, their tokens (``N_SLOTS`` per candidate, -1 for
    none) and ``FLAGS``."""

    text: str
    starts: list[int]
    lowered: list[bool]
    tokens: np.ndarray  # [n, N_SLOTS] int64
    flags: np.ndarray  # [n, len(FLAGS)] float32


_DYNAMIC = [FLAGS.index(f) for f in ("in_reply", "is_key", "after_key")]


def prompt_words(prompt: Sequence[int], texts: Sequence[str], special: str) -> PromptWords:
    """``build_prompt_words`` of the prompt, kept by its ``drafting.prompt.Prompt`` (computed once per prompt)."""
    return prompt_of(prompt, len(prompt)).words(texts, special)


def candidates(context: Sequence[int], prompt_len: int, q: int, key: str, texts: Sequence[str],
               special: str) -> Candidates:
    """The prompt's candidate words (``prompt_words``) with the flags that read the reply so far (up to
    the quote ``context[q]``) and the key whose value opens there."""
    pw = prompt_words(context[:min(prompt_len, len(context))], texts, special)
    return with_dynamic(pw, dynamic_flags(pw, context, prompt_len, q, key, texts))


def with_dynamic(pw: PromptWords, dynamic: np.ndarray) -> Candidates:
    """``pw``'s candidates with the flags that read the reply (``dynamic_flags``) filled in."""
    flags = pw.flags.copy()
    flags[:, _DYNAMIC] = dynamic
    return Candidates(pw.text, pw.starts, pw.lowered, pw.tokens, flags)


def dynamic_flags(pw: PromptWords, context: Sequence[int], prompt_len: int, q: int, key: str,
                  texts: Sequence[str]) -> np.ndarray:
    """The flags that read the reply so far (up to the quote ``context[q]``) and the key whose value opens
    there, for each of ``pw``'s candidates: [n, 3] (``in_reply``, ``is_key``, ``after_key``). Each distinct
    word is looked up once (a word is offered twice where its lower case differs), and the two flags that
    read only the key are computed once per prompt and key."""
    P = min(prompt_len, len(context))
    reply = fold("".join([texts[t] for t in context[P:q + 1]]))
    distinct, of = _distinct_words(pw)
    out = np.empty((len(pw.words), 3), dtype=np.float32)
    if len(of):
        found = np.fromiter((bool(w) and (f'"{w}' in reply or f" {w}" in reply) for w in distinct),
                            dtype=np.float32, count=len(distinct))
        out[:, 0] = found[of]
    out[:, 1:] = _key_flags(pw, key)
    return out


def _distinct_words(pw: PromptWords) -> tuple[list[str], np.ndarray]:
    """``pw``'s distinct words and, per candidate, the index of its word among them (kept in ``pw.memo``)."""
    hit = pw.memo.get("distinct")
    if hit is None:
        index: dict[str, int] = {}
        of = np.array([index.setdefault(w, len(index)) for w in pw.words], dtype=np.int64)
        hit = pw.memo["distinct"] = (list(index), of)
    return hit


def _key_flags(pw: PromptWords, key: str) -> np.ndarray:
    """[n, 2]: per candidate, its word is a part of ``key`` (``is_key``), the word before it is
    (``after_key``); kept per prompt and key in ``pw.memo``."""
    hit = pw.memo.get(("key", key))
    if hit is None:
        fkey = fold(key)
        names = set(fkey.split("_")) | {fkey} if fkey else set()
        hit = np.zeros((len(pw.words), 2), dtype=np.float32)
        if names:
            hit[:, 0] = [w in names for w in pw.words]
            hit[:, 1] = [bool(prev) and prev in names for prev in pw.prev_words]
        pw.memo[("key", key)] = hit
    return hit


def continuation(c: Candidates, n: int, k: int, encode: Callable[[str], list[int]]) -> list[int]:
    """Candidate ``n`` drafted (``copying.prompt_continuation``): the prompt's text from its start, in lower
    case where offered so; the first ``k`` tokens."""

    return prompt_continuation(c.text[c.starts[n]:], k, encode, lower=c.lowered[n])


def number_text(c: Candidates, n: int) -> str:
    """Candidate ``n``'s number (``NUMBER`` at its start; "" for a word that is none)."""
    m = NUMBER.match(c.text, c.starts[n])
    return m.group() if m else ""


def number_continuation(c: Candidates, n: int, k: int, encode: Callable[[str], list[int]]) -> list[int]:
    """Candidate ``n`` drafted as a number value: its number alone (the reply closes the value after it),
    re-encoded; the first ``k`` tokens."""
    text = number_text(c, n)
    return [int(i) for i in encode(text)[:k]] if text else []


def number_candidates(c: Candidates | PromptWords) -> np.ndarray:
    """The candidates a number value may copy: those that start with a digit (flag ``digit``)."""
    return c.flags[:, _DIGIT] > 0


class PointerNet(nn.Module):
    """Scores the candidates of a batch of value starts, and "no copy" (index 0 of the output)."""

    def __init__(self, cfg: PointerConfig):
        super().__init__()
        d, h = cfg.dim, cfg.hidden
        self.proj = nn.Linear(cfg.embed_dim, d, bias=False)
        self.cand = nn.Sequential(nn.Linear(d * (N_SLOTS + 2) + len(FLAGS), h), nn.ReLU(), nn.Linear(h, 1))
        self.null = nn.Sequential(nn.Linear(d * 2, h), nn.ReLU(), nn.Linear(h, 1))
        self.pad = nn.Parameter(torch.zeros(d))  # a missing neighbour token

    def scores(self, table: torch.Tensor, tokens: torch.Tensor, flags: torch.Tensor, mask: torch.Tensor,
               keys: torch.Tensor, quote: torch.Tensor) -> torch.Tensor:
        """``table``: the projected embedding [V, d]; ``tokens`` [B, n, N_SLOTS] (-1: none); ``flags``
        [B, n, F]; ``mask`` [B, n] (a real candidate); ``keys`` [B, m] the key's token ids (-1 padding);
        ``quote`` [B] the opening quote's token. Returns [B, 1 + n] logits: "no copy", then the
        candidates (-inf where masked)."""
        B, n = tokens.shape[:2]
        rows = torch.where((tokens >= 0)[..., None], table[tokens.clamp(min=0)], self.pad)
        km = (keys >= 0).float()[..., None]
        key_vec = (table[keys.clamp(min=0)] * km).sum(1) / km.sum(1).clamp(min=1)
        ctx = torch.cat([key_vec, table[quote]], dim=1)
        x = torch.cat([rows.reshape(B, n, -1), ctx[:, None].expand(B, n, -1), flags], dim=2)
        cand = self.cand(x)[..., 0].masked_fill(~mask, float("-inf"))
        return torch.cat([self.null(ctx), cand], dim=1)


NUMBER_PREFIX = "number."  # the number net's tensors in ``pointer.safetensors``


class Pointer:
    """A trained pointer ready to score (``pick``): the net, and the target's embedding projected; and where
    it was trained with one (``numbers``), a second net of the same shape for number values (its own
    weights: trained together with the string net, the number starts cost the string picks 2 to 11 points of
    copied values in the simulator)."""

    def __init__(self, net: PointerNet, embed: torch.Tensor, cfg: PointerConfig,
                 number_net: PointerNet | None = None):
        self.net = net.eval()
        self.cfg = cfg
        with torch.no_grad():
            self.table = net.proj(embed.float())
            number_table = number_net.eval().proj(embed.float()) if number_net is not None else None
        self.scorer = Scorer(net, self.table)
        self.number_scorer = Scorer(number_net, number_table) if number_net is not None else None
        self.numbers = number_net is not None  # picks a number value's number (``pick(numbers=True)``)
        self._keys: dict[str, list[int]] = {}
        self._memo: dict[tuple, tuple[Candidates, np.ndarray]] = {}

    @classmethod
    def load(cls, pointer_dir: Path, model_dir: Path) -> "Pointer":
        """The pointer in ``pointer_dir`` over the embedding of the model in ``model_dir`` (the served one)."""
        from safetensors.torch import load_file

        from ..model.weights import load_target_weights

        pointer_dir = Path(pointer_dir)
        if not (pointer_dir / "pointer.safetensors").is_file() or not (pointer_dir / "config.json").is_file():
            raise FileNotFoundError(f"no pointer (pointer.safetensors, config.json) in {pointer_dir}: train one "
                                    "with `cartspec draft pointer --out DIR`")
        cfg = PointerConfig(**json.loads((pointer_dir / "config.json").read_text()))
        state = load_file(str(pointer_dir / "pointer.safetensors"))
        net = PointerNet(cfg)
        net.load_state_dict({k: v for k, v in state.items() if not k.startswith(NUMBER_PREFIX)})
        number = {k[len(NUMBER_PREFIX):]: v for k, v in state.items() if k.startswith(NUMBER_PREFIX)}
        number_net = None
        if number:  # a pointer trained before number values had none: it picks string values only
            number_net = PointerNet(cfg)
            number_net.load_state_dict(number)
        embed = load_target_weights(Path(model_dir))["embed"]
        if embed.shape[1] != cfg.embed_dim:
            raise ValueError(f"the pointer in {pointer_dir} was trained for a hidden size of {cfg.embed_dim}; "
                             f"the embedding of {model_dir} has {embed.shape[1]}")
        return cls(net, embed, cfg, number_net)

    def probs(self, context: Sequence[int], prompt_len: int, texts: Sequence[str],
              encode: Callable[[str], list[int]], special: str,
              numbers: bool = False, prompt: Prompt | None = None) -> tuple[Candidates, np.ndarray]:
        """At a value's opening quote (the context's last token): the candidates and the probabilities of
        "no copy" (index 0) and of each candidate (float32); with ``numbers``, at a number value's start
        (``drafting.tokens.number_open``), over the candidates that are numbers (``number_candidates``; the
        others 0). Cached per context (a value's later positions ask again); the candidates' share of the
        net's first layer is computed once per prompt (``Scorer.prompt_part``), so a value's opening costs
        the flags that read the reply and two small matrix products in numpy (no torch call on the engine's
        cores). ``prompt``: the context's ``drafting.prompt.Prompt`` where the caller keeps one."""
        if numbers and not self.numbers:
            raise ValueError("this pointer was trained without number values: retrain it (`cartspec draft pointer`)")
        memo = (tuple(context), numbers)
        hit = self._memo.get(memo)
        if hit is not None:
            return hit
        q = len(context) - 1
        key = value_key(context, prompt_len, q, texts)
        pw = prompt_of(context, prompt_len, prompt).words(texts, special)
        dyn = dynamic_flags(pw, context, prompt_len, q, key, texts)
        if not pw.starts:
            p = np.ones(1, dtype=np.float32)
        else:
            if key not in self._keys:
                self._keys[key] = [t for t in encode(key) if 0 <= t < len(self.table)] if key else []
            scorer = self.number_scorer if numbers else self.scorer
            part = pw.memo.get(scorer)
            if part is None:
                part = pw.memo[scorer] = scorer.prompt_part(pw.tokens, pw.flags)
            p = scorer.probs(part, dyn, self._keys[key], int(context[q]), number_candidates(pw) if numbers else None)
        out = (with_dynamic(pw, dyn), p)
        if len(self._memo) >= MEMO:
            self._memo.pop(next(iter(self._memo)))
        self._memo[memo] = out
        return out

    def pick(self, context: Sequence[int], prompt_len: int, k: int, texts: Sequence[str],
             encode: Callable[[str], list[int]], special: str, numbers: bool = False,
             prompt: Prompt | None = None) -> list[int]:
        """The draft at a value's opening quote (the context's last token): the best candidate's tokens,
        or [] where "no copy" scores best or the best is less likely than ``min_p``. With ``numbers``, at a
        number value's start: the best number candidate's number alone (``number_continuation``)."""
        if numbers and not self.numbers:
            return []
        c, p = self.probs(context, prompt_len, texts, encode, special, numbers, prompt)
        best = int(p.argmax())
        if best == 0 or float(p[best]) < self.cfg.min_p:
            return []
        return (number_continuation if numbers else continuation)(c, best - 1, k, encode)

    def no_copy(self, context: Sequence[int], prompt_len: int, texts: Sequence[str],
                encode: Callable[[str], list[int]], special: str, prompt: Prompt | None = None) -> float:
        """The probability that the value opening at the context's last token copies no prompt word."""
        return float(self.probs(context, prompt_len, texts, encode, special, prompt=prompt)[1][0])


class Scorer:
    """``PointerNet.scores`` for one value's opening, in numpy, split so that what depends only on the prompt
    is computed once per prompt: the candidate MLP's first layer is ``W_tokens @ tokens + W_flags @ flags +
    W_context @ context + b``; the first two terms (the dynamic flags' columns aside) are ``prompt_part``,
    the rest ``probs``. The same function as the net's, float32 (a test holds the two together)."""

    def __init__(self, net: PointerNet, table: torch.Tensor):
        d = net.proj.out_features
        w1, b1 = net.cand[0].weight.detach().float().numpy(), net.cand[0].bias.detach().float().numpy()
        cut = d * N_SLOTS
        self.w_tokens = np.ascontiguousarray(w1[:, :cut].T)  # [N_SLOTS * d, h]
        self.w_context = np.ascontiguousarray(w1[:, cut:cut + 2 * d].T)  # [2d, h]
        self.w_flags = np.ascontiguousarray(w1[:, cut + 2 * d:].T)  # [F, h]
        self.w_dynamic = np.ascontiguousarray(self.w_flags[_DYNAMIC])  # [3, h]
        self.b1 = b1
        self.w2 = net.cand[2].weight.detach().float().numpy()[0]  # [h]
        self.b2 = float(net.cand[2].bias.detach().float()[0])
        self.n1 = np.ascontiguousarray(net.null[0].weight.detach().float().numpy().T)  # [2d, h]
        self.nb1 = net.null[0].bias.detach().float().numpy()
        self.n2 = net.null[2].weight.detach().float().numpy()[0]
        self.nb2 = float(net.null[2].bias.detach().float()[0])
        self.table = table.detach().float().numpy()  # [V, d]
        self.pad = net.pad.detach().float().numpy()

    def prompt_part(self, tokens: np.ndarray, flags: np.ndarray) -> np.ndarray:
        """[n, h]: the candidates' tokens and their flags that do not read the reply, through the first layer
        (the dynamic flags' columns are 0 in ``flags``), with its bias."""
        rows = np.where((tokens >= 0)[..., None], self.table[np.clip(tokens, 0, None)], self.pad)
        static = flags.copy()
        static[:, _DYNAMIC] = 0.0
        return rows.reshape(len(tokens), -1) @ self.w_tokens + static @ self.w_flags + self.b1

    def probs(self, part: np.ndarray, dynamic: np.ndarray, key_ids: Sequence[int], quote: int,
              mask: np.ndarray | None = None) -> np.ndarray:
        """Softmax over "no copy" then each candidate, given ``prompt_part``'s rows, the dynamic flags [n, 3],
        the key's token ids ([] for none: a zero vector, as the net's mask gives) and the quote's token;
        ``mask`` [n]: the candidates offered (the others get 0, as the net's mask gives)."""
        key_vec = self.table[list(key_ids)].mean(0) if len(key_ids) else np.zeros_like(self.pad)
        ctx = np.concatenate([key_vec, self.table[quote]])
        hidden = np.maximum(part + dynamic @ self.w_dynamic + ctx @ self.w_context, 0.0)
        logits = np.empty(len(part) + 1, dtype=np.float32)
        logits[0] = np.maximum(ctx @ self.n1 + self.nb1, 0.0) @ self.n2 + self.nb2
        logits[1:] = hidden @ self.w2 + self.b2
        if mask is not None:
            logits[1:][~mask] = -np.inf
        e = np.exp(logits - logits.max())
        return e / e.sum()


def save(net: PointerNet, cfg: PointerConfig, out: Path, number_net: PointerNet | None = None) -> Path:
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in net.state_dict().items()}
    if number_net is not None:
        state.update({NUMBER_PREFIX + k: v.detach().contiguous() for k, v in number_net.state_dict().items()})
    save_file(state, str(out / "pointer.safetensors"))
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=1) + "\n")
    return out


