"""``cartspec draft``: train EAGLE-3 heads and measure their acceptance."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ..progress import LoggedProgress

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="EAGLE-3 draft heads: train them for the served target, measure acceptance.")
console = Console(stderr=True)


def _fail(msg: str, code: int = 2) -> None:
    console.print(f"[bold red]error:[/] {msg}")
    raise typer.Exit(code)


class _quiet:  # a progress display that shows nothing (ranks > 0 under torchrun)
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_task(self, *a, **k):
        return 0

    def update(self, *a, **k):
        pass


def _progress() -> Progress:
    """A bar in a terminal; a line per tenth of the work (or per 30 s) in a log file."""
    return LoggedProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=console, transient=False)


def _prompts(kind: str, tok, n: int, seed: int) -> tuple[list[list[int]], str]:
    if kind == "domain":
        from ..task.generator import generate
        from ..task.prompts import render

        reqs = generate("train", n, seed)
        texts = [render(tok, r) for r in reqs]
        desc = f'generate("train", {n}, seed={seed}) rendered with the chat template'
    else:
        from .general_prompts import general_prompts, render_general

        texts = [render_general(tok, p) for p in general_prompts(n, seed)]
        desc = f"general_prompts({n}, seed={seed}) (built-in, non-commerce), user turn only"
    return [tok(t, add_special_tokens=False).input_ids for t in texts], desc


def _file_prompts(path: str, tok, limit: int | None) -> tuple[list[list[int]], str]:
    """A user's prompts: cartspec request lines or OpenAI chat lines, rendered with the target's template."""
    from ..task.data import read_requests
    from ..task.prompts import messages

    reqs = read_requests(path)[:limit] if limit else read_requests(path)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"the target's tokenizer has no chat template: cannot render the prompts of {path}")
    texts = [tok.apply_chat_template(messages(r), tokenize=False, add_generation_prompt=True) for r in reqs]
    return ([tok(t, add_special_tokens=False).input_ids for t in texts],
            f"{len(reqs)} requests from `{path}` rendered with the target's chat template")


def _default_out(label: str, digest: str, kind: str = "heads") -> Path:
    """Where a head (or a pointer: ``kind`` "pointers") goes unless --out says: never into the bundled assets."""
    import os

    root = Path(os.environ["CARTSPEC_HOME"]) / kind if os.environ.get("CARTSPEC_HOME") else Path("runs") / kind
    return root / f"{label}-{digest[:8]}"


def _is_bundled(path: Path, root: Path | None = None) -> bool:
    """Is ``path`` inside the bundled heads (or ``root``, e.g. the bundled pointers)?"""
    from ..model.registry import HEADS_DIR

    try:
        path.resolve().relative_to((root or HEADS_DIR).resolve())
        return True
    except ValueError:
        return False


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
    prompts: str = typer.Option("1200", help="FILE.jsonl (cartspec request lines or OpenAI chat lines "
                                             "{\"messages\": [...]}), or N: that many prompts of --kind"),
    limit: Optional[int] = typer.Option(None, help="first N prompts of --prompts FILE only"),
    sampled: float = typer.Option(0.5, help="extra sampled answers, as a share of the prompts (temperature below)"),
    temperature: float = typer.Option(0.7, help="temperature of the sampled answers"),
    max_tokens: int = typer.Option(192, help="response length cap when regenerating"),
    steps: Optional[int] = typer.Option(None, help="optimiser steps (overrides --epochs)"),
    epochs: float = typer.Option(1.0),
    ttt_steps: int = typer.Option(5, "--ttt-steps", help="k: unrolled draft steps in the training-time test"),
    draft_vocab: int = typer.Option(8192, help="draft vocabulary size"),
    lr: float = typer.Option(1e-3),
    batch_tokens: int = typer.Option(2048, help="padded tokens per batch"),
    max_minutes: Optional[float] = typer.Option(None, help="stop training (checkpointed, exported) after this long"),
    save_every: int = typer.Option(50),
    seed: int = typer.Option(0),
    enforce_eager: bool = typer.Option(False, help="vLLM without torch.compile when regenerating"),
    device: str = typer.Option("auto", help="feature capture and training: auto (cuda when available) | cpu | cuda"),
    fsdp: bool = typer.Option(False, "--fsdp", help="under torchrun: shard the head, its gradients and optimiser "
                                                    "state over the processes (FSDP2) instead of replicating it (DDP)"),
    replace_bundled: bool = typer.Option(False, "--replace-bundled",
                                         help="allow --out inside the bundled heads (maintainers only)"),
) -> None:
    """Regenerate the target's answers, capture its features, train the head (resumable), export it.

    Under ``torchrun --nproc_per_node N`` the training runs data-parallel (DDP, or FSDP2 with ``--fsdp``; gloo
    on CPU, nccl on CUDA): rank 0 regenerates and captures the features, every rank trains on its share of
    each batch."""
    import torch
    from transformers import AutoTokenizer

    from ..model.convert import ModelNotFound
    from ..model.registry import resolve_model, target_digest
    from ..paths import config_digest, home
    from ..task.data import DataFileError
    from .export import export_head, head_size_bytes
    from .features import FeatureSet, Sampling, build_features, model_key
    from .head import param_count
    from .train import TrainConfig, distributed, pick_device, train_head

    if kind is not None and kind not in ("generic", "domain"):
        _fail("--kind must be generic or domain")
    from_file = not prompts.isdigit()
    if not from_file and kind is None:
        _fail("give the training prompts: --prompts FILE.jsonl (your own requests or chat lines), "
              "or --kind generic|domain for a built-in set")
    try:
        dev = pick_device(device)
    except ValueError as exc:
        _fail(str(exc))
    label = kind if not from_file else (kind or "custom")
    target = target or ("base" if kind == "generic" else "commerce")
    try:
        model_dir = resolve_model(target)
    except ModelNotFound as exc:
        _fail(str(exc))
    digest = target_digest(model_dir)
    out = out or _default_out(label, digest)
    if _is_bundled(out) and not replace_bundled:
        _fail(f"--out {out} is inside the bundled heads; a trained head goes elsewhere (default runs/heads/) "
              "unless --replace-bundled says to replace a bundled one")
    rank, world = distributed()
    log = console.print if rank == 0 else (lambda *a, **k: None)
    t_start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(model_dir)
    try:
        prompt_ids, prompt_desc = (_file_prompts(prompts, tok, limit) if from_file
                                   else _prompts(label, tok, int(prompts), seed))
    except (DataFileError, ValueError) as exc:
        _fail(str(exc))
    n_s = int(round(sampled * len(prompt_ids)))
    all_prompts = prompt_ids + prompt_ids[:n_s]
    sampling = [Sampling(0.0, max_tokens=max_tokens)] * len(prompt_ids) + \
        [Sampling(temperature, top_p=0.95, max_tokens=max_tokens, seed=seed * 100003 + i) for i in range(n_s)]
    log(f"target {model_dir} (digest {digest}): {len(prompt_ids)} greedy + {n_s} sampled (T={temperature}) answers")

    def features():
        with _progress() as pg:
            task = pg.add_task("features", total=len(all_prompts), info="regenerating with vLLM")
            res = build_features(
                model_dir, all_prompts, sampling, tag=label, enforce_eager=enforce_eager, log=console.print,
                progress=lambda d, t: pg.update(task, completed=d, total=t, info="HF forward, aux states"),
                device=dev)
            pg.update(task, completed=len(all_prompts), info=str(res[0]))
        return res

    if world > 1:  # rank 0 builds (or finds cached) features; the others wait, then read the cache
        import torch.distributed as dist

        if rank == 0:
            fdir, records, shards = features()
        dist.barrier()
        if rank != 0:
            fdir, records, shards = build_features(model_dir, all_prompts, sampling, tag=label, log=log,
                                                   device=dev)
    else:
        fdir, records, shards = features()
    t_feat = time.perf_counter() - t_start
    fs = FeatureSet.load(shards)
    resp_tokens = int(sum(len(r["output_ids"]) for r in records))
    log(f"features: {fs.n_seqs} sequences, {int(fs.offsets[-1])} tokens ({resp_tokens} response) in {fdir}")

    cfg = TrainConfig(ttt_steps=ttt_steps, lr=lr, batch_tokens=batch_tokens, epochs=epochs, steps=steps,
                      draft_vocab_size=draft_vocab, save_every=save_every, seed=seed, max_minutes=max_minutes,
                      fsdp=fsdp)
    data_key = fdir.name
    work = home() / "draft" / "runs" / f"{label}-{config_digest([str(out.resolve()), data_key])}"
    extra_vocab = [t for p in prompt_ids for t in p]
    with _progress() if rank == 0 else _quiet() as pg:
        task = pg.add_task("train", total=1, info="")

        def on_step(step: int, total: int, rec: dict) -> None:
            accs = " ".join(f"{a:.2f}" if a is not None else "-" for a in rec["acc"])
            pg.update(task, completed=step, total=total, info=f"loss {rec['loss']:.3f} acc/step [{accs}]")

        head, summary = train_head(fs, model_dir, work, cfg, extra_vocab_tokens=extra_vocab, data_key=data_key,
                                   on_step=on_step, log=log, device=dev)
    if rank != 0:
        return
    export_head(head, out, metadata={"kind": label, "target": str(model_dir)},
                target={"digest": digest, "name": target, "path": str(model_dir)})
    (out / "training_log.json").write_text((work / "training_log.json").read_text())
    size = head_size_bytes(out)
    total_s = time.perf_counter() - t_start
    meta = json.loads((fdir / "meta.json").read_text())
    cmd = "cartspec draft " + " ".join(shlex.quote(a) for a in sys.argv[sys.argv.index("train"):]) \
        if "train" in sys.argv else "cartspec draft train --kind " + label
    (out / "PROVENANCE.md").write_text(f"""# EAGLE-3 head: `{label}`

