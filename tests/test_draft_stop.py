"""Draft length per request (``drafting.length``, patch ``draft_stop``) and the engine's step times (patch
``step_stats``): the rule, the spec and labels that carry it, and both patches on a stand-in runner."""

from __future__ import annotations

import gc
import json
import time
import types

import pytest
import torch

from cartspec.drafting.length import FULL_BATCH, KEY, STOP_P, check_stop_p, kept_length, kept_lengths, threshold_at
from cartspec.vllm_plugin import draft_stop, draft_vocab, steps


def test_a_draft_is_cut_where_its_path_probability_falls_below_the_threshold():
    assert kept_length([0.9, 0.9, 0.5, 0.99], 0.5) == 2  # 0.9, 0.81, 0.405 < 0.5
    assert kept_length([0.4, 0.99], 0.5) == 0  # unsure of the first token: nothing drafted
    assert kept_length([0.99, 0.99, 0.99], 0.5) == 3
    assert kept_length([], 0.5) == 0
    g = torch.Generator().manual_seed(0)
    table = torch.rand(200, 5, generator=g) ** 0.3
    for p in (0.1, 0.5, 0.9):
        assert kept_lengths(table, p) == [kept_length(r, p) for r in table.tolist()]
        assert kept_lengths(table.tolist(), p) == kept_lengths(table, p)
    assert kept_lengths(torch.zeros(3, 0), 0.5) == [0, 0, 0]
    for bad in (0, 1, -0.2, 1.5):
        with pytest.raises(ValueError, match="strictly between 0 and 1"):
            check_stop_p(bad)


def test_the_spec_the_label_and_the_study_carry_the_threshold():
    from cartspec.bench.plan import parse_deployment, preset
    from cartspec.serving.server import VllmServer, needs_patches
    from cartspec.serving.spec import DeploymentSpec, Speculative

    d = parse_deployment("eagle3:domain:5:stop", "commerce")
    assert d.speculative.draft_stop == STOP_P and d.speculative.num_speculative_tokens == 5
    assert d.label == f"eagle3-domain-stop{STOP_P:g}-g5"
    assert parse_deployment("eagle3:domain:3:stop0.7", "commerce").speculative.draft_stop == 0.7
    assert parse_deployment("eagle3:domain:3", "commerce").speculative.draft_stop is None
    with pytest.raises(ValueError, match="strictly between"):
        parse_deployment("eagle3:domain:3:stop2", "commerce")
    assert d.speculative.additional_config("/m") == {KEY: {"p": STOP_P}}
    assert "draft_stop" not in DeploymentSpec().model_dump()["speculative"]  # absent: left out of results' keys
    assert DeploymentSpec.model_validate(json.loads(d.model_dump_json())) == d
    assert needs_patches(d) == ("draft_vocab", "draft_stop") and needs_patches(DeploymentSpec()) == ()
    with pytest.raises(ValueError, match="setting of methods 'eagle3' and 'hybrid'"):
        Speculative(method="ngram", num_speculative_tokens=3, draft_stop=0.5)
    assert any(x.speculative.draft_stop == STOP_P for x in preset("paper").deployments)
    h = parse_deployment("hybrid:domain:5:stop", "commerce")  # the hybrid cut the same way, its rule the default
    assert (h.speculative.method, h.speculative.draft_stop, h.speculative.hybrid) == ("hybrid", STOP_P, None)
    assert h.label == f"hybrid-domain-stop{STOP_P:g}-g5" and needs_patches(h)[-2:] == ("draft_vocab", "draft_stop")
    r = parse_deployment("hybrid-pointer:domain:3:stop0.6", "commerce").speculative
    assert (r.hybrid.rule, r.draft_stop, r.num_speculative_tokens) == ("pointer", 0.6, 3)
    env = VllmServer(d, log_dir="/tmp/x-logs", port=1234).environment()
    assert env[steps.ENV].endswith(f"vllm-cartspec-eagle3-domain-stop{STOP_P:g}-g5-1234.steps.json")


