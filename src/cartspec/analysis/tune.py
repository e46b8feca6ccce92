"""γ per batch size: the speculation schedule this machine's measurements say is fastest.

vLLM takes ``num_speculative_tokens_per_batch_size`` ([[lo, hi, k], ...], k = 0: no speculation at
that batch size), because the same head that doubles throughput for one stream can halve it for
sixteen on a machine whose verification cost grows with every token. For every batch size b from 1 to
``max_batch`` and every γ from 0 to ``max_gamma`` the speedup over plain decoding is taken

* **measured**, where this head was measured at exactly concurrency b and that γ, with the baseline at
  the same load, temperature and request set: the measured throughput ratio, preferred to the model
  because it is what the machine did;
* **model**, elsewhere: the fitted cost model's predicted ratio (``cost_model.py``) with the head's
  measured acceptance per position (from its largest γ, at the nearest concurrency).

Where some γ was measured at a batch size, a γ only the model speaks for must beat the best measured
one by more than the model's leave-one-out error to be chosen there: within its error, the model
cannot tell them apart and the measurement can.

The speedup a γ is judged by is the mean over the temperatures the head was measured at (greedy and
sampled traffic both count), and the chosen k is the γ with the highest one, or 0 when none beats
plain decoding by ``min_speedup``. γ above the largest one measured is not considered: the acceptance
at positions never drafted is unknown. Where the head and the baseline were measured in rounds beside
each other, the chosen γ must also clear ``min_speedup`` with the lower end of its 95% interval (mean over
the temperatures): the goal is asymmetric, since decoding plainly where speculation gains a few percent
costs those few percent, while speculating where the gain is noise can fall below the baseline.

Several runs of one machine pool (``cartspec tune --run A --run B``): each fixed-γ point is set beside
its own run's baseline, the ratios averaged, the paired slices of all runs give the interval, and the
cost model is fitted to every point. One run's noise at a load (two servers doing the same work measured
up to 16% apart there) then moves the schedule less: tuned from one run at a time, the schedule swung
between γ=5 and γ=3 at four streams from run to run.

γ never rises with the batch (``monotone``). The batch sizes where the deciding γ was measured, and
measured within reach of the model's prediction, anchor the schedule; a batch size between two anchors
keeps a γ between theirs. So the model's guess between two measurements cannot overrule both (it did:
γ=2 predicted at 9-15 capped the γ=3 that 16 streams measured fastest), and a point far off the model
(a stall of the host) anchors nothing.

Where the points cannot fit the cost model (the ``quick`` preset: the baseline and one γ at two loads),
``cartspec tune`` decides from the measurements alone (``measured_schedule``): at every load measured, the
fastest γ whose 95% interval over the baseline (paired slices, measured in rounds) clears ``min_speedup``,
else plain decoding (γ=0). A batch size between two measured loads takes the decision of the larger one
(a γ's speedup only falls as the batch grows, so what holds at the larger load holds below it), and batch
sizes above the largest measured load decode plainly: nothing measured says speculation pays there. A point
measured alone (no slices beside the baseline) has no interval and supports nothing. The result says which
way it was decided (``TuneResult.basis``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Literal, Sequence

import numpy as np
from pydantic import BaseModel, Field

from ..results import PointResult
from ..config_files import FileModel
from ..serving.spec import DeploymentSpec, Speculative
from .specs import measured_spec
from .cost_model import (CALIBRATE_HINT, MODEL_DRAFTERS, CostModel, Observation, acceptance_for, exclusion,
                         fit_cost_model, observations)

Schedule = list[tuple[int, int, int]]


class BatchChoice(BaseModel):
    """The decision at one batch size, with what it compared."""

    batch: int
    k: int = Field(..., description="γ chosen; 0: no speculation")
    reason: Literal["measured", "model", "unmeasured"] = Field(
        ..., description="measured: a point at this concurrency entered the decision (basis measured: the "
                         "measured load it follows); model: predictions only; unmeasured: above every measured "
                         "load, with no model to speak for it")
    predicted_throughput: dict[int, float] = Field(
        ..., description="γ -> the model's output tokens/s (mean over temperatures)")
    speedup: dict[int, float] = Field(..., description="γ -> speedup over γ=0 the decision used (mean over T)")
    source: dict[int, Literal["measured", "model", "mixed"]] = Field(
        ..., description="γ -> measured at every temperature, at none (model), or at some (mixed)")
    anchor: bool = Field(False, description="the chosen γ was measured here, within the model's reach of what it "
                                            "predicts: the batch sizes around it follow it (γ never rises)")
    interval: dict[int, tuple[float, float]] = Field(
        default_factory=dict, description="γ -> 95% interval of the measured speedup (each end the mean over T), "
                                          "where measured in rounds beside the baseline")
    load: int | None = Field(None, description="basis measured: the measured concurrency whose decision this batch "
                                               "size takes (the smallest at or above it); None above them all")


class TuneResult(FileModel):
    """A tuned schedule and why: what each batch size compared, and the cost model behind it."""

    head: str
    method: str = "eagle3"
    temperatures: list[float]
    gammas: list[int] = Field(..., description="the γ values compared (0 is plain decoding)")
    max_batch: int
    min_speedup: float = 1.0
    schedule: Schedule = Field(..., description="[(lo, hi, k), ...] covering 1..max_batch; k=0: off")
    choices: list[BatchChoice]
    basis: Literal["model", "measured"] = Field(
        "model", description="model: measured where measured, the cost model elsewhere; measured: the points "
                             "could not fit the cost model, so the measured loads and their intervals decided")
    cost_model: CostModel | None = Field(None, description="the fitted step costs (None where basis is measured)")
    notes: list[str] = Field(default_factory=list)

    @property
    def speculates(self) -> bool:
        return any(k for _, _, k in self.schedule)

    def deployment(self, base: DeploymentSpec | None = None) -> DeploymentSpec:
        """``base`` (the measured deployment's engine settings) with this schedule, or with plain
        decoding when the schedule never speculates."""
        base = base or DeploymentSpec()
        if not self.speculates:
            sp = Speculative()
        else:
            sp = Speculative(method=self.method, model=self.head,
                             num_speculative_tokens=max(k for *_, k in self.schedule),
                             schedule=[tuple(s) for s in self.schedule])
        return base.model_copy(update={"speculative": sp, "name": f"{base.name}-tuned"})


def merge_schedule(ks: list[int]) -> Schedule:
    """k per batch size (``ks[0]`` is batch size 1) -> inclusive ranges, equal neighbours merged."""
    out: Schedule = []
    for b, k in enumerate(ks, start=1):
        if out and out[-1][2] == k:
            out[-1] = (out[-1][0], b, k)
        else:
            out.append((b, b, k))
    return out


def _same_load(r: PointResult) -> tuple:
    c = r.config
    return (c.request_set, c.concurrency, c.temperature, c.max_tokens, c.structured)


def as_runs(results: Iterable[PointResult] | Sequence[Sequence[PointResult]]) -> list[list[PointResult]]:
    """One run's points, or several runs' (a sequence of lists): always a list of runs. A point pairs with
    the baseline of its own run only (another run's baseline ran on another host state)."""
    items = list(results)
    if items and all(isinstance(x, (list, tuple)) for x in items):
        return [list(x) for x in items]
    return [items]


def _head_beside_baseline(results: Iterable[PointResult] | Sequence[Sequence[PointResult]], head: str,
                          method: str | None = None):
    """(temperature, concurrency, γ), the head's point and the baseline's at the same load in the same run:
    closed-loop points with a fixed γ (of ``method`` only, where given: the hybrid drafts with the same head)."""
    for run in as_runs(results):
        base = {_same_load(r): r for r in run if r.config.method == "none" and exclusion(r) is None}
        for r in run:
            c = r.config
            b = base.get(_same_load(r))
            if (c.method in MODEL_DRAFTERS and (c.head or c.method) == head and exclusion(r) is None and b
                    and (method is None or c.method == method)):
                yield (c.temperature, int(c.concurrency), int(c.gamma)), r, b


def measured_speedups(results: Iterable[PointResult] | Sequence[Sequence[PointResult]],
                      head: str, method: str | None = None) -> dict[tuple[float, int, int], float]:
    """(temperature, concurrency, γ) -> this head's throughput / the baseline's at the same load (mean over
    request sets and runs), from closed-loop points with a fixed γ."""
    ratios: dict[tuple[float, int, int], list[float]] = {}
    for key, r, b in _head_beside_baseline(results, head, method):
        if b.output_throughput:
            ratios.setdefault(key, []).append(r.output_throughput / b.output_throughput)
    return {k: float(np.mean(v)) for k, v in ratios.items()}


def measured_intervals(results: Iterable[PointResult] | Sequence[Sequence[PointResult]], head: str,
                       method: str | None = None) -> dict[tuple[float, int, int], tuple[float, float]]:
    """(temperature, concurrency, γ) -> the 95% interval of this head's speedup over the baseline, from every
    pair of slices measured back to back at that load (in rounds, beside each other; several request sets or
    runs pool their pairs: ``analysis.rows.pooled_ratio_ci``); absent elsewhere."""
    from .rows import pooled_ratio_ci

    pairs: dict[tuple[float, int, int], list] = {}
    for key, r, b in _head_beside_baseline(results, head, method):
        pairs.setdefault(key, []).append((r, b))
    cis = {k: pooled_ratio_ci(v) for k, v in pairs.items()}
    return {k: ci for k, ci in cis.items() if ci}


def measured_lows(results: Iterable[PointResult] | Sequence[Sequence[PointResult]],
                  head: str) -> dict[tuple[float, int, int], float]:
    """(temperature, concurrency, γ) -> the lower end of ``measured_intervals``."""
    return {k: ci[0] for k, ci in measured_intervals(results, head).items()}


def pick_head(obs: list[Observation], head: str | None) -> str:
    counts: dict[str, int] = {}
    for o in obs:
        if o.gamma > 0:
            counts[o.head] = counts.get(o.head, 0) + 1
    if not counts:
        raise ValueError("no EAGLE-3 point with acceptance counters in these results: the schedule needs the "
                         f"baseline and the head measured at several concurrencies; {CALIBRATE_HINT}")
    if head is None:
        return max(sorted(counts), key=lambda h: counts[h])
    if head not in counts:
        raise ValueError(f"no EAGLE-3 points for head {head!r} in these results (measured: "
                         f"{', '.join(sorted(counts))}); run `cartspec study --preset calibrate` with that head, "
                         f"or --deployments baseline,eagle3:{head}:5")
    return head


def tune_schedule(results: Iterable[PointResult] | Sequence[Sequence[PointResult]], head: str | None = None,
                  max_gamma: int = 5, max_batch: int = 64, min_speedup: float = 1.0,
                  model: CostModel | None = None, fallback: bool = False) -> TuneResult:
    """The fastest γ per batch size 1..max_batch for ``head`` (default: the EAGLE-3 head with the most
    points), measured where measured, predicted elsewhere. ``results``: one run's points, or a list of
    several runs' (of one machine): their measurements pool, each point beside its own run's baseline, and
    the cost model is fitted to all of them. ``fallback``: where the points cannot fit the cost model,
    decide from the measured loads and their intervals (``measured_schedule``) instead of raising. Raises
    ValueError saying what to measure."""
    if max_gamma < 0 or max_batch < 1:
        raise ValueError("max_gamma must be >= 0 and max_batch >= 1")
    runs = [[r for r in run if r.status == "ok"] for run in as_runs(results)]
    results = [r for run in runs for r in run]
    obs = observations(results)
    head = pick_head(obs, head)
    mine = [o for o in obs if o.gamma > 0 and o.head == head]
    if model is None:
        try:
            model = fit_cost_model(results)
        except ValueError as exc:
            if not fallback:
                raise
            return measured_schedule(runs, head=head, max_gamma=max_gamma, max_batch=max_batch,
                                     min_speedup=min_speedup, why=str(exc))
    method = mine[0].result.config.method
    temps = sorted({o.result.config.temperature for o in mine})
    top = max(o.gamma for o in mine)
    gammas = list(range(0, min(max_gamma, top) + 1))
    notes = []
    if max_gamma > top:
        notes.append(f"γ above {top} not considered: acceptance beyond position {top} was never measured "
                     f"(measure eagle3:{head}:{max_gamma})")
    widest = max(int(o.result.config.concurrency) for o in obs)
    if max_batch > widest:
        notes.append(f"batch sizes above {widest} (the most concurrency measured) are the model's extrapolation")
    # Request lengths at each temperature: sampled replies run longer or shorter than greedy ones.
    lengths = {}
    for t in temps:
        at = [o for o in obs if o.result.config.temperature == t and (o.gamma == 0 or o.head == head)]
        lengths[t] = (float(np.mean([o.prompt_tokens for o in at])), float(np.mean([o.output_tokens for o in at])))
    measured = measured_speedups(runs, head)
    lows = measured_lows(runs, head)
    if len(runs) > 1:
        notes.append(f"measurements of {len(runs)} runs pooled, each point beside its own run's baseline")
    margin = model.loo_median_abs_error if model.loo_median_abs_error is not None else model.median_abs_error

    choices = []
    for b in range(1, max_batch + 1):
        thr: dict[int, float] = {}
        speedup: dict[int, float] = {}
        predicted: dict[int, float] = {}
        source: dict[int, str] = {}
        for g in gammas:
            per_t, model_thr, model_sp, n_meas = [], [], [], 0
            for t in temps:
                p, n = lengths[t]
                acc = acceptance_for(obs, head, t, g, b) if g else []
                x = model.predict_throughput(b, g, acc, p, n)
                x0 = model.predict_throughput(b, 0, [], p, n)
                model_thr.append(x)
                model_sp.append(x / x0)
                if g and (t, b, g) in measured:
                    per_t.append(measured[(t, b, g)])
                    n_meas += 1
                else:
                    per_t.append(model_sp[-1])
            thr[g] = float(np.mean(model_thr))
            speedup[g] = float(np.mean(per_t))
            predicted[g] = float(np.mean(model_sp))
            source[g] = "measured" if n_meas == len(temps) else "mixed" if n_meas else "model"
        best = max(gammas[1:], key=lambda g: (speedup[g], -g), default=0)
        # A γ the model alone speaks for displaces a measured one only when it is predicted faster by
        # more than the model's own error: within it, what the machine did wins.
        meas = [g for g in gammas[1:] if source[g] == "measured"]
        if meas and source[best] != "measured":
            top_meas = max(meas, key=lambda g: (speedup[g], -g))
            if speedup[best] <= speedup[top_meas] * (1 + margin):
                notes.append(f"batch {b}: measured γ={top_meas} ({speedup[top_meas]:.2f}) kept over the model's "
                             f"γ={best} ({speedup[best]:.2f}), within the model's error of {margin:.0%}")
                best = top_meas
        k = best if best and speedup[best] > min_speedup else 0
        # Measured in rounds: the chosen γ must clear min_speedup with its interval's lower end too (module doc).
        low = [lows[(t, b, k)] for t in temps if (t, b, k) in lows] if k else []
        if k and len(low) == len(temps) and float(np.mean(low)) <= min_speedup:
            notes.append(f"batch {b}: γ={k} measured ×{speedup[k]:.2f}, but its 95% interval reaches "
                         f"×{float(np.mean(low)):.2f}: off (speculation must beat plain decoding beyond the noise)")
            k = 0
        reason = "measured" if any(source[g] != "model" for g in gammas[1:]) else "model"
        # An anchor: the decisive γ (the chosen one, or the best measured one where none pays) was measured
        # here and is no outlier of the model (within ``ANCHOR_REACH`` x its error): the batch sizes
        # between two anchors, where only the model speaks, follow the measurements around them.
        deciding = best if best else max(gammas[1:], key=lambda g: speedup[g], default=0)
        reach = max(ANCHOR_REACH * margin, ANCHOR_MIN_REACH)
        anchor = bool(deciding and source[deciding] == "measured"
                      and abs(speedup[deciding] / predicted[deciding] - 1) <= reach)
        choices.append(BatchChoice(batch=b, k=k, reason=reason, predicted_throughput=thr, speedup=speedup,
                                   source=source, anchor=anchor))
    notes += monotone(choices)
    schedule = merge_schedule([c.k for c in choices])
    if not any(k for *_, k in schedule):
        notes.append(f"speculation with head {head!r} beats plain decoding at no batch size on this machine: "
                     "the tuned deployment decodes plainly (method none)")
    return TuneResult(head=head, method=method, temperatures=temps, gammas=gammas, max_batch=max_batch,
                      min_speedup=min_speedup, schedule=schedule, choices=choices, cost_model=model, notes=notes)


def _drafter_of(results: Iterable[PointResult], head: str) -> str:
    """The drafting method a schedule for ``head`` is written for: EAGLE-3 where the head drafted alone (the
    hybrid drafts with the same head, and a schedule is one drafter's γ per batch size)."""
    methods = [r.config.method for r in results if r.config.method in MODEL_DRAFTERS
               and (r.config.head or r.config.method) == head]
    return "eagle3" if "eagle3" in methods else max(sorted(set(methods)), key=methods.count)


def measured_schedule(results: Iterable[PointResult] | Sequence[Sequence[PointResult]], head: str | None = None,
                      max_gamma: int = 5, max_batch: int = 64, min_speedup: float = 1.0,
                      why: str = "") -> TuneResult:
    """γ per batch size from the measured loads alone, for points too few to fit the cost model (module doc):
    at each load, the fastest γ whose 95% interval over the baseline clears ``min_speedup``, else 0; between
    loads the larger load's decision, above them all 0, and γ never rises with load. ``why``: why the model
    could not be fitted, said in the notes. Raises ValueError when no point of the head was measured beside
    the baseline at its own load."""
    runs = [[r for r in run if r.status == "ok"] for run in as_runs(results)]
    flat = [r for run in runs for r in run]
    head = pick_head(observations(flat), head)
    method = _drafter_of(flat, head)
    ratio = {k: v for k, v in measured_speedups(runs, head, method).items() if k[2] <= max_gamma}
    cis = measured_intervals(runs, head, method)
    if not ratio:
        raise ValueError(f"no point of head {head!r} was measured beside the baseline at its own load (same "
                         f"concurrency, temperature and request set): {CALIBRATE_HINT}")
    temps = sorted({t for t, _, _ in ratio})
    loads = sorted({c for _, c, _ in ratio})
    notes = [f"decided from the measured points: the cost model cannot be fitted ({why})" if why else
             "decided from the measured points"]
    if len(runs) > 1:
        notes.append(f"measurements of {len(runs)} runs pooled, each point beside its own run's baseline")
    per_load: dict[int, BatchChoice] = {}
    for c in loads:
        speedup: dict[int, float] = {}
        interval: dict[int, tuple[float, float]] = {}
        for g in sorted({g for _, cc, g in ratio if cc == c}):
            at = [(t, c, g) for t in temps]
            if not all(k in ratio for k in at):  # a mean over fewer temperatures would not compare
                notes.append(f"load {c}: γ={g} was not measured at every temperature ({', '.join(map(str, temps))})"
                             ": left out")
                continue
            speedup[g] = float(np.mean([ratio[k] for k in at]))
            if all(k in cis for k in at):
                interval[g] = (float(np.mean([cis[k][0] for k in at])), float(np.mean([cis[k][1] for k in at])))
        reliable = [g for g in speedup if g in interval and interval[g][0] > min_speedup]
        k = max(reliable, key=lambda g: (speedup[g], -g)) if reliable else 0
        for g in sorted(speedup):
            if g in reliable or speedup[g] <= min_speedup:
                continue
            if g in interval:
                notes.append(f"load {c}: γ={g} measured ×{speedup[g]:.2f}, but its 95% interval reaches "
                             f"×{interval[g][0]:.2f}: not reliably faster than plain decoding")
            else:
                notes.append(f"load {c}: γ={g} measured ×{speedup[g]:.2f} with no interval (not measured in rounds "
                             "beside the baseline): not reliably faster than plain decoding")
        per_load[c] = BatchChoice(batch=c, k=k, reason="measured", predicted_throughput={}, speedup=speedup,
                                  source={g: "measured" for g in speedup}, anchor=True, interval=interval, load=c)
    cap = None
    for c in loads:  # γ never rises with load: a larger γ at a larger load is noise (``monotone``)
        if cap is not None and per_load[c].k > cap:
            notes.append(f"load {c}: γ={per_load[c].k} capped at γ={cap}, the γ of a smaller load (γ never rises "
                         "with load)")
            per_load[c].k = cap
        cap = per_load[c].k
    choices = []
    for b in range(1, max_batch + 1):
        at = next((c for c in loads if c >= b), None)
        if at is None:
            choices.append(BatchChoice(batch=b, k=0, reason="unmeasured", predicted_throughput={}, speedup={},
                                       source={}))
        else:
            choices.append(per_load[at].model_copy(update={"batch": b, "anchor": b == at}))
    if len(loads) > 1 or loads[0] > 1:
        notes.append("a batch size between measured loads takes the decision of the next larger one (a γ's "
                     "speedup falls as the batch grows)")
    if max_batch > loads[-1]:
        notes.append(f"batch sizes above {loads[-1]} (the most concurrency measured) decode plainly: no "
                     "measurement says speculation pays there")
    schedule = merge_schedule([ch.k for ch in choices])
    if not any(k for *_, k in schedule):
        notes.append(f"speculation with head {head!r} was reliably faster than plain decoding at no measured load: "
                     "the tuned deployment decodes plainly (method none)")
    gammas = [0] + sorted({g for ch in per_load.values() for g in ch.speedup})
    return TuneResult(head=head, method=method, temperatures=temps, gammas=gammas, max_batch=max_batch,
                      min_speedup=min_speedup, schedule=schedule, choices=choices, basis="measured",
                      cost_model=None, notes=notes)


# A measured choice anchors the schedule when its speedup is within this many times the model's
# leave-one-out error of the model's prediction (and never less than ANCHOR_MIN_REACH): a point further
# off than that is more likely a stall of the host than the machine.
ANCHOR_REACH = 3.0
ANCHOR_MIN_REACH = 0.10


def _capped(cur: BatchChoice, k: int, what: str, moved: list[tuple[int, int, str, str]]) -> None:
    moved.append((cur.batch, cur.k, cur.reason, what))
    cur.k = k


def _notes(moved: list[tuple[int, int, str, str]]) -> list[str]:
    """One note per run of consecutive batch sizes moved for the same reason ("batch 9-15: γ=2 (model) ...")."""
    runs: list[list[tuple[int, int, str, str]]] = []
    for m in sorted(moved):
        last = runs[-1][-1] if runs else None
        if last and m[0] == last[0] + 1 and m[2:] == last[2:]:
            runs[-1].append(m)
        else:
            runs.append([m])
    out = []
    for r in runs:
        ks = sorted({m[1] for m in r})
        b = f"{r[0][0]}" if len(r) == 1 else f"{r[0][0]}-{r[-1][0]}"
        k = f"{ks[0]}" if len(ks) == 1 else f"{ks[0]}-{ks[-1]}"
        out.append(f"batch {b}: γ={k} ({r[0][2]}) {r[0][3]}")
    return out


def monotone(choices: list[BatchChoice]) -> list[str]:
    """Make γ non-increasing in the batch size, in place, and say what moved.

    Verification costs grow with b·(γ+1) while a draft's worth does not, so γ never rises with the batch:
    a larger γ at a larger batch is noise, not the machine. The measured anchors decide first (a later
    anchor above an earlier one is capped at it); a batch size between two anchors is then kept between
    their γ (at most the one before, at least the one after) and capped at its left neighbour. So where the
    model alone prefers a smaller γ than the measurements on both sides of it (γ=2 at batch 9-15 where
    batch 8 and 16 both measured γ=3 fastest), the measurements win, instead of the model's γ capping every
    measured batch size after it."""
    notes: list[tuple[int, int, str, str]] = []
    anchors = [c for c in choices if c.anchor]
    for prev, cur in zip(anchors, anchors[1:]):
        if cur.k > prev.k:
            _capped(cur, prev.k, f"capped at γ={prev.k}, the γ of batch {prev.batch} (γ never rises with load)",
                    notes)
    before: BatchChoice | None = None
    for i, cur in enumerate(choices):
        if cur.anchor:
            before = cur
            continue
        after = next((c for c in choices[i + 1:] if c.anchor), None)
        left = choices[i - 1] if i else None
        hi = min(x.k for x in (before, left) if x is not None) if (before or left) else cur.k
        if cur.k > hi:
            src = left if left is not None and left.k == hi else before
            _capped(cur, hi, f"capped at γ={hi}, the γ of batch {src.batch} (γ never rises with load)", notes)
        elif after is not None and cur.k < after.k:
            _capped(cur, after.k, f"raised to γ={after.k}, the γ of the measured batch {after.batch} (γ never "
                                  f"rises with load)", notes)
    return _notes(notes)


def base_spec(results: Iterable[PointResult], head: str) -> DeploymentSpec:
    """The engine settings (model, dtype, limits, flags) the head was measured with, so that the tuned
    deployment runs as the measurements did."""
    for r in results:
        if r.config.head == head and r.config.spec:
            try:
                return measured_spec(r.config).model_copy(update={"speculative": Speculative()})
            except ValueError:
                continue
    return DeploymentSpec()


def tune_json_path(spec_path: str | Path) -> Path:
    """``spec.yaml`` -> ``spec.tune.json``: the reasons travel beside the spec."""
    return Path(spec_path).with_suffix(".tune.json")


def save_tuned(result: TuneResult, spec: DeploymentSpec, out: str | Path) -> tuple[Path, Path]:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return spec.save(out), result.save(tune_json_path(out))
