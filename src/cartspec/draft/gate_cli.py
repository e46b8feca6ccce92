"""``cartspec draft gate``: measure a candidate head version against the current one on held-out recent traffic.

The held-out requests are the most recent share of the recorded traffic (deduplicated), less any request
the candidate may have trained on: when its provenance records its training window
(``provenance["data_window"]["until"]``), records at or before that time, and later records of the same
request, are left out. Both versions are measured one after the other in vLLM at γ (``measure_vllm``, T=0)
with the drafter ``serve`` deploys (``--method``; default ``gate_method``: the hybrid, each version with its
own pointer, where one is trained for the target or kept with a version); each report is written beside the
candidate version as soon as it is measured (a rerun with the same requests, method, γ, target, heads and
pointers reuses it). The decision (``draft.gate``) goes to the version's gate.json
(``HeadRegistry.write_gate``) and to ``--out``. The command exits 0 whatever the decision: the decision is
its output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from ..cli_options import dtype_option, enforce_eager_option, force_option, model_option

console = Console(stderr=True)
if not console.is_terminal:  # a log file or pipe gets whole lines and tables, not 80 squeezed columns
    console = Console(stderr=True, width=170)
out_console = Console()
if not out_console.is_terminal:
    out_console = Console(width=170)


GATE_METHODS = ("eagle3", "hybrid")  # the drafters with a head that `serve` deploys


def _fail(msg: str, code: int = 2) -> None:
    console.print(f"[bold red]error:[/] {msg}", soft_wrap=True)
    raise typer.Exit(code)


def _progress() -> Any:
    """A bar in a terminal; a line per tenth of the work (or per 30 s) in a log file."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from ..progress import LoggedProgress

    return LoggedProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=console, transient=False)


def _when(ts: float | None) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts)) if ts is not None else "-"


def held_out_requests(traffic: Path, share: float, until: float | None, limit: int | None) -> tuple[list, Any]:
    """The requests to measure on and a ``HeldOut`` that says how they were chosen."""
    from pydantic import ValidationError

    from ..task.traffic import dedupe, request_key, scan_traffic, split_by_time
    from .gate import HeldOut

    scan = scan_traffic(traffic)
    records = dedupe(scan.records)
    _, held = split_by_time(records, share)
    notes = []
    if scan.skipped:
        notes.append(f"{scan.skipped} torn or invalid lines skipped")
    left_trained = 0
    if until is not None:
        trained = {request_key(r) for r in scan.records if r.ts <= until}
        kept = [r for r in held if r.ts > until and request_key(r) not in trained]
        left_trained = len(held) - len(kept)
        held = kept
    n_held = len(held) + left_trained
    if limit is not None:
        held = held[-limit:]  # the most recent
    reqs, bad = [], 0
    seen: dict[str, int] = {}
    for rec in held:
        try:
            r = rec.request()
        except ValidationError:
            bad += 1
            continue
        k = seen.get(r.id, 0)  # repeated request ids (two agents): made unique, so replies pair by id
        seen[r.id] = k + 1
        if k:
            r = r.model_copy(update={"id": f"{r.id}#{k}"})
        reqs.append(r)
    if bad:
        notes.append(f"{bad} records that are not a valid request left out")
    info = HeldOut(traffic=str(traffic), share=share, records=len(records), held_out=n_held,
                   after=until, left_out_trained=left_trained, limit=limit, requests=len(reqs),
                   first_ts=held[0].ts if held else None, last_ts=held[-1].ts if held else None,
                   served_gamma=sorted({r.gamma for r in held if r.gamma is not None}),
                   note="; ".join(notes) or None)
    return reqs, info


def describe_held_out(h: Any) -> str:
    s = (f"held out the most recent {h.share:.0%} of {h.records} deduplicated records: {h.held_out}")
    if h.after is not None:
        s += (f"; {h.left_out_trained} of them at or before the candidate's training window end "
              f"({_when(h.after)}) or repeating a request from it, left out")
    else:
        s += "; the candidate's provenance records no training window, so none were left out for it"
    if h.limit is not None:
        s += f"; --limit {h.limit}: the most recent"
    s += f" -> {h.requests} requests"
    if h.first_ts is not None:
        s += f" from {_when(h.first_ts)} to {_when(h.last_ts)}"
    return s + (f" ({h.note})" if h.note else "")