class _Model:
    """Logits over 6 tokens from a [batch, 1] hidden state: row i puts probability ``h[i]`` on token 4."""

    def compute_logits(self, h):
        p = h[:, :1].clamp(1e-6, 1 - 1e-6)
        rest = ((1 - p) / 5).log().expand(-1, 6).clone()
        rest[:, 4:5] = p.log()
        return rest


def _stand_in(extra: dict, confidences: list[list[float]]):
    """A module whose ``GPUModelRunner.propose_draft_token_ids`` runs an EAGLE-like drafter: per position, its
    ``_greedy_sample`` on hidden states carrying each request's confidence there."""

    class Drafter:
        model = _Model()

        def _greedy_sample(self, hidden_states):
            return self.model.compute_logits(hidden_states).argmax(dim=-1)

    class GPUModelRunner:
        def __init__(self):
            self.vllm_config = types.SimpleNamespace(additional_config=extra)
            self.speculative_config = types.SimpleNamespace(method="eagle3")
            self.input_batch = types.SimpleNamespace(num_reqs=len(confidences))
            self.drafter = Drafter()

        def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
            cols = [self.drafter._greedy_sample(torch.tensor([[row[j]] for row in confidences]))
                    for j in range(len(confidences[0]))]
            return torch.stack(cols, dim=1)

        def execute_model(self, scheduler_output, *args, **kwargs):
            return None

        def sample_tokens(self, grammar_output):
            return self.propose_draft_token_ids(None)

    return types.SimpleNamespace(GPUModelRunner=GPUModelRunner)


def test_the_patch_cuts_each_requests_draft_and_keeps_vllms_tokens(monkeypatch, tmp_path):
    monkeypatch.setenv(steps.ENV, str(tmp_path / "steps.json"))
    # path probabilities: 0.9, 0.81, 0.729 | 0.3 | 0.99, 0.594, 0.475
    conf = [[0.9, 0.9, 0.9], [0.3, 0.9, 0.9], [0.99, 0.6, 0.8]]
    mod = _stand_in({KEY: {"p": 0.5, "full_batch": 3}}, conf)
    draft_stop.apply(mod)
    steps.apply(mod)
    runner = mod.GPUModelRunner()
    out = runner.propose_draft_token_ids(None)
    assert out == [[4, 4, 4], [], [4, 4]]  # vLLM's tokens, cut per request
    assert runner._cartspec_steps.pending["drafted"] == 9 and runner._cartspec_steps.pending["kept"] == 5
    # the same requests alone: at one request nothing is cut and no probability is computed
    lone = _stand_in({KEY: {"p": 0.5, "full_batch": 3}}, conf[1:2])
    draft_stop.apply(lone)
    runner = lone.GPUModelRunner()
    out = runner.propose_draft_token_ids(None)
    assert isinstance(out, torch.Tensor) and out.tolist() == [[4, 4, 4]]
    assert not hasattr(runner.drafter, "_cartspec_logits")  # the drafter was never asked for its logits


def test_draft_vocab_wraps_every_eagle3_drafter_and_records_only_at_the_steps_that_ask():
    conf = [[0.9, 0.9, 0.9], [0.3, 0.9, 0.9], [0.99, 0.6, 0.8]]
    mod = _stand_in({KEY: {"p": 0.5, "full_batch": 3}}, conf)
    draft_vocab.apply(mod)  # innermost, as the plugin orders them
    draft_stop.apply(mod)
    runner = mod.GPUModelRunner()
    assert runner.propose_draft_token_ids(None) == [[4, 4, 4], [], [4, 4]]
    assert len(runner.drafter._cartspec_logits) == 3 and runner.drafter._cartspec_recording is False
    plain = _stand_in({}, conf)  # an EAGLE-3 deployment that asks nothing: wrapped, records nothing
    draft_vocab.apply(plain)
    draft_stop.apply(plain)
    runner = plain.GPUModelRunner()
    assert runner.propose_draft_token_ids(None).tolist() == [[4, 4, 4]] * 3
    assert runner.drafter._cartspec_logits == [] and runner.drafter._cartspec_recording is False
    other = _stand_in({}, conf)  # another proposer: left alone
    draft_vocab.apply(other)
    runner = other.GPUModelRunner()
    runner.speculative_config.method = "ngram"
    runner.propose_draft_token_ids(None)
    assert not hasattr(runner.drafter, "_cartspec_logits")


