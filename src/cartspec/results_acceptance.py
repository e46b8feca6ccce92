"""What ``cartspec draft acceptance`` writes: an ``AcceptanceReport`` (τ, acceptance rate, per position and by
token class, with how it was measured), which loads back.

A result file is an API, as ``results.py``'s points are: the report is read by the analysis (``draft predict``,
``analysis.predict``), the gate (``draft.gate``) and the benchmarks without the measuring code (``draft.acceptance``,
which re-exports these names).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .results import AcceptanceStats


class _Written(BaseModel):
    """Writes the keys that were given and no others (``exclude_unset``): the two measurements give
    different keys, and a file written before a key existed loads without it."""

    model_config = ConfigDict(extra="forbid")

    def to_json(self) -> str:
        return self.model_dump_json(indent=2, exclude_unset=True) + "\n"


class ClassCount(_Written):
    """Acceptance at the draft positions whose target token is of one class (``task.classes``)."""

    reached: int = 0
    accepted: int = 0
    acceptance: float | None = None
    head_alone: int | None = Field(None, description="hybrid: positions the head's own draft would have won")
    head_alone_acceptance: float | None = None
    tokens: int | None = Field(None, description="output tokens of the class")


class EngineCounts(_Written):
    """vLLM's own per-request summary, pooled: a cross-check of the per-step arrays."""

    num_spec_steps: int = 0
    num_accepted_draft_tokens: int = 0
    num_draft_tokens: int = 0
    tau: float | None = None
    acceptance_rate: float | None = None


class ReplySteps(_Written):
    """One reply's tokens and the drafts accepted at each of its verify steps."""

    id: str | None = None  # a user's request lines may carry no id
    token_ids: list[int] = Field(default_factory=list)
    per_step_accepted: list[int] | None = None


class AcceptanceReport(_Written):
    """What ``cartspec draft acceptance`` writes (``--out``): τ, acceptance rate, per position and by class,
    with how they were measured. ``measure_vllm`` and ``measure_simulated`` give its keys (each its own)."""

    tau: float | None = None
    acceptance_rate: float | None = None
    per_position: list[float] = Field(default_factory=list, description="acceptance at draft position 1, 2, ...")
    acceptance: AcceptanceStats | None = None
    by_class: dict[str, ClassCount] = Field(default_factory=dict)
    by_class_note: str | None = None
    verify_steps: int | None = None
    accepted_tokens: int | None = None
    draft_tokens: int | None = None
    engine_counts: EngineCounts | None = None
    replay_agrees_with_engine: str | None = Field(None, description="ngram, schema: requests whose replayed proposer "
                                                                    "gives the engine's per-step counts")
    hybrid: dict[str, Any] | None = Field(None, description="the hybrid drafter's settings")
    draft_stop: float | None = Field(None, description="eagle3, hybrid: each draft cut where the head's path "
                                                       "probability fell below this (a hybrid's before its first "
                                                       "copied token; drafting.length); None: fixed γ")
    per_step_accepted: list[list[int]] | None = Field(None, description="simulated hybrid: per request, per step")
    replies: list[ReplySteps] | None = None
    mode: Literal["vllm", "simulate"] | None = None
    method: str | None = None
    gamma: int | None = None
    target: str | None = None
    head: str | None = None
    head_version: str | None = Field(None, description="NAME@v0002 when the head came from a head registry")
    n: int | None = None
    temperature: float | None = None
    concurrency: int | None = None
    max_tokens: int | None = None
    output_tokens: int | None = None
    wall_s: float | None = None
    output_tokens_per_s: float | None = None
    requests_without_step_metrics: int | None = None
    engine: dict[str, Any] = Field(default_factory=dict, description="versions of what measured it")
    server: str | None = None
    served_name: str | None = None
    data: str | None = None
    head_name: str | None = None
    server_api_key_env: str | None = Field(None, description="the variable's name; the key is never written")

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, path: str | Path) -> "AcceptanceReport":
        return cls.model_validate_json(Path(path).read_text())
