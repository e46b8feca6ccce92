"""EAGLE-3 head: shapes, the d2t/t2d vocabulary mapping (against vLLM's own
compute_logits), and the training-time-test attention against an independent
step-by-step chain-drafting reference with an explicit KV cache."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from cartspec.draft.head import Eagle3Head, HeadConfig, default_aux_layer_ids, param_count

V, VD, H = 500, 64, 32


def small_cfg(**kw) -> HeadConfig:
    base = dict(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                vocab_size=V, draft_vocab_size=VD, target_hidden_size=H, aux_layer_ids=[1, 2, 3],
                rms_norm_eps=1e-5, rope_theta=10000.0)
    base.update(kw)
    return HeadConfig(**base)


def make_head(seed=0, **kw) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(small_cfg(**kw))
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ids = torch.sort(torch.randperm(V)[:VD]).values
    head.set_vocab(ids)
    return head


def test_shapes_and_param_names():
    head = make_head()
    names = set(head.state_dict())
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
            "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
            "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
            "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
            "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight"} == names
    assert head.fc.weight.shape == (H, 3 * H)
    assert head.midlayer.self_attn.q_proj.weight.shape == (4 * 8, 2 * H)  # q/k/v read embed ⊕ hidden
    assert head.midlayer.self_attn.k_proj.weight.shape == (2 * 8, 2 * H)
    assert head.lm_head.weight.shape == (VD, H)
    assert head.d2t.dtype == torch.long and head.d2t.shape == (VD,)
    assert head.t2d.dtype == torch.bool and head.t2d.shape == (V,)
    assert param_count(head) > 0

    B, T = 2, 12
    ids = torch.randint(0, V, (B, T))
    aux = torch.randn(B, T, 3 * H)
    starts = torch.tensor([(0, 3), (0, 7), (1, 5), (1, 8)])
    outs = head.unroll(torch.randn(V, H), ids, aux, torch.tensor([T, 10]), starts, steps=3)
    assert len(outs) == 3
    for s, o in enumerate(outs):
        assert o["logits"].shape == (4, VD)
        assert o["hidden"].shape == (4, H)
        # step s of the chain at i predicts x[i+2+s]: valid while that exists
        assert o["valid"].tolist() == [3 + 2 + s < T, 7 + 2 + s < T, 5 + 2 + s < 10, 8 + 2 + s < 10]


def test_d2t_t2d_mapping_matches_vllm_compute_logits():
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    head = make_head()
    ids = head.draft_ids
    # d2t holds offsets: target = draft + d2t[draft]
    assert torch.equal(torch.arange(VD) + head.d2t, ids)
    assert torch.equal(head.to_target(torch.arange(VD)), ids)
    assert int(head.t2d.sum()) == VD and bool(head.t2d[ids].all())
    assert torch.equal(head.target_to_draft(ids), torch.arange(VD))
    outside = torch.tensor(sorted(set(range(V)) - set(ids.tolist()))[:5])
    assert (head.target_to_draft(outside) == -1).all() and not head.t2d[outside].any()

    # vLLM scatters draft logits into the target vocabulary with our d2t
    hidden = torch.randn(7, H)
    draft_logits = head.lm_head(head.norm(hidden))
    stub = SimpleNamespace(lm_head=head.lm_head, draft_id_to_target_id=head.d2t,
                           config=SimpleNamespace(draft_vocab_size=VD, vocab_size=V),
                           logits_processor=lambda lm, h: lm(h))
    full = Eagle3LlamaForCausalLM.compute_logits(stub, head.norm(hidden))
    assert full.shape == (7, V)
    assert torch.equal(full.argmax(-1), head.to_target(draft_logits.argmax(-1)))
    assert torch.isinf(full[:, ~head.t2d]).all()

    with pytest.raises(ValueError):
        head.set_vocab(torch.flip(ids, [0]))


def test_default_aux_layers_follow_vllm():
    from vllm.model_executor.models.interfaces import SupportsEagle3

    for L in (4, 8, 30, 32):
        stub = SimpleNamespace(model=SimpleNamespace(layers=[None] * L))
        want = SupportsEagle3.get_eagle3_default_aux_hidden_state_layers(stub)
        # vLLM's runner applies them sorted and de-duplicated
        assert default_aux_layer_ids(L) == sorted(set(want))
    assert default_aux_layer_ids(30) == [2, 15, 27]


# --- independent reference: vLLM-style chain drafting with a KV cache -------------

def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    """Neox rotate-half via complex multiplication on split halves (independent code path)."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos * freqs
    c = torch.polar(torch.ones_like(ang), ang)
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2:].double()) * c
    return torch.cat([z.real, z.imag], dim=-1).float()