def test_a_hybrids_draft_is_cut_only_by_the_heads_own_tokens_before_its_first_copy():
    from cartspec.drafting.length import first_copy, with_copy

    assert with_copy(1, 2, 3) == 1  # unsure before the copy: cut there, the copy with it
    assert with_copy(2, 2, 3) == 3 and with_copy(3, 0, 3) == 3  # sure up to the copy: the whole draft
    assert with_copy(2, None, 3) == 2  # no copy: the head's cut
    assert first_copy([1, 2, 9], [1, 2, 3]) == 2 and first_copy([1, 2, 3], [1, 2, 3]) is None
    # in a runner: patch hybrid (stood in for here) runs inside draft_stop's wrap and leaves its copies
    conf = [[0.9, 0.9, 0.9], [0.3, 0.9, 0.9], [0.99, 0.6, 0.8]]  # paths 0.729 | 0.3 | 0.99, 0.594, 0.475
    mod = _stand_in({KEY: {"p": 0.5, "full_batch": 3}}, conf)
    draft_vocab.apply(mod)
    inner = mod.GPUModelRunner.propose_draft_token_ids

    def hybrid_like(self, scheduler_output, *args, **kwargs):
        d = inner(self, scheduler_output, *args, **kwargs).clone()
        d[1, 2] = 7  # request 1 copies at position 2, behind a head token the head was unsure of (0.3)
        d[2, 1:] = 7  # request 2 copies from position 1, behind a token the head was sure of (0.99)
        self._cartspec_copies = {1: 2, 2: 1}
        return d

    mod.GPUModelRunner.propose_draft_token_ids = hybrid_like
    draft_stop.apply(mod)
    runner = mod.GPUModelRunner()
    # request 0 the head's cut (none needed); 1 cut before its copy; 2 kept whole, where the head alone keeps 2
    assert runner.propose_draft_token_ids(None) == [[4, 4, 4], [], [4, 7, 7]]
    assert runner._cartspec_copies == {1: 2, 2: 1}


def test_the_simulator_cuts_a_hybrids_draft_as_the_patch_does():
    from cartspec.draft.simulate import simulate_hybrid
    from cartspec.drafting.config import HybridConfig

    # the prompt holds 5 6 7 8; the reply copies it after 3: the lookup drafts 6 7 8 where the head drafts 0s
    tokens = [5, 6, 7, 8, 1, 2, 5, 6, 7, 8, 3]
    P = 5
    fs = types.SimpleNamespace(n_seqs=1, seq=lambda s: slice(0, len(tokens)), input_ids=torch.tensor(tokens),
                               prompt_lens=torch.tensor([P]))
    n = len(tokens) - P
    preds = [torch.zeros(n, 3, dtype=torch.long)]
    cfg = HybridConfig(rule="lookup", head_p=0.0)
    sure, unsure = torch.full((n, 3), 0.99), torch.full((n, 3), 0.3)
    plain, _ = simulate_hybrid(preds, fs, 3, cfg, probs=[unsure])
    cut, _ = simulate_hybrid(preds, fs, 3, cfg, probs=[unsure], stop_p=0.5)
    # the copies (from position 0, the head unsure of nothing before them) are kept whole; the head's own
    # drafts, unsure from their first token, are cut to nothing: the same tokens accepted, fewer drafted
    assert plain["accepted_tokens"] == cut["accepted_tokens"] > 0
    assert 0 < cut["draft_tokens"] < plain["draft_tokens"]
    head = HybridConfig(rule="head", head_p=0.0)
    assert simulate_hybrid(preds, fs, 3, head, probs=[unsure], stop_p=0.5)[0]["draft_tokens"] == 0
    assert simulate_hybrid(preds, fs, 3, head, probs=[sure], stop_p=0.5)[0]["draft_tokens"] == 3 * (n - 1)
    with pytest.raises(ValueError, match="needs the head's probabilities"):
        simulate_hybrid(preds, fs, 3, cfg, stop_p=0.5)


