"""``cartspec serve``: the target deployment and the agent, in one command."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console

if TYPE_CHECKING:
    from ..serving.spec import DeploymentSpec

console = Console(stderr=True)


def default_spec(model: str, head: str, gamma: int, enforce_eager: bool) -> "DeploymentSpec":
    """The deployment ``serve`` runs: the commerce target; EAGLE-3 with the domain
    head at γ=3 when the head is there (the study's best γ), otherwise no speculation."""
    from ..model.convert import ModelNotFound
    from ..model.registry import resolve_head
    from ..serving.spec import DeploymentSpec, Speculative

    speculative = Speculative()
    if head != "none":
        try:
            resolve_head("domain" if head == "auto" else head)
            speculative = Speculative(method="eagle3", model="domain" if head == "auto" else head,
                                      num_speculative_tokens=gamma)
        except ModelNotFound as exc:
            if head != "auto":
                raise
            console.print(f"[yellow]no domain head ({exc}); serving without speculation[/]")
    # Per-request timing metrics give the trace vLLM's own queue time and TTFT.
    return DeploymentSpec(model=model, speculative=speculative, enforce_eager=enforce_eager,
                          engine_args=["--enable-per-request-metrics"])


class Keeper(threading.Thread):
    """Restarts a deployment that died (crash, OOM kill); the agent answers 503
    meanwhile and follows it back up through its health probe."""

    def __init__(self, server, every_s: float = 2.0):
        super().__init__(daemon=True, name="vllm-keeper")
        self.server, self.every_s = server, every_s
        self.stopping = threading.Event()
        self.restarts = 0

    def run(self) -> None:
        from ..serving.server import DeploymentError

        backoff = 5.0
        while not self.stopping.wait(self.every_s):
            if self.server.alive():
                backoff = 5.0
                continue
            console.print(f"[yellow]vLLM exited; restarting it (log: {self.server.log_path})[/]")
            try:
                self.server.restart()
                self.restarts += 1
                console.print(f"[green]vLLM back at {self.server.url}[/]")
            except DeploymentError as exc:
                if self.stopping.is_set():
                    return
                console.print(f"[red]restart failed: {exc.reason}; next try in {backoff:.0f}s[/]")
                self.stopping.wait(backoff)
                backoff = min(backoff * 2, 120.0)


def serve(
    model: str = typer.Option("commerce", help="target: commerce | base | PATH to an HF directory"),
    head: str = typer.Option("auto", help="EAGLE-3 head: auto (domain when present) | none | domain | generic | PATH"),
    gamma: int = typer.Option(3, min=1, max=16, help="γ, draft tokens per step"),
    spec_file: Optional[Path] = typer.Option(None, "--spec", help="a DeploymentSpec file (YAML/TOML/JSON); "
                                             "replaces --model/--head/--gamma"),
    upstream: Optional[str] = typer.Option(None, help="use this running OpenAI-compatible server; start no vLLM"),
    served_name: str = typer.Option("cartspec", help="model name on --upstream"),
    label: str = typer.Option("external", help="what runs on --upstream (e.g. eagle3-domain-g3, or baseline "
                              "for no speculation), for headers and metrics"),
    config: Optional[Path] = typer.Option(None, help="an AgentConfig file (YAML/TOML/JSON)"),
    host: Optional[str] = typer.Option(None, help="bind address (default 127.0.0.1)"),
    port: Optional[int] = typer.Option(None, help="agent port (default 8080)"),
    api_key: Optional[str] = typer.Option(None, envvar="CARTSPEC_API_KEY", help="require this key on /v1/*"),
    trace: Optional[Path] = typer.Option(None, help="JSONL trace, one line per request "
                                         "[default: --config's trace_path, else runs/agent/trace.jsonl]"),
    structured: Optional[bool] = typer.Option(None, "--structured/--no-structured",
                                              help="constrain replies with vLLM structured outputs (default on)"),
    log_dir: Path = typer.Option(Path("runs/logs"), help="vLLM logs"),
    enforce_eager: bool = typer.Option(False, help="skip torch.compile: faster start, slower decode"),
    restart: bool = typer.Option(True, help="restart vLLM if it dies"),
) -> None:
    """Serve the commerce agent (search parameters, support replies) on a vLLM deployment."""
    import uvicorn

    from ..model.convert import ModelNotFound
    from ..serving.server import DeploymentError, VllmServer
    from ..serving.spec import DeploymentSpec
    from . import AgentConfig, Upstream, Upstreams, create_app

    cfg = AgentConfig.load(config) if config else AgentConfig()
    overrides = {k: v for k, v in dict(host=host, port=port, api_key=api_key, trace_path=trace,
                                       structured_outputs=structured).items() if v is not None}
    cfg = cfg.model_copy(update=overrides)
    if config is None and trace is None:  # a config file decides for itself (trace_path: null = no trace)
        cfg = cfg.model_copy(update={"trace_path": Path("runs/agent/trace.jsonl")})
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and not cfg.api_key:
        console.print(f"[yellow]binding {cfg.host} without an API key: anyone who reaches it can use it[/]")

    server = keeper = None
    try:
        if upstream:
            up = Upstream(upstream, model=served_name, label=label, info={"url": upstream})
        else:
            try:
                spec = DeploymentSpec.load(spec_file) if spec_file else default_spec(model, head, gamma,
                                                                                     enforce_eager)
                server = VllmServer(spec, log_dir=log_dir)
                console.print(f"starting vLLM: {spec.model}, {spec.label} (a minute or two on CPU; "
                              f"log {server.log_path})")
                server.start()
            except (DeploymentError, ModelNotFound, FileNotFoundError, ValueError) as exc:
                console.print(f"[bold red]error:[/] {exc}")
                raise typer.Exit(2) from None
            info = server.info()
            up = Upstream(server.url, model=spec.name, label=spec.label,
                          info={"spec": info.spec, "versions": info.versions})
            console.print(f"vLLM ready at {server.url} ({info.versions.get('vllm')}, {spec.label})")
            if restart:
                keeper = Keeper(server)
                keeper.start()
        # A deployment without speculation is the plain target (spec label "baseline").
        app = create_app(cfg, Upstreams(plain=up) if up.label == "baseline" else Upstreams(speculative=up))
        console.print(f"[green]agent on http://{cfg.host}:{cfg.port}[/]  try:\n"
                      f"  curl -s http://{cfg.host}:{cfg.port}/v1/search -H 'content-type: application/json' "
                      "-d '{\"query\": \"red trail runners under $120, size 10, no nike\"}'")
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", timeout_graceful_shutdown=10)
    finally:
        if keeper:
            keeper.stopping.set()
        if server:
            server.stop()