Built with

```
{cmd}
```

- target: `{model_dir}` (`{target}`, target digest {digest}, recorded in config.json; weights key
  {model_key(model_dir)})
- prompts: {prompt_desc}; answers regenerated by the target with vLLM offline:
  {len(prompt_ids)} greedy + {n_s} sampled (temperature {temperature}, top-p 0.95), max {max_tokens} tokens;
  {fs.n_seqs} sequences, {int(fs.offsets[-1])} tokens, {resp_tokens} response tokens
- aux layers (vLLM ids = HF hidden_states indices): {fs.layer_ids}; features captured in
  {meta.get("capture_dtype", "bfloat16 (cached before capture followed the machine's dtype)")}
- head: {param_count(head) / 1e6:.2f} M parameters, draft vocabulary {summary['draft_vocab_size']},
  norm_before_residual={cfg.norm_before_residual}; `model.safetensors` bf16, {size / 1e6:.1f} MB
- training-time test: k={ttt_steps} steps, weights 0.8^step, lr {lr} (cosine), {batch_tokens} tokens/batch,
  {summary['steps']} optimiser steps ({summary['steps_per_epoch']} per epoch){' — stopped early by --max-minutes' if summary['stopped_early'] else ''}
- per-step accuracy (mean of the last 20 batches, vs the target's greedy token): {summary['acc_per_step_last20']}
- trained on {dev}{f" with {world} processes ({summary['sharding'].upper()})" if world > 1 else ""}, compute dtype {summary.get('compute_dtype', '?')}
- time on this machine ({torch.get_num_threads()} threads): features {t_feat / 60:.1f} min (incl. regeneration,
  cached on reruns), training {summary['seconds'] / 60:.1f} min, total {total_s / 60:.1f} min
- training log (loss and accuracy per step, every batch): `training_log.json`
""")
    console.print(f"[green]head[/] -> {out} ({size / 1e6:.1f} MB, {summary['steps']} steps, "
                  f"{summary['seconds'] / 60:.1f} min training; acc/step {summary['acc_per_step_last20']})")


@app.command()
def pointer(
    target: str = typer.Option("commerce", help="model the pointer drafts for: commerce | base | HF directory | "
                                                "LoRA adapter directory"),
    prompts: str = typer.Option("2400", help="N: that many training-split commerce requests with their gold "
                                             "replies, or FILE.jsonl: your requests with replies (cartspec lines "
                                             "with gold, or chat lines ending in the assistant's reply)"),
    dev: str = typer.Option("200", help="N dev-split requests, or FILE.jsonl, to check the pointer on "
                                        "after every epoch (0: none)"),
    out: Optional[Path] = typer.Option(None, help="pointer directory (default: runs/pointers/TARGET-DIGEST)"),
    epochs: int = typer.Option(8),
    lr: float = typer.Option(3e-3),
    seed: int = typer.Option(0),
    replace_bundled: bool = typer.Option(False, "--replace-bundled",
                                         help="allow --out inside the bundled pointers (maintainers only)"),
) -> None:
    """Train the hybrid's pointer: which word of the prompt a reply's string value copies (draft/pointer.py).

    It learns from the requests' replies (no generation: the replies are what the model was fine-tuned to
    write) in a few minutes on a CPU; the hybrid's rule ``pointer`` drafts its pick at every value start."""
    from transformers import AutoTokenizer

    from ..model.convert import ModelNotFound
    from ..model.registry import POINTERS_DIR, resolve_model, target_digest
    from ..serving.hybrid import TokenInfo
    from ..task.data import DataFileError, read_requests
    from .acceptance import load_data
    from .pointer import sequences_from_gold, train_pointer

    try:
        model_dir = resolve_model(target)
    except ModelNotFound as exc:
        _fail(str(exc))
    digest = target_digest(model_dir)
    out = out or _default_out(Path(target).name, digest, "pointers")
    if _is_bundled(out, POINTERS_DIR) and not replace_bundled:
        _fail(f"--out {out} is inside the bundled pointers; a trained pointer goes elsewhere unless "
              "--replace-bundled says to replace the bundled one")

    def requests(spec: str, split: str):
        if spec.isdigit():
            return (load_data(split, int(spec)) if int(spec) else []), f'generate("{split}", {spec}, seed=0)'
        return read_requests(spec), f"`{spec}`"

    try:
        train_reqs, train_desc = requests(prompts, "train")
        dev_reqs, dev_desc = requests(dev, "dev")
    except (DataFileError, FileNotFoundError) as exc:
        _fail(str(exc))
    tok = AutoTokenizer.from_pretrained(model_dir)
    seqs, dev_seqs = sequences_from_gold(tok, train_reqs), sequences_from_gold(tok, dev_reqs)
    if not seqs:
        _fail(f"none of the {len(train_reqs)} requests of {train_desc} has a reply to learn from: give each "
              "a gold answer, or end each chat line with the assistant's reply")
    console.print(f"pointer for {model_dir} (digest {digest}): {len(seqs)} replies of {train_desc}, "
                  f"checked on {len(dev_seqs)} of {dev_desc}")
    info = TokenInfo.from_tokenizer(tok)
    summary = train_pointer(model_dir, seqs, info, out, epochs=epochs, lr=lr, seed=seed, dev=dev_seqs,
                            target={"name": target, "digest": digest}, log=console.print)
    last = summary["epochs"][-1]
    console.print(f"[green]pointer[/] -> {out} ({summary['examples']} value starts, {summary['seconds']:.0f} s; "
                  f"last epoch: " + ", ".join(f"{k} {v}" for k, v in last.items() if k != "epoch") + ")")