def reference_chain(head: Eagle3Head, embed, ids, aux, i, steps, own=False):
    """First pass over positions 0..i with target features, then ``steps`` chain
    steps, each appending its key/value to the cache (what vLLM does); ``own``: each step after the first
    reads the token the step before drafted (vLLM), not the target's."""
    c = head.cfg
    ml = head.midlayer
    at = ml.self_attn
    nrep = c.num_attention_heads // c.num_key_value_heads
    keys, vals = [], []

    def layer(tok, h, pos, add_kv=True):
        e = _rms(embed[tok], ml.input_layernorm.weight, c.rms_norm_eps)
        hn = _rms(h, ml.hidden_norm.weight, c.rms_norm_eps)
        res = hn if c.norm_before_residual else h
        x = torch.cat([e, hn])
        q = _rope((x @ at.q_proj.weight.T).view(c.num_attention_heads, c.head_dim), pos, c.rope_theta)
        k = _rope((x @ at.k_proj.weight.T).view(c.num_key_value_heads, c.head_dim), pos, c.rope_theta)
        v = (x @ at.v_proj.weight.T).view(c.num_key_value_heads, c.head_dim)
        if add_kv:
            keys.append(k)
            vals.append(v)
        K = torch.stack(keys).repeat_interleave(nrep, dim=1)  # [n, heads, d]
        Vv = torch.stack(vals).repeat_interleave(nrep, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q, K) / math.sqrt(c.head_dim), dim=-1)
        a = torch.einsum("hn,nhd->hd", p, Vv).reshape(-1)
        r = a @ at.o_proj.weight.T + res
        m = ml.mlp(_rms(r, ml.post_attention_layernorm.weight, c.rms_norm_eps)) + r
        return head.lm_head(_rms(m, head.norm.weight, c.rms_norm_eps)), m

    hs = aux @ head.fc.weight.T
    for j in range(i):  # first pass, positions < i: cache only
        layer(ids[j + 1], hs[j], j)
    logits, h = layer(ids[i + 1], hs[i], i)
    out = [logits]
    for s in range(1, steps):
        tok = head.to_target(logits.argmax(-1)) if own else ids[i + 1 + s]
        logits, h = layer(tok, h, i + s)
        out.append(logits)
    return out


@pytest.mark.parametrize("nbr", [True, False])
def test_unroll_equals_step_by_step_chain_drafting(nbr):
    head = make_head(seed=1, norm_before_residual=nbr)
    torch.manual_seed(2)
    T = 14
    ids = torch.randint(0, V, (2, T))
    aux = torch.randn(2, T, 3 * H)
    embed = torch.randn(V, H)
    starts = torch.tensor([(0, 0), (0, 4), (1, 6), (1, 9)])
    with torch.no_grad():
        outs = head.unroll(embed, ids, aux, torch.tensor([T, T]), starts, steps=4)
        for n, (b, i) in enumerate(starts.tolist()):
            ref = reference_chain(head, embed, ids[b], aux[b], i, 4)
            for s in range(4):
                torch.testing.assert_close(outs[s]["logits"][n], ref[s], rtol=2e-4, atol=2e-4)


def test_unroll_on_its_own_tokens_is_vllms_chain_and_agrees_with_teacher_forcing_up_to_its_first_miss():
    """``own_tokens``: each step reads the head's own draft (vLLM's chain), step by step as the reference does;
    its drafts equal the teacher-forced ones up to the first position where the head missed the target's
    token, and where it missed, what follows is drafted from its own token (a hybrid keeps those)."""
    head = make_head(seed=3)
    torch.manual_seed(4)
    T = 14
    ids = torch.randint(0, VD, (1, T))  # target ids inside the draft vocabulary (d2t is the identity)
    aux = torch.randn(1, T, 3 * H)
    embed = torch.randn(V, H)
    starts = torch.tensor([(0, i) for i in range(T - 1)])
    with torch.no_grad():
        own = head.unroll(embed, ids, aux, torch.tensor([T]), starts, steps=3, own_tokens=True)
        forced = head.unroll(embed, ids, aux, torch.tensor([T]), starts, steps=3)
        for n, i in enumerate(starts[:, 1].tolist()):
            ref = reference_chain(head, embed, ids[0], aux[0], i, 3, own=True)
            for s in range(3):
                torch.testing.assert_close(own[s]["logits"][n], ref[s], rtol=2e-4, atol=2e-4)
    d_own = torch.stack([head.to_target(o["logits"].argmax(-1)) for o in own], 1)
    d_forced = torch.stack([head.to_target(o["logits"].argmax(-1)) for o in forced], 1)
    torch.testing.assert_close(d_own[:, 0], d_forced[:, 0])
    missed = 0
    for n, i in enumerate(starts[:, 1].tolist()[:-1]):
        # teacher-forced on targets whose next token is the head's own draft: the same step 1 as its own chain
        alt = ids.clone()
        alt[0, i + 2] = d_own[n, 0]
        with torch.no_grad():
            f = head.unroll(embed, alt, aux, torch.tensor([T]), starts[n:n + 1], steps=2)
        torch.testing.assert_close(f[1]["logits"][0], own[1]["logits"][n], rtol=1e-4, atol=1e-4)
        if d_own[n, 0] != ids[0, i + 2]:  # a miss: the two chains read different tokens at step 1
            missed += 1
            assert not torch.allclose(own[1]["logits"][n], forced[1]["logits"][n])
    assert missed  # a random head misses
