"""What the agent costs: GuideLLM against ``cartspec serve`` and against the same vLLM directly, interleaved.

One vLLM (the deployment ``cartspec serve`` runs by default, or ``--deployment baseline``: no speculation) and
one agent in front of it (``cartspec serve --upstream``, its own process, with its trace on as by default).
GuideLLM (vllm-project/guidellm 0.8) sends the same synthetic chat requests, streamed, of ``--prompt-tokens``
asking for exactly ``--output-tokens`` (``ignore_eos``, temperature 0, so both targets decode the same tokens),
``--requests`` per run at each concurrency, to the agent's ``/v1/chat/completions`` and to vLLM's, in rounds:
each round runs both targets, the one that goes first alternating round by round, so drift (a warming cache,
a neighbour's load) falls on both alike. Each round pairs its two runs: throughput agent/vLLM and p50 TTFT
agent − vLLM; the table gives the rounds' median and their range, and vLLM's own run-to-run spread, the noise
floor a difference must clear. Goals: the agent costs at most 3% of output throughput and adds at most 10 ms
to p50 TTFT.

On a small machine GuideLLM gets a core of its own and vLLM's compute threads the rest (``--client-cpus``), as
in ``guidellm_compare.py``; the agent and vLLM's API server keep every core, as ``cartspec serve`` runs them.
vLLM's random API key reaches the agent through an environment variable (``--upstream-key-env``) and GuideLLM
through its settings' environment (``GUIDELLM__SPEC__BACKEND__API_KEY``), never a command line; GuideLLM's
reports are checked not to hold it.

GuideLLM pins dependencies that clash with cartspec's (torch, transformers), so it lives in its own venv
(``python -m venv ~/.cache/cartspec/guidellm-venv && ~/.cache/cartspec/guidellm-venv/bin/pip install
guidellm``); ``--guidellm`` names its binary if elsewhere. Its prompts are tokenized with the served model's
own tokenizer, from its local directory (nothing is downloaded). Run it alone on the machine::

    flock /tmp/cartspec-heavy.lock .venv/bin/python benchmarks/agent_overhead.py --concurrency 1,8 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median
from typing import Any

DEFAULT_GUIDELLM = Path.home() / ".cache/cartspec/guidellm-venv/bin/guidellm"
GOAL_THROUGHPUT = 0.97  # agent/vLLM output throughput at least this
GOAL_TTFT_MS = 10.0  # p50 TTFT agent − vLLM at most this
KEY_VAR = "CARTSPEC_BENCH_UPSTREAM_KEY"  # vLLM's key, for the agent (named by --upstream-key-env)
GUIDELLM_KEY_VAR = "GUIDELLM__SPEC__BACKEND__API_KEY"  # GuideLLM's backend api_key, from its settings' environment
TARGETS = ("agent", "vllm")


# --- GuideLLM's report ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunMetrics:
    """One GuideLLM run (one benchmark of its JSON report): what the overhead table compares."""

    streams: int
    requests: int  # successful
    errors: int
    incomplete: int
    duration_s: float
    output_tokens: int
    output_throughput: float  # output tokens / s over the run
    ttft_p50_ms: float
    itl_p50_ms: float
    output_tokens_p50: float
    first_error: str | None = None


def _at(data: Any, *path: str | int, base: tuple[str | int, ...] = ()) -> Any:
    """``data[path[0]][path[1]]...``, or a ValueError naming the missing part from the report's root (``data``
    being found at ``base``)."""
    for i, key in enumerate(path):
        try:
            data = data[key]
        except (KeyError, IndexError, TypeError):
            full = base + path[: i + 1]
            where = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in full).lstrip(".")
            raise ValueError(f"not a GuideLLM 0.8 JSON report: it has no {where} (write one with guidellm run "
                             "--output kind=json,path=FILE)") from None
    return data


def parse_guidellm(report: dict[str, Any]) -> RunMetrics:
    """The metrics of a GuideLLM JSON report (``guidellm run --output kind=json``) holding one benchmark."""
    benches = _at(report, "benchmarks")
    if not isinstance(benches, list) or len(benches) != 1:
        n = len(benches) if isinstance(benches, list) else "no"
        raise ValueError(f"expected a GuideLLM report of one benchmark (one concurrency), found {n}")
    b, at = benches[0], ("benchmarks", 0)

    def ok(name: str, stat: str) -> float:
        return float(_at(b, "metrics", name, "successful", stat, base=at))

    totals = {k: int(_at(b, "metrics", "request_totals", k, base=at)) for k in ("successful", "errored", "incomplete")}
    duration = float(_at(b, "duration", base=at))
    tokens = ok("output_token_count", "total_sum")
    errored = _at(b, "requests", base=at).get("errored") or []
    first_error = next((r.get("info", {}).get("error") for r in errored if r.get("info", {}).get("error")), None)
    return RunMetrics(streams=int(_at(b, "config", "strategy", "streams", base=at)), requests=totals["successful"],
                      errors=totals["errored"], incomplete=totals["incomplete"], duration_s=duration,
                      output_tokens=int(tokens), output_throughput=tokens / duration if duration > 0 else 0.0,
                      ttft_p50_ms=ok("time_to_first_token_ms", "median"),
                      itl_p50_ms=ok("inter_token_latency_ms", "median"),
                      output_tokens_p50=ok("output_token_count", "median"), first_error=first_error)


# --- the overhead, from paired runs --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    target: str  # agent | vllm
    concurrency: int
    round: int
    metrics: RunMetrics


def _span(values: list[float]) -> dict[str, float]:
    return {"median": median(values), "min": min(values), "max": max(values)}


def overhead_rows(runs: list[Run]) -> list[dict[str, Any]]:
    """Per concurrency: each round's agent run against its vLLM run (throughput ratio, p50 TTFT and ITL
    differences), the rounds' median and range, vLLM's own spread across rounds, and whether the medians
    meet the goals. A round missing either target is left out."""
    rows = []
    for c in sorted({r.concurrency for r in runs}):
        pairs = []
        for rnd in sorted({r.round for r in runs if r.concurrency == c}):
            by = {r.target: r.metrics for r in runs if r.concurrency == c and r.round == rnd}
            if set(TARGETS) <= set(by):
                pairs.append((by["agent"], by["vllm"]))
        if not pairs:
            continue
        ratio = _span([a.output_throughput / v.output_throughput for a, v in pairs])
        ttft = _span([a.ttft_p50_ms - v.ttft_p50_ms for a, v in pairs])
        itl = _span([a.itl_p50_ms - v.itl_p50_ms for a, v in pairs])
        vllm_tput, vllm_ttft = [v.output_throughput for _, v in pairs], [v.ttft_p50_ms for _, v in pairs]
        rows.append({
            "concurrency": c, "rounds": len(pairs), "requests_per_run": pairs[0][1].requests,
            "output_throughput": {t: median(p[i].output_throughput for p in pairs) for i, t in enumerate(TARGETS)},
            "ttft_p50_ms": {t: median(p[i].ttft_p50_ms for p in pairs) for i, t in enumerate(TARGETS)},
            "itl_p50_ms": {t: median(p[i].itl_p50_ms for p in pairs) for i, t in enumerate(TARGETS)},
            "throughput_ratio": ratio, "ttft_p50_diff_ms": ttft, "itl_p50_diff_ms": itl,
            # vLLM against itself across rounds: the noise floor a difference must clear
            "vllm_spread": max(vllm_tput) / min(vllm_tput) - 1, "vllm_ttft_spread_ms": max(vllm_ttft) - min(vllm_ttft),
            "meets_throughput_goal": ratio["median"] >= GOAL_THROUGHPUT,
            "meets_ttft_goal": ttft["median"] <= GOAL_TTFT_MS,
        })
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'c':>3} {'rounds':>6} {'req/run':>7} | {'out tok/s agent':>15} {'vLLM':>7} {'agent/vLLM':>10} "
            f"{'(range)':>15} | {'TTFT p50 agent':>14} {'vLLM':>7} {'Δ ms':>7} {'(range)':>15} | "
            f"{'ITL p50 Δ ms':>12} | {'vLLM spread (tok/s, TTFT)':>25} | goals (≥{GOAL_THROUGHPUT:.0%}, ≤{GOAL_TTFT_MS:g} ms)")
    lines = [head, "-" * len(head)]
    for r in rows:
        ra, tt = r["throughput_ratio"], r["ttft_p50_diff_ms"]
        goals = (f"throughput {'met' if r['meets_throughput_goal'] else 'MISSED'}, "
                 f"TTFT {'met' if r['meets_ttft_goal'] else 'MISSED'}")
        ratio_range = f"{ra['min']:.3f}..{ra['max']:.3f}"
        ttft_range = f"{tt['min']:+.1f}..{tt['max']:+.1f}"
        spread = f"{r['vllm_spread']:.1%}, {r['vllm_ttft_spread_ms']:.1f} ms"
        lines.append(
            f"{r['concurrency']:>3} {r['rounds']:>6} {r['requests_per_run']:>7} | "
            f"{r['output_throughput']['agent']:>15.1f} {r['output_throughput']['vllm']:>7.1f} "
            f"{ra['median']:>10.3f} {ratio_range:>15} | "
            f"{r['ttft_p50_ms']['agent']:>14.1f} {r['ttft_p50_ms']['vllm']:>7.1f} {tt['median']:>+7.1f} "
            f"{ttft_range:>15} | {r['itl_p50_diff_ms']['median']:>+12.2f} | "
            f"{spread:>25} | {goals}")
    return "\n".join(lines)


# --- running GuideLLM ------------------------------------------------------------------------------------------
def scenario(url: str, model: str, tokenizer: str, streams: int, n: int, prompt_tokens: int, output_tokens: int,
             out: Path, per_chunk_usage: bool = False) -> dict[str, Any]:
    """GuideLLM's run settings (a scenario file, ``guidellm run -c``): streamed chat completions, greedy and of
    a fixed length, ``streams`` at a time until ``n`` requests are done. The API key is not in it.

    ``per_chunk_usage``: GuideLLM's own default asks for token usage on every chunk (vLLM's
    ``continuous_usage_stats``), which the agent does not pass on (it asks vLLM for usage once, at the end): with
    it, vLLM does more work per token when reached directly than behind the agent. Off, both paths ask the same."""
    usage = {"include_usage": True, "continuous_usage_stats": per_chunk_usage}
    return {"spec": {
        "backend": {"kind": "openai_http", "target": url, "model": model, "request_format": "/v1/chat/completions",
                    "stream": True, "extras": {"body": {"temperature": 0, "stream_options": usage}}},
        "profile": {"kind": "concurrent", "streams": streams},
        "constraints": [{"kind": "max_requests", "count": n}],
        "data": [{"kind": "synthetic_text", "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}],
        "tokenizer": {"kind": "hf_auto", "model": tokenizer},
        "outputs": [{"kind": "json", "path": str(out)}]}}


def run_guidellm(exe: str, settings: dict[str, Any], name: str, out_dir: Path, api_key: str | None,
                 cpus: set[int] | None, timeout_s: float) -> RunMetrics:
    """One GuideLLM run of ``settings`` (its scenario and console log beside its report in ``out_dir``)."""
    from cartspec.private_files import open_private, write_private

    scenario_path = write_private(out_dir / f"{name}.scenario.json", json.dumps(settings, indent=1))
    report_path = Path(settings["spec"]["outputs"][0]["path"])
    report_path.unlink(missing_ok=True)  # an earlier run's report must not pass for this one's
    env = {k: v for k, v in os.environ.items() if k not in (KEY_VAR, GUIDELLM_KEY_VAR)}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if api_key:
        env[GUIDELLM_KEY_VAR] = api_key
    with open_private(out_dir / f"{name}.log", "w") as log:
        proc = subprocess.run([exe, "run", "-c", str(scenario_path), "--disable-progress"], stdout=log,
                              stderr=subprocess.STDOUT, env=env, timeout=timeout_s,
                              preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    if proc.returncode != 0 or not report_path.exists():
        tail = (out_dir / f"{name}.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"guidellm failed (exit {proc.returncode}); its log {out_dir / f'{name}.log'} ends:\n{tail}")
    text = report_path.read_text()
    if api_key and api_key in text:  # GuideLLM masks SecretStr fields; a version that did not must not pass
        report_path.unlink()
        raise RuntimeError(f"GuideLLM wrote the API key into its report {report_path} (deleted): do not use this "
                           "GuideLLM version with a keyed server")
    metrics = parse_guidellm(json.loads(text))
    if metrics.errors or metrics.incomplete or metrics.requests == 0:
        raise RuntimeError(f"{name}: {metrics.requests} requests answered, {metrics.errors} errors, "
                           f"{metrics.incomplete} incomplete; first error: {metrics.first_error} (report {report_path})")
    return metrics


async def _warm(url: str, model: str, api_key: str | None, streams: int, prompt: str, output_tokens: int) -> None:
    import httpx

    body = {"model": model, "stream": True, "max_tokens": output_tokens, "ignore_eos": True, "temperature": 0,
            "messages": [{"role": "user", "content": prompt}]}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def one(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            r.raise_for_status()
            async for _ in r.aiter_lines():
                pass

    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(one(client) for _ in range(streams)))


def warm(url: str, model: str, api_key: str | None, streams: int, prompt_tokens: int, output_tokens: int) -> None:
    """``streams`` streamed requests at once through ``url``, answered and discarded: the engine's batch shapes
    and the agent's path are warm before the first timed run of a concurrency."""
    prompt = " ".join(["market"] * prompt_tokens)  # about one token a word for this tokenizer: length is what counts
    asyncio.run(_warm(url, model, api_key, streams, prompt, output_tokens))