def test_the_threshold_follows_the_batch():
    assert threshold_at(0.5, 1) == 0.0 and threshold_at(0.5, FULL_BATCH) == 0.5 and threshold_at(0.5, 64) == 0.5
    assert threshold_at(0.5, 2) == pytest.approx(0.5 / (FULL_BATCH - 1))
    ramp = [threshold_at(0.5, b) for b in range(1, FULL_BATCH + 1)]
    assert ramp == sorted(ramp) and threshold_at(0.5, 1, full_batch=1) == 0.5


def _scheduled(tokens: dict[str, int], new: tuple[str, ...] = (), outputs: dict[str, int] | None = None,
               resumed: frozenset = frozenset()):
    """A stand-in for vLLM's ``SchedulerOutput``: ``tokens`` per request; ``new`` requests' first chunk; the
    others running, with ``outputs`` tokens generated so far (1 unless given)."""
    cached = [r for r in tokens if r not in new]
    outputs = outputs or {}
    return types.SimpleNamespace(
        total_num_scheduled_tokens=sum(tokens.values()), num_scheduled_tokens=dict(tokens),
        scheduled_new_reqs=[types.SimpleNamespace(req_id=r) for r in new],
        scheduled_cached_reqs=types.SimpleNamespace(req_ids=cached, resumed_req_ids=set(resumed),
                                                    num_output_tokens=[outputs.get(r, 1) for r in cached]))


def test_the_prompts_share_of_a_steps_tokens():
    # a new prompt's first chunk, a prompt's second chunk (no output yet), a preempted request computed
    # again, and a request verifying its last token and 3 drafts: 48 + 32 + 20 of the 104 tokens are prefill
    sched = _scheduled({"new": 48, "chunked": 32, "resumed": 20, "decoding": 4}, new=("new",),
                       outputs={"chunked": 0, "resumed": 7, "decoding": 12}, resumed=frozenset({"resumed"}))
    assert steps.prompt_tokens(sched) == 100
    assert steps.prompt_tokens(_scheduled({"a": 4, "b": 1})) == 0
    by = {"1": {"steps": 2, "tokens": 104, "prompt_tokens": 100}, "2": {"steps": 2, "tokens": 96, "prompt_tokens": 0}}
    assert steps.summary(by)["prefill_share"] == 0.5
    assert "decode_ms" not in steps.summary(by)  # counters written before decoding steps were counted


def test_a_decoding_steps_time_and_the_time_in_steps_that_prefilled():
    """The steps that prefilled no prompt give the cost of a step of decoding alone; the rest of the time went
    to steps that prefilled one, which τ does not shorten."""
    by = {"1": {"steps": 4, "draft_s": 0.04, "verify_s": 0.36, "tokens": 60, "prompt_tokens": 50,
                "decode_steps": 3, "decode_s": 0.15},
          "2": {"steps": 1, "draft_s": 0.02, "verify_s": 0.08, "tokens": 8, "prompt_tokens": 0,
                "decode_steps": 1, "decode_s": 0.1}}
    s = steps.summary(by)
    assert s["decode_ms"] == 62.5  # (0.15 + 0.1) s over 4 steps
    assert s["prefill_time_share"] == 0.5  # 0.25 of the 0.5 s in the one step that prefilled
    assert s["fixed_time_share"] == 0.5  # counters without the batch: one stream, the prefilling step's whole time


