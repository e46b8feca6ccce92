"""What a decode step costs on this machine, fitted from a sweep, and the throughput it predicts.

Whether speculation pays is a property of the machine (verifying γ+1 tokens costs almost γ+1 times one
token where the matmuls are compute-bound, nearly nothing more where they are memory-bound), so the
study's points are read as measurements of a small step-cost model:

In a closed loop with ``b`` sequences in the batch and chain drafting of γ tokens, one engine step

    s(b, γ) = α + β·b·(γ+1) + γ·(δ + ε·b)          seconds

is a target forward over b·(γ+1) tokens (a fixed part α and β per token) plus γ draft forwards over the
b sequences (δ per forward, ε per drafted token). It moves every sequence on by

    τ(γ) = 1 + p_1 + … + p_γ                        tokens

where p_i is the share of drafts whose i-th token was accepted (γ = 0: plain decoding, τ = 1, no draft
cost). Each request also has its prompt of P tokens prefilled, π·P seconds of engine time, shared by
its n_out output tokens. So the engine time per output token is

    1 / throughput = s(b, γ) / (b·τ) + π·P / n_out

which is linear in (α, β, δ, ε, π). They are fitted by non-negative least squares on relative error
(each row divided by the measured 1/throughput, so that a point at one stream weighs as much as one at
thirty-two), over every successful closed-loop point of the baseline and of model drafters (EAGLE-3,
draft models), each with its own measured acceptance. n-gram points are left out: their drafts are
lookups with no model forward, and steps without a match draft nothing, which this model does not
describe. Points whose γ varies with batch size (a schedule) or per request (a draft cut where the head is
unsure: fewer tokens verified than b·(γ+1)) are left out too.

``b`` is the batch the engine actually ran, not the nominal concurrency: by Little's law the mean
number of requests in flight is Σ E2EL / wall time. A closed loop of 2·c requests at concurrency c
drains at the end (the last requests run in a shrinking batch), and with n_requests ≈ 2c the drain is
a large share of the run; the nominal c would overstate the batch by that much. Without per-request
records the nominal concurrency is used.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterable

import numpy as np
from pydantic import BaseModel, Field, computed_field

from ..results import PointResult
from ..config_files import FileModel
from .specs import measured_spec

#: Methods whose drafts come from a model forward: the ones this cost model describes.
MODEL_DRAFTERS = ("eagle3", "draft_model", "hybrid")  # hybrid: EAGLE-3 forwards + a CPU lookup

CALIBRATE_HINT = "run `cartspec study --preset calibrate`"


class StepCosts(BaseModel):
    """The machine's step costs, in seconds."""

    alpha: float = Field(..., ge=0, description="per target step, whatever its size")
    beta: float = Field(..., ge=0, description="per token the target verifies (b·(γ+1) a step)")
    delta: float = Field(..., ge=0, description="per draft forward (γ a step)")
    epsilon: float = Field(..., ge=0, description="per drafted token (b·γ a step)")
    pi: float = Field(..., ge=0, description="per prompt token prefilled")

    def vector(self) -> np.ndarray:
        return np.array([self.alpha, self.beta, self.delta, self.epsilon, self.pi])

    @classmethod
    def from_vector(cls, x: Iterable[float]) -> "StepCosts":
        a, b, d, e, p = (max(float(v), 0.0) for v in x)
        return cls(alpha=a, beta=b, delta=d, epsilon=e, pi=p)


class PointPrediction(BaseModel):
    deployment: str
    method: str
    gamma: int
    concurrency: int
    temperature: float
    batch: float = Field(..., description="requests in flight on average (Little's law), the b of the model")
    measured: float = Field(..., description="output tokens/s")
    predicted: float = Field(..., description="output tokens/s")

    @computed_field
    @property
    def error(self) -> float:
        """Relative: predicted / measured − 1."""
        return self.predicted / self.measured - 1.0


