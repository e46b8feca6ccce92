"""Patch ``step_stats``: where an engine step's time goes, drafting against verifying, by batch size.

vLLM 0.32's model runner does one engine step in two calls: ``execute_model`` (the target's forward over
the scheduled tokens: the verify pass of the drafts, or a plain decode) and ``sample_tokens`` (sampling,
the rejection sampler, and the drafter's ``propose_draft_token_ids`` for the next step, then the
bookkeeping). This patch times the three, the drafting wrapped outermost (the head's forwards and every
cartspec drafter: hybrid, schema, draft length), and counts per step:

* ``draft_s``: ``propose_draft_token_ids``;
* ``verify_s``: the rest of the step (the target's forward, sampling and verification, bookkeeping);
* ``gc_s``: of the step's time, Python's garbage collections in this process (a collection runs wherever an
  allocation sets it off, so a drafter's objects can make the verify phase pay for it);
* the requests in the batch and the tokens the target ran, and of those the prompts' prefill
  (``prompt_tokens``), work that speculation does not shorten;
* the steps that prefilled no prompt and their time (``decode_steps``, ``decode_s``): what a step of
  decoding alone costs, the cost that a draft's τ divides; and the requests that entered (``prompts``);
* the tokens drafted and kept where a draft is cut per request (``draft_stop``).

Counts are kept per batch-size bucket (``BUCKETS``) and written, at most every ``EVERY_S`` seconds and
atomically, as JSON to the file named by ``CARTSPEC_STEP_STATS`` (``VllmServer`` names one beside its log).
A step that closes within ``EVERY_S`` of the last write is written by a background thread once that time has
passed, so that the file holds every step ``EVERY_S`` after the engine went idle: a reader that waits that
long reads a run's last steps. ``read`` reads it back; the agent exports it in ``/metrics`` and its trace
lines, and a study point records its own steps (the difference of two reads). Without the variable nothing is
written.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from .registry import Patch, Target

MODULE = "vllm.v1.worker.gpu_model_runner"
SCHED = "vllm.v1.core.sched.output"
ENV = "CARTSPEC_STEP_STATS"
EVERY_S = 0.2
# batch-size buckets (requests in the step): their upper bounds; the last takes the rest
BUCKETS = (1, 2, 4, 8, 16, 32)
FIELDS = ("steps", "draft_s", "verify_s", "gc_s", "requests", "tokens", "prompt_tokens", "drafted", "kept",
          "decode_steps", "decode_s", "prompts")


def bucket_of(n: int) -> str:
    """The bucket a batch of ``n`` requests counts in: ``"1"``, ``"2"``, ``"3-4"``, ..., ``"33+"``."""
    lo = 1
    for hi in BUCKETS:
        if n <= hi:
            return str(hi) if lo == hi else f"{lo}-{hi}"
        lo = hi + 1
    return f"{lo}+"


class Stats:
    """One process's counters (module doc)."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self.by: dict[str, dict[str, float]] = {}
        self.pending: dict[str, float] = {}  # the step being run: filled by the three wraps
        self.last_write = 0.0
        self.dirty = False  # steps closed since the last write
        self.lock = threading.Lock()  # the counters, between the engine's thread and the flusher
        self.flusher: threading.Thread | None = None
        self.pid = os.getpid()

    def add(self, field: str, value: float) -> None:
        self.pending[field] = self.pending.get(field, 0.0) + value

    def close_step(self, requests: int, tokens: int, prompt: int, prompts: int) -> None:
        p, self.pending = self.pending, {}
        with self.lock:
            self._count(p, requests, tokens, prompt, prompts)
            self.dirty = True
            if self.path is not None and time.monotonic() - self.last_write >= EVERY_S:
                self._write()
        if self.path is not None and self.flusher is None:
            self.flusher = threading.Thread(target=self._flush_loop, name="cartspec-step-stats", daemon=True)
            self.flusher.start()

    def _count(self, p: dict[str, float], requests: int, tokens: int, prompt: int, prompts: int) -> None:
        row = self.by.setdefault(bucket_of(requests), dict.fromkeys(FIELDS, 0.0))
        row["steps"] += 1
        row["requests"] += requests
        row["tokens"] += tokens
        row["prompt_tokens"] += prompt
        row["prompts"] += prompts
        draft = p.get("draft_s", 0.0)
        row["draft_s"] += draft
        row["verify_s"] += max(p.get("step_s", 0.0) - draft, 0.0)
        row["gc_s"] += p.get("gc_s", 0.0)
        if not prompt:
            row["decode_steps"] += 1
            row["decode_s"] += p.get("step_s", 0.0)
        row["drafted"] += p.get("drafted", 0.0)
        row["kept"] += p.get("kept", 0.0)

    def _flush_loop(self) -> None:
        """Write held-back steps when EVERY_S has passed since the last write: within EVERY_S of the step
        that closed last, whenever it closed (a check that found nothing held back sleeps EVERY_S; the step
        that then closes came after the last write, which is at most that long before the next check)."""
        while True:
            with self.lock:
                due = self.last_write + EVERY_S - time.monotonic() if self.dirty else EVERY_S
                if due <= 0:
                    self._write()
                    due = EVERY_S
            time.sleep(max(due, 0.005))

    def _write(self) -> None:  # with the lock held
        self.last_write, self.dirty = time.monotonic(), False
        tmp = self.path.with_name(f".{self.path.name}.{self.pid}")
        try:
            tmp.write_text(json.dumps({"pid": self.pid, "time": time.time(), "by_batch": self.by}))
            os.replace(tmp, self.path)
        except OSError:
            pass  # a full disk must not stop the engine; the stats are then stale


