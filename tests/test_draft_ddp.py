"""Head training under ``torchrun --nproc_per_node 2`` (gloo on CPU), replicated (DDP) or sharded (FSDP2),
reaches the loss one process reaches on the same data."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# argv: features, target, out, [ddp|fsdp]. The FSDP run is stopped after its first step (checkpointed from
# the shards) and resumed, so the sharded checkpoint round trip is on the path to the final loss.
SCRIPT = """
import json, sys
from dataclasses import replace
from pathlib import Path
from cartspec.draft.features import FeatureSet
from cartspec.draft.train import TrainConfig, distributed, train_head
fs = FeatureSet.load(sorted(Path(sys.argv[1]).glob("shard-*.safetensors")))
fsdp = sys.argv[4:] == ["fsdp"]
cfg = TrainConfig(ttt_steps=3, lr=3e-3, batch_tokens=1024, steps=30, warmup_steps=5, draft_vocab_size=512,
                  save_every=1000, threads=1, fsdp=fsdp)
run = lambda c: train_head(fs, Path(sys.argv[2]), Path(sys.argv[3]), c, data_key="ddp-test", log=lambda *a: None)
stopped = run(replace(cfg, max_minutes=1e-9))[1]["steps"] if fsdp else None
head, summary = run(cfg)
rank, world = distributed()
if rank == 0:
    print("RESULT " + json.dumps({"world": summary["world_size"], "sharding": summary["sharding"],
          "stopped_at": stopped, "history": [r["loss"] for r in
          json.loads((Path(sys.argv[3]) / "training_log.json").read_text())["history"]]}), flush=True)
"""


def _run(cmd, env, out: Path | None = None):
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and out is not None:
        # gloo on a 2-core CPU loses a rank now and then (an abort, "terminate called without an active
        # exception", about once in ten runs; under the whole suite's load other ways too): one clean rerun,
        # from an empty output directory, then the run must pass. The first failure is printed (pytest -rA
        # or a failing run shows it), so that a rerun is never silent.
        print(f"\n[ddp] rerun after rc {proc.returncode}: " + proc.stderr[-1500:])
        shutil.rmtree(out, ignore_errors=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:] + "\n--- stdout ---\n" + proc.stdout[-1000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_torchrun_two_processes_reach_the_single_process_loss_ddp_and_fsdp(tiny_llama_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from cartspec.draft.features import extract

    # a confident target (its final norm scaled up): a random model's near-uniform next-token
    # distribution leaves a soft cross-entropy nothing to learn
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(40.0)
    target = tmp_path / "target"
    model.save_pretrained(target)
    tiny_llama_dir = target

    rng = random.Random(0)
    # repetitive "responses" a head can learn: cycles of a few tokens after a random prompt
    records = []
    for i in range(32):
        cyc = [rng.randrange(100, 600) for _ in range(rng.randrange(2, 5))]
        records.append({"prompt_ids": [rng.randrange(100, 2000) for _ in range(12)],
                        "output_ids": (cyc * 20)[:40]})
    extract(tiny_llama_dir, records, tmp_path / "features", [2, 3], shard_size=64)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    # gloo even where torch sees a GPU: both ranks train on the CPU here
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CARTSPEC_DDP_BACKEND": "gloo"}
    one = _run([sys.executable, str(script), str(tmp_path / "features"), str(tiny_llama_dir),
                str(tmp_path / "one")], env)
    torchrun = Path(sys.executable).with_name("torchrun")
    two = {mode: _run([str(torchrun), "--standalone", "--nproc_per_node", "2", str(script),
                       str(tmp_path / "features"), str(tiny_llama_dir), str(tmp_path / mode), mode], env,
                      out=tmp_path / mode)
           for mode in ("ddp", "fsdp")}
    assert one["world"] == 1 and one["sharding"] is None
    assert all(two[m]["world"] == 2 and two[m]["sharding"] == m for m in two)
    assert two["fsdp"]["stopped_at"] == 1 and len(two["fsdp"]["history"]) == 30  # stopped, then resumed
    tail = lambda h: sum(h[-10:]) / 10  # noqa: E731
    l1 = tail(one["history"])
    print(f"\n[ddp] final loss (mean of the last 10 of {len(one['history'])} steps; first step "
          f"{one['history'][0]:.4f}): one process {l1:.4f}, " + ", ".join(
              f"torchrun 2 processes {m.upper()} {tail(two[m]['history']):.4f} (relative difference "
              f"{abs(tail(two[m]['history']) - l1) / l1:.4f})" for m in two))
    assert l1 < 0.8 * one["history"][0]  # it learnt something
    for m in two:
        assert abs(tail(two[m]["history"]) - l1) <= 0.05 * l1, (m, one, two[m])
