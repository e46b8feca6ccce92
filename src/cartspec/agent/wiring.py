"""What ``cartspec serve`` puts behind the agent, apart from starting processes (testable without vLLM).

``build_upstreams`` turns the command line into the speculative and plain
targets, opening each through ``open_endpoint`` (``serving.endpoint.endpoint``
in ``cartspec serve``: a spec is started, a URL is used as it is);
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


# (spec or URL, served name on a URL) -> an open ``serving.endpoint.Endpoint``: ``url``, ``served_name``,
# ``api_key``, ``versions``. Whoever passes it owns what it started and stops it.
OpenEndpoint = Callable[[DeploymentSpec | str, str | None], Any]


def _target(open_endpoint: OpenEndpoint, what: DeploymentSpec | str, served_name: str | None,
            label: str) -> Upstream:
    ep = open_endpoint(what, served_name)
    info = ({"spec": what.model_dump(mode="json"), "versions": ep.versions}  # started here: what it runs is known
            if isinstance(what, DeploymentSpec) else {"url": ep.url})
    return Upstream(ep.url, model=ep.served_name, label=label, api_key=ep.api_key, info=info)


def build_upstreams(spec: DeploymentSpec | None, open_endpoint: OpenEndpoint, *,
                    upstream: str | None = None, served_name: str = "cartspec", label: str = "external",
                    plain: bool = False, plain_upstream: str | None = None,
                    plain_served_name: str = "cartspec") -> Upstreams:
    """The agent's targets. ``open_endpoint(spec_or_url, served_name)`` opens one: it starts a spec and
    returns it started, and uses a URL as it is. The main target is ``upstream``, else ``spec``; the plain
    one is ``plain_upstream``, else (with ``plain``) ``spec``'s target without speculation. ``label``: what
    runs on ``upstream``, for headers and metrics."""
    if upstream:
        main = _target(open_endpoint, upstream, served_name, label)
    else:
        if spec is None:
            raise ValueError("build_upstreams needs a spec or an upstream URL")
        main = _target(open_endpoint, spec, None, spec.label)
    want_plain = plain or bool(plain_upstream)
    if main.label == PLAIN_LABEL:  # no speculation: the main deployment is the plain target
        if want_plain:
            log.warning("the main deployment has no speculation: it is the plain target; "
                        "--plain/--plain-upstream ignored")
        return Upstreams(plain=main)
    if plain_upstream:
        other = _target(open_endpoint, plain_upstream, plain_served_name, PLAIN_LABEL)
    elif plain:
        if spec is None:
            raise ValueError("--plain needs the target's spec to start it without speculation")
        other = _target(open_endpoint, plain_spec(spec), None, PLAIN_LABEL)
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