def _toy_engine(streams: int, tau: int, c: float = 0.05, delta: float = 0.04) -> dict[str, float]:
    """Closed-loop streams on a toy engine, counted as the plugin counts: every step advances each stream's
    request, by its prompt (one token) or by ``tau`` tokens; a step costs ``c`` plus ``delta`` per prompt."""
    lengths = [13, 25, 37, 49, 61]
    tot = dict.fromkeys(steps.FIELDS, 0.0)
    todo = [[lengths[(3 * i + k) % len(lengths)] for k in range(24)] for i in range(streams)]
    left = [0] * streams
    while any(todo) or any(left):
        active = prompts = 0
        for i in range(streams):
            if not left[i]:
                if not todo[i]:
                    continue
                left[i], prompts = todo[i].pop(0) - 1, prompts + 1
            else:
                left[i] -= min(tau, left[i])
            active += 1
        cost = c + delta * prompts
        tot["steps"] += 1
        tot["requests"] += active
        tot["verify_s"] += cost
        tot["prompts"] += prompts
        tot["prompt_tokens"] += 20 * prompts
        if not prompts:
            tot["decode_steps"] += 1
            tot["decode_s"] += cost
    return tot


@pytest.mark.parametrize("streams", [1, 2, 8, 32])
def test_the_time_no_tau_can_shorten_predicts_the_time_of_a_longer_draft(streams):
    """A step that prefills one request's prompt also decodes the others', and that part shrinks with τ; only
    a request's first step and what a prompt adds to a step stay. The fixed share measured at τ = 3 predicts
    the time the same requests take at τ = 4; the prefilling steps' whole share does so at one stream only."""
    a, b = _toy_engine(streams, 3), _toy_engine(streams, 4)
    s = steps.summary({"5-8": a})
    ratio = b["verify_s"] / a["verify_s"]
    assert ratio == pytest.approx(s["fixed_time_share"] + (1 - s["fixed_time_share"]) * 3 / 4, abs=0.002)
    old = s["prefill_time_share"] + (1 - s["prefill_time_share"]) * 3 / 4
    if streams == 1:
        assert s["fixed_time_share"] == s["prefill_time_share"]
    else:
        assert old - ratio > 0.01 and s["fixed_time_share"] < s["prefill_time_share"]


def test_step_stats_time_drafting_and_verifying_by_batch_size(monkeypatch, tmp_path):
    path = tmp_path / "steps.json"
    monkeypatch.setenv(steps.ENV, str(path))
    monkeypatch.setattr(steps, "EVERY_S", 0.0)
    assert [steps.bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9, 32, 33, 64)] == [
        "1", "2", "3-4", "3-4", "5-8", "5-8", "9-16", "17-32", "33+", "33+"]
    mod = _stand_in({KEY: {"p": 0.5, "full_batch": 2}}, [[0.9, 0.9, 0.9], [0.3, 0.9, 0.9]])
    forward = mod.GPUModelRunner.execute_model

    def collecting(self, *args, **kwargs):
        gc.collect()  # a collection that an allocation of the step's forward set off
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(mod.GPUModelRunner, "execute_model", collecting)
    draft_stop.apply(mod)
    steps.apply(mod)
    runner = mod.GPUModelRunner()
    before = steps.read(path)
    assert before == {}
    sched = _scheduled({"a": 4, "b": 4})
    gc.collect()  # one between steps: not the step's
    for _ in range(3):  # one engine step: the target's forward, then sampling with the next draft
        runner.execute_model(sched)
        runner.sample_tokens(None)
    by = steps.read(path)
    assert set(by) == {"2"} and by["2"]["steps"] == 3 and by["2"]["requests"] == 6 and by["2"]["tokens"] == 24
    assert by["2"]["prompt_tokens"] == 0 and by["2"]["prompts"] == 0  # both requests decoding
    assert by["2"]["decode_steps"] == 3 and by["2"]["decode_s"] == pytest.approx(by["2"]["draft_s"] + by["2"]["verify_s"])
    assert by["2"]["drafted"] == 18 and by["2"]["kept"] == 9
    assert by["2"]["draft_s"] > 0 and by["2"]["verify_s"] >= 0 and by["2"]["gc_s"] > 0
    s = steps.summary(steps.difference(by, before))
    assert s["steps"] == 3 and s["requests"] == 2 and s["kept_share"] == 0.5 and s["draft_ms"] > 0
    assert 0 < s["gc_ms"] <= s["draft_ms"] + s["verify_ms"]
    assert s["decode_ms"] == pytest.approx(s["draft_ms"] + s["verify_ms"], abs=0.002) and s["prefill_time_share"] == 0
    # a point's own steps: the difference of two reads; a restarted server's counters start again
    runner.execute_model(sched)
    runner.sample_tokens(None)
    assert steps.summary(steps.difference(steps.read(path), by))["steps"] == 1
    assert steps.difference({"2": {"steps": 1}}, by) == {"2": {f: (1 if f == "steps" else 0) for f in steps.FIELDS}}
    assert steps.summary({}) is None and steps.read(tmp_path / "none.json") == {}


