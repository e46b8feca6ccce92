"""The default local judge (vLLM serving SmolLM2-135M-Instruct, the commerce model's base) end to end."""

from __future__ import annotations

import pytest

from cartspec.quality.judge import JudgeSetup, calibrate, judge_endpoint, judge_sync
from cartspec.serving.client import ChatClient
from cartspec.task.generator import generate

pytestmark = pytest.mark.vllm


def test_local_judge_reads_letters_and_is_calibrated(tmp_path):
    setup = JudgeSetup(mode="reference", calibration_per_kind=2)
    with judge_endpoint(setup, tmp_path / "logs") as ep:
        def make():
            return ChatClient(ep.url, ep.served_name, api_key=ep.api_key)

        reqs = generate("test", 4)
        judged = judge_sync(make, [(r, '{"intent": "search"}', '{"intent": "support"}', None) for r in reqs])
        picks = [p for j in judged for p in j.picks]
        assert len(picks) == 8
        # one token with its top log-probabilities: the judge's letter is read from them, not guessed
        assert sum(p in ("A", "B", "C") for p in picks) >= 6, picks
        cal = calibrate(make, setup)
    assert cal.mode == "reference" and cal.n == 12  # 2 pairs x 5 corruptions + 2 identical
    for v in (cal.accuracy, cal.position_consistency, cal.tie_rate):
        assert 0.0 <= v <= 1.0
    assert cal.reliable == (cal.accuracy >= 0.8)
    assert set(cal.by_kind) >= {"identical", "price_changed"}
