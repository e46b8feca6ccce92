"""What a study measures: the grid of deployments × loads × temperatures, and the named presets."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..serving.spec import DeploymentSpec, Speculative
from ..results import PointConfig

class SweepPlan(BaseModel):
    """A grid of points; serialised into ``run.json`` beside the results."""

    model_config = ConfigDict(extra="forbid")

    name: str = "custom"
    deployments: list[DeploymentSpec]
    concurrencies: list[int] = Field(default_factory=lambda: [1, 8])
    rates: list[float] = Field(default_factory=list, description="open-loop arrival rates (req/s); empty: closed loop")
    temperatures: list[float] = Field(default_factory=lambda: [0.0])
    request_sets: list[str] = Field(default_factory=lambda: ["commerce"])
    n_requests: int | None = Field(None, description="measured requests per point; None: per-load rule below")
    requests_per_stream: int = 4
    min_requests: int = 16
    duration_s: float | None = None
    warmup: int | None = Field(None, description="warm-up requests per point; None: min(concurrency, 8)")
    max_tokens: int = 128
    structured: bool = False
    seed: int = 0
    samples: int = Field(1, ge=1, description="replies per request (paired seeds): at T > 0 several samples per "
                                              "request make the paired quality tests conclusive sooner")
    slo_e2el_s: float = 2.0
    interleave: int = Field(1, ge=1, description="servers up at once, measured in turn at each point (the order "
                                                  "rotating from point to point) so that a drift of the host lands "
                                                  "on every deployment alike; 1: one deployment after another")
    rounds: int = Field(1, ge=1, description="each point measured in this many slices of consecutive requests, "
                                             "the servers of a group taking turns at every slice (at least two "
                                             "requests per stream in a slice); the slices merge into the point")
    restart_rounds: bool = Field(False, description="stop the group's servers after every round and start them "
                                                    "again, the start order rotated by one: an offset that follows "
                                                    "a server process (or the order the servers started in) then "
                                                    "lands on every deployment alike instead of on one (needs "
                                                    "rounds and interleave above 1; a start per server per "
                                                    "round; points are recorded in the last round, so a run "
                                                    "killed before it keeps none)")
    server_url: str | None = Field(None, description="measure this running endpoint instead of starting vLLM")
    served_name: str | None = None

    def points(self, deployment: DeploymentSpec, label: str | None = None) -> list[PointConfig]:
        sp = deployment.speculative
        common = dict(deployment=label or deployment.label, method=sp.method, gamma=sp.num_speculative_tokens,
                      head=sp.model if sp.method in ("eagle3", "hybrid") else None,
                      head_version=registered_version(sp.model) if sp.method in ("eagle3", "hybrid") else None,
                      spec=deployment.model_dump(mode="json"), max_tokens=self.max_tokens,
                      structured=self.structured, seed=self.seed, slo_e2el_s=self.slo_e2el_s,
                      duration_s=self.duration_s, samples=self.samples, rounds=self.rounds)
        loads: list[dict[str, Any]] = ([dict(mode="open", rate=r, concurrency=None) for r in self.rates]
                                       if self.rates else [dict(mode="closed", concurrency=c) for c in self.concurrencies])
        out = []
        for rs in self.request_sets:
            for temp in self.temperatures:
                for load in loads:
                    width = load["concurrency"] or max(1, round(load["rate"]))
                    n = self.n_requests or max(self.min_requests, self.requests_per_stream * width)
                    warm = self.warmup if self.warmup is not None else min(width, 8)
                    out.append(PointConfig(request_set=rs, temperature=temp, n_requests=n, warmup=warm,
                                           **load, **common))
        return out

    def all_points(self) -> list[PointConfig]:
        return [p for d in self.deployments for p in self.points(d)]


def baseline(model: str) -> DeploymentSpec:
    return DeploymentSpec(model=model)


def spec_deployment(model: str, method: str, gamma: int, head: str | None = None,
                    rule: str | None = None, draft_stop: float | None = None) -> DeploymentSpec:
    """``rule``: the hybrid's (``drafting.config.RULES``; None: its default); ``draft_stop``: EAGLE-3's or the
    hybrid's draft cut per request where the head's path probability falls below it (``drafting.length``)."""
    from ..drafting.config import HybridConfig

    hybrid = HybridConfig(rule=rule) if rule else None
    return DeploymentSpec(model=model, speculative=Speculative(method=method, num_speculative_tokens=gamma,
                                                               model=head, hybrid=hybrid, draft_stop=draft_stop))


def _stop(text: str, whole: str) -> float:
    """``stop`` (the default, ``drafting.length.STOP_P``) or ``stopP`` (``stop0.6``) -> the threshold."""
    from ..drafting.length import STOP_P, check_stop_p

    value = text[len("stop"):]
    try:
        return check_stop_p(float(value)) if value else STOP_P
    except ValueError as exc:
        raise ValueError(f"cannot read deployment {whole!r}: {exc}") from None


def adaptive_deployment(model: str, head: str) -> DeploymentSpec:
    """EAGLE-3 with γ per batch size tuned for this machine when the deployment starts."""
    return DeploymentSpec(model=model, speculative=Speculative(method="eagle3", model=head, adaptive=True))


def parse_deployment(text: str, model: str) -> DeploymentSpec:
    """``baseline`` | ``ngram:3`` | ``schema:3`` (drafts from the reply's JSON schema and the prompt, no head) |
    ``eagle3:domain:3`` | ``eagle3:/path/to/head:5`` | ``eagle3:domain:auto``
    (γ per batch size, tuned for this machine) | ``hybrid:domain:3`` (EAGLE-3 + prompt lookup) |
    ``hybrid-pointer:domain:3`` (the hybrid with that rule, ``drafting.config.RULES``) |
    ``eagle3:domain:5:stop`` (EAGLE-3 drafting up to 5 tokens, each request's draft cut where the head's path
    probability falls below ``drafting.length.STOP_P``; ``:stop0.6`` another threshold) | ``hybrid:domain:5:stop``
    (the hybrid, its draft cut the same way before its first copied token) -> a spec."""
    parts = text.split(":")
    stop = None
    if (parts[0] == "eagle3" or parts[0].split("-", 1)[0] == "hybrid") and len(parts) >= 4 \
            and parts[-1].startswith("stop"):
        stop, parts = _stop(parts[-1], text), parts[:-1]
    if parts[0] == "eagle3" and stop is not None:
        return spec_deployment(model, "eagle3", int(parts[-1]), ":".join(parts[1:-1]), draft_stop=stop)
    if parts[0].startswith("hybrid-") and len(parts) >= 3:
        from ..drafting.config import RULES

        rule = parts[0][len("hybrid-"):]
        if rule not in RULES:
            raise ValueError(f"cannot read deployment {text!r}: hybrid rule {rule!r} is not one of {', '.join(RULES)}")
        return spec_deployment(model, "hybrid", int(parts[-1]), ":".join(parts[1:-1]), rule, draft_stop=stop)
    if parts[0] == "hybrid" and stop is not None:
        return spec_deployment(model, "hybrid", int(parts[-1]), ":".join(parts[1:-1]), draft_stop=stop)
    if parts[0] in ("baseline", "none"):
        return baseline(model)
    if parts[0] == "eagle3" and len(parts) >= 3 and parts[-1] == "auto":
        return adaptive_deployment(model, ":".join(parts[1:-1]))
    if parts[0] == "suffix" and not suffix_available():
        raise ValueError(SUFFIX_MISSING)
    if parts[0] in ("ngram", "suffix", "schema") and len(parts) == 2:
        return spec_deployment(model, parts[0], int(parts[1]))
    if parts[0] in ("eagle3", "draft_model", "hybrid") and len(parts) >= 3:
        return spec_deployment(model, parts[0], int(parts[-1]), ":".join(parts[1:-1]))
    raise ValueError(f"cannot read deployment {text!r}: use baseline, ngram:γ, schema:γ, eagle3:HEAD:γ, eagle3:HEAD:auto, "
                     "eagle3:HEAD:γ:stop, hybrid:HEAD:γ, hybrid-RULE:HEAD:γ or hybrid:HEAD:γ:stop")


SUFFIX_MISSING = ("suffix decoding needs the arctic-inference package (vLLM imports its suffix tree), which is "
                  "not installed here: scripts/install.sh builds arctic-inference==0.3.0 from its source "
                  "distribution; rerun it and read the line it prints about arctic-inference")


def suffix_available() -> bool:
    """Can vLLM run ``method: suffix`` here (is ``arctic_inference.suffix_decoding`` importable)?"""
    import importlib.util

    try:
        return importlib.util.find_spec("arctic_inference.suffix_decoding") is not None
    except ImportError:
        return False


def registered_version(name: str | None) -> str | None:
    """``NAME@v0002`` when the head ``name`` resolves to a head registry's version now, else None."""
    from ..model.heads import HeadRegistryError, resolve_registered

    if not name:
        return None
    try:
        v = resolve_registered(name)
    except (FileNotFoundError, HeadRegistryError):
        return None
    return v.ref if v else None


def head_available(name: str) -> bool:
    from ..model.registry import resolve_head

    try:
        resolve_head(name)
        return True
    except Exception:
        return False


PRESETS = ("quick", "paper", "calibrate")


def preset(name: str, model: str = "commerce", head: str = "domain") -> SweepPlan:
    """``paper``: the published study's grid, plus n-gram, suffix decoding (where arctic-inference is
    installed) and the adaptive schedule tuned for this machine. The ``generic`` head (off the shelf:
    trained for the base model on general prompts) is not in it, because a head made for another
    target is refused without ``--force``; compare it with ``--deployments
    baseline,eagle3:generic:3,eagle3:domain:3 --force``.
    ``quick``: a taste of it in about 13 minutes on 2 cores, with the schema drafter beside n-gram and the hybrid
    drafter beside the head, the deployments
    up at once and measured in turn. ``calibrate``: what the cost model and
    ``cartspec tune`` need on a new machine (the baseline and the head at γ=5 at three loads), in minutes."""
    from ..drafting.length import STOP_P

    if name == "paper":
        return SweepPlan(name="paper", deployments=[
            baseline(model), spec_deployment(model, "eagle3", 3, head),
            spec_deployment(model, "eagle3", 5, head), adaptive_deployment(model, head),
            # draft length per request (up to γ=5, cut where the head's path probability falls below STOP_P)
            spec_deployment(model, "eagle3", 5, head, draft_stop=STOP_P),
            # the hybrid with its default rule for the target (the pointer for the bundled model), as serve
            # deploys it
            spec_deployment(model, "hybrid", 3, head), spec_deployment(model, "hybrid", 5, head),
            spec_deployment(model, "ngram", 3), spec_deployment(model, "schema", 3),
            *([spec_deployment(model, "suffix", 3)] if suffix_available() else [])],
            concurrencies=[1, 2, 4, 8, 16, 32], temperatures=[0.0, 0.5],
            # the baseline, the head at γ 3 and 5 and the adaptive schedule up at once (about 4.8 GB each
            # with the bundled model in float32), measured in turn at every point: the adaptive-vs-fixed and
            # speculative-vs-baseline ratios are then free of the host's drift; the draft cut per request, the
            # hybrids, n-gram and suffix follow in groups of four (six servers of the bundled model did not fit
            # a 24 GiB machine's memory)
            interleave=4,
            # 10..64 requests per point: about half an hour on 2 CPU cores; points are paired (the same
            # requests on every deployment), so ratios stay tight even with few requests.
            requests_per_stream=2, min_requests=10, max_tokens=96)
    if name == "quick":
        # the two drafters that need no head: n-gram lookup and the schema drafter
        deps = [baseline(model), spec_deployment(model, "ngram", 3), spec_deployment(model, "schema", 3)]
        if head_available("domain"):
            deps += [spec_deployment(model, "eagle3", 3, "domain"),
                     spec_deployment(model, "hybrid", 3, "domain")]  # its default rule, as serve deploys it
        # up at once and measured in turn at every point, as in ``paper``: one after another, a ratio carries
        # whatever the host did in the minutes between two deployments (a few busy minutes land on one of them)
        return SweepPlan(name="quick", deployments=deps, concurrencies=[1, 8], temperatures=[0.0],
                         requests_per_stream=3, min_requests=8, max_tokens=96, interleave=len(deps))
    if name == "calibrate":
        # γ=5 measures acceptance at every position a schedule may use (chain drafting: the first i
        # positions do not depend on γ); 1, 4 and 16 streams separate per-step from per-token costs.
        return SweepPlan(name="calibrate", deployments=[baseline(model), spec_deployment(model, "eagle3", 5, head)],
                         concurrencies=[1, 4, 16], temperatures=[0.0], requests_per_stream=2, min_requests=8,
                         max_tokens=96)
    raise ValueError(f"unknown preset {name!r}: {', '.join(PRESETS)}")


