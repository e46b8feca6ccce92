"""``cartspec draft``: train EAGLE-3 heads and measure their acceptance (``draft refresh`` and ``draft gate``
are registered from their own modules, ``draft predict`` from ``analysis/cli.py``)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

import typer

from ..cli_options import (dtype_option, enforce_eager_option, force_option, model_option, replace_bundled_option,
                           served_name_option, server_api_key_env_option)
from ..drafting.length import METHODS as STOP_METHODS, STOP_P
from .pipeline import (DraftPipelineError, HeadTrainingConfig, PointerTrainingConfig, build_head, build_pointer,
                       check_drafters, hybrid_config)
from .terminal import console, fail as _fail, progress as _progress

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="EAGLE-3 draft heads: train them for the served target, measure acceptance.")


TRAIN = HeadTrainingConfig()  # the defaults the options show
POINTER = PointerTrainingConfig()


@app.command()
def train(
    kind: Optional[str] = typer.Option(None, "--kind", help="built-in prompt set: generic (general prompts, "
                                       "target base) | domain (commerce requests, target commerce); optional "
                                       "with --prompts FILE.jsonl"),
    target: Optional[str] = typer.Option(None, help="model the head drafts for: base | commerce | HF directory | "
                                                    "LoRA adapter directory (merged onto the base it names) "
                                                    "(default: base for generic, else commerce)"),
    out: Optional[Path] = typer.Option(None, help="head directory (default: runs/heads/NAME-DIGEST, or "
                                                  "$CARTSPEC_HOME/heads/... when CARTSPEC_HOME is set)"),
    prompts: str = typer.Option(TRAIN.prompts, help="FILE.jsonl (cartspec request lines or OpenAI chat lines "
                                                    "{\"messages\": [...]}), or N: that many prompts of --kind"),
    limit: Optional[int] = typer.Option(None, help="first N prompts of --prompts FILE only"),
    substituted: int = typer.Option(TRAIN.substituted, help="with --kind domain: N more training-split search "
                                    "requests whose products, brands, colours and materials are words no "
                                    "generator pool has (replies that copy words the head never saw as values)"),
    init: Optional[str] = typer.Option(None, "--init", help="start from this head (bundled name, registry or "
                                       "directory; same target) instead of a random one, its draft vocabulary "
                                       "widened by the reply tokens (seen twice or more) it lacks"),
    sampled: float = typer.Option(TRAIN.sampled, help="extra sampled answers, as a share of the prompts "
                                                      "(temperature below)"),
    temperature: float = typer.Option(TRAIN.temperature, help="temperature of the sampled answers"),
    max_tokens: int = typer.Option(TRAIN.max_tokens, help="response length cap when regenerating"),
    steps: Optional[int] = typer.Option(None, help="optimiser steps (overrides --epochs)"),
    epochs: float = typer.Option(TRAIN.epochs),
    ttt_steps: int = typer.Option(TRAIN.ttt_steps, "--ttt-steps", help="k: unrolled draft steps in the training-time "
                                                                        "test"),
    draft_vocab: int = typer.Option(TRAIN.draft_vocab, help="draft vocabulary size"),
    lr: float = typer.Option(TRAIN.lr),
    batch_tokens: int = typer.Option(TRAIN.batch_tokens, help="padded tokens per batch"),
    max_minutes: Optional[float] = typer.Option(None, help="stop training (checkpointed, exported) after this long"),
    save_every: int = typer.Option(TRAIN.save_every),
    seed: int = typer.Option(TRAIN.seed),
    enforce_eager: bool = enforce_eager_option(when="when regenerating"),
    device: str = typer.Option(TRAIN.device, help="feature capture and training: auto (cuda when available) | cpu | "
                                                  "cuda"),
    fsdp: bool = typer.Option(False, "--fsdp", help="under torchrun: shard the head, its gradients and optimiser "
                                                    "state over the processes (FSDP2) instead of replicating it (DDP)"),
    replace_bundled: bool = replace_bundled_option("heads"),
) -> None:
    """Regenerate the target's answers, capture its features, train the head (resumable), export it.

    Under ``torchrun --nproc_per_node N`` the training runs data-parallel (DDP, or FSDP2 with ``--fsdp``; gloo
    on CPU, nccl on CUDA): rank 0 regenerates and captures the features, every rank trains on its share of
    each batch."""
    cfg = HeadTrainingConfig(kind=kind, target=target, out=out, prompts=prompts, limit=limit,
                             substituted=substituted, init=init, sampled=sampled,
                             temperature=temperature, max_tokens=max_tokens, steps=steps, epochs=epochs,
                             ttt_steps=ttt_steps, draft_vocab=draft_vocab, lr=lr, batch_tokens=batch_tokens,
                             max_minutes=max_minutes, save_every=save_every, seed=seed, enforce_eager=enforce_eager,
                             device=device, fsdp=fsdp, replace_bundled=replace_bundled)
    command = ("cartspec draft " + " ".join(shlex.quote(a) for a in sys.argv[sys.argv.index("train"):])
               if "train" in sys.argv else None)
    try:
        res = build_head(cfg, command=command, log=console.print, progress=_progress)
    except DraftPipelineError as exc:
        _fail(str(exc))
    if res is None:  # a rank other than 0 under torchrun: rank 0 exports and reports
        return
    console.print(f"[green]head[/] -> {res.out} ({res.size_bytes / 1e6:.1f} MB, {res.steps} steps, "
                  f"{res.training_seconds / 60:.1f} min training; acc/step {res.acc_per_step_last20})")


@app.command()
def pointer(
    target: str = typer.Option(POINTER.target, help="model the pointer drafts for: commerce | base | HF directory | "
                                                    "LoRA adapter directory"),
    prompts: str = typer.Option(POINTER.prompts, help="N: that many training-split commerce requests with their "
                                                      "gold replies, or FILE.jsonl: your requests with replies "
                                                      "(cartspec lines with gold, or chat lines ending in the "
                                                      "assistant's reply)"),
    dev: str = typer.Option(POINTER.dev, help="N dev-split requests, or FILE.jsonl, to check the pointer on "
                                              "after every epoch (0: none)"),
    out: Optional[Path] = typer.Option(None, help="pointer directory (default: runs/pointers/TARGET-DIGEST)"),
    epochs: int = typer.Option(POINTER.epochs),
    lr: float = typer.Option(POINTER.lr),
    seed: int = typer.Option(POINTER.seed),
    replace_bundled: bool = replace_bundled_option("pointers"),
) -> None:
    """Train the hybrid's pointer: which word of the prompt a reply's string value copies (draft/pointer.py).

    It learns from the requests' replies (no generation: the replies are what the model was fine-tuned to
    write) in a few minutes on a CPU; the hybrid's rule ``pointer`` drafts its pick at every value start."""
    cfg = PointerTrainingConfig(target=target, prompts=prompts, dev=dev, out=out, epochs=epochs, lr=lr, seed=seed,
                                replace_bundled=replace_bundled)
    try:
        res = build_pointer(cfg, log=console.print)
    except DraftPipelineError as exc:
        _fail(str(exc))
    console.print(f"[green]pointer[/] -> {res.out} ({res.examples} value starts, {res.seconds:.0f} s; "
                  f"last epoch: " + ", ".join(f"{k} {v}" for k, v in res.last_epoch.items() if k != "epoch") + ")")


