"""The commerce agent service: an HTTP API in front of vLLM deployments.

``create_app(config, upstream)`` builds the FastAPI app; ``cartspec serve``
brings up a deployment and the app together. Modules, in request order:
config (typed settings), cache (hot replies), router (which deployment),
upstream (deployments and their health), metrics (Prometheus), trace (JSONL
per request), app (validation, retries, error mapping).
"""

from .config import AgentConfig, CacheConfig, RouterConfig
from .upstream import Upstream, Upstreams

__all__ = ["AgentConfig", "CacheConfig", "RouterConfig", "Upstream", "Upstreams", "create_app"]


def create_app(config: AgentConfig | None = None, upstream=None):  # noqa: D401 - lazy import keeps CLI help fast
    from .app import create_app as _create

    return _create(config, upstream)
