"""Typed deployment specs: what a vLLM server runs, kept in YAML/TOML/JSON files."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..config_files import FileModel, omit_when_none
from ..drafting.config import HybridConfig
from ..drafting.length import METHODS as STOP_METHODS

# spec files written before the ``hybrid`` block: its settings as flat fields (and a hybrid's n-gram sizes in
# prompt_lookup_min/max), read into ``hybrid``
_FLAT_HYBRID = {"hybrid_rule": "rule", "hybrid_pointer": "pointer", "hybrid_head_p": "head_p", "lookup_scope": "scope"}

Method = Literal["none", "eagle3", "ngram", "draft_model", "suffix", "hybrid", "schema"]


def schedule_gamma(schedule: list[tuple[int, int, int]], batch_size: int) -> int:
    """γ at this batch size under a ``[(lo, hi, k), ...]`` schedule, as vLLM looks it up: the range that
    holds it, else (in a gap or past the end) the last range below it."""
    k = 0
    for lo, hi, kk in sorted(schedule):
        if batch_size >= lo:
            k = kk
        if lo <= batch_size <= hi:
            break
    return k


class Speculative(BaseModel):
    """One speculative-decoding method and its knobs (vLLM's ``--speculative-config``)."""

    model_config = ConfigDict(extra="forbid")

    method: Method = "none"
    num_speculative_tokens: int | None = Field(None, ge=1, le=16, description="γ")
    model: str | None = Field(None, description="EAGLE-3 head or draft model: 'domain', 'generic' or a path")
    prompt_lookup_min: int | None = Field(None, ge=1, description="method ngram: the smallest n-gram matched")
    prompt_lookup_max: int | None = Field(None, ge=1, description="method ngram: the largest n-gram matched")
    hybrid: HybridConfig | None = Field(
        None, description="method hybrid: the rule and its settings (rule, n_min, n_max, scope, pointer, head_p; "
                          "drafting.config.HybridConfig, whose defaults fill what is left out); absent: the "
                          "target's default, as serve deploys it (rule pointer where a pointer was trained for "
                          "the target, else head)")
    reply_schema: str | None = Field(
        None, description="method schema: a JSON schema file the drafter follows for requests that send no "
                          "response_format; absent: the commerce task's replies (search parameters or a support "
                          "reply)")
    draft_stop: float | None = Field(
        None, gt=0, lt=1, description="methods eagle3 and hybrid: draft length per request and per step: each "
                                      "request's draft is cut where the head's probability of the path drafted so "
                                      "far falls below this (in a hybrid, only before its first copied token; "
                                      "drafting.length; STOP_P is the default a deployment label's `:stop` "
                                      "gives); absent: vLLM's fixed γ")
    schedule: list[tuple[int, int, int]] | None = Field(
        None, description="per-batch-size γ: [(lo, hi, k), ...] -> num_speculative_tokens_per_batch_size")
    adaptive: bool = Field(False, description="γ per batch size tuned for this machine (`cartspec tune`); the "
                                              "schedule is filled in when the deployment starts")

    # only a hybrid with settings written out carries the block; a schema drafter with its own schema, the file
    _without_absent = omit_when_none("hybrid", "reply_schema", "draft_stop")

    @model_validator(mode="before")
    @classmethod
    def _flat_hybrid_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        found = {new: data.pop(old) for old, new in _FLAT_HYBRID.items() if old in data}
        found = {k: v for k, v in found.items() if v is not None}
        if data.get("method") == "hybrid":
            for old, new in (("prompt_lookup_min", "n_min"), ("prompt_lookup_max", "n_max")):
                if data.get(old) is not None:
                    found[new] = data.pop(old)
        if found:
            if data.get("method") != "hybrid":
                raise ValueError("hybrid_rule, lookup_scope, hybrid_pointer and hybrid_head_p are settings of "
                                 "method 'hybrid'")
            if data.get("hybrid") is not None:
                raise ValueError("the hybrid's settings go in `hybrid` (rule, n_min, n_max, scope, pointer, head_p), "
                                 "not beside it as well")
            data["hybrid"] = found
        return data

    @model_validator(mode="after")
    def _check(self) -> "Speculative":
        if self.method == "none":
            return self
        if self.schedule:
            ks = [k for _, _, k in self.schedule]
            if min(ks) < 0:
                raise ValueError("schedule γ values must be >= 0 (0: no speculation at that batch size)")
            if self.num_speculative_tokens is not None and max(ks) > self.num_speculative_tokens:
                raise ValueError(f"schedule asks for γ={max(ks)} above num_speculative_tokens="
                                 f"{self.num_speculative_tokens} (vLLM caps it there)")
            if sorted(self.schedule)[0][0] != 1:
                raise ValueError("the schedule's first batch-size range must start at 1")
        if self.num_speculative_tokens is None and self.adaptive and not self.schedule:
            return self  # tuned when the deployment starts
        if self.num_speculative_tokens is None:
            raise ValueError(f"method {self.method!r} needs num_speculative_tokens (γ)")
        if self.method in ("eagle3", "draft_model", "hybrid") and not self.model:
            raise ValueError(f"method {self.method!r} needs model (a head or draft model)")
        if self.method != "hybrid" and self.hybrid is not None:
            raise ValueError("hybrid is a setting of method 'hybrid'")
        if self.draft_stop is not None and self.method not in STOP_METHODS:
            raise ValueError("draft_stop (draft length per request) is a setting of methods 'eagle3' and 'hybrid' "
                             "(it cuts by the head's probabilities)")
        if not self.follows_schema and self.reply_schema is not None:
            raise ValueError("reply_schema is a setting of method 'schema' (and of a hybrid with rule 'schema')")
        if self.method == "schema" and self.model:
            raise ValueError("method 'schema' drafts from the reply's JSON schema and the prompt, with no head or "
                             "draft model: leave model out")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min or 2, self.prompt_lookup_max or 4
            if lo > hi:
                raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        return self

    @property
    def label(self) -> str:
        if self.method == "none":
            return "baseline"
        head = f"-{Path(self.model).name}" if self.method in ("eagle3", "hybrid") and self.model else ""
        if self.method == "hybrid" and self.hybrid is not None:  # rules differ in what they draft: say which
            head += f"-{self.hybrid.rule}"
        if self.draft_stop is not None:  # cut per request: say at what, so it never shares a fixed γ's label
            head += f"-stop{self.draft_stop:g}"
        if self.adaptive:
            return f"{self.method}{head}-auto"
        if self.schedule:  # an explicit schedule: say which, so it never shares a label with a fixed γ
            steps = "_".join(f"{lo}-{hi}k{k}" for lo, hi, k in sorted(self.schedule))
            return f"{self.method}{head}-sched{steps}"
        return f"{self.method}{head}-g{self.num_speculative_tokens}"

    def gamma_at(self, batch_size: int) -> int:
        """The γ vLLM drafts at this many scheduled requests (its schedule lookup; past the last range the
        last γ carries on, capped at num_speculative_tokens)."""
        if self.method == "none":
            return 0
        cap = self.num_speculative_tokens or 0
        return min(schedule_gamma(self.schedule, batch_size), cap) if self.schedule else cap

    def vllm_config(self, resolved_model: str | None = None) -> dict[str, Any] | None:
        if self.method == "none":
            return None
        if self.num_speculative_tokens is None:
            raise ValueError("an adaptive deployment needs its schedule tuned first (`cartspec tune`, or the "
                             "study's eagle3:HEAD:auto label, which tunes it)")
        cfg: dict[str, Any] = {"num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            cfg.update(method="ngram", prompt_lookup_min=self.prompt_lookup_min or 2,
                       prompt_lookup_max=self.prompt_lookup_max or 4)
        elif self.method == "eagle3":
            cfg.update(method="eagle3", model=resolved_model or self.model)
        elif self.method == "hybrid":  # EAGLE-3 underneath; the lookup is added in the runner (hybrid_env)
            cfg.update(method="eagle3", model=resolved_model or self.model)
        elif self.method == "draft_model":
            cfg.update(method="draft_model", model=resolved_model or self.model)
        elif self.method == "suffix":
            cfg.update(method="suffix")
        elif self.method == "schema":  # vLLM's public interface for a model-free proposer
            from ..vllm_plugin.schema import CLASS_PATH

            cfg.update(method="custom_class", model=CLASS_PATH)
        if self.schedule:
            cfg["num_speculative_tokens_per_batch_size"] = [list(t) for t in self.schedule]
        return cfg


    def hybrid_config(self, model_dir: str | None = None) -> HybridConfig | None:
        """The hybrid drafter's settings, its pointer resolved where the rule is ``pointer``; None for other
        methods. Without a ``hybrid`` block: the default for the target in ``model_dir``
        (``drafting.config.default_rule``), as ``serve`` and ``draft acceptance`` resolve it."""
        if self.method != "hybrid":
            return None
        from ..drafting.config import for_target
        from ..model.convert import ModelNotFound
        from ..model.registry import resolve_head

        try:  # a head that keeps its own pointer (a refreshed version) drafts with it
            head_dir = resolve_head(self.model) if self.model else None
        except (ModelNotFound, FileNotFoundError):
            head_dir = None  # starting the deployment reports the missing head
        return for_target(self.hybrid, model_dir, head_dir)

    def additional_config(self, model_dir: str | None = None) -> dict[str, Any]:
        """What vLLM's ``--additional-config`` (the settings vLLM keeps for plugins) carries for this method: the
        hybrid's settings for cartspec's vLLM plugin (vLLM's speculative config rejects keys it does not know);
        ``model_dir``: the target's, for its default rule."""
        out: dict[str, Any] = {}
        if self.follows_schema:
            from ..vllm_plugin.schema import KEY as SCHEMA_KEY

            out[SCHEMA_KEY] = {"schema": self.schema_dict()}
        cfg = self.hybrid_config(model_dir)
        if cfg is not None:
            from ..drafting.config import KEY

            out[KEY] = cfg.to_dict()
        if self.draft_stop is not None:
            from ..drafting.length import KEY as STOP_KEY

            out[STOP_KEY] = {"p": self.draft_stop}
        return out

    @property
    def follows_schema(self) -> bool:
        """Drafts from the reply's JSON schema: method ``schema``, or a hybrid whose rule follows one
        (``drafting.config.NEEDS_SCHEMA``): its own, or without a ``hybrid`` block the default rule (which a
        target without a pointer replaces by the head alone; the schema it carries is then unused)."""
        from ..drafting.config import DEFAULT, NEEDS_SCHEMA

        rule = self.hybrid.rule if self.hybrid is not None else DEFAULT.rule
        return self.method == "schema" or (self.method == "hybrid" and rule in NEEDS_SCHEMA)

    def schema_dict(self) -> dict[str, Any] | None:
        """The schema drafter's schema for requests that send none: ``reply_schema``'s file, else the commerce
        task's replies; None where the method drafts from no schema (``follows_schema``)."""
        if not self.follows_schema:
            return None
        return reply_schema_of(self.reply_schema)


def reply_schema_of(path: str | None) -> dict[str, Any]:
    """The schema drafter's schema for requests that send none: the JSON schema file ``path``, else (None) the
    commerce task's replies. A missing or unreadable file is a ValueError that says what to give."""
    if path is None:
        from ..task.schema import reply_schema

        return reply_schema()
    p = Path(path).expanduser()
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"reply_schema {p} does not exist: give a JSON schema file") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"reply_schema {p} is not JSON ({exc}): give a JSON schema file") from None


