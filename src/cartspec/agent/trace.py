"""One JSON line per request: what happened to it, where the time went.

Written synchronously with a flush per line: a line is ~1 KB, far cheaper than
the model call it describes, and a crash loses at most the line being written.
The file is its owner's only (0600, never written through a symlink).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from ..private_files import UnsafePathError, check_dir, open_private, private_dir


class Timing(BaseModel):
    queue_ms: float = 0.0      # waiting for a free slot at the deployment (agent side)
    upstream_ms: float = 0.0   # model calls, all attempts, HTTP round trip
    parse_ms: float = 0.0      # reading and validating replies
    total_ms: float = 0.0
    engine_queue_ms: float | None = None   # vLLM's own queue time, when it reports per-request metrics
    engine_ttft_ms: float | None = None
    ttft_ms: float | None = None           # a stream: from the request's arrival to its first chunk of text


class SpecTrace(BaseModel):
    """Speculative decoding of the answering call, as vLLM reported it."""

    acceptance_rate: float | None = None
    acceptance_length: float | None = None
    drafts: int = 0
    proposed: int = 0
    accepted: int = 0
    per_step_accepted: list[int] | None = None
    per_step_proposed: list[int] | None = None

    @classmethod
    def from_vllm(cls, spec: dict[str, Any] | None) -> "SpecTrace | None":
        if not spec:
            return None
        return cls(acceptance_rate=spec.get("draft_acceptance_rate"),
                   acceptance_length=spec.get("mean_acceptance_length"),
                   drafts=spec.get("num_spec_steps", 0), proposed=spec.get("num_draft_tokens", 0),
                   accepted=spec.get("num_accepted_draft_tokens", 0),
                   per_step_accepted=spec.get("per_step_accepted"),
                   per_step_proposed=spec.get("per_step_drafted"))


class EngineTrace(BaseModel):
    """The engine's steps while the answering call ran (cartspec's vLLM plugin, ``vllm_plugin.steps``): how
    many, and per step the time spent drafting and on the rest (the target's verify forward, sampling), of
    those the time in Python's garbage collector, the mean batch, the prompts' share of the tokens the target
    ran, the time of a step that prefilled no prompt and the share of the time in steps that did, and the share
    of drafted tokens kept where drafts are cut per request. Steps are shared by the requests in flight
    together; the engine writes its counters every 0.2 s, so a call shorter than that may see none."""

    steps: int = 0
    draft_ms: float | None = None
    verify_ms: float | None = None
    gc_ms: float | None = None  # of draft_ms + verify_ms, the engine worker's garbage collections
    requests: float | None = None
    prefill_share: float | None = None  # of the tokens the target ran, the prompts' prefill
    decode_ms: float | None = None  # a step that prefilled no prompt
    prefill_time_share: float | None = None  # of the steps' time, the steps that prefilled a prompt
    kept_share: float | None = None

    @classmethod
    def of(cls, by_batch: dict[str, dict[str, float]]) -> "EngineTrace | None":
        from ..vllm_plugin.steps import summary

        s = summary(by_batch)
        return cls(**s) if s else None


class FallbackTrace(BaseModel):
    """The acceptance fallback when the request was routed."""

    state: str                        # speculative | fallback
    acceptance: float | None = None   # rolling, accepted / drafted tokens over the window
    observed: int = 0                 # replies in the window
    probe: bool = False               # sent to the speculative deployment to test it during fallback


class AdmissionTrace(BaseModel):
    """Admission control's estimate for the chosen deployment (Little's law)."""

    admitted: bool
    expected_s: float | None = None   # None: nothing measured yet (admitted)
    queued: int = 0
    inflight: int = 0
    rate: float | None = None         # completions per busy second


class CanaryTrace(BaseModel):
    """The canary of a candidate head when the request was answered (``canary.CanaryView``)."""

    state: str                        # trial | promoted | rolled_back
    arm: str                          # candidate | current: whose head drafted the reply
    share: float                      # the candidate's share of speculative-bound traffic
    n: int = 0                        # candidate replies observed in the trial
    current_n: int = 0
    candidate_tau: float | None = None
    current_tau: float | None = None
    candidate_acceptance: float | None = None
    current_acceptance: float | None = None
    decision: str | None = None       # promote | rollback, on the request that made it
    figures: dict[str, Any] | None = None  # that decision's figures

    def header(self) -> str:
        """``X-Cartspec-Canary``: whose head drafted, the state, the candidate's replies so far."""
        text = f"{self.arm}; state={self.state}; n={self.n}"
        return text + (f"; decision={self.decision}" if self.decision else "")


class TraceRecord(BaseModel):
    id: str
    ts: float = Field(default_factory=time.time)
    endpoint: str
    status: int = 0
    error: str | None = None          # error type when status is not 2xx
    reason: str | None = None
    route: str | None = None          # target deployment
    route_reason: str | None = None
    deployment: str | None = None     # its spec label, e.g. eagle3-domain-g3
    head: str | None = None           # head registry name, when the deployment's head is a registry version
    head_version: str | None = None   # that version, e.g. v0002
    cache: str | None = None          # hit | miss | coalesced | bypass | off; None: never got that far
    attempts: int = 0
    structured: list[bool] = Field(default_factory=list)  # per attempt: constrained decoding on?
    repaired: bool = False
    output_tokens: int = 0
    finish_reason: str | None = None
    timing: Timing = Field(default_factory=Timing)
    spec: SpecTrace | None = None
    engine: EngineTrace | None = None
    fallback: FallbackTrace | None = None
    admission: AdmissionTrace | None = None
    canary: CanaryTrace | None = None


class TraceWriter:
    """Appends ``TraceRecord`` lines to ``path`` (None: no trace), rotating it to ``path.1`` past ``max_bytes``.

    The trace can hold what requests were about (reasons, errors), so it is a file only its owner reads:
    0600, never opened through a symlink. A missing directory is created 0700; an existing one is used as
    it is (it may hold other things) unless another user owns it or others may write it: then
    ``UnsafePathError`` says what to do."""

    def __init__(self, path: str | Path | None, max_bytes: int = 256 * 1024 * 1024):
        self.path = Path(path).expanduser() if path else None
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._fh = None
        if self.path:
            try:
                _trace_dir(self.path.parent)
                self._fh = open_private(self.path, "a")
            except UnsafePathError as e:
                raise UnsafePathError(f"cannot write the trace to {self.path}: {e}") from None

    def write(self, record: TraceRecord) -> None:
        if self._fh is None:
            return
        line = record.model_dump_json(exclude_none=True) + "\n"
        with self._lock:
            self._fh.write(line)
            self._fh.flush()
            if self._fh.tell() > self.max_bytes:
                self._rotate()

    def _rotate(self) -> None:
        self._fh.close()
        self.path.replace(self.path.with_name(self.path.name + ".1"))  # renames the entry: never through a link
        self._fh = open_private(self.path, "a")

    def close(self) -> None:
        with self._lock:
            if self._fh:
                self._fh.close()
                self._fh = None


def _trace_dir(path: Path) -> None:
    """Create ``path`` 0700 when missing; refuse an existing one that another user owns or others may write."""
    if os.path.lexists(path):
        check_dir(path)
    else:
        private_dir(path)


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
