"""Typed deployment specs: what a vLLM server runs, kept in YAML/TOML/JSON files."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..config_files import FileModel

Method = Literal["none", "eagle3", "ngram", "draft_model", "suffix"]


class Speculative(BaseModel):
    """One speculative-decoding method and its knobs (vLLM's ``--speculative-config``)."""

    model_config = ConfigDict(extra="forbid")

    method: Method = "none"
    num_speculative_tokens: int | None = Field(None, ge=1, le=16, description="γ")
    model: str | None = Field(None, description="EAGLE-3 head or draft model: 'domain', 'generic' or a path")
    prompt_lookup_min: int | None = Field(None, ge=1)
    prompt_lookup_max: int | None = Field(None, ge=1)
    schedule: list[tuple[int, int, int]] | None = Field(
        None, description="per-batch-size γ: [(lo, hi, k), ...] -> num_speculative_tokens_per_batch_size")

    @model_validator(mode="after")
    def _check(self) -> "Speculative":
        if self.method == "none":
            return self
        if self.num_speculative_tokens is None:
            raise ValueError(f"method {self.method!r} needs num_speculative_tokens (γ)")
        if self.method in ("eagle3", "draft_model") and not self.model:
            raise ValueError(f"method {self.method!r} needs model (a head or draft model)")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min or 2, self.prompt_lookup_max or 4
            if lo > hi:
                raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        return self

    @property
    def label(self) -> str:
        if self.method == "none":
            return "baseline"
        head = f"-{Path(self.model).name}" if self.method == "eagle3" and self.model else ""
        return f"{self.method}{head}-g{self.num_speculative_tokens}"

    def vllm_config(self, resolved_model: str | None = None) -> dict[str, Any] | None:
        if self.method == "none":
            return None
        cfg: dict[str, Any] = {"num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            cfg.update(method="ngram", prompt_lookup_min=self.prompt_lookup_min or 2,
                       prompt_lookup_max=self.prompt_lookup_max or 4)
        elif self.method == "eagle3":
            cfg.update(method="eagle3", model=resolved_model or self.model)
        elif self.method == "draft_model":
            cfg.update(method="draft_model", model=resolved_model or self.model)
        elif self.method == "suffix":
            cfg.update(method="suffix")
        if self.schedule:
            cfg["num_speculative_tokens_per_batch_size"] = [list(t) for t in self.schedule]
        return cfg


class DeploymentSpec(FileModel):
    """A vLLM deployment: target model, speculation, engine flags."""

    model_config = ConfigDict(extra="forbid")

    name: str = "cartspec"
    model: str = Field("commerce", description="'commerce', 'base' or a path to an HF directory")
    speculative: Speculative = Field(default_factory=Speculative)
    dtype: str = "bfloat16"
    max_model_len: int = 1024
    max_num_seqs: int = 32
    enforce_eager: bool = False
    seed: int = 0
    engine_args: list[str] = Field(default_factory=list, description="extra flags passed to vLLM as-is")
    env: dict[str, str] = Field(default_factory=dict)
    start_timeout_s: float = 600.0

    @property
    def label(self) -> str:
        return self.speculative.label