def test_the_last_steps_before_the_engine_goes_idle_are_written(monkeypatch, tmp_path):
    """The counters are written at most every EVERY_S; steps that close sooner after a write, with no step
    after them (the engine idle at the end of a point), are written by the flusher once EVERY_S has passed, so
    a reader that waits that long reads them (the study's loads do)."""
    import time

    path = tmp_path / "steps.json"
    monkeypatch.setattr(steps, "EVERY_S", 0.3)
    st = steps.Stats(str(path))
    st.close_step(2, 8, 0, 0)  # written at once: the first write
    assert steps.read(path)["2"]["steps"] == 1
    for _ in range(4):  # within EVERY_S of that write: held back
        st.close_step(2, 8, 0, 0)
    assert steps.read(path)["2"]["steps"] == 1
    last = time.monotonic()
    while steps.read(path)["2"]["steps"] < 5 and time.monotonic() - last < 10:  # the engine idle: no step closes
        time.sleep(0.01)
    assert steps.read(path)["2"]["steps"] == 5
    # written within EVERY_S of the last step (and a shared machine's scheduling): what a reader waits
    assert time.monotonic() - last < 2 * steps.EVERY_S
    assert st.flusher is not None and st.flusher.daemon and not st.dirty


def test_a_runner_that_did_not_ask_drafts_as_vllm_does():
    mod = _stand_in({}, [[0.3, 0.3, 0.3]])  # path 0.027: a runner that asked would cut it all
    draft_stop.apply(mod)
    out = mod.GPUModelRunner().propose_draft_token_ids(None)
    assert isinstance(out, torch.Tensor) and out.tolist() == [[4, 4, 4]]


