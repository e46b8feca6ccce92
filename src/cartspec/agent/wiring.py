"""What ``cartspec serve`` puts behind the agent, apart from starting processes (testable without vLLM).

``build_upstreams`` turns the command line into the speculative and plain
targets, calling ``start(spec)`` for each deployment it must run itself;
``apply_flags`` turns on what two targets make possible (the router, the
acceptance fallback) unless the config file or a flag said otherwise.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ..serving.spec import DeploymentSpec, Speculative
from .config import AgentConfig
from .upstream import Upstream, Upstreams

log = logging.getLogger("cartspec.agent")

PLAIN_LABEL = "baseline"  # a spec without speculation is labelled so (Speculative.label)


def plain_spec(spec: DeploymentSpec) -> DeploymentSpec:
    """The same target and engine settings without speculation: the only difference routing should see."""
    return spec.model_copy(update={"speculative": Speculative()})


def _from_server(server: Any, spec: DeploymentSpec) -> Upstream:
    info = server.info()
    return Upstream(server.url, model=spec.name, label=spec.label, info={"spec": info.spec, "versions": info.versions})


def build_upstreams(spec: DeploymentSpec | None, start: Callable[[DeploymentSpec], Any], *,
                    upstream: str | None = None, served_name: str = "cartspec", label: str = "external",
                    plain: bool = False, plain_upstream: str | None = None,
                    plain_served_name: str = "cartspec") -> Upstreams:
    """The agent's targets. ``start(spec)`` runs a deployment and returns it started (``VllmServer``-like:
    ``url``, ``info()``); it is called for the main deployment unless ``upstream`` is given, then for the
    plain one if ``plain`` and no ``plain_upstream``. ``spec``: what the main deployment runs, and the
    target the plain one runs without speculation (with ``upstream``, only the latter)."""
    if upstream:
        main = Upstream(upstream, model=served_name, label=label, info={"url": upstream})
    else:
        if spec is None:
            raise ValueError("build_upstreams needs a spec or an upstream URL")
        main = _from_server(start(spec), spec)
    want_plain = plain or bool(plain_upstream)
    if main.label == PLAIN_LABEL:  # no speculation: the main deployment is the plain target
        if want_plain:
            log.warning("the main deployment has no speculation: it is the plain target; "
                        "--plain/--plain-upstream ignored")
        return Upstreams(plain=main)
    if plain_upstream:
        other = Upstream(plain_upstream, model=plain_served_name, label=PLAIN_LABEL, info={"url": plain_upstream})
    elif plain:
        if spec is None:
            raise ValueError("--plain needs the target's spec to start it without speculation")
        pspec = plain_spec(spec)
        other = _from_server(start(pspec), pspec)
    else:
        return Upstreams(speculative=main)
    return Upstreams(speculative=main, plain=other)


def apply_flags(cfg: AgentConfig, upstreams: Upstreams, *, router: bool | None = None,
                fallback: bool | None = None, admission_max_wait: float | None = None) -> AgentConfig:
    """``cfg`` with the command line's switches. With two targets the router comes on, unless the config
    file set ``router.enabled`` itself; the fallback decides for itself (``FallbackConfig.enabled``)."""
    two = len(upstreams.by_target) == 2
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
    return cfg.model_copy(update={"router": r, "fallback": fb, "admission": adm})