def _reusable(path: Path, ids: list, gamma: int, target_dir: Path, head_dir: Path, max_tokens: int,
              method: str = "eagle3") -> Any:
    """A report written by an earlier run of the same measurement (for a hybrid: with the settings and pointer
    the version deploys now), else None."""
    from ..results_acceptance import AcceptanceReport

    if not path.exists():
        return None
    try:
        rep = AcceptanceReport.load(path)
    except ValueError:
        return None
    same = (rep.mode == "vllm" and rep.method == method and rep.gamma == gamma and rep.max_tokens == max_tokens
            and (method != "hybrid" or rep.hybrid == _deployed_hybrid(target_dir, head_dir, gamma))
            and rep.target == str(target_dir) and rep.head == str(head_dir) and rep.replies is not None
            and [x.id for x in rep.replies] == ids and not rep.requests_without_step_metrics)
    return rep if same else None


def _deployed_hybrid(target_dir: Path, head_dir: Path, gamma: int) -> dict[str, Any] | None:
    """The hybrid's settings a deployment of this head runs (its own pointer, else the target's default), as
    ``measure_vllm`` records them."""
    from ..serving.spec import Speculative

    sp = Speculative(method="hybrid", model=str(head_dir), num_speculative_tokens=gamma)
    cfg = sp.hybrid_config(str(target_dir))
    return cfg.__dict__ if cfg is not None else None


def gate_method(target_dir: Path, head_dirs: list[Path]) -> str:
    """The drafter the gate measures with when none is asked: the hybrid where ``serve --head NAME`` deploys it
    (``drafting.config.default_draft``) for either version (the current one now, the candidate once promoted),
    else eagle3. A hybrid without a pointer drafts as the head alone, so each side is measured as it would be
    deployed."""
    from ..drafting.config import default_draft

    return "hybrid" if any(default_draft(target_dir, d) == "hybrid" for d in head_dirs) else "eagle3"


def print_decision(d: Any) -> None:
    from rich.table import Table

    def f(x: float | None, digits: int = 3) -> str:
        return "—" if x is None else f"{x:.{digits}f}"

    def iv(lo: float | None, hi: float | None) -> str:
        return "—" if lo is None or hi is None else f"[{lo:+.3f}, {hi:+.3f}]"

    drafter = d.method or "—"
    if d.method == "hybrid":
        drafter += f" (pointers: candidate {d.pointer_candidate or 'none'}, current {d.pointer_current or 'none'})"
    t = Table(title=f"gate: {d.candidate} vs {d.current}, {drafter} at γ={d.gamma}, {d.n} paired requests")
    for col in ("", "candidate", "current", "diff", "95% bootstrap", "95% t", "verdict"):
        t.add_column(col, justify="left" if col in ("", "verdict") else "right")
    tau_verdict = "—" if d.ci_low is None else ("above 0" if d.ci_low > 0 else "not above 0")
    t.add_row("τ (mean per request)", f(d.tau_candidate), f(d.tau_current),
              "—" if d.diff is None else f"{d.diff:+.3f}", iv(d.ci_low, d.ci_high), iv(d.t_low, d.t_high),
              tau_verdict)
    t.add_row("τ (pooled)", f(d.tau_pooled_candidate), f(d.tau_pooled_current), "", "", "", "")
    for c in d.classes:
        verdict = "worse" if c.worse else ("ok" if c.judged else "not judged")
        t.add_row(f"{c.token_class} ({c.requests} req)",
                  f"{f(c.candidate)} ({c.accepted_candidate}/{c.reached_candidate})",
                  f"{f(c.current)} ({c.accepted_current}/{c.reached_current})",
                  "—" if c.diff is None else f"{c.diff:+.3f}", iv(c.ci_low, c.ci_high), "", verdict)
    out_console.print(t)
    head = "[bold green]eligible[/]" if d.eligible else "[bold red]not eligible[/]"
    out_console.print(f"{d.candidate}: {head}")
    for r in d.reasons:
        out_console.print(f"  - {r}", highlight=False, soft_wrap=True)