@app.command()
def acceptance(
    head: Optional[str] = typer.Option(None, help="generic | domain | NAME[@vN] (a registered head) | PATH "
                                       "(methods eagle3, hybrid)"),
    gamma: int = typer.Option(3, "--gamma", help="γ: draft tokens per verify step"),
    data: str = typer.Option("test", help="train | dev | test | novel (words in no generator pool) | handwritten (40 requests written by hand) | real (180 real shoppers' queries, held out) | real-traffic (300 more) | FILE.jsonl"),
    out: Path = typer.Option(..., help="where the JSON goes"),
    simulate: bool = typer.Option(False, "--simulate", help="offline simulator instead of a vLLM deployment"),
    method: str = typer.Option("eagle3", help="eagle3 | ngram | schema (from the reply's JSON schema and the "
                                              "prompt, no head) | hybrid (EAGLE-3 + prompt lookup)"),
    reply_schema: Optional[Path] = typer.Option(
        None, help="schema, and hybrid rule schema: the JSON schema file the replies follow (default: the "
                   "commerce task's replies)"),
    draft_stop: Optional[float] = typer.Option(
        None, "--draft-stop", help="eagle3, hybrid: draft length per request, each draft cut where the head's "
                                   "path probability falls below this (a hybrid's only before its first copied "
                                   f"token; {STOP_P:g} is the default `eagle3:HEAD:γ:stop` and `hybrid:HEAD:γ:stop` "
                                   "deploy); --gamma is then the longest draft"),
    lookup_min: Optional[int] = typer.Option(None, help="hybrid: smallest n-gram the lookup matches"),
    lookup_max: Optional[int] = typer.Option(None, help="hybrid: largest n-gram the lookup matches"),
    rule: Optional[str] = typer.Option(None, help="hybrid: lookup | agree | head | anchor | text | pointer | schema "
                                                  "(drafting/rules); default: what serve deploys, pointer where "
                                                  "a pointer was trained for --target, else head"),
    pointer: Optional[str] = typer.Option(None, help="hybrid rule pointer: commerce (bundled) | DIR (`cartspec "
                                                     "draft pointer`); default: the head's own (a refreshed "
                                                     "version's), else the bundled one"),
    scope: Optional[str] = typer.Option(None, help="hybrid: prompt | context (where the lookup searches)"),
    head_p: Optional[float] = typer.Option(
        None, "--head-p", help="hybrid: where a copy first differs from the head's draft and the head is at "
                               "least this sure of its own token, the head's draft stands (0 = off; default: "
                               "the rule's, 0.9 for pointer)"),
    target: str = model_option("served model"),
    limit: Optional[int] = typer.Option(None, help="first N requests only"),
    concurrency: int = typer.Option(8),
    max_tokens: int = typer.Option(192),
    enforce_eager: bool = enforce_eager_option(),
    dtype: str = dtype_option(),
    force: bool = force_option("measure a head"),
    server: Optional[str] = typer.Option(
        None, help="measure this running vLLM instead of starting one; it must serve --target with --method, "
                   "--gamma and --head (which describe it) and --per-request-spec-decode-metrics detailed"),
    served_name: Optional[str] = served_name_option(),
    server_api_key_env: Optional[str] = server_api_key_env_option(records="the JSON"),
) -> None:
    """τ, acceptance rate, per-position and by-class acceptance at temperature 0."""
    from ..model.convert import ModelNotFound
    from ..serving.endpoint import EndpointError, MissingApiKey, api_key_from_env
    from ..serving.server import DeploymentError
    from ..task.data import DataFileError
    from .acceptance import AcceptanceReport, load_data, measure_simulated, measure_vllm

    if method not in ("eagle3", "ngram", "schema", "hybrid"):
        _fail("--method must be eagle3, ngram, schema or hybrid")
    from ..drafting.config import NEEDS_SCHEMA

    if reply_schema is not None and not (method == "schema" or (method == "hybrid" and rule in NEEDS_SCHEMA)):
        _fail("--reply-schema is a setting of --method schema (and of --method hybrid --rule schema or "
              "pointer-schema)")
    if reply_schema is not None and not reply_schema.is_file():
        _fail(f"--reply-schema {reply_schema} does not exist: give a JSON schema file")
    if draft_stop is not None and method not in STOP_METHODS:
        _fail("--draft-stop (draft length per request) is a setting of --method eagle3 or hybrid (it cuts by the "
              "head's probabilities)")
    if draft_stop is not None and not 0 < draft_stop < 1:
        _fail(f"--draft-stop is a probability strictly between 0 and 1, got {draft_stop}")
    if method in ("eagle3", "hybrid") and not head:
        _fail(f"--head is required with --method {method}")
    if (served_name or server_api_key_env) and not server:
        _fail("--served-name and --server-api-key-env are settings of --server")
    if server and simulate:
        _fail("--server measures a running vLLM; --simulate runs no server")
    try:  # checked now, not after the requests are built
        api_key = api_key_from_env(server_api_key_env)
    except MissingApiKey as exc:
        _fail(f"--server-api-key-env: {exc}")
    hybrid = None
    try:
        if method == "hybrid":
            hybrid = hybrid_config(lookup_min, lookup_max, rule, scope, head_p, pointer, target=target, head=head)
        elif any(x is not None for x in (lookup_min, lookup_max, rule, scope, pointer, head_p)):
            _fail("settings of --method hybrid only: --lookup-min, --lookup-max, --rule, --scope, --pointer, "
                  "--head-p")
        if head:  # a head trained for another target than --target: refuse (or --force)
            check_drafters(head, target, hybrid.pointer if hybrid is not None else None, force=force,
                           warn=lambda m: console.print(f"[bold yellow]{m}[/]"))
    except DraftPipelineError as exc:
        _fail(str(exc))
    try:
        reqs = load_data(data, limit)
    except DataFileError as exc:
        _fail(str(exc))
    with _progress() as pg:
        task = pg.add_task(f"{method} γ={gamma}", total=len(reqs), info="simulating" if simulate else "vLLM")
        prog = lambda d, t: pg.update(task, completed=d, total=t)  # noqa: E731
        try:
            if simulate:
                res = measure_simulated(target, method, gamma, reqs, head=head, max_tokens=max_tokens,
                                        log=console.print, progress=prog, enforce_eager=enforce_eager,
                                        hybrid=hybrid, reply_schema=_str(reply_schema), draft_stop=draft_stop)
            else:
                res = measure_vllm(target, method, gamma, reqs, head=head, concurrency=concurrency,
                                   max_tokens=max_tokens, log=console.print, enforce_eager=enforce_eager,
                                   on_done=prog, dtype=dtype, hybrid=hybrid, server=server,
                                   served_name=served_name, api_key=api_key, reply_schema=_str(reply_schema),
                                   draft_stop=draft_stop)
        except (ModelNotFound, DeploymentError, EndpointError, FileNotFoundError) as exc:
            _fail(str(exc))
    res["data"] = data
    res["head_name"] = head
    if server_api_key_env:
        res["server_api_key_env"] = server_api_key_env  # the variable's name; the key is never written
    AcceptanceReport.model_validate(res).save(out)
    pp = " ".join(f"{x:.3f}" for x in res["per_position"])
    console.print(f"{res['mode']} {method}{'/' + head if head else ''} γ={gamma} n={res['n']}: "
                  f"τ={_fig(res['tau'])} acceptance={_fig(res['acceptance_rate'])} per-position [{pp}]")
    for c, v in res["by_class"].items():
        if v["reached"]:
            alone = (f"   head alone on these {v['head_alone']:6d} = {v['head_alone_acceptance']:.3f}"
                     if v.get("head_alone_acceptance") is not None else "")
            console.print(f"  {c:22s} {v['accepted']:6d}/{v['reached']:<6d} = {v['acceptance']:.3f}{alone}")
    console.print(f"-> {out}")


def _str(path: Path | None) -> str | None:
    return None if path is None else str(path)


def _fig(value: float | None) -> str:
    """A figure to three decimals; "—" when it is undefined (nothing was drafted)."""
    return "—" if value is None else f"{value:.3f}"


def _register_more() -> None:
    from .gate_cli import register as register_gate
    from .refresh_cli import register as register_refresh

    register_refresh(app)  # draft refresh
    register_gate(app)  # draft gate


_register_more()
