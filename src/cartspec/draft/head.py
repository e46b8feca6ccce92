"""The EAGLE-3 draft head, laid out exactly as vLLM's ``Eagle3LlamaForCausalLM`` loads it.

Parameter names are the checkpoint names (``fc.weight``, ``midlayer.*``,
``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``), so ``state_dict()`` is
what export writes. Token embeddings are the target's and are passed in, never
stored (vLLM shares the target's ``embed_tokens`` when the head has none).

Computation (vLLM 0.32, ``vllm/model_executor/models/llama_eagle3.py``):

* ``combine``: ``fc(aux_{l1} ⊕ aux_{l2} ⊕ aux_{l3})`` -> H, once per target position;
* the one decoder layer: ``x = input_layernorm(embed) ⊕ hidden_norm(h)`` (2H) ->
  q/k/v -> RoPE attention -> o_proj; ``residual`` is ``h`` (or ``hidden_norm(h)``
  when ``norm_before_residual``); then ``post_attention_layernorm`` / MLP with
  the usual residual adds;
* ``norm`` -> ``lm_head`` over the draft vocabulary; the pre-norm output is the
  hidden state fed back for the next draft step;
* draft id ``d`` is target id ``d + d2t[d]``; ``t2d[t]`` says whether target id
  ``t`` is in the draft vocabulary.

Attention in ``unroll`` implements the training-time test: chain step ``s`` that
started at target position ``i`` sits at position ``i + s`` and attends to the
step-0 keys of positions ``<= i`` (those were written by vLLM's first pass with
target features) and to its own chain's keys of steps ``1..s`` (what vLLM's
draft KV cache holds during chain drafting).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    norm_before_residual: bool = True
    target_num_hidden_layers: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HeadConfig":
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def for_target(cls, target_cfg: dict[str, Any], draft_vocab_size: int,
                   aux_layer_ids: list[int] | None = None, norm_before_residual: bool = True) -> "HeadConfig":
        """A head sized like the target's decoder layers (what EAGLE-3 does)."""
        L = int(target_cfg["num_hidden_layers"])
        H = int(target_cfg["hidden_size"])
        nh = int(target_cfg["num_attention_heads"])
        theta, scaling = target_rope(target_cfg)
        return cls(hidden_size=H, intermediate_size=int(target_cfg["intermediate_size"]),
                   num_attention_heads=nh,
                   num_key_value_heads=int(target_cfg.get("num_key_value_heads") or nh),
                   head_dim=int(target_cfg.get("head_dim") or H // nh),
                   vocab_size=int(target_cfg["vocab_size"]), draft_vocab_size=int(draft_vocab_size),
                   target_hidden_size=H,
                   aux_layer_ids=canonical_layer_ids(aux_layer_ids or default_aux_layer_ids(L)),
                   rms_norm_eps=float(target_cfg.get("rms_norm_eps", 1e-5)), rope_theta=float(theta),
                   rope_scaling=scaling,
                   max_position_embeddings=int(target_cfg.get("max_position_embeddings", 2048)),
                   norm_before_residual=norm_before_residual, target_num_hidden_layers=L,
                   bos_token_id=target_cfg.get("bos_token_id"), eos_token_id=target_cfg.get("eos_token_id"))


def target_rope(target_cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling or None) from a target config, old (``rope_theta`` + ``rope_scaling``) or new
    (``rope_parameters``) style; the scaling dict carries ``rope_type`` and its own parameters."""
    rope = dict(target_cfg.get("rope_parameters") or {})
    theta = float(rope.get("rope_theta", target_cfg.get("rope_theta", 10000.0)))
    scaling = {k: v for k, v in (target_cfg.get("rope_scaling") or rope).items() if k != "rope_theta"}
    if scaling and "rope_type" not in scaling and "type" in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if not scaling or scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default for Llama (``get_eagle3_default_aux_hidden_state_layers``),
    canonicalised the way its model runner applies them: sorted, without
    duplicates (``_set_aux_hidden_state_layers``); the aux states reach the head
    concatenated in that order."""
    return canonical_layer_ids([2, num_layers // 2, num_layers - 3])


def canonical_layer_ids(ids) -> list[int]:
    return sorted(set(int(i) for i in ids))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        H, d = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(2 * H, self.nh * d, bias=False)
        self.k_proj = nn.Linear(2 * H, self.nkv * d, bias=False)
        self.v_proj = nn.Linear(2 * H, self.nkv * d, bias=False)
        self.o_proj = nn.Linear(self.nh * d, H, bias=False)


class MLP(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies as vLLM's ``get_rope`` builds them for ``rope_type`` default, ``llama3``
    (``Llama3RotaryEmbedding._compute_inv_freq``) and ``linear`` (positions divided by ``factor``,
    folded into the frequencies here)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor, lo, hi = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        orig = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = orig / lo, orig / hi
        wave_len = 2 * math.pi / inv
        smooth = (orig / wave_len - lo) / (hi - lo) if lo != hi else torch.zeros_like(inv)
        return torch.where(wave_len < high_wavelen, inv,
                           torch.where(wave_len > low_wavelen, inv / factor,
                                       (1 - smooth) * inv / factor + smooth * inv))
    raise ValueError(f"RoPE type {kind!r} is not supported by the head trainer (supported: "
                     f"{', '.join(SUPPORTED_ROPE_TYPES)}): the head must rotate exactly as vLLM's drafter does")


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 scaling: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) RoPE tables for integer ``positions`` of any shape."""
    inv = rope_inv_freq(head_dim, theta, scaling).to(positions.device)
    ang = positions.to(torch.float32)[..., None] * inv
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: [..., heads, d]; ``cos``/``sin``: [..., d] (broadcast over heads)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos[..., None, :] + rot.float() * sin[..., None, :]).to(x.dtype)


class Eagle3Head(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # refuse a RoPE type we cannot mirror
        self.cfg = cfg
        n_aux = len(cfg.aux_layer_ids)
        self.fc = nn.Linear(n_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        if cfg.draft_vocab_size == cfg.vocab_size:
            self.t2d.fill_(True)

    # --- vocabulary ---------------------------------------------------------
    def set_vocab(self, draft_to_target: torch.Tensor) -> None:
        """``draft_to_target[d]`` = target id of draft id ``d`` (strictly increasing)."""
        ids = torch.as_tensor(draft_to_target, dtype=torch.long)
        if ids.numel() != self.cfg.draft_vocab_size:
            raise ValueError(f"{ids.numel()} draft ids for draft_vocab_size {self.cfg.draft_vocab_size}")
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("draft vocabulary must be sorted by target id and unique")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def draft_ids(self) -> torch.Tensor:
        """Target id of every draft id."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Draft id of each target id, -1 where it is not in the draft vocabulary."""
        lut = torch.full((self.cfg.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        lut[self.draft_ids] = torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device)
        return lut[target_ids]

    # --- pieces ---------------------------------------------------------------
    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """[..., n_aux * target_hidden] -> [..., H] (vLLM's ``combine_hidden_states``)."""
        return self.fc(aux)

    def _qkv_in(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ml = self.midlayer
        e = ml.input_layernorm(embeds)
        hn = ml.hidden_norm(hidden)
        residual = hn if self.cfg.norm_before_residual else hidden
        return torch.cat([e, hn], dim=-1), residual

    def _kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.midlayer.self_attn
        k = a.k_proj(x).unflatten(-1, (a.nkv, a.d))
        v = a.v_proj(x).unflatten(-1, (a.nkv, a.d))
        return apply_rope(k, cos, sin), v

    def _q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a = self.midlayer.self_attn
        return apply_rope(a.q_proj(x).unflatten(-1, (a.nh, a.d)), cos, sin)

    def _after_attn(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj, residual adds, MLP, final norm. Returns (logits, pre-norm hidden)."""
        ml = self.midlayer
        residual = ml.self_attn.o_proj(attn.flatten(-2)) + residual
        out = ml.mlp(ml.post_attention_layernorm(residual)) + residual
        return self.lm_head(self.norm(out)), out

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)

    def forward(self, *args, **kwargs) -> list[dict[str, torch.Tensor]]:
        """``unroll`` (so that DDP, which hooks ``forward``, can wrap the head)."""
        return self.unroll(*args, **kwargs)

    # --- the training-time test / chain drafting ---------------------------------
    def unroll(self, embed: nn.Embedding | torch.Tensor, input_ids: torch.Tensor, aux: torch.Tensor,
               lengths: torch.Tensor, starts: torch.Tensor, steps: int,
               own_tokens: bool = False) -> list[dict[str, torch.Tensor]]:
        """Chain-draft ``steps`` tokens from every chain start, teacher-forced (or from its own: ``own_tokens``).

        ``input_ids`` [B, T] are the target tokens (prompt + response), ``aux``
        [B, T, n_aux*Ht] the target's aux hidden states, ``lengths`` [B] the
        valid lengths, ``starts`` [N, 2] (batch row, position ``i``) the chain
        starts. Step ``s`` of the chain at ``i`` reads token ``x[i+1+s]`` and
        predicts ``x[i+2+s]``, at position ``i+s``. Returns per step a dict
        with ``logits`` [N, Vd] and ``valid`` [N] (the predicted position exists).

        ``own_tokens``: step ``s`` > 0 reads the token the head drafted at step ``s − 1`` (its argmax, as
        vLLM's chain drafting does) instead of the target's ``x[i+1+s]``. The two drafts agree up to the
        head's first wrong token, so the head's acceptance is the same; they differ after it, where a
        hybrid puts a copy and keeps the head's later tokens, which vLLM drafted from the head's own.
        """
        a = self.midlayer.self_attn
        B, T = input_ids.shape
        dev = input_ids.device
        emb_w = embed.weight if isinstance(embed, nn.Embedding) else embed
        bi, ti = starts[:, 0], starts[:, 1]
        N = bi.numel()
        nrep = a.nh // a.nkv
        scale = 1.0 / math.sqrt(a.d)

        # Step 0 keys/values at every position (vLLM's first pass over target features).
        h_all = self.combine(aux)
        nxt = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)
        x_all, _ = self._qkv_in(F.embedding(nxt, emb_w).to(h_all.dtype), h_all)
        pos = torch.arange(T, device=dev).expand(B, T)
        cos, sin = self._rope(pos)
        K0, V0 = self._kv(x_all, cos, sin)  # [B, T, nkv, d]
        K0 = K0.repeat_interleave(nrep, dim=2).transpose(1, 2)  # [B, nh, T, d]
        V0 = V0.repeat_interleave(nrep, dim=2).transpose(1, 2)
        # queries only at chain starts, scattered into the dense [B, T] layout for attention
        j = torch.arange(T, device=dev)
        causal = (j[None, :] <= j[:, None])[None, None]  # [1, 1, Tq, Tk]
        keep = causal & (j < lengths[:, None])[:, None, None, :]  # [B, 1, T, T]

        hidden = h_all[bi, ti]
        diag_k: list[torch.Tensor] = []
        diag_v: list[torch.Tensor] = []
        out: list[dict[str, torch.Tensor]] = []
        drafted = None
        for s in range(steps):
            tok_pos = ti + 1 + s
            valid = tok_pos + 1 < lengths[bi]
            tok = drafted if own_tokens and s > 0 else input_ids[bi, tok_pos.clamp(max=T - 1)]
            x, residual = self._qkv_in(F.embedding(tok, emb_w).to(hidden.dtype), hidden)
            cs, sn = self._rope(ti + s)
            q = self._q(x, cs, sn)  # [N, nh, d]
            if s > 0:  # at step 0 the query's own key is K0 at i, already in the causal block
                k, v = self._kv(x, cs, sn)
                diag_k.append(k.repeat_interleave(nrep, dim=1).float())
                diag_v.append(v.repeat_interleave(nrep, dim=1).float())
            qd = q.new_zeros(B, T, a.nh, a.d, dtype=torch.float32).index_put((bi, ti), q.float())
            sc0 = torch.einsum("bthd,bhjd->bhtj", qd, K0.float()) * scale
            sc0 = sc0.masked_fill(~keep, float("-inf"))[bi, :, ti]  # [N, nh, T]
            if diag_k:
                kd = torch.stack(diag_k, dim=2)  # [N, nh, s, d]
                vd = torch.stack(diag_v, dim=2)
                scd = torch.einsum("nhd,nhsd->nhs", q.float(), kd) * scale
                p = torch.softmax(torch.cat([sc0, scd], dim=-1), dim=-1)
                pd = p[..., :T]
                extra = torch.einsum("nhs,nhsd->nhd", p[..., T:], vd)
            else:
                pd = torch.softmax(sc0, dim=-1)
                extra = None
            # back to dense for the value product: [B, nh, T, T] @ [B, nh, T, d]
            pdense = pd.new_zeros(B, T, a.nh, T).index_put((bi, ti), pd).transpose(1, 2)
            att = torch.matmul(pdense, V0.float()).transpose(1, 2)[bi, ti]  # [N, nh, d]
            if extra is not None:
                att = att + extra
            logits, hidden = self._after_attn(att.to(x.dtype), residual)
            out.append({"logits": logits, "valid": valid, "hidden": hidden})
            if own_tokens:
                drafted = self.to_target(logits.argmax(-1))
        return out


def param_count(head: nn.Module) -> int:
    return sum(p.numel() for p in head.parameters())
