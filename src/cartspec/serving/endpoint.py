"""One home for "use a running endpoint, or start vLLM".

``endpoint(spec_or_url, ...)`` is what ``cartspec study``, ``eval-model`` and ``serve`` open:

- a ``DeploymentSpec``: starts a ``VllmServer`` (or what an injected ``launcher`` starts: the
  study's tests put a paced stand-in there) and stops it however the block ends;
- a URL: starts nothing. Someone else runs it: vLLM, SGLang, NVIDIA NIM, a hosted API.

Either way the block gets an ``Endpoint``: where requests go (``url``, ``served_name``,
``api_key``), whether it still answers (``alive``, ``died_reason``), what it is (``versions``,
``describe``: the study's ``DeploymentInfo``) and whether vLLM's Prometheus ``/metrics``
answers there (``has_metrics``; without it a point is measured without acceptance figures).

A URL is alive when ``/health`` answers 200 (vLLM, SGLang), else ``/v1/health/ready`` (NIM,
whose ``/health`` is 404), else ``/v1/models`` (any OpenAI-compatible server); the path that
answered is asked first from then on. An API key goes as ``Authorization: Bearer KEY`` on every
call. It is in neither ``describe()`` nor ``repr()``, so it cannot reach a results file; what a
run may record is the name of the environment variable that holds it (``api_key_from_env``). A vLLM
started here requires a key of its own, random per start (``VllmServer.api_key``): ``Endpoint.api_key``
is that key, so every caller that goes through the endpoint (chat, ``/v1/models``, ``/metrics``) has it.
What is shown or recorded of a URL is ``urls.redact_url``'s (no ``user:pw@``, no query values).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import httpx

from .client import HEALTH_PATHS, auth_headers
from .spec import DeploymentSpec, Speculative, check_name
from .urls import redact_url

if TYPE_CHECKING:
    from ..results import DeploymentInfo
    from .server import VllmServer

# What a launcher starts instead of ``VllmServer``: a context manager (spec, log_dir) that yields a
# started deployment with ``url``, ``alive()``, ``describe()`` and ``died_reason()`` (or an Endpoint).
Launcher = Callable[[DeploymentSpec, Path], contextlib.AbstractContextManager]


class MissingApiKey(ValueError):
    """An API key was asked for by the name of an environment variable that does not hold one."""

    def __init__(self, var: str):
        super().__init__(f"the environment variable {var} holds no API key (it is not set, or empty): "
                         f"export {var}=KEY first")
        self.var = var


class EndpointError(RuntimeError):
    """An endpoint that cannot be used as given: unreachable, refusing us, or serving no model."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def api_key_from_env(var: str | None) -> str | None:
    """The key held in the environment variable ``var`` (None without ``var``). Commands take the variable's
    name, never the key itself: the name is safe to record with a run, and the key stays out of shell history."""
    if not var:
        return None
    key = os.environ.get(var, "").strip()
    if not key:
        raise MissingApiKey(var)
    return key


def _refused(status: int) -> str:
    return " (unauthorised: the API key is missing or wrong)" if status in (401, 403) else ""