def median_abs_error(predictions: list[PointPrediction]) -> float:
    return float(np.median([abs(p.error) for p in predictions])) if predictions else math.nan


def tokens_per_step(gamma: int, per_position: list[float]) -> float:
    """τ: the bonus token plus the expected accepted drafts; chain drafting makes p_i cumulative."""
    if gamma < 0:
        raise ValueError(f"γ must be >= 0, got {gamma}")
    if len(per_position) < gamma:
        raise ValueError(f"γ={gamma} needs the acceptance at {gamma} positions, got {len(per_position)}: "
                         f"measure a deployment with γ >= {gamma}")
    return 1.0 + float(sum(per_position[:gamma]))


def features(batch: float, gamma: int, per_position: list[float], prompt_tokens: float,
             output_tokens: float) -> np.ndarray:
    """The row of the linear model: 1/throughput = features · (α, β, δ, ε, π)."""
    if batch <= 0 or output_tokens <= 0:
        raise ValueError("batch size and output tokens must be positive")
    tau = tokens_per_step(gamma, per_position)
    return np.array([1 / (batch * tau), (gamma + 1) / tau, gamma / (batch * tau), gamma / tau,
                     prompt_tokens / output_tokens])


# --- the points a fit can use -------------------------------------------------------------


@dataclass(frozen=True)
class Observation:
    """One measured point, reduced to what the model reads."""

    result: PointResult
    batch: float
    gamma: int
    per_position: tuple[float, ...]
    prompt_tokens: float
    output_tokens: float
    throughput: float

    @property
    def row(self) -> np.ndarray:
        return features(self.batch, self.gamma, list(self.per_position), self.prompt_tokens, self.output_tokens)

    @property
    def head(self) -> str:
        return self.result.config.head or self.result.config.method


def in_flight(r: PointResult) -> float:
    """Mean requests in flight over the measured run (Little's law), capped at the concurrency."""
    c = float(r.config.concurrency or 1)
    lat = [x.e2el for x in r.records if x.ok and x.e2el is not None]
    if not lat or r.wall_s <= 0:
        return c
    return min(c, sum(lat) / r.wall_s) or c


def has_schedule(r: PointResult) -> bool:
    spec = measured_spec(r.config)
    return bool(spec and (spec.speculative.schedule or spec.speculative.adaptive))


def cuts_drafts(r: PointResult) -> bool:
    """Whether the point's drafts were cut per request (``speculative.draft_stop``)."""
    spec = measured_spec(r.config)
    return bool(spec and spec.speculative.draft_stop)


def exclusion(r: PointResult) -> str | None:
    """Why a point cannot inform the model (None: it can)."""
    c = r.config
    if r.status != "ok" or not r.output_throughput or r.output_throughput <= 0:
        return "not measured successfully"
    if c.mode != "closed" or not c.concurrency:
        return "open loop: throughput follows the arrival rate, not the machine"
    if c.method != "none" and c.method not in MODEL_DRAFTERS:
        return f"{c.method} drafts without a model forward"
    if has_schedule(r):
        return "γ varies with batch size (a schedule)"
    if cuts_drafts(r):
        return "γ varies per request (a draft cut where the head is unsure): fewer than b·(γ+1) tokens verified"
    if c.method != "none":
        if not c.gamma:
            return "speculative point without γ"
        if r.acceptance is None or not r.acceptance.steps or len(r.acceptance.per_position) < c.gamma:
            return "no per-position acceptance counters"
    return None


def observe(r: PointResult) -> Observation:
    ok = [x for x in r.records if x.ok]
    out = float(np.mean([x.output_tokens for x in ok])) if ok else 0.0
    if out <= 0:
        out = r.output_tokens / max(r.n_requests - r.n_errors, 1)
    prompt = float(np.mean([x.prompt_tokens for x in ok])) if ok else 0.0
    gamma = 0 if r.config.method == "none" else int(r.config.gamma or 0)
    per_pos = tuple(r.acceptance.per_position_rate[:gamma]) if gamma and r.acceptance else ()
    return Observation(result=r, batch=in_flight(r), gamma=gamma, per_position=per_pos, prompt_tokens=prompt,
                       output_tokens=max(out, 1.0), throughput=float(r.output_throughput))