@app.command()
def acceptance(
    head: Optional[str] = typer.Option(None, help="generic | domain | PATH (methods eagle3, hybrid)"),
    gamma: int = typer.Option(3, "--gamma", help="γ: draft tokens per verify step"),
    data: str = typer.Option("test", help="train | dev | test | novel (words in no generator pool) | FILE.jsonl"),
    out: Path = typer.Option(..., help="where the JSON goes"),
    simulate: bool = typer.Option(False, "--simulate", help="offline simulator instead of a vLLM deployment"),
    method: str = typer.Option("eagle3", help="eagle3 | ngram | hybrid (EAGLE-3 + prompt lookup)"),
    lookup_min: Optional[int] = typer.Option(None, help="hybrid: smallest n-gram the lookup matches"),
    lookup_max: Optional[int] = typer.Option(None, help="hybrid: largest n-gram the lookup matches"),
    rule: Optional[str] = typer.Option(None, help="hybrid: lookup | agree | head | anchor | text | pointer "
                                                  "(serving/hybrid.py)"),
    pointer: Optional[str] = typer.Option(None, help="hybrid rule pointer: commerce (bundled, the default) | "
                                                     "DIR (`cartspec draft pointer`)"),
    scope: Optional[str] = typer.Option(None, help="hybrid: prompt | context (where the lookup searches)"),
    head_p: Optional[float] = typer.Option(
        None, "--head-p", help="hybrid: where a copy first differs from the head's draft and the head is at "
                               "least this sure of its own token, the head's draft stands (0 = off; default: "
                               "the rule's, 0.9 for pointer)"),
    target: str = typer.Option("commerce", help="served model: commerce | base | PATH"),
    limit: Optional[int] = typer.Option(None, help="first N requests only"),
    concurrency: int = typer.Option(8),
    max_tokens: int = typer.Option(192),
    enforce_eager: bool = typer.Option(False, help="vLLM without torch.compile"),
    dtype: str = typer.Option("auto", help="serving dtype: auto (float32 on a CPU without native bf16, else bfloat16) | bfloat16 | float32 | float16"),
    force: bool = typer.Option(False, "--force", help="measure a head trained for another target anyway (warns)"),
    server: Optional[str] = typer.Option(
        None, help="measure this running vLLM instead of starting one; it must serve --target with --method, "
                   "--gamma and --head (which describe it) and --per-request-spec-decode-metrics detailed"),
    served_name: Optional[str] = typer.Option(None, help="model name on --server (default: its first model)"),
    server_api_key_env: Optional[str] = typer.Option(
        None, "--server-api-key-env", metavar="VAR", help="the environment variable holding --server's API key "
        "(sent as 'Authorization: Bearer KEY'); the JSON records VAR, never the key"),
) -> None:
    """τ, acceptance rate, per-position and by-class acceptance at temperature 0."""
    from ..model.convert import ModelNotFound
    from ..serving.endpoint import EndpointError, MissingApiKey, api_key_from_env
    from ..serving.server import DeploymentError
    from ..task.data import DataFileError
    from .acceptance import load_data, measure_simulated, measure_vllm

    if method not in ("eagle3", "ngram", "hybrid"):
        _fail("--method must be eagle3, ngram or hybrid")
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
    if method == "hybrid":
        from ..serving.hybrid import DEFAULT, HybridConfig

        try:
            hybrid = HybridConfig(n_min=lookup_min or DEFAULT.n_min, n_max=lookup_max or DEFAULT.n_max,
                                  rule=rule or DEFAULT.rule, scope=scope or DEFAULT.scope, head_p=head_p)
            if hybrid.rule == "pointer":
                from ..model.registry import resolve_pointer

                hybrid = replace(hybrid, pointer=str(resolve_pointer(pointer)))
            elif pointer:
                _fail("--pointer is a setting of --rule pointer")
        except (ValueError, ModelNotFound) as exc:
            _fail(str(exc))
    elif any(x is not None for x in (lookup_min, lookup_max, rule, scope, pointer, head_p)):
        _fail("settings of --method hybrid only: --lookup-min, --lookup-max, --rule, --scope, --pointer, --head-p")
    if head:  # a head trained for another target than --target: refuse (or --force)
        from ..model.registry import HeadMismatch, check_head, resolve_head, resolve_model

        try:
            check_head(resolve_head(head), resolve_model(target), force=force,
                       warn=lambda m: console.print(f"[bold yellow]{m}[/]"))
            if hybrid is not None and hybrid.pointer:
                check_head(Path(hybrid.pointer), resolve_model(target), force=force,
                           warn=lambda m: console.print(f"[bold yellow]{m}[/]"), what="pointer")
        except (HeadMismatch, ModelNotFound) as exc:
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
                                        hybrid=hybrid)
            else:
                res = measure_vllm(target, method, gamma, reqs, head=head, concurrency=concurrency,
                                   max_tokens=max_tokens, log=console.print, enforce_eager=enforce_eager,
                                   on_done=prog, dtype=dtype, hybrid=hybrid, server=server,
                                   served_name=served_name, api_key=api_key)
        except (ModelNotFound, DeploymentError, EndpointError, FileNotFoundError) as exc:
            _fail(str(exc))
    res["data"] = data
    res["head_name"] = head
    if server_api_key_env:
        res["server_api_key_env"] = server_api_key_env  # the variable's name; the key is never written
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    pp = " ".join(f"{x:.3f}" for x in res["per_position"])
    console.print(f"{res['mode']} {method}{'/' + head if head else ''} γ={gamma} n={res['n']}: "
                  f"τ={_fig(res['tau'])} acceptance={_fig(res['acceptance_rate'])} per-position [{pp}]")
    for c, v in res["by_class"].items():
        if v["reached"]:
            alone = (f"   head alone on these {v['head_alone']:6d} = {v['head_alone_acceptance']:.3f}"
                     if v.get("head_alone_acceptance") is not None else "")
            console.print(f"  {c:22s} {v['accepted']:6d}/{v['reached']:<6d} = {v['acceptance']:.3f}{alone}")
    console.print(f"-> {out}")


def _fig(value: float | None) -> str:
    """A figure to three decimals; "—" when it is undefined (nothing was drafted)."""
    return "—" if value is None else f"{value:.3f}"
