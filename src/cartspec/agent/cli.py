"""``cartspec serve``: the target deployment(s) and the agent, in one command.

A shell: what it deploys by default is ``agent.defaults``, what keeps the vLLMs up is
``agent.supervisor``, what goes behind the agent is ``agent.wiring``, and an adaptive schedule comes
from the tuning cache (``bench.sweep.serving_schedule``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console

from ..cli_options import dtype_option, enforce_eager_option, force_option, model_option
from ..drafting.length import STOP_P
from .defaults import DEFAULT_DRAFT

if TYPE_CHECKING:
    from ..serving.spec import DeploymentSpec

console = Console(stderr=True)


def _warn(message: str) -> None:
    console.print(f"[yellow]{message}[/]")


def serve(
    model: str = model_option("target"),
    head: str = typer.Option("auto", help="EAGLE-3 head: auto (domain when present) | none | domain | generic | "
                             "NAME[@vN] (a registered head, `cartspec heads`) | PATH"),
    gamma: int = typer.Option(3, min=1, max=16, help="γ, draft tokens per step"),
    draft: Optional[str] = typer.Option(None, help="how it drafts: eagle3 | hybrid (EAGLE-3 + prompt lookup of "
                                        "the shopper's words) | schema (from the reply's JSON schema and the "
                                        "prompt, no head); default: hybrid, the one measured best for the "
                                        "bundled model (eagle3 with --adaptive, whose schedule is the head's); "
                                        "schema for a model without a head"),
    pointer: Optional[str] = typer.Option(None, help="the hybrid's pointer trained for --model (the directory "
                                          "`cartspec draft pointer` wrote): the hybrid drafts with rule pointer "
                                          "(default: the bundled pointer where it was trained for --model, else "
                                          "the head alone)"),
    draft_stop: Optional[float] = typer.Option(
        None, "--draft-stop", help="with --draft eagle3 or hybrid: draft length per request, each request's draft "
                                   "cut where the head's path probability falls below this (a hybrid's only "
                                   f"before its first copied token; {STOP_P:g} is what the study's eagle3:HEAD:γ:stop "
                                   "and hybrid:HEAD:γ:stop measure); --gamma is then the longest draft"),
    adaptive: bool = typer.Option(False, "--adaptive", help="γ per batch size, tuned for this machine: the "
                                  "schedule cached by an earlier study or tune, else a calibration first (a few "
                                  "minutes); replaces --gamma"),
    spec_file: Optional[Path] = typer.Option(None, "--spec", help="a DeploymentSpec file (YAML/TOML/JSON); "
                                             "replaces --model/--head/--gamma"),
    upstream: Optional[str] = typer.Option(None, help="use this running OpenAI-compatible server; start no vLLM"),
    served_name: str = typer.Option("cartspec", help="model name on --upstream"),
    upstream_key_env: Optional[str] = typer.Option(None, "--upstream-key-env", metavar="VAR", help="the "
                                                   "environment variable holding the API key --upstream needs "
                                                   "(sent as 'Authorization: Bearer KEY'; default: "
                                                   "CARTSPEC_UPSTREAM_KEY when set)"),
    upstream_key: Optional[str] = typer.Option(None, "--upstream-key", hidden=True,
                                               help="deprecated: the key in the process list; use --upstream-key-env"),
    label: str = typer.Option("external", help="what runs on --upstream (e.g. eagle3-domain-g3, or baseline "
                              "for no speculation), for headers and metrics"),
    plain: bool = typer.Option(False, "--plain", help="also start a plain deployment (no speculation) of the same "
                               "target beside the speculative one, so the router and the acceptance fallback "
                               "have a second target. Both vLLMs share this machine's cores (2 on the study "
                               "machine) and memory (a KV cache each): each decodes slower than alone, start-up "
                               "takes about twice as long. With --upstream: a plain deployment of --model"),
    plain_upstream: Optional[str] = typer.Option(None, help="use this running server as the plain deployment "
                                                 "(no speculation); start none"),
    plain_served_name: str = typer.Option("cartspec", help="model name on --plain-upstream"),
    plain_upstream_key_env: Optional[str] = typer.Option(None, "--plain-upstream-key-env", metavar="VAR",
                                                         help="the environment variable holding the API key "
                                                         "--plain-upstream needs (default: "
                                                         "CARTSPEC_PLAIN_UPSTREAM_KEY when set)"),
    router: Optional[bool] = typer.Option(None, "--router/--no-router", help="route by expected reply length "
                                          "and load between the two deployments (default: on with two, unless "
                                          "--config sets router.enabled)"),
    fallback: Optional[bool] = typer.Option(None, "--fallback/--no-fallback", help="acceptance fallback: route "
                                            "to plain while the rolling acceptance is under fallback.threshold, "
                                            "probing the speculative one (default: on with two deployments)"),
    admission_max_wait: Optional[float] = typer.Option(None, "--admission-max-wait", metavar="S",
                                                       help="admission control: answer 503 with Retry-After, at "
                                                       "once, when a request's expected latency (Little's law "
                                                       "over recent completions) is over S seconds; cache hits "
                                                       "and an idle deployment always pass; 0: off (default: "
                                                       "--config's admission, else off)"),
    canary_head: Optional[str] = typer.Option(None, "--canary-head", metavar="REF", help="canary: try this "
                                              "head (NAME@vNNNN, NAME for its registry's newest candidate, or a "
                                              "head directory) on a share of the speculative traffic: a second "
                                              "vLLM of the same target with the head replaced; promoted in the "
                                              "registry when it drafts better, rejected when acceptance falls "
                                              "or errors rise (default: --config's canary.head)"),
    canary_upstream: Optional[str] = typer.Option(None, "--canary-upstream", metavar="URL", help="canary: this "
                                                  "running server serves the candidate (start none); with "
                                                  "--canary-head saying which head it drafts with"),
    canary_served_name: str = typer.Option("cartspec", help="model name on --canary-upstream"),
    canary_key_env: Optional[str] = typer.Option(None, "--canary-key-env", metavar="VAR", help="the environment "
                                                 "variable holding the API key --canary-upstream needs (default: "
                                                 "CARTSPEC_CANARY_KEY when set)"),
    canary_key: Optional[str] = typer.Option(None, "--canary-key", hidden=True,
                                             help="deprecated: the key in the process list; use --canary-key-env"),
    canary_share: Optional[float] = typer.Option(None, "--canary-share", min=0.001, max=0.5,
                                                 help="share of the speculative traffic the candidate gets: "
                                                 "every k-th request, k = 1/share (default: --config's "
                                                 "canary.share, else 0.1)"),
    record_traffic: Optional[Path] = typer.Option(None, "--record-traffic", metavar="DIR", help="record each "
                                                  "answered request (messages, the target's reply, deployment, "
                                                  "head version, acceptance, latency) to rotating JSONL files "
                                                  "in DIR, for `cartspec draft refresh` (default: --config's "
                                                  "traffic.dir, else off). Masked before writing, by one "
                                                  "pseudonym per value across the record: e-mails, phone "
                                                  "numbers, card numbers, IBANs, US SSNs, Spanish, Italian, "
                                                  "French and Indian national ids, order ids, and JSON fields "
                                                  "such as order_id or email. NOT masked: names, street "
                                                  "addresses, anything else (add --redact)"),
    redact: list[str] = typer.Option([], "--redact", metavar="REGEX", help="also mask what this regex matches "
                                     "in recorded traffic (repeatable; group 'v': only that part), e.g. "
                                     "customer names; what --record-traffic lists is masked anyway"),
    config: Optional[Path] = typer.Option(None, help="an AgentConfig file (YAML/TOML/JSON)"),
    host: Optional[str] = typer.Option(None, help="bind address (default 127.0.0.1)"),
    port: Optional[int] = typer.Option(None, help="agent port (default 8080)"),
    api_key_env: Optional[str] = typer.Option(None, "--api-key-env", metavar="VAR", help="the environment "
                                              "variable holding the key the agent requires on /v1/* and /metrics "
                                              "('Authorization: Bearer KEY' or 'X-API-Key'; default: "
                                              "CARTSPEC_API_KEY when set, else --config's api_key)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", hidden=True,
                                          help="deprecated: the key in the process list; use --api-key-env"),
    trace: Optional[Path] = typer.Option(None, help="JSONL trace, one line per request "
                                         "[default: --config's trace_path, else runs/agent/trace.jsonl]"),
    structured: Optional[bool] = typer.Option(None, "--structured/--no-structured",
                                              help="constrain replies with vLLM structured outputs (default on)"),
    log_dir: Path = typer.Option(Path("runs/logs"), help="vLLM logs"),
    enforce_eager: bool = enforce_eager_option(),
    dtype: str = dtype_option(note="; a --spec file's own wins unless this is set"),
    restart: bool = typer.Option(True, help="restart vLLM if it dies"),
    force: bool = force_option("serve a head"),
) -> None:
    """Serve a model behind the agent: OpenAI's API (/v1/chat/completions, streamed or not, /v1/completions,
    /v1/models) for any model, and the commerce endpoints (/v1/search, /v1/support) for the commerce model, on a
    vLLM deployment, or on two (--plain): speculative and plain, with the router and the acceptance fallback;
    with a canary of a candidate head beside it (--canary-head) and traffic recording (--record-traffic).

    Each vLLM started here requires a random key of its own, which only the agent holds. Keys are read from
    environment variables that the --*-key-env options name, and are never logged, traced or shown."""
    import contextlib

    import uvicorn

    from ..model.convert import ModelNotFound
    from ..serving.endpoint import Endpoint, EndpointError, endpoint
    from ..serving.server import DeploymentError, VllmServer
    from ..serving.spec import DeploymentSpec
    from . import AgentConfig, create_app
    from .defaults import DRAFTS, adaptive_request, default_spec
    from .supervisor import Keeper
    from .wiring import apply_flags, build_upstreams

    try:  # before anything starts: a key asked for and missing is a usage error
        api_key = _key("--api-key", api_key, api_key_env, "CARTSPEC_API_KEY")
        upstream_key = _key("--upstream-key", upstream_key, upstream_key_env, "CARTSPEC_UPSTREAM_KEY")
        plain_key = _key(None, None, plain_upstream_key_env, "CARTSPEC_PLAIN_UPSTREAM_KEY")
        canary_key = _key("--canary-key", canary_key, canary_key_env, "CARTSPEC_CANARY_KEY")
    except ValueError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from None
    cfg = AgentConfig.load(config) if config else AgentConfig()
    overrides = {k: v for k, v in dict(host=host, port=port, api_key=api_key, trace_path=trace,
                                       structured_outputs=structured).items() if v is not None}
    cfg = cfg.model_copy(update=overrides)
    if record_traffic is not None or redact:
        from pydantic import ValidationError

        traffic = cfg.traffic.model_dump()
        if record_traffic is not None:
            traffic["dir"] = record_traffic
        traffic["redact_patterns"] = [*traffic["redact_patterns"], *redact]
        try:
            cfg = cfg.model_copy(update={"traffic": type(cfg.traffic).model_validate(traffic)})
        except ValidationError as exc:
            console.print(f"[bold red]error:[/] --redact: {exc.errors()[0]['msg'].removeprefix('Value error, ')}")
            raise typer.Exit(2) from None
        if cfg.traffic.dir is None:
            _warn("--redact without --record-traffic (or traffic.dir in --config): nothing is recorded")
    canary_head = canary_head or cfg.canary.head
    if config is None and trace is None:  # a config file decides for itself (trace_path: null = no trace)
        cfg = cfg.model_copy(update={"trace_path": Path("runs/agent/trace.jsonl")})
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and not cfg.api_key:
        console.print(f"[yellow]binding {cfg.host} without an API key: anyone who reaches it can use it[/]")

    _log_to_stderr()
    servers: list[VllmServer] = []  # the vLLMs started here, for the keeper
    keeper = None
    # Owns every endpoint opened below: the vLLMs started here stop on the way out, however it goes.
    endpoints = contextlib.ExitStack()

    def open_endpoint(what: DeploymentSpec | str, name: str | None, key: str | None) -> Endpoint:
        if isinstance(what, DeploymentSpec):
            console.print(f"starting vLLM: {what.model}, {what.label} (a minute or two on CPU; log {log_dir})")
        ep = endpoints.enter_context(endpoint(what, log_dir=log_dir, served_name=name, api_key=key))
        if ep.server is not None:
            servers.append(ep.server)
            console.print(f"vLLM ready at {ep.url} ({ep.versions.get('vllm')}, {ep.label}; log {ep.server.log_path})")
        return ep

    try:
        try:
            spec = None
            if canary_head:  # a candidate that does not resolve fails before anything starts
                from .wiring import candidate_head

                candidate_head(canary_head)
            if spec_file:
                spec = DeploymentSpec.load(spec_file)
                spec = spec.model_copy(update={"dtype": dtype}) if dtype != "auto" else spec
            elif not upstream:
                draft = draft or ("eagle3" if adaptive else DEFAULT_DRAFT)
                if draft not in DRAFTS:
                    raise ValueError(f"--draft must be {' or '.join(DRAFTS)}, not {draft!r}")
                if pointer and draft != "hybrid":
                    raise ValueError("--pointer is a setting of --draft hybrid")
                spec = default_spec(model, head, gamma, enforce_eager, dtype, draft, say=_warn, pointer=pointer,
                                    draft_stop=draft_stop)
                if adaptive:
                    spec = adaptive_schedule(adaptive_request(spec))
            elif canary_head and not canary_upstream:  # the candidate: --model/--head/--gamma, head swapped
                spec = default_spec(model, head, gamma, enforce_eager, dtype, draft or DEFAULT_DRAFT, say=_warn)
            elif plain and not plain_upstream:  # only its target matters: it runs without speculation
                spec = default_spec(model, "none", gamma, enforce_eager, dtype, say=_warn)
            if spec is not None and not upstream:  # a head trained for another model: refuse (or --force)
                from ..model.registry import check_spec_head

                check_spec_head(spec, force=force, warn=lambda m: console.print(f"[bold yellow]{m}[/]"))
            if canary_head and not canary_upstream and spec is not None:  # the candidate's head, pinned the same
                from ..model.registry import check_spec_head
                from .wiring import canary_spec, candidate_head

                check_spec_head(canary_spec(spec, candidate_head(canary_head)[0]), force=force,
                                warn=lambda m: console.print(f"[bold yellow]{m}[/]"))
            ups = build_upstreams(spec, open_endpoint, upstream=upstream, served_name=served_name, label=label,
                                  upstream_key=upstream_key, plain=plain, plain_upstream=plain_upstream,
                                  plain_served_name=plain_served_name, plain_key=plain_key, canary_head=canary_head,
                                  canary_upstream=canary_upstream, canary_served_name=canary_served_name,
                                  canary_key=canary_key)
        except (DeploymentError, EndpointError, ModelNotFound, FileNotFoundError, ValueError) as exc:
            console.print(f"[bold red]error:[/] {exc}")
            raise typer.Exit(2) from None
        if servers and restart:
            keeper = Keeper(servers, say=_warn)
            keeper.start()
        cfg = apply_flags(cfg, ups, router=router, fallback=fallback, admission_max_wait=admission_max_wait,
                          canary_share=canary_share)
        try:
            app = create_app(cfg, ups)
        except OSError as exc:  # the traffic directory cannot be made
            console.print(f"[bold red]error:[/] {exc}")
            raise typer.Exit(2) from None
        agent = app.state.agent
        cn = agent.canary
        console.print("targets: " + ", ".join(f"{t} {u.label} at {u.shown_url}" for t, u in ups.items())
                      + f"; router {'on (' + cfg.router.policy + ')' if cfg.router.enabled else 'off'}"
                      + f"; acceptance fallback {'on' if agent.fallback else 'off'}"
                      + f"; admission {f'on (max wait {cfg.admission.max_wait_s:g}s)' if agent.admission else 'off'}"
                      + (f"; canary on (1 in {cn.every} speculative requests to {cn.candidate or 'the candidate'}"
                         f", against {cn.current or 'the current head'})" if cn else "")
                      + (f"; recording traffic to {cfg.traffic.dir}" if agent.traffic else ""))
        base = f"http://{cfg.host}:{cfg.port}"
        auth = f" -H \"authorization: Bearer ${api_key_env or 'CARTSPEC_API_KEY'}\"" if cfg.api_key else ""
        console.print(f"[green]agent on {base}[/] (OpenAI API at {base}/v1, model '{agent.model_id}')  try:\n"
                      f"  curl -s {base}/v1/chat/completions -H 'content-type: application/json'{auth} -d "
                      f"'{{\"model\": \"{agent.model_id}\", \"messages\": [{{\"role\": \"user\", \"content\": "
                      "\"Hello!\"}]}'\n"
                      f"  curl -s {base}/v1/search -H 'content-type: application/json'{auth} "
                      "-d '{\"query\": \"red trail runners under $120, size 10, no nike\"}'  (the commerce model)")
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", timeout_graceful_shutdown=10)
    finally:
        if keeper:
            keeper.stopping.set()  # first: a keeper still running would restart what is stopped next
        endpoints.close()


def _key(value_flag: str | None, value: str | None, env_flag: str | None, default_var: str) -> str | None:
    """A key from the variable ``env_flag`` names, else from the deprecated ``value_flag`` (with a warning:
    a key on the command line is in the process list and the shell's history), else from ``default_var`` when
    set. Raises ``MissingApiKey`` (a ValueError) for a named variable that holds none."""
    import os

    from ..serving.endpoint import api_key_from_env

    if env_flag:
        return api_key_from_env(env_flag)
    if value:
        _warn(f"{value_flag} KEY is deprecated: any local user sees the key in the process list; "
              f"export a variable and pass {value_flag}-env VAR instead")
        return value
    return os.environ.get(default_var, "").strip() or None


def adaptive_schedule(spec: "DeploymentSpec") -> "DeploymentSpec":
    """An adaptive ``spec`` (``defaults.adaptive_request``) with the γ-per-batch-size schedule tuned for this
    machine: the one a study or ``cartspec tune`` cached, else a calibration run into the cache first."""
    from ..bench.sweep import serving_schedule

    return serving_schedule(spec, log=lambda m: console.print(m))


def _log_to_stderr() -> None:
    """Fallback switches are logged at INFO (recovery) and WARNING: show both, once, beside uvicorn's."""
    logger = logging.getLogger("cartspec.agent")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
