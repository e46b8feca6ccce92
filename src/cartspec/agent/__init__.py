"""The agent service: an HTTP API in front of vLLM deployments, OpenAI's for any model and the commerce task's.

``create_app(config, upstream)`` builds the FastAPI app; ``cartspec serve``
brings up a deployment (or two: ``--plain``) and the app together. Modules,
in request order: config (typed settings), cache (hot replies), router (which
deployment), fallback (away from a draft that stopped paying, and back),
canary (a candidate head on a share of the traffic, promoted or rolled back),
admission (refuse what would wait too long), upstream (deployments, their
health and throughput), acceptance (one definition of it), metrics
(Prometheus), trace (JSONL per request; the traffic log is ``task.traffic``),
chat (the one call every endpoint makes: messages, format, retry plan), retry (what follows each
attempt: accept, retry constrained, give up), observer (what each model call reports to: metrics, router,
fallback, canary), errors (the API's error type), openai_api (OpenAI's endpoints, request and response
types), routes (the commerce and service handlers), app (the agent and the app: validation, the call, error
mapping). Around it: defaults (what ``cartspec serve`` deploys), wiring (what goes
behind the agent), supervisor (restarts a deployment that died), process (the
agent as a process its caller owns: the drills and tests) and cli
(``cartspec serve``, a shell over these).
"""

from .config import AdmissionConfig, AgentConfig, CacheConfig, CanaryConfig, FallbackConfig, RouterConfig
from .upstream import Upstream, Upstreams

__all__ = ["AdmissionConfig", "AgentConfig", "CacheConfig", "CanaryConfig", "FallbackConfig", "RouterConfig",
           "Upstream", "Upstreams", "create_app"]


def create_app(config: AgentConfig | None = None, upstream=None):  # noqa: D401 - lazy import keeps CLI help fast
    from .app import create_app as _create

    return _create(config, upstream)