class Collections:
    """Seconds this process has spent in Python's garbage collector (a ``gc.callbacks`` hook, installed with
    the patch); the step's wraps take the difference over their calls."""

    def __init__(self):
        self.seconds = 0.0
        self.started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        elif self.started:
            self.seconds += time.perf_counter() - self.started
            self.started = 0.0


_collections = Collections()


def stats(runner) -> Stats:
    """This runner's ``Stats`` (made on first use, writing where ``CARTSPEC_STEP_STATS`` says)."""
    st = getattr(runner, "_cartspec_steps", None)
    if st is None:
        st = runner._cartspec_steps = Stats(os.environ.get(ENV) or None)
    return st


def prompt_tokens(scheduler_output) -> int:
    """Of the tokens a step runs, the prompts' prefill: a new request's first chunk, the later chunks of a
    prompt still being prefilled (no output token yet), and a preempted request computed again. The rest
    are decoding: each running request's last token and its drafts."""
    n = scheduler_output.num_scheduled_tokens
    total = sum(n.get(r.req_id, 0) for r in scheduler_output.scheduled_new_reqs)
    cached = scheduler_output.scheduled_cached_reqs
    resumed = cached.resumed_req_ids
    for rid, outputs in zip(cached.req_ids, cached.num_output_tokens):
        if outputs == 0 or rid in resumed:
            total += n.get(rid, 0)
    return total


def count_drafts(runner, drafted: int, kept: int) -> None:
    """The draft length patch's counts for the current step."""
    st = stats(runner)
    st.add("drafted", drafted)
    st.add("kept", kept)