@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_in_vllm_drafts_are_cut_per_request_replies_stay_the_targets_and_steps_are_timed(tiny_llama_dir, tmp_path,
                                                                                          monkeypatch):
    """A tiny random Llama and a random head, whose path probabilities straddle the threshold: some requests
    keep drafts, some keep fewer or none, at every step. Greedy replies stay the plain deployment's token for
    token; sampled requests run through vLLM's rejection sampler with drafts of every length; the step file
    times drafting and verifying. A hybrid cut the same way keeps the greedy replies too."""
    import asyncio

    from conftest import make_random_head

    from cartspec.serving.client import ChatClient, gather_limited
    from cartspec.serving.endpoint import endpoint
    from cartspec.serving.spec import DeploymentSpec, Speculative
    from cartspec.task.generator import generate
    from cartspec.task.prompts import messages

    monkeypatch.setenv("CARTSPEC_HOME", str(tmp_path / "home"))
    head = make_random_head(tiny_llama_dir, tmp_path / "head")
    reqs = generate("test", 8, 0)

    def run(spec, name):
        with endpoint(spec, log_dir=tmp_path / name) as ep:
            async def go():
                async with ChatClient(ep.url, ep.served_name, timeout=600, api_key=ep.api_key) as client:
                    greedy = await gather_limited((client.chat(messages(r), max_tokens=24, temperature=0.0,
                                                               extra={"return_token_ids": True}) for r in reqs), 4)
                    sampled = await gather_limited((client.chat(messages(r), max_tokens=16, temperature=0.5, seed=i)
                                                    for i, r in enumerate(reqs)), 4)
                    return greedy, sampled
            out = asyncio.run(go())
            time.sleep(steps.EVERY_S + 0.5)  # the engine writes its counters every EVERY_S: the run's last steps too
            return out, steps.read(ep.server.step_stats_path), ep.server.log_path.read_text(errors="replace")

    base = DeploymentSpec(name="cartspec", model=str(tiny_llama_dir), enforce_eager=True, max_num_seqs=4)
    cut = base.model_copy(update={"speculative": Speculative(method="eagle3", model=str(head),
                                                             num_speculative_tokens=3, draft_stop=2e-5)})
    (g0, _), by0, _ = run(base, "base")
    (g1, s1), by1, log = run(cut, "cut")
    assert "cartspec patch: draft_stop applied" in log and "cartspec patch: step_stats applied" in log
    assert "draft length per request in this runner" in log
    assert [c.raw["choices"][0]["token_ids"] for c in g1] == [c.raw["choices"][0]["token_ids"] for c in g0]
    assert all(c.text is not None for c in s1) and len(s1) == len(reqs)
    total = steps.summary(by1)
    assert 0 < total["kept_share"] < 1, by1  # cut somewhere, not everywhere
    assert total["draft_ms"] > 0 and total["verify_ms"] > 0
    plain = steps.summary(by0)
    assert plain["draft_ms"] < total["draft_ms"] and "kept_share" not in plain
    assert 0 < plain["prefill_share"] < 1 and 0 < total["prefill_share"] < 1  # read from vLLM's scheduler output
    assert 0 < plain["prefill_time_share"] < 1 and plain["decode_ms"] > 0  # steps that decoded alone, and the rest
    assert sum(row["prompts"] for row in by0.values()) == 2 * len(reqs)  # each request entered once
    assert 0 < plain["fixed_time_share"] <= plain["prefill_time_share"]
    # the hybrid (the prompt's n-gram copies over the head's draft) cut the same way: the two patches stack
    from cartspec.drafting.config import HybridConfig

    hybrid = base.model_copy(update={"speculative": Speculative(
        method="hybrid", model=str(head), num_speculative_tokens=3, draft_stop=2e-5,
        hybrid=HybridConfig(rule="lookup", scope="context"))})
    (g2, _), by2, log = run(hybrid, "hybrid")
    assert "cartspec patch: hybrid applied" in log and "hybrid drafts in this runner" in log
    assert "draft length per request in this runner" in log
    assert [c.raw["choices"][0]["token_ids"] for c in g2] == [c.raw["choices"][0]["token_ids"] for c in g0]
    assert 0 < steps.summary(by2)["kept_share"] < 1, by2