def first_model(url: str, api_key: str | None = None) -> str:
    """The first model a running endpoint lists on ``/v1/models``."""
    url = url.rstrip("/")
    shown = redact_url(url)
    try:
        r = httpx.get(url + "/v1/models", headers=auth_headers(api_key), timeout=10)
    except httpx.HTTPError as exc:  # httpx's own message may hold the URL as given
        raise EndpointError(f"{shown} is unreachable: {type(exc).__name__}: {str(exc).replace(url, shown)}") \
            from None
    if r.status_code != 200:
        raise EndpointError(f"{shown} answered HTTP {r.status_code} {r.reason_phrase} on /v1/models"
                            f"{_refused(r.status_code)}")
    try:
        return str(r.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise EndpointError(f"{shown} lists no model on /v1/models; name the served model") from exc


class Endpoint:
    """A running OpenAI-compatible server. The base class is one given by URL, which nobody here started:
    liveness is what it answers over HTTP. ``spec``/``label``: what it runs, as the study records it."""

    server: "VllmServer | None" = None  # the vLLM process behind it, when this process started one

    def __init__(self, url: str, served_name: str, *, api_key: str | None = None,
                 spec: DeploymentSpec | None = None, label: str | None = None):
        self.url = url.rstrip("/")
        self.served_name = served_name
        self.api_key = api_key
        self.spec = spec
        self.label = label or (spec.label if spec else served_name)
        self.health_path: str | None = None  # the liveness path that answered last
        self._refusals: list[tuple[str, int | str]] = []  # what the last failed liveness check got, per path
        self._versions: dict[str, str] | None = None

    def __repr__(self) -> str:  # never the key
        return (f"{type(self).__name__}({redact_url(self.url)!r}, served_name={self.served_name!r}, "
                f"label={self.label!r})")

    def get(self, path: str, timeout: float = 5.0) -> httpx.Response:
        """GET ``path`` with the endpoint's key."""
        return httpx.get(self.url + path, headers=auth_headers(self.api_key), timeout=timeout)

    # --- liveness -----------------------------------------------------------
    def alive(self) -> bool:
        order = ([self.health_path] if self.health_path else []) + [p for p in HEALTH_PATHS if p != self.health_path]
        self._refusals = []
        for path in order:
            try:
                status = self.get(path).status_code
            except httpx.HTTPError as exc:
                self._refusals.append((path, type(exc).__name__))
                return False  # unreachable: no other path will answer either
            if status == 200:
                self.health_path = path
                return True
            self._refusals.append((path, status))
        return False

    def died_reason(self) -> str:
        """Why the last ``alive()`` said no: what each liveness path answered."""
        seen = "; ".join(f"{p}: {s if isinstance(s, str) else f'HTTP {s}'}" for p, s in self._refusals)
        if any(s in (401, 403) for _, s in self._refusals):  # up, but not for us
            return f"the endpoint {redact_url(self.url)} refuses us ({seen}){_refused(401)}"
        return f"the endpoint {redact_url(self.url)} stopped answering ({seen or 'not asked yet'})"

    def log_cause(self) -> str | None:
        """The first error the server's own log records, with the log's path, where this process has its log
        (a server it started); None here: nobody here started it."""
        return None

    # --- what it is ---------------------------------------------------------
    @property
    def versions(self) -> dict[str, str]:
        """What the server says it is (vLLM's ``/version``), asked once; empty when it does not say."""
        if self._versions is None:
            self._versions = {}
            try:
                r = self.get("/version")
                if r.status_code == 200:
                    self._versions["server"] = str(r.json().get("version"))
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
        return self._versions

    @property
    def step_stats_path(self) -> "Path | None":
        """The engine's step-time file (``vllm_plugin.steps``) where this process started the vLLM, else None."""
        return getattr(self.server, "step_stats_path", None)  # None: no server here, or one without the file

    @property
    def has_metrics(self) -> bool:
        """Whether vLLM's Prometheus ``/metrics`` answers here now (NIM and hosted APIs: 404 or 401)."""
        try:
            return self.get("/metrics", timeout=10.0).status_code == 200
        except httpx.HTTPError:
            return False

    def describe(self) -> "DeploymentInfo":
        from ..results import DeploymentInfo

        sp = self.spec.speculative if self.spec else Speculative()
        return DeploymentInfo(label=self.label, method=sp.method, gamma=sp.num_speculative_tokens, head=sp.model,
                              model=self.served_name,
                              deployment_spec=self.spec.model_dump(mode="json") if self.spec else {},
                              url=redact_url(self.url), versions=dict(self.versions))


class VllmEndpoint(Endpoint):
    """A ``VllmServer`` of this process (constructed here, started and stopped by ``endpoint()``):
    liveness is its process, a death is explained by its log, and ``describe()`` says which model ran.
    ``api_key``: the key the server requires (default: a random one, ``VllmServer``); ``api_key`` is then its."""

    def __init__(self, spec: DeploymentSpec, log_dir: str | Path, api_key: str | None = None):
        from .server import VllmServer

        self.server = VllmServer(spec, log_dir=log_dir, api_key=api_key)
        super().__init__(self.server.url, spec.name, api_key=self.server.api_key, spec=spec)

    def alive(self) -> bool:
        return self.server.alive()

    @property
    def versions(self) -> dict[str, str]:
        if self._versions is None:
            self._versions = dict(self.server.info().versions)
        return self._versions

    def describe(self) -> "DeploymentInfo":
        from ..results import DeploymentInfo
        from ..paths import dir_digest

        info = self.server.info()
        sp = self.spec.speculative
        for key in ("model_dir", "head_dir"):  # the content, not just the path, says which model ran
            path = Path(info.versions.get(key) or "")
            if str(path) not in ("", ".") and path.is_dir():
                info.versions[key.replace("_dir", "_digest")] = dir_digest(path)[:16]
        return DeploymentInfo(label=self.label, method=sp.method, gamma=sp.num_speculative_tokens,
                              head=info.versions.get("head_dir") or None, model=info.versions.get("model_dir", ""),
                              deployment_spec=info.spec, url=info.url, versions=info.versions,
                              log_path=info.log_path)

    def died_reason(self) -> str:
        from .server import read_log, root_cause

        code = self.server.proc.returncode if self.server.proc else None
        log = read_log(self.server.log_path)
        cause = root_cause(log)
        if cause is None:
            telling = [ln for ln in log.splitlines()[-200:]
                       if any(k in ln.lower() for k in ("error", "killed", "memory"))]
            cause = (telling[-1] if telling else "no error line in log").strip()[-300:]
        return f"vLLM server died (exit code {code}): {cause} (log: {self.server.log_path})"

    def log_cause(self) -> str | None:
        from .server import read_log, root_cause

        cause = root_cause(read_log(self.server.log_path))
        return f"{cause} (log: {self.server.log_path})" if cause else None


class _Launched(Endpoint):
    """What an injected launcher started: it knows its own liveness, death and description."""

    def __init__(self, started: Any, spec: DeploymentSpec, api_key: str | None):
        super().__init__(started.url, spec.name, api_key=api_key, spec=spec)
        self.started = started

    def alive(self) -> bool:
        return self.started.alive()

    def died_reason(self) -> str:
        return self.started.died_reason()

    def log_cause(self) -> str | None:
        cause = getattr(self.started, "log_cause", None)
        return cause() if callable(cause) else None

    def describe(self) -> "DeploymentInfo":
        return self.started.describe()

    @property
    def versions(self) -> dict[str, str]:
        return dict(getattr(self.started, "versions", None) or {})


@contextlib.contextmanager
def endpoint(spec_or_url: DeploymentSpec | str, *, log_dir: str | Path = Path("runs/logs"),
             api_key: str | None = None, served_name: str | None = None, launcher: Launcher | None = None,
             runs: DeploymentSpec | None = None, label: str | None = None) -> Iterator[Endpoint]:
    """The endpoint to send requests to, started for the block when given a spec.

    ``served_name``: for a URL, the model to ask for (default: the first ``/v1/models`` lists); for a
    spec, the name vLLM serves it under (default: the spec's ``name``). ``launcher``: starts a spec
    instead of ``VllmServer``. ``runs``/``label``: for a URL, what that endpoint runs and how the
    study labels it (a started spec is its own). A start that fails raises (``DeploymentError``
    from vLLM, ``EndpointError`` for a URL whose models cannot be listed)."""
    if isinstance(spec_or_url, str):
        name = served_name or first_model(spec_or_url, api_key)
        yield Endpoint(spec_or_url, name, api_key=api_key, spec=runs, label=label)
        return
    spec = spec_or_url
    if served_name and served_name != spec.name:  # checked as a spec's own name is: it is recorded and exported
        spec = spec.model_copy(update={"name": check_name(served_name)})
    with contextlib.ExitStack() as stack:
        if launcher is not None:
            started = stack.enter_context(launcher(spec, Path(log_dir)))
            ep = started if isinstance(started, Endpoint) else _Launched(started, spec, api_key)
        else:
            ep = VllmEndpoint(spec, log_dir, api_key)
            stack.enter_context(ep.server)  # starts it now; stops it however the block ends
        yield ep
