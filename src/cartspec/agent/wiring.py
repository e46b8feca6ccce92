"""What ``cartspec serve`` puts behind the agent, apart from starting processes (testable without vLLM).

``build_upstreams`` turns the command line into the speculative, plain and
candidate targets, opening each through ``open_endpoint``
(``serving.endpoint.endpoint`` in ``cartspec serve``: a spec is started, a URL
is used as it is); ``apply_flags`` turns on what two targets make possible (the
router, the acceptance fallback) unless the config file or a flag said
otherwise. The candidate (a canary, ``canary.py``) is the main spec with its
head swapped (``canary_spec``; a hybrid keeps its kind and drafts with the
candidate's own pointer), started like the plain target. Each target gets
the key its server requires: a URL's from the command line (a key option names
the variable holding it), a started vLLM's own random one (``VllmServer``).
What an ``Upstream`` keeps of a spec is its public part (no env, no engine flags).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from ..drafting.config import HybridConfig
from ..serving.spec import DeploymentSpec, Speculative
from .config import AgentConfig
from .upstream import Upstream, Upstreams, public_spec

log = logging.getLogger("cartspec.agent")

PLAIN_LABEL = "baseline"  # a spec without speculation is labelled so (Speculative.label)


def plain_spec(spec: DeploymentSpec) -> DeploymentSpec:
    """The same target and engine settings without speculation: the only difference routing should see."""
    return spec.model_copy(update={"speculative": Speculative()})


# (spec or URL, served name on a URL, the key a URL needs) -> an open ``serving.endpoint.Endpoint``: ``url``,
# ``served_name``, ``api_key`` (a started server's own), ``versions``. Whoever passes it owns what it started
# and stops it.
OpenEndpoint = Callable[[DeploymentSpec | str, str | None, str | None], Any]


def head_ref(spec: DeploymentSpec | None) -> str | None:
    """``NAME@vNNNN`` when the spec drafts with a head registry's version (``--head NAME`` is its current one
    when it starts), else None."""
    sp = spec.speculative if spec is not None else None
    if sp is None or sp.method not in ("eagle3", "hybrid") or not sp.model:
        return None
    from ..model.heads import version_of
    from ..model.registry import resolve_head

    try:
        return version_of(resolve_head(sp.model))
    except Exception:  # a head that does not resolve: starting the deployment says why
        return version_of(Path(sp.model))


def candidate_head(ref: str) -> tuple[str, str | None]:
    """The head a canary's candidate drafts with, and its registry ref: ``NAME@vNNNN`` (that version),
    ``NAME`` (the registry's newest candidate version) or a head directory (a registry ref when it is one)."""
    from ..model.heads import HeadRegistry, HeadRegistryError, parse_ref, valid_name, version_of

    path = Path(ref).expanduser()
    if "/" in ref or path.is_dir():
        return str(path), version_of(path)
    try:
        name, version = parse_ref(ref)
    except HeadRegistryError as exc:
        raise ValueError(f"--canary-head {ref!r}: {exc}") from None
    reg = HeadRegistry(name) if valid_name(name) else None
    if reg is None or not reg.exists():
        if version is not None:
            raise ValueError(f"--canary-head {ref!r}: there is no head registry {name!r} "
                             f"(see `cartspec heads list`)")
        return ref, None  # a bundled head's name: resolve_head finds it when the deployment starts
    if version is None:
        candidates = [v for v in reg.versions() if v.status == "candidate"]
        if not candidates:
            raise ValueError(f"--canary-head {ref!r}: the head registry {name!r} has no candidate version "
                             f"(see `cartspec heads list {name}`; make one with `cartspec draft refresh`)")
        v = candidates[-1]
    else:
        v = reg.get(version)
    if v.status == "current":
        raise ValueError(f"--canary-head {v.ref} is already the current version of {name!r}: nothing to try")
    if v.status == "rejected":
        log.warning("the canary's candidate %s was rejected before (see `cartspec heads show %s`)", v.ref, v.ref)
    return v.ref, v.ref


def canary_spec(spec: DeploymentSpec, head: str) -> DeploymentSpec:
    """The same target, engine settings and drafter kind drafting with another head: the only difference a
    canary should see. A hybrid drafts with the candidate's own pointer (``candidate_pointer``)."""
    sp = spec.speculative
    if sp.method not in ("eagle3", "hybrid") or not sp.model:
        raise ValueError(f"a canary needs a main deployment that drafts with a head (eagle3 or hybrid), not "
                         f"{spec.label}: serve with --head NAME (or a --spec with an EAGLE-3 head)")
    update: dict[str, Any] = {"model": head}
    if sp.hybrid is not None:
        update["hybrid"] = candidate_pointer(sp.hybrid, sp.model, head)
    return spec.model_copy(update={"speculative": sp.model_copy(update=update)})


def candidate_pointer(hybrid: HybridConfig, current: str, candidate: str) -> HybridConfig:
    """The main deployment's hybrid settings for the candidate head: a pointer written out in them (``--pointer``,
    a spec file) gives way to the one kept in the candidate's directory (``model.registry.head_pointer``, trained
    with it) and is never the current head's own; left out, ``Speculative.hybrid_config`` resolves the
    candidate's own pointer, else the one trained for the target."""
    from dataclasses import replace

    from ..drafting.config import NEEDS_POINTER
    from ..model.registry import head_pointer

    if hybrid.rule not in NEEDS_POINTER or not hybrid.pointer:
        return hybrid
    own, theirs = head_pointer(_head_dir(candidate)), head_pointer(_head_dir(current))
    if own is not None:
        return replace(hybrid, pointer=str(own))
    if theirs is not None and Path(hybrid.pointer).expanduser().resolve() == theirs.resolve():
        return replace(hybrid, pointer="")  # the current head's own pointer: the candidate's default instead
    return hybrid


def _head_dir(head: str) -> Path | None:
    """A head's directory, None where it does not resolve (starting the deployment says why)."""
    from ..model.registry import resolve_head

    try:
        return resolve_head(head)
    except (OSError, ValueError):  # missing (ModelNotFound), unreadable, or a corrupt registry version
        return None


def _target(open_endpoint: OpenEndpoint, what: DeploymentSpec | str, served_name: str | None,
            label: str, api_key: str | None = None, head: str | None = None) -> Upstream:
    """One target; ``api_key``: what a URL needs (a started server has its own, ``ep.api_key``); ``head``: the
    registry version a URL drafts with, if known."""
    ep = open_endpoint(what, served_name, api_key)
    if isinstance(what, DeploymentSpec):  # started here: what it runs is known
        info: dict[str, Any] = {"spec": public_spec(what.model_dump(mode="json")), "versions": ep.versions}
        step_stats = getattr(ep, "step_stats_path", None)  # a vLLM this process started (not a stand-in)
        if step_stats is not None:
            info["step_stats"] = str(step_stats)
        head = head_ref(what)
    else:
        info = {}
    if head:
        info["head"] = head
    return Upstream(ep.url, model=ep.served_name, label=label, api_key=api_key or ep.api_key, info=info)


def build_upstreams(spec: DeploymentSpec | None, open_endpoint: OpenEndpoint, *,
                    upstream: str | None = None, served_name: str = "cartspec", label: str = "external",
                    upstream_key: str | None = None,
                    plain: bool = False, plain_upstream: str | None = None,
                    plain_served_name: str = "cartspec", plain_key: str | None = None,
                    canary_head: str | None = None, canary_upstream: str | None = None,
                    canary_served_name: str = "cartspec", canary_key: str | None = None) -> Upstreams:
    """The agent's targets. ``open_endpoint(spec_or_url, served_name, api_key)`` opens one: it starts a spec
    and returns it started, and uses a URL as it is. The main target is ``upstream``, else ``spec``; the plain
    one is ``plain_upstream``, else (with ``plain``) ``spec``'s target without speculation. ``label``: what
    runs on ``upstream``, for headers and metrics; ``upstream_key``, ``plain_key``, ``canary_key``: the keys
    the URLs need.

    The candidate of a canary is ``canary_upstream`` (a running server; ``canary_head``, when given, says
    which head it drafts with, so a promotion reaches the registry), else (with ``canary_head``) ``spec``
    with its head replaced by ``canary_head`` (``candidate_head``: NAME@vNNNN, NAME or a path). A canary
    needs a main deployment that drafts with a head."""
    canary = bool(canary_head or canary_upstream)
    if upstream:
        main = _target(open_endpoint, upstream, served_name, label, api_key=upstream_key)
    else:
        if spec is None:
            raise ValueError("build_upstreams needs a spec or an upstream URL")
        main = _target(open_endpoint, spec, None, spec.label)
    want_plain = plain or bool(plain_upstream)
    if main.label == PLAIN_LABEL:  # no speculation: the main deployment is the plain target
        if canary:
            raise ValueError("a canary needs a speculative main deployment: the main one runs without "
                             "speculation (baseline), so there is no head to try the candidate against; serve "
                             "with --head NAME (or --upstream URL with --label naming its head)")
        if want_plain:
            log.warning("the main deployment has no speculation: it is the plain target; "
                        "--plain/--plain-upstream ignored")
        return Upstreams(plain=main)
    candidate = None
    if canary:
        head, ref = candidate_head(canary_head) if canary_head else (None, None)
        if canary_upstream:
            cand_label = canary_spec(spec, head).label if spec is not None and head else "candidate"
            candidate = _target(open_endpoint, canary_upstream, canary_served_name, cand_label,
                                api_key=canary_key, head=ref)
        else:
            if spec is None:
                raise ValueError("--canary-head needs the main deployment's spec to start the candidate: give "
                                 "--canary-upstream URL for a running one")
            cspec = canary_spec(spec, head)
            if cspec.label == main.label and ref is None:
                raise ValueError(f"--canary-head {canary_head!r} is the head the main deployment already "
                                 "drafts with: nothing to try")
            candidate = _target(open_endpoint, cspec, None, cspec.label)
        if ref is not None and ref == main.head_ref:
            raise ValueError(f"the canary's candidate {ref} is the head the main deployment drafts with")
    if plain_upstream:
        other = _target(open_endpoint, plain_upstream, plain_served_name, PLAIN_LABEL, api_key=plain_key)
    elif plain:
        if spec is None:
            raise ValueError("--plain needs the target's spec to start it without speculation")
        other = _target(open_endpoint, plain_spec(spec), None, PLAIN_LABEL)
    else:
        return Upstreams(speculative=main, candidate=candidate)
    return Upstreams(speculative=main, plain=other, candidate=candidate)


def apply_flags(cfg: AgentConfig, upstreams: Upstreams, *, router: bool | None = None,
                fallback: bool | None = None, admission_max_wait: float | None = None,
                canary_share: float | None = None) -> AgentConfig:
    """``cfg`` with the command line's switches. With two targets (speculative and plain) the router comes
    on, unless the config file set ``router.enabled`` itself; the fallback decides for itself
    (``FallbackConfig.enabled``)."""
    two = {"speculative", "plain"} <= set(upstreams.by_target)
    r = cfg.router
    if router is not None:
        r = r.model_copy(update={"enabled": router})
    elif two and "enabled" not in r.model_fields_set:
        r = r.model_copy(update={"enabled": True})
    fb = cfg.fallback if fallback is None else cfg.fallback.model_copy(update={"enabled": fallback})
    adm = cfg.admission
    if admission_max_wait is not None:
        adm = adm.model_copy(update={"enabled": admission_max_wait > 0, "max_wait_s": admission_max_wait}
                             if admission_max_wait > 0 else {"enabled": False})
    canary = cfg.canary if canary_share is None else cfg.canary.model_copy(update={"share": canary_share})
    if canary_share is not None:
        canary = type(canary).model_validate(canary.model_dump())  # the share's bounds, checked
    return cfg.model_copy(update={"router": r, "fallback": fb, "admission": adm, "canary": canary})