def apply(mod) -> None:
    runner_cls = mod.GPUModelRunner
    execute, sample, propose = runner_cls.execute_model, runner_cls.sample_tokens, runner_cls.propose_draft_token_ids

    @functools.wraps(execute)
    def execute_model(self, scheduler_output, *args, **kwargs):
        t0, g0 = time.perf_counter(), _collections.seconds
        try:
            return execute(self, scheduler_output, *args, **kwargs)
        finally:
            st = stats(self)
            st.add("step_s", time.perf_counter() - t0)
            st.add("gc_s", _collections.seconds - g0)
            st.pending["_tokens"] = scheduler_output.total_num_scheduled_tokens
            st.pending["_requests"] = len(scheduler_output.num_scheduled_tokens)
            st.pending["_prompt"] = prompt_tokens(scheduler_output)
            st.pending["_prompts"] = len(scheduler_output.scheduled_new_reqs)

    @functools.wraps(sample)
    def sample_tokens(self, *args, **kwargs):
        t0, g0 = time.perf_counter(), _collections.seconds
        try:
            return sample(self, *args, **kwargs)
        finally:
            st = stats(self)
            st.add("step_s", time.perf_counter() - t0)
            st.add("gc_s", _collections.seconds - g0)
            requests, tokens = int(st.pending.pop("_requests", 0)), int(st.pending.pop("_tokens", 0))
            prompt, prompts = int(st.pending.pop("_prompt", 0)), int(st.pending.pop("_prompts", 0))
            if requests:
                st.close_step(requests, tokens, prompt, prompts)
            else:
                st.pending.clear()

    @functools.wraps(propose)
    def propose_draft_token_ids(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return propose(self, *args, **kwargs)
        finally:
            stats(self).add("draft_s", time.perf_counter() - t0)

    runner_cls.execute_model = execute_model
    runner_cls.sample_tokens = sample_tokens
    if _collections not in gc.callbacks:
        gc.callbacks.append(_collections)
    runner_cls.propose_draft_token_ids = propose_draft_token_ids


def needed() -> str | None:
    return None


def read(path: str | Path | None) -> dict[str, dict[str, float]]:
    """The counters in a stats file, by batch bucket; {} where there is none (yet) or it cannot be read."""
    if not path:
        return {}
    try:
        return json.loads(Path(path).read_text()).get("by_batch", {})
    except (OSError, ValueError, AttributeError):
        return {}


def difference(after: dict, before: dict) -> dict[str, dict[str, float]]:
    """The steps between two ``read``s (a server restarted in between: ``after`` alone)."""
    if any(after.get(b, {}).get("steps", 0) < row.get("steps", 0) for b, row in before.items()):
        before = {}
    out = {}
    for b, row in after.items():
        prev = before.get(b, {})
        d = {f: row.get(f, 0.0) - prev.get(f, 0.0) for f in FIELDS}  # a field older files lack: 0
        if d["steps"] > 0:
            out[b] = d
    return out


def fixed_share(tot: dict[str, float]) -> float:
    """Of the steps' time, the part that no τ can shorten. A request takes one step to prefill its prompt and
    then (L − 1) / τ steps to decode the rest of its L tokens, and every step advances the whole batch, so with
    R requests and a mean batch b the engine runs R / b steps that τ leaves as they are, each costing a
    decoding step c; and each of the P prefilling steps costs Δ more than c, for its prompts' tokens. Fixed
    time: P·Δ + (R / b)·c (counters written before ``prompts`` was: R taken as P). At one stream this is the
    prefilling steps' whole time; at several, the decoding they also do for the other requests shrinks with τ
    like any other step's."""
    n, decode_steps, step_s = tot["steps"], tot["decode_steps"], tot["draft_s"] + tot["verify_s"]
    if not n or not decode_steps or step_s <= 0:
        return 0.0
    c = tot["decode_s"] / decode_steps
    prefill_steps = n - decode_steps
    entered = tot.get("prompts") or prefill_steps
    batch = max(tot["requests"] / n, 1.0)
    fixed = (step_s - tot["decode_s"]) - prefill_steps * c + entered * c / batch
    return min(max(fixed / step_s, 0.0), 1.0)


def summary(by: dict[str, dict[str, float]]) -> dict[str, Any] | None:
    """Per-step means over ``by`` (all buckets pooled): steps, draft_ms, verify_ms, gc_ms (of those two, the
    garbage collector's), requests (mean batch), prefill_share (the prompts' share of the tokens the target
    ran: work that speculation does not shorten), decode_ms (a step that prefilled no prompt) with
    prefill_time_share (the share of the steps' time spent in steps that prefilled one), fixed_time_share (of
    the steps' time, the part no τ can shorten: ``fixed_share``) and kept_share
    (kept / drafted tokens, where drafts were cut per request); None without steps."""
    tot = {f: sum(row.get(f, 0.0) for row in by.values()) for f in FIELDS}
    n = tot["steps"]
    if not n:
        return None
    out = {"steps": int(n), "draft_ms": round(1000 * tot["draft_s"] / n, 3),
           "verify_ms": round(1000 * tot["verify_s"] / n, 3), "gc_ms": round(1000 * tot["gc_s"] / n, 3),
           "requests": round(tot["requests"] / n, 2)}
    if tot["tokens"]:
        out["prefill_share"] = round(tot["prompt_tokens"] / tot["tokens"], 4)
    step_s = tot["draft_s"] + tot["verify_s"]
    if tot.get("decode_steps") and step_s > 0:
        out["decode_ms"] = round(1000 * tot["decode_s"] / tot["decode_steps"], 3)
        out["prefill_time_share"] = round(max(0.0, 1.0 - tot["decode_s"] / step_s), 4)
        out["fixed_time_share"] = round(fixed_share(tot), 4)
    if tot["drafted"]:
        out["kept_share"] = round(tot["kept"] / tot["drafted"], 4)
    return out


PATCH = Patch(
    name="step_stats", module=MODULE,
    what="times each engine step's drafting and verifying, by batch size, for /metrics, traces and studies",
    targets=(Target(MODULE, "GPUModelRunner.execute_model", ("self", "scheduler_output")),
             Target(MODULE, "GPUModelRunner.sample_tokens", ("self", "grammar_output")),
             Target(MODULE, "GPUModelRunner.propose_draft_token_ids", ("self", "scheduler_output")),
             # the scheduler's output, read for the prompts' share (``prompt_tokens``)
             Target(SCHED, "SchedulerOutput.__init__", ("self", "scheduled_new_reqs", "scheduled_cached_reqs",
                                                        "num_scheduled_tokens", "total_num_scheduled_tokens")),
             Target(SCHED, "NewRequestData.__init__", ("self", "req_id")),
             Target(SCHED, "CachedRequestData.__init__", ("self", "req_ids", "resumed_req_ids", "new_token_ids",
                                                          "all_token_ids", "new_block_ids", "num_computed_tokens",
                                                          "num_output_tokens"))),
    apply=apply, needed=needed)