# A deployment's name is written into shell scripts, compose service names, Helm values and vLLM's
# --served-model-name: letters, digits, '.', '_' and '-', starting with a letter or digit, at most 63 (a DNS
# label's length), matched whole (re.fullmatch: `$` would let a trailing newline through)
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def check_name(name: str) -> str:
    """``name`` if it is a valid deployment name (``NAME_PATTERN``), else a ValueError that says what is."""
    if not NAME_PATTERN.fullmatch(name):
        shown = name if len(name) <= 80 else name[:80] + "..."  # repr'd below: a newline shows as \n
        raise ValueError(f"name {shown!r} is not a deployment name: use 1 to 63 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit (it becomes the served model's name, a compose service "
                         "and a shell argument)")
    return name


SCALE_FIELDS = ("tensor_parallel_size", "data_parallel_size", "gpu_memory_utilization", "enable_prefix_caching",
                "quantization", "kv_cache_fit")


class DeploymentSpec(FileModel):
    """A vLLM deployment: target model, speculation, engine flags."""

    # hidden inputs: a refused spec's error must not print what it holds (env and engine flags may hold keys)
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    name: str = Field("cartspec", description="the served model's name (vLLM's --served-model-name): 1 to 63 "
                                               "letters, digits, '.', '_' or '-', starting with a letter or digit")
    tag: str | None = Field(None, description="tells apart deployments whose speculation is the same (another "
                            "dtype, env or engine flags) in one study: their label becomes LABEL@tag")
    model: str = Field("commerce", description="'commerce', 'base' or a path to an HF directory")
    speculative: Speculative = Field(default_factory=Speculative)
    dtype: str = Field("auto", description="auto: float32 on a CPU without native bf16, bfloat16 where it is "
                                         "native (AVX-512-bf16, AMX, CUDA); or any dtype vLLM takes")
    max_model_len: int = 1024
    max_num_seqs: int = 32
    enforce_eager: bool = False
    seed: int = 0
    engine_args: list[str] = Field(default_factory=list, description="extra flags passed to vLLM as-is")
    env: dict[str, str] = Field(default_factory=dict)
    start_timeout_s: float = 600.0
    # at scale (vLLM's own flags, typed; unset: vLLM's default, and left out of the spec's JSON so that
    # results recorded before they existed keep their keys)
    tensor_parallel_size: int | None = Field(None, ge=1, description="GPUs one replica's weights are split over")
    data_parallel_size: int | None = Field(None, ge=1, description="replicas behind one endpoint")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="share of each GPU's memory vLLM takes")
    enable_prefix_caching: bool | None = Field(None, description="reuse the KV cache of shared prompt prefixes")
    quantization: str | None = Field(None, description="vLLM's --quantization (fp8, awq, gptq, ...)")
    kv_cache_fit: bool | None = Field(None, description="on CPU, a KV cache that just holds max_num_seqs x "
                                      "max_model_len tokens instead of 4 GiB, so several servers share one host "
                                      "(an interleaved study); VLLM_CPU_KVCACHE_SPACE in env wins")

    @model_validator(mode="after")
    def _typed_not_raw(self) -> "DeploymentSpec":
        for name in SCALE_FIELDS:
            flag = "--" + name.replace("_", "-")
            if getattr(self, name) is not None and any(a.split("=")[0] in (flag, "--no-" + flag[2:])
                                                       for a in self.engine_args):
                raise ValueError(f"{name} is set and engine_args passes {flag} too: keep one")
        return self

    @model_validator(mode="after")
    def _no_key(self) -> "DeploymentSpec":
        # vLLM takes --api-key, its abbreviations and --api_key; a spec is logged, recorded and exported
        flags = [a.split("=")[0].replace("_", "-") for a in self.engine_args if a.startswith("--")]
        if any(len(f) > len("--api-") and "--api-key".startswith(f) for f in flags) or "VLLM_API_KEY" in self.env:
            raise ValueError("a deployment spec holds no API key (engine_args --api-key, env VLLM_API_KEY): the "
                             "spec is written to logs, run.json and exports. A vLLM that cartspec starts gets a "
                             "random key of its own; for a key of yours, put it in an environment variable and "
                             "name it with the key option (serve --upstream-key-env VAR, study "
                             "--server-api-key-env VAR)")
        return self

    @model_validator(mode="after")
    def _safe_name(self) -> "DeploymentSpec":
        check_name(self.name)
        return self

    _drop_unset = omit_when_none(*SCALE_FIELDS, "tag")  # fields added later: absent from old results

    def scale_args(self) -> list[str]:
        """The typed scale settings as vLLM flags."""
        args: list[str] = []
        for name in ("tensor_parallel_size", "data_parallel_size", "gpu_memory_utilization", "quantization"):
            if getattr(self, name) is not None:
                args += ["--" + name.replace("_", "-"), str(getattr(self, name))]
        if self.enable_prefix_caching is not None:
            args.append("--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching")
        return args

    @property
    def label(self) -> str:
        return f"{self.speculative.label}@{self.tag}" if self.tag else self.speculative.label

    def resolved(self) -> "DeploymentSpec":
        """This spec with ``dtype: auto`` replaced by the dtype picked for this machine, so that what a
        result records (and its resume key) says which dtype ran."""
        from .engine import resolve_dtype

        return self if self.dtype != "auto" else self.model_copy(update={"dtype": resolve_dtype(self.dtype)})

