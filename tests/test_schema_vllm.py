"""Real vLLM on CPU runs the schema drafter (``custom_class``) with structured outputs on, and changes nothing
a user gets: at T=0 the same replies as plain decoding, at T=0.5 the same token distribution, and no
"failed to advance FSM" from vLLM's grammar when drafts and structured outputs meet.

A tiny random Llama: unconstrained it writes noise, which no schema drafts; with the reply schema sent as
``response_format`` it writes the schema's JSON, so the drafter has forced tokens to propose. Both
deployments run vLLM's structured outputs without free whitespace (``disable_any_whitespace``): with it, a
random model writes spaces and newlines until ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter

import pytest

pytestmark = pytest.mark.vllm

SAMPLES = 240  # T=0.5 replies per deployment for the distribution test
POSITIONS = 6  # the first tokens of each sampled reply, compared position by position


def _chi2_p(a: Counter, b: Counter) -> float:
    """p-value of Pearson's chi-square test that two samples of categories come from one distribution
    (categories with fewer than 5 expected pooled into one)."""
    import torch

    cats = sorted(set(a) | set(b), key=lambda c: -(a[c] + b[c]))
    na, nb = sum(a.values()), sum(b.values())
    rows, rest = [], [0, 0]
    for c in cats:
        if (a[c] + b[c]) * min(na, nb) / (na + nb) >= 5:
            rows.append([a[c], b[c]])
        else:
            rest[0] += a[c]
            rest[1] += b[c]
    if sum(rest):
        rows.append(rest)
    if len(rows) < 2:
        return 1.0
    n = na + nb
    stat = sum((obs - exp) ** 2 / exp for r in rows for obs, exp in
               zip(r, (sum(r) * na / n, sum(r) * nb / n)))
    df = len(rows) - 1  # (rows - 1) x (2 - 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))  # chi2 survival


def _run(spec, reqs, tmp_path):
    from cartspec.serving.client import ChatClient, gather_limited
    from cartspec.serving.endpoint import endpoint
    from cartspec.task.prompts import messages
    from cartspec.task.schema import json_schema

    with endpoint(spec, log_dir=tmp_path / "logs") as ep:
        async def go():
            async with ChatClient(ep.url, ep.served_name, timeout=600, api_key=ep.api_key) as client:
                greedy = await gather_limited(
                    (client.chat(messages(r), max_tokens=40, temperature=0.0, json_schema=json_schema(r.task),
                                 extra={"return_token_ids": True}) for r in reqs), 4)
                r0 = reqs[0]
                sampled = await gather_limited(
                    (client.chat(messages(r0), max_tokens=POSITIONS, temperature=0.5, seed=i,
                                 json_schema=json_schema(r0.task), extra={"return_token_ids": True})
                     for i in range(SAMPLES)), 8)
                return greedy, sampled
        return asyncio.run(go())


@pytest.mark.timeout(1500)
def test_the_schema_drafter_keeps_replies_and_their_distribution_under_structured_outputs(tiny_llama_dir, tmp_path):
    from cartspec.serving.spec import DeploymentSpec, Speculative
    from cartspec.task.generator import generate

    reqs = generate("test", 8, 0)
    compact = ["--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})]
    base = DeploymentSpec(name="cartspec", model=str(tiny_llama_dir), enforce_eager=True, max_num_seqs=8,
                          engine_args=compact)
    schema = base.model_copy(update={"speculative": Speculative(method="schema", num_speculative_tokens=3)})
    g0, s0 = _run(base, reqs, tmp_path / "base")
    g1, s1 = _run(schema, reqs, tmp_path / "schema")
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "schema" / "logs").glob("*.log"))
    assert "cartspec patch: schema_batch applied" in logs and "cartspec: schema drafter, γ=3" in logs
    assert "failed to advance" not in logs.lower() and "fsm" not in logs.lower()

    # T=0: the replies are the plain deployment's, token for token, and the drafter drafted and was accepted
    assert [c.raw["choices"][0]["token_ids"] for c in g1] == [c.raw["choices"][0]["token_ids"] for c in g0]
    accepted = sum((c.request_spec_metrics or {}).get("num_accepted_draft_tokens", 0) for c in g1)
    assert accepted > 0, [c.request_spec_metrics for c in g1]
    for c in g1:  # structured outputs held: every reply parses (it may be cut at max_tokens)
        text = c.text
        assert text.startswith("{"), text

    # T=0.5: at each of the first positions the token frequencies agree within sampling error; at least one
    # position is open (the model chooses among several tokens) and drafts were accepted while sampling
    tokens0 = [c.raw["choices"][0]["token_ids"] for c in s0]
    tokens1 = [c.raw["choices"][0]["token_ids"] for c in s1]
    figures = []
    open_positions = 0
    for j in range(POSITIONS):
        a = Counter(t[j] for t in tokens0 if len(t) > j)
        b = Counter(t[j] for t in tokens1 if len(t) > j)
        p = _chi2_p(a, b)
        figures.append((j, len(a | b), round(p, 4)))
        open_positions += len([c for c in a | b if (a[c] + b[c]) >= 10]) >= 2
        assert p > 1e-3, (j, a.most_common(5), b.most_common(5), figures)
    assert open_positions >= 1, figures
    sampled_accepted = sum((c.request_spec_metrics or {}).get("num_accepted_draft_tokens", 0) for c in s1)
    assert sampled_accepted > 0
    (tmp_path / "figures.json").write_text(json.dumps({"positions": figures, "accepted_t0": accepted,
                                                       "accepted_t05": sampled_accepted}))
    assert math.isfinite(figures[0][2])