def observations(results: Iterable[PointResult]) -> list[Observation]:
    return [observe(r) for r in results if exclusion(r) is None]


# --- the fit ------------------------------------------------------------------------------


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0, exactly, by trying every support set.

    The optimum's non-zero coefficients are the unconstrained least-squares solution on their own
    columns, so it is the best of the non-negative per-subset solutions; with five coefficients that
    is 31 small solves, with no iteration to converge and no scipy needed. Columns are scaled to unit
    norm first so that seconds-per-step and seconds-per-token are on one footing.
    """
    n = a.shape[1]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a_s = a / scale
    best, best_res = np.zeros(n), float(np.sum(y ** 2))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            idx = list(cols)
            z, *_ = np.linalg.lstsq(a_s[:, idx], y, rcond=None)
            if np.any(z < -1e-12):
                continue
            x = np.zeros(n)
            x[idx] = np.clip(z, 0, None)
            res = float(np.sum((a_s @ x - y) ** 2))
            if res < best_res - 1e-15:
                best, best_res = x, res
    return best / scale


def _solve(obs: list[Observation]) -> StepCosts:
    # Divided by the measured 1/throughput: each row's residual is a relative error.
    a = np.array([o.row * o.throughput for o in obs])
    return StepCosts.from_vector(nnls(a, np.ones(len(obs))))


def _check_enough(obs: list[Observation]) -> None:
    base = sorted({o.result.config.concurrency for o in obs if o.gamma == 0})
    spec = sorted({o.result.config.concurrency for o in obs if o.gamma > 0})
    if len(base) >= 2 and len(spec) >= 2 and len(obs) >= 5:
        return
    have = (f"this run has {len(obs)} usable point(s): baseline at "
            f"{'c=' + ','.join(map(str, base)) if base else 'no concurrency'}, speculative (EAGLE-3) at "
            f"{'c=' + ','.join(map(str, spec)) if spec else 'no concurrency'}")
    raise ValueError("the cost model needs baseline and speculative (EAGLE-3) points at two or more "
                     f"concurrencies, five points or more in all ({have}); {CALIBRATE_HINT}")


def describe_machine(results: Iterable[PointResult]) -> str:
    """What the costs belong to: they transfer to no other CPU, dtype or engine."""
    seen: list[str] = []
    for r in results:
        m = r.machine
        dtype = spec.dtype if (spec := measured_spec(r.config)) else None
        parts = []
        if m:
            parts.append(f"{m.cpu}, {m.cores} cores, {m.memory_gib:g} GiB ({m.hostname})")
            if m.versions.get("vllm"):
                parts.append(m.versions["vllm"])
        if dtype:
            parts.append(f"dtype {dtype}")
        text = ", ".join(parts) or "unknown machine"
        if text not in seen:
            seen.append(text)
    return "; ".join(seen) or "unknown machine"


class CostModel(FileModel):
    """Step costs fitted on one machine, how well they fit, and the throughput they predict."""

    coefficients: StepCosts
    n_points: int
    median_abs_error: float = Field(..., description="in-sample, relative")
    loo_median_abs_error: float | None = Field(None, description="leave-one-out: each point predicted by a "
                                                                 "fit without it")
    machine: str = Field("", description="CPU, cores, engine and dtype the costs were measured on")

    def step_time(self, batch: float, gamma: int) -> float:
        c = self.coefficients
        return c.alpha + c.beta * batch * (gamma + 1) + gamma * (c.delta + c.epsilon * batch)

    def predict_throughput(self, concurrency: float, gamma: int, per_position: list[float],
                           prompt_tokens: float, output_tokens: float) -> float:
        """Output tokens/s with ``concurrency`` sequences in the batch drafting γ tokens with this
        acceptance per position (only the first γ are read)."""
        sec_per_token = float(features(concurrency, gamma, per_position, prompt_tokens, output_tokens)
                              @ self.coefficients.vector())
        if sec_per_token <= 0:
            raise ValueError("the fitted costs are all zero: the model cannot predict")
        return 1.0 / sec_per_token

    def predict(self, o: Observation) -> PointPrediction:
        c = o.result.config
        return PointPrediction(deployment=c.deployment, method=c.method, gamma=o.gamma,
                               concurrency=int(c.concurrency or 0), temperature=c.temperature, batch=o.batch,
                               measured=o.throughput,
                               predicted=self.predict_throughput(o.batch, o.gamma, list(o.per_position),
                                                                 o.prompt_tokens, o.output_tokens))

    def evaluate(self, results: Iterable[PointResult]) -> list[PointPrediction]:
        """Predicted against measured at every point the model describes, with that point's own batch,
        acceptance and request lengths."""
        return [self.predict(o) for o in observations(results)]


def fit_cost_model(results: Iterable[PointResult], loo: bool = True) -> CostModel:
    """The step costs that best explain these points (relative error), with in-sample and, by default,
    leave-one-out error. Raises ValueError saying what to measure when the points cannot pin them down."""
    results = list(results)
    obs = observations(results)
    _check_enough(obs)
    model = CostModel(coefficients=_solve(obs), n_points=len(obs), median_abs_error=0.0,
                      machine=describe_machine(o.result for o in obs))
    model.median_abs_error = median_abs_error([model.predict(o) for o in obs])
    if loo:
        model.loo_median_abs_error = median_abs_error(_leave_one_out(obs))
    return model


def _leave_one_out(obs: list[Observation]) -> list[PointPrediction]:
    out = []
    for i, o in enumerate(obs):
        rest = obs[:i] + obs[i + 1:]
        m = CostModel(coefficients=_solve(rest), n_points=len(rest), median_abs_error=0.0)
        try:
            out.append(m.predict(o))
        except ValueError:  # the rest pinned nothing down: as wrong as a prediction can be
            c = o.result.config
            out.append(PointPrediction(deployment=c.deployment, method=c.method, gamma=o.gamma,
                                       concurrency=int(c.concurrency or 0), temperature=c.temperature,
                                       batch=o.batch, measured=o.throughput, predicted=0.0))
    return out


def leave_one_out(results: Iterable[PointResult]) -> list[PointPrediction]:
    """Each point predicted by the model fitted on all the others: the error to expect at a point
    that was not measured, which the in-sample error understates."""
    obs = observations(results)
    _check_enough(obs)
    return _leave_one_out(obs)


# --- acceptance where it was not measured ---------------------------------------------------


def acceptance_for(results: Iterable[PointResult] | list[Observation], head: str, temperature: float, gamma: int,
                   concurrency: float) -> list[float]:
    """Per-position acceptance for this head at γ, from the point with the largest γ of the head at this
    temperature (chain drafting: the first i positions do not depend on γ), at the nearest concurrency."""
    results = list(results)
    obs = results if all(isinstance(o, Observation) for o in results) else observations(results)
    pts = [o for o in obs if o.gamma > 0 and o.head == head and o.result.config.temperature == temperature]
    if not pts:
        raise ValueError(f"no acceptance measured for head {head!r} at T={temperature:g}")
    top = max(o.gamma for o in pts)
    if gamma > top:
        raise ValueError(f"acceptance of head {head!r} was measured up to position {top}, not {gamma}: "
                         f"measure eagle3:{head}:{gamma}")
    at_top = [o for o in pts if o.gamma == top]
    near = min(at_top, key=lambda o: (abs(math.log(o.result.config.concurrency / concurrency)),
                                      o.result.config.concurrency))
    return list(near.per_position[:gamma])
