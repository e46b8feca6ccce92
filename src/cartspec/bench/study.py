"""The study's plan from a user's settings: a preset, the deployments replacing or joining its own, the grid and
the measurement settings, checked before any server starts.

``cartspec study`` parses its options into ``StudySettings`` and gets its ``SweepPlan`` from ``study_plan``;
the sweep (``bench/sweep.py``), the quality tests and the report follow in the command.
"""

from __future__ import annotations

from typing import Callable, Optional

from pydantic import BaseModel, ConfigDict

from .plan import SweepPlan


class StudySetupError(ValueError):
    """Settings the study refuses, before anything starts; the message says what to give instead."""


class StudySettings(BaseModel):
    """What a user sets for a study; None (and an empty list) leave the preset's choice."""

    model_config = ConfigDict(extra="forbid")

    preset: str = "quick"
    model: str = "commerce"
    server: Optional[str] = None  # measure this running endpoint instead of starting deployments
    served_name: Optional[str] = None
    server_api_key_env: Optional[str] = None
    deployments: Optional[list[str]] = None  # replace the preset's (parse_deployment's syntax)
    spec_files: Optional[list[str]] = None  # DeploymentSpec files measured after them
    concurrencies: Optional[list[int]] = None
    rates: Optional[list[float]] = None
    temperatures: Optional[list[float]] = None
    request_sets: Optional[list[str]] = None
    requests: Optional[int] = None
    requests_per_stream: Optional[int] = None
    min_requests: Optional[int] = None
    duration: Optional[float] = None
    warmup: Optional[int] = None
    max_tokens: Optional[int] = None
    structured: bool = False
    enforce_eager: bool = False
    dtype: str = "auto"
    slo: float = 2.0
    seed: int = 0
    samples: int = 1
    force: bool = False  # measure heads trained for another target (warns)
    interleave: Optional[int] = None
    rounds: Optional[int] = None
    restart_rounds: bool = False


def study_plan(s: StudySettings, warn: Callable[[str], None] = lambda m: None) -> SweepPlan:
    """The sweep plan of ``s``. Raises StudySetupError for settings it refuses; ``warn`` gets what it accepts
    but would measure less well than the user likely meant (and a head trained for another target, with
    ``s.force``)."""
    from ..serving.endpoint import MissingApiKey, api_key_from_env
    from ..serving.spec import DeploymentSpec
    from .plan import parse_deployment, preset

    if s.server_api_key_env:
        if not s.server:
            raise StudySetupError("--server-api-key-env is the key of --server: give --server too")
        try:  # checked now, not when the first point is measured
            api_key_from_env(s.server_api_key_env)
        except MissingApiKey as exc:
            raise StudySetupError(f"--server-api-key-env: {exc}") from exc
    try:
        plan = preset(s.preset, s.model)
        if s.deployments is not None:
            plan.deployments = [parse_deployment(d, s.model) for d in s.deployments]
    except ValueError as exc:
        raise StudySetupError(str(exc)) from exc
    if s.spec_files is not None:
        try:
            plan.deployments += [DeploymentSpec.load(f) for f in s.spec_files]
        except (OSError, ValueError) as exc:
            raise StudySetupError(f"--spec: {exc}") from exc
    if s.server:
        # An endpoint we do not start: --deployments (one) only says what it runs, for labels.
        if s.deployments is not None and len(plan.deployments) != 1:
            raise StudySetupError("with --server, --deployments names the one deployment behind it")
        plan.server_url, plan.served_name = s.server, s.served_name
        plan.deployments = (plan.deployments if s.deployments is not None
                            else [DeploymentSpec(model=s.served_name or "server")])
    if s.enforce_eager:
        plan.deployments = [d.model_copy(update={"enforce_eager": True}) for d in plan.deployments]
    seen: set[str] = set()
    for d in plan.deployments:  # results, slices and the report name deployments by label
        if d.label in seen:
            raise StudySetupError(f"two deployments are both labelled {d.label!r}: give the spec files a "
                                  "distinct `tag:` (its label becomes LABEL@tag), or measure one of them")
        seen.add(d.label)
    if not s.server:  # a head trained for another target than the served one: refuse before starting anything
        from ..model.registry import HeadMismatch, check_spec_head

        try:
            for d in plan.deployments:
                check_spec_head(d, force=s.force, warn=warn)
        except HeadMismatch as exc:
            raise StudySetupError(str(exc)) from exc
        # an endpoint we do not start runs whatever dtype it runs; here an explicit --dtype wins, otherwise a
        # spec file's own dtype does, and "auto" is picked now
        plan.deployments = [(d.model_copy(update={"dtype": s.dtype}) if s.dtype != "auto" else d).resolved()
                            for d in plan.deployments]
    plan.concurrencies = s.concurrencies or plan.concurrencies
    plan.rates = s.rates or plan.rates
    plan.temperatures = s.temperatures or plan.temperatures
    plan.request_sets = s.request_sets or plan.request_sets
    plan.n_requests = s.requests or plan.n_requests
    plan.requests_per_stream = s.requests_per_stream or plan.requests_per_stream
    plan.min_requests = s.min_requests or plan.min_requests
    plan.duration_s = s.duration or plan.duration_s
    plan.warmup = s.warmup if s.warmup is not None else plan.warmup
    plan.max_tokens = s.max_tokens or plan.max_tokens
    plan.structured = s.structured
    plan.slo_e2el_s = s.slo
    plan.seed = s.seed
    plan.samples = s.samples
    plan.interleave = s.interleave or plan.interleave
    plan.rounds = s.rounds or plan.rounds
    plan.restart_rounds = s.restart_rounds or plan.restart_rounds
    if plan.restart_rounds and (plan.rounds < 2 or plan.interleave < 2 or s.server):
        raise StudySetupError("--restart-rounds restarts the servers of an interleaved study between its rounds: "
                              "give --rounds 2 or more and --interleave 2 or more, without --server")
    if plan.rounds > 1 and (plan.interleave < 2 or s.server):
        warn("--rounds without --interleave: the slices of each deployment follow one another, so no ratio gets "
             "an interval; add --interleave 2 or more")
    return plan