def gate(
    head: str = typer.Option(..., "--head", help="the head registry's name ($CARTSPEC_HOME/heads/NAME)"),
    candidate: str = typer.Option(..., "--candidate", help="the version to gate, vNNNN (see `cartspec heads list`)"),
    traffic: Path = typer.Option(..., "--traffic", help="the directory `serve --record-traffic` wrote (or one "
                                                        "traffic-*.jsonl file)"),
    gamma: int = typer.Option(3, "--gamma", help="γ: the served draft tokens per verify step"),
    method: Optional[str] = typer.Option(None, "--method", help="eagle3 (the head alone) | hybrid (the head and "
                                         "each version's own pointer); default: what `serve --head NAME` deploys "
                                         "for --target, the hybrid where a pointer is trained for it or kept "
                                         "with a version"),
    held_out: float = typer.Option(0.2, "--held-out", help="the most recent share of the deduplicated traffic "
                                                            "to measure on"),
    limit: Optional[int] = typer.Option(None, help="the N most recent held-out requests only"),
    target: str = model_option("served model"),
    out: Optional[Path] = typer.Option(None, help="also write the decision (JSON) here"),
    min_requests: int = typer.Option(30, "--min-requests", help="fewer paired requests: not eligible"),
    seed: int = typer.Option(0, help="the bootstrap's seed"),
    n_boot: int = typer.Option(2000, "--n-boot", help="bootstrap resamples"),
    concurrency: int = typer.Option(8),
    max_tokens: int = typer.Option(192),
    enforce_eager: bool = enforce_eager_option(),
    dtype: str = dtype_option(),
    force: bool = force_option("measure a head"),
) -> None:
    """Is the candidate version better than the current one on held-out recent traffic, both deployed as
    `serve` deploys them? τ at γ per request (paired 95% interval), and no token class worse beyond its
    interval. Exits 0 whatever the decision."""
    from ..model.convert import ModelNotFound
    from ..model.heads import HeadRegistry, HeadRegistryError
    from ..model.registry import head_pointer, resolve_head, resolve_model
    from ..serving.endpoint import EndpointError
    from ..serving.server import DeploymentError
    from . import acceptance
    from .gate import GateError, decide, gate_reports
    from .pipeline import DraftPipelineError, check_drafters

    if not 0 < held_out < 1:
        _fail("--held-out is a share of the traffic, above 0 and below 1 (e.g. 0.2)")
    if limit is not None and limit < 1:
        _fail("--limit must be at least 1")
    if gamma < 1:
        _fail("--gamma must be at least 1")
    if method is not None and method not in GATE_METHODS:
        _fail(f"--method must be {' or '.join(GATE_METHODS)}, not {method!r}")
    asked = method is not None
    if min_requests < 2:
        _fail("--min-requests must be at least 2: an interval needs two pairs")
    if n_boot < 100:
        _fail("--n-boot must be at least 100 (2000 gives a stable 95% interval)")
    try:
        reg = HeadRegistry(head)
    except HeadRegistryError as exc:
        _fail(str(exc))
    if not reg.exists():
        _fail(f"no head registry {head!r} in {reg.root}: register heads with `cartspec heads add {head} HEAD_DIR` "
              f"or `cartspec draft refresh --head {head}`")
    try:
        cand = reg.get(candidate)
    except (ModelNotFound, HeadRegistryError) as exc:
        _fail(str(exc))
    cur = reg.current()
    if cur is None:
        _fail(f"the head registry {head!r} has no current version to compare with: promote one with "
              f"`cartspec heads promote {head}@vN`")
    if cur.version == cand.version:
        _fail(f"{cand.ref} is the current version: gate a candidate against it (see `cartspec heads list {head}`)")
    if cand.status == "rejected":
        console.print(f"[yellow]{cand.ref} was rejected before; gating it again[/]")

    window = cand.provenance.get("data_window") if isinstance(cand.provenance, dict) else None
    until = window.get("until") if isinstance(window, dict) else None
    try:
        reqs, info = held_out_requests(traffic, held_out, float(until) if until is not None else None, limit)
    except (FileNotFoundError, ValueError) as exc:
        _fail(str(exc))
    console.print(describe_held_out(info), highlight=False, soft_wrap=True)
    if info.served_gamma and info.served_gamma != [gamma]:
        served = ", ".join(map(str, info.served_gamma))
        console.print(f"[yellow]the held-out traffic was served at γ={served}; measuring at γ={gamma} (--gamma)[/]")

    if len(reqs) < min_requests:
        d = decide([], [], gamma=gamma, candidate_ref=cand.ref, current_ref=cur.ref, min_requests=min_requests,
                   seed=seed, n_boot=n_boot, held_out=info, method=method)
        d.reasons = [f"only {len(reqs)} held-out requests, fewer than the {min_requests} needed (min_requests): not "
                     "measured; record more traffic or hold out a larger share (--held-out)"]
        _write(reg, cand, d, out)
        return

    try:
        target_dir = resolve_model(target)
        heads = {"candidate": (cand, resolve_head(cand.ref)), "current": (cur, resolve_head(cur.ref))}
        method = method or gate_method(target_dir, [d_ for _, d_ in heads.values()])
        for v, head_dir in heads.values():  # a head (or its own pointer) trained for another target: refuse
            own = head_pointer(head_dir) if method == "hybrid" else None
            check_drafters(v.ref, target, str(own) if own else None, force=force,
                           warn=lambda m: console.print(f"[bold yellow]{m}[/]"))
    except (ModelNotFound, DraftPipelineError) as exc:
        _fail(str(exc))
    console.print(f"drafter: {method}" + (" (--method)" if asked else ", what `serve` deploys for this target "
                                          "(--method to choose)"), highlight=False)

    ids = [r.id for r in reqs]
    reports: dict[str, Any] = {}
    paths: dict[str, str] = {}
    for side, (v, head_dir) in heads.items():
        path = cand.path / f"gate-acceptance-{v.version}{'' if method == 'eagle3' else '-' + method}.json"
        paths[side] = str(path)
        rep = _reusable(path, ids, gamma, target_dir, head_dir, max_tokens, method)
        if rep is not None:
            console.print(f"{side} {v.ref}: reusing {path} (same requests, method, γ, target, head and pointer)")
            reports[side] = rep
            continue
        console.print(f"measuring the {side} {v.ref} in vLLM: {method} γ={gamma}, {len(reqs)} requests")
        with _progress() as pg:
            task = pg.add_task(f"{side} {v.ref}", total=len(reqs), info="vLLM")
            try:
                # the hybrid's settings left to the deployment's default: the version's own pointer
                res = acceptance.measure_vllm(target, method, gamma, reqs, head=v.ref, concurrency=concurrency,
                                              max_tokens=max_tokens, log=console.print, enforce_eager=enforce_eager,
                                              on_done=lambda d_, t_: pg.update(task, completed=d_, total=t_),
                                              dtype=dtype)
            except (ModelNotFound, DeploymentError, EndpointError, FileNotFoundError, RuntimeError) as exc:
                kept = f" ({paths['candidate']} is kept for a rerun)" if side == "current" else ""
                _fail(f"measuring {v.ref}: {exc}{kept}")
        res["data"] = f"traffic {traffic}: held-out {held_out:g}"
        res["head_name"] = v.ref
        reports[side] = acceptance.AcceptanceReport.model_validate(res)
        reports[side].save(path)
        console.print(f"{side} {v.ref}: τ={_fig(reports[side].tau)} -> {path}")

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    try:
        d = gate_reports(reports["candidate"], reports["current"], reqs, tok, gamma=gamma, candidate_ref=cand.ref,
                         current_ref=cur.ref, min_requests=min_requests, n_boot=n_boot, seed=seed, held_out=info,
                         method=method)
    except GateError as exc:
        _fail(str(exc))
    d.reports = paths
    _write(reg, cand, d, out)


def _fig(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def _write(reg: Any, cand: Any, d: Any, out: Optional[Path]) -> None:
    path = reg.write_gate(cand.version, d.model_dump(mode="json"))
    print_decision(d)
    console.print(f"-> {path}")
    if out is not None:
        console.print(f"-> {d.save(out)}")


def register(app: typer.Typer) -> None:
    """Add ``gate`` to ``app`` (``cartspec draft``)."""
    app.command("gate")(gate)