def test_serve_and_draft_acceptance_take_the_threshold_and_refuse_it_without_a_head(monkeypatch):
    from typer.testing import CliRunner

    from cartspec.agent.defaults import default_spec
    from cartspec.cli import app

    spec = default_spec("commerce", "domain", 5, True, draft="eagle3", draft_stop=STOP_P)
    assert spec.speculative.draft_stop == STOP_P and spec.label == f"eagle3-domain-stop{STOP_P:g}-g5"
    spec = default_spec("commerce", "domain", 5, True, draft="hybrid", draft_stop=STOP_P)
    assert spec.speculative.method == "hybrid" and spec.speculative.draft_stop == STOP_P
    for draft, head in (("eagle3", "none"), ("schema", "auto"), ("schema", "domain")):
        with pytest.raises(ValueError, match="--draft-stop cuts by an EAGLE-3 head's probabilities"):
            default_spec("commerce", head, 5, True, draft=draft, draft_stop=STOP_P)
    r = CliRunner().invoke(app, ["draft", "acceptance", "--method", "ngram", "--draft-stop", "0.5", "--out", "x.json"])
    assert r.exit_code != 0 and "--draft-stop" in r.output and "eagle3 or hybrid" in " ".join(r.output.split())
    r = CliRunner().invoke(app, ["draft", "acceptance", "--method", "eagle3", "--head", "domain", "--draft-stop", "1.5",
                                  "--out", "x.json"])
    assert r.exit_code != 0 and "strictly between 0 and 1" in r.output


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_draft_vocabularys_probabilities_pick_vllms_token_and_its_softmax(dtype):
    """vLLM spreads an EAGLE-3 head's draft-vocabulary logits over the target vocabulary (-inf elsewhere) and
    takes the argmax; the patch reads the draft logits directly, in float32: the same token (ties included,
    in bfloat16 too), the same probability, without the full vocabulary's softmax."""
    g = torch.Generator().manual_seed(0)
    draft_ids = torch.sort(torch.randperm(500, generator=g)[:64]).values  # increasing target ids

    class Eagle3Like(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(8, 64, bias=False)
            self.draft_id_to_target_id = draft_ids - torch.arange(64)

        def logits_processor(self, lm_head, h):
            return lm_head(h)

        def compute_logits(self, h):  # as vLLM 0.32 does
            logits = self.logits_processor(self.lm_head, h)
            new = logits.new_full((h.shape[0], 500), float("-inf"))
            new[:, torch.arange(64) + self.draft_id_to_target_id] = logits
            return new

    model = Eagle3Like().to(dtype)
    with torch.no_grad():
        model.lm_head.weight[5] = model.lm_head.weight[9]  # a tie between two draft ids
    drafter = types.SimpleNamespace(model=model, _greedy_sample=lambda h: model.compute_logits(h).argmax(-1))
    kept = draft_vocab.record_logits(drafter)
    h = torch.randn(40, 8, generator=g).to(dtype)
    h[0] = 0  # every logit equal
    with torch.no_grad():
        plain = drafter._greedy_sample(h)  # a step nobody records at: the token alone
        assert kept == []
        drafter._cartspec_recording = True
        ids = drafter._greedy_sample(h)
        full = model.compute_logits(h)
    assert ids.tolist() == plain.tolist() == full.argmax(-1).tolist()
    assert kept[0].dtype == torch.float32 and kept[0].shape == (40, 64)  # the draft vocabulary's logits
    assert torch.allclose(draft_vocab.probs_of(kept[0]), full.float().softmax(-1).amax(-1), atol=1e-6)
    # the hybrid's gate reads the same draft-vocabulary probabilities, for just the rows it asks
    from cartspec.vllm_plugin.hybrid import head_probs

    p = head_probs(drafter, [h], [(1, 0), (7, 0)])
    assert p[(1, 0)] == pytest.approx(float(full.float().softmax(-1).amax(-1)[1]), abs=1e-6)
    assert p[(7, 0)] == pytest.approx(float(full.float().softmax(-1).amax(-1)[7]), abs=1e-6)
    # the draft ids, computed once per head, are computed anew when the head's mapping changes in place
    assert draft_vocab.draft_targets(model) is draft_vocab.draft_targets(model)
    model.draft_id_to_target_id[1] = -1  # no longer increasing: the full logits are used
    assert draft_vocab.draft_targets(model) is None


def test_the_default_rule_cuts_more_as_the_batch_grows_and_nothing_at_one():
    # the deployed rule (module doc of drafting.length): nothing cut at one request, the whole threshold from
    # FULL_BATCH requests on, and a threshold that only rises with the batch in between
    ramp = [threshold_at(STOP_P, b) for b in range(1, 65)]
    assert ramp[0] == 0.0 and ramp == sorted(ramp)
    assert all(t == STOP_P for t in ramp[FULL_BATCH - 1:]) and 0 < ramp[1] < STOP_P