# --- the benchmark ------------------------------------------------------------------------------------------------
def _client_cpus(choice: str) -> set[int] | None:
    n_cpu = os.cpu_count() or 1
    if choice == "auto":
        return {n_cpu - 1} if 1 < n_cpu <= 8 else None
    if choice == "none":
        return None
    return {int(x) for x in choice.split(",")}


def _deployment(kind: str, model: str):
    from cartspec.agent.defaults import default_spec

    head = "none" if kind == "baseline" else "auto"
    return default_spec(model, head, 3, enforce_eager=False)


def _machine() -> dict[str, Any]:
    import platform

    from cartspec.machine import cpu_features, hardware

    return {"hardware": hardware(), "cpu_features": list(cpu_features()), "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine()}


def _requests(arg: str | None, c: int) -> int:
    """Requests per run at concurrency ``c``: ``--requests`` (N, or C:N,C:N), else 8 at one stream and three
    waves (3 × c) above."""
    if arg:
        if ":" not in arg:
            return int(arg)
        per = dict(tuple(int(x) for x in part.split(":")) for part in arg.split(","))
        if c in per:
            return per[c]
    return max(8, 3 * c)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="commerce", help="commerce | base | PATH: the target vLLM serves")
    ap.add_argument("--deployment", choices=("default", "baseline"), default="default",
                    help="default: what `cartspec serve` deploys (the hybrid drafter on the bundled model); "
                         "baseline: the same target without speculation")
    ap.add_argument("--upstream", help="an already running OpenAI-compatible server instead of starting vLLM "
                    "(then --tokenizer is required)")
    ap.add_argument("--upstream-key-env", metavar="VAR", help="with --upstream: the variable holding its API key")
    ap.add_argument("--served-name", help="with --upstream: its model (default: the first it lists)")
    ap.add_argument("--tokenizer", help="a local model directory whose tokenizer builds GuideLLM's prompts "
                    "(default: the served model's)")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of both targets at each concurrency")
    ap.add_argument("--requests", default=None, help="requests per GuideLLM run: N, or per concurrency as "
                    "C:N,C:N (default: 8 at one stream, 3 × concurrency above)")
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--output-tokens", type=int, default=60)
    ap.add_argument("--per-chunk-usage", action="store_true", help="let GuideLLM ask for usage on every chunk, "
                    "its default, which only the direct path then computes (the agent asks vLLM for it once)")
    ap.add_argument("--client-cpus", default="auto", help="cores for GuideLLM; vLLM computes on the others. "
                    "auto: the last core when the machine has 2 to 8; none: no pinning; or a list (0,1)")
    ap.add_argument("--guidellm", default=shutil.which("guidellm") or str(DEFAULT_GUIDELLM))
    ap.add_argument("--run-timeout", type=float, default=900, help="seconds one GuideLLM run may take")
    ap.add_argument("--out", type=Path, default=Path("runs/benchmarks/agent-overhead"))
    a = ap.parse_args()
    if not Path(a.guidellm).exists():
        sys.exit(f"no GuideLLM at {a.guidellm}: install it in its own venv (see this script's docstring) or pass "
                 "--guidellm PATH")
    if a.upstream and not a.tokenizer:
        sys.exit("--upstream needs --tokenizer DIR (a local model directory with the served model's tokenizer)")

    from contextlib import nullcontext

    from cartspec.agent.config import AgentConfig
    from cartspec.agent.process import AgentProcess
    from cartspec.private_files import private_dir
    from cartspec.serving.endpoint import api_key_from_env, first_model
    from cartspec.serving.server import VllmServer
    from cartspec.serving.urls import redact_url

    out = private_dir(a.out)  # vLLM's and the agent's logs, GuideLLM's reports (the servers' replies)
    client_cpus = _client_cpus(a.client_cpus)
    concurrencies = [int(x) for x in a.concurrency.split(",")]
    server_env: dict[str, str] = {}  # vLLM's compute threads off GuideLLM's cores
    if client_cpus and not a.upstream:
        rest = sorted(set(range(os.cpu_count() or 1)) - client_cpus)
        server_env = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, rest)), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    if a.upstream:
        server, url, api_key, tokenizer = None, a.upstream.rstrip("/"), api_key_from_env(a.upstream_key_env), a.tokenizer
        name, label, spec = a.served_name or first_model(url, api_key), "external", None
    else:
        from cartspec.model.registry import resolve_model

        spec = _deployment(a.deployment, a.model)
        spec = spec.model_copy(update={"env": {**spec.env, **server_env}})
        server = VllmServer(spec, log_dir=out / "logs")
        url, api_key, name, label = server.url, server.api_key, spec.name, spec.label
        tokenizer = a.tokenizer or str(resolve_model(a.model))
    print(f"vLLM: {'at ' + redact_url(url) if a.upstream else 'starting ' + label + ' (a minute or two on CPU)'}",
          flush=True)
    runs: list[Run] = []
    names: list[str] = []  # each run's files in --out: NAME.json (GuideLLM's report), NAME.scenario.json, NAME.log
    t_start = time.monotonic()
    with server or nullcontext():
        if api_key:
            os.environ[KEY_VAR] = api_key  # the agent's process reads it from there (--upstream-key-env)
        serve_args = ["--upstream", url, "--served-name", name, "--label", label]
        if api_key:
            serve_args += ["--upstream-key-env", KEY_VAR]
        agent = AgentProcess(AgentConfig(trace_path=out / "agent-trace.jsonl"), serve_args, out / "agent")
        with agent:
            if client_cpus:  # after both servers started: they keep every core; GuideLLM and warm-ups run here
                os.sched_setaffinity(0, client_cpus)
                print(f"GuideLLM pinned to cores {sorted(client_cpus)}; vLLM computes on "
                      f"{server_env.get('VLLM_CPU_OMP_THREADS_BIND', 'its own cores')}", flush=True)
            urls = {"agent": (agent.url, None), "vllm": (url, api_key)}
            for c in concurrencies:
                warm(agent.url, name, None, c, a.prompt_tokens, a.output_tokens)
                warm(url, name, api_key, c, a.prompt_tokens, a.output_tokens)
            for rnd in range(a.rounds):
                for c in concurrencies:
                    n = _requests(a.requests, c)
                    for target in (TARGETS if rnd % 2 == 0 else TARGETS[::-1]):
                        run_name = f"c{c}-r{rnd}-{target}"
                        target_url, key = urls[target]
                        settings = scenario(target_url, name, tokenizer, c, n, a.prompt_tokens, a.output_tokens,
                                            out / f"{run_name}.json", a.per_chunk_usage)
                        m = run_guidellm(a.guidellm, settings, run_name, out, key, client_cpus, a.run_timeout)
                        runs.append(Run(target, c, rnd, m))
                        names.append(run_name)
                        print(f"  round {rnd + 1}/{a.rounds} c={c} {target:5s}: {m.requests} requests, "
                              f"{m.output_throughput:.1f} out tok/s, TTFT p50 {m.ttft_p50_ms:.1f} ms, ITL p50 "
                              f"{m.itl_p50_ms:.1f} ms, output tokens p50 {m.output_tokens_p50:.0f}", flush=True)
        versions = server.info().versions if server else {}
    rows = overhead_rows(runs)
    print()
    print(table(rows))
    guidellm_version = subprocess.run([a.guidellm, "--version"], capture_output=True, text=True).stdout.strip()
    result = {
        "benchmark": "agent_overhead", "command": " ".join(sys.argv), "machine": _machine(),
        "deployment": {"kind": "external" if a.upstream else a.deployment, "label": label, "served_name": name,
                       "spec": spec.model_dump(mode="json") if spec else None,
                       "versions": versions},
        "guidellm": guidellm_version, "client_cpus": sorted(client_cpus) if client_cpus else None,
        "settings": {"concurrency": concurrencies, "rounds": a.rounds, "prompt_tokens": a.prompt_tokens,
                     "output_tokens": a.output_tokens, "requests": {c: _requests(a.requests, c) for c in concurrencies},
                     "temperature": 0, "stream": True, "per_chunk_usage": a.per_chunk_usage},
        "goals": {"throughput_ratio_min": GOAL_THROUGHPUT, "ttft_p50_diff_ms_max": GOAL_TTFT_MS},
        "wall_s": round(time.monotonic() - t_start, 1),
        "guidellm_command": f"{a.guidellm} run -c NAME.scenario.json --disable-progress",
        "rows": rows, "runs": [{"name": n, "target": r.target, "round": r.round, **asdict(r.metrics)}
                               for n, r in zip(names, runs)],
    }
    path = out / "agent_overhead.json"
    path.write_text(json.dumps(result, indent=2))
    met = all(r["meets_throughput_goal"] and r["meets_ttft_goal"] for r in rows)
    print(f"\nmachine: {result['machine']['hardware']}, {result['machine']['cpus']} cores; "
          f"{'every goal met' if met else 'goals NOT all met'} -> {path}")


if __name__ == "__main__":
    from cartspec.serving.server import install_signal_handlers

    install_signal_handlers()  # killed (SIGTERM/SIGHUP), it still stops the vLLM and the agent it started
    main()
