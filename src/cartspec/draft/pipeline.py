"""Training a draft head, or the hybrid's pointer, as functions: prompts in, a head (pointer) directory out.

``build_head`` is the whole ``cartspec draft train`` pipeline (prompts, the target's regenerated answers, their
features, training, export, provenance), ``build_pointer`` the whole ``cartspec draft pointer``; the commands
only parse options into a config and print. Under ``torchrun`` ``build_head`` runs on every process: rank 0
regenerates and captures the features while the others wait at a barrier, every rank trains, rank 0 alone
exports (the others get None back).

Heavy imports (torch, transformers, vLLM) stay inside the functions: the CLI imports this module for its
defaults, and ``--help`` must stay instant.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from pydantic import BaseModel, ConfigDict, Field

Log = Callable[[str], None]


class DraftPipelineError(ValueError):
    """A setting or an input the pipeline refuses, before any expensive work; the message says what to give."""


class ProgressLike(Protocol):
    """What the pipeline needs of a progress display (``rich.progress.Progress`` has it)."""

    def __enter__(self) -> "ProgressLike": ...

    def __exit__(self, *exc: Any) -> Any: ...

    def add_task(self, description: str, **kw: Any) -> Any: ...

    def update(self, task: Any, **kw: Any) -> None: ...


class Quiet:
    """A progress display that shows nothing (ranks > 0 under torchrun, and callers that want no bars)."""

    def __enter__(self) -> "Quiet":
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False

    def add_task(self, *a: Any, **k: Any) -> int:
        return 0

    def update(self, *a: Any, **k: Any) -> None:
        pass


def _noop(*a: Any, **k: Any) -> None:
    pass


def default_out(label: str, digest: str, kind: str = "heads") -> Path:
    """Where a head (or a pointer: ``kind`` "pointers") goes unless the caller says: never into the bundled
    assets."""
    root = Path(os.environ["CARTSPEC_HOME"]) / kind if os.environ.get("CARTSPEC_HOME") else Path("runs") / kind
    return root / f"{label}-{digest[:8]}"


def is_bundled(path: Path, root: Path | None = None) -> bool:
    """Is ``path`` inside the bundled heads (or ``root``, e.g. the bundled pointers)?"""
    from ..model.registry import HEADS_DIR

    try:
        path.resolve().relative_to((root or HEADS_DIR).resolve())
        return True
    except ValueError:
        return False


# --- the head -------------------------------------------------------------------


class HeadTrainingConfig(BaseModel):
    """Everything ``build_head`` needs; the defaults are ``cartspec draft train``'s."""

    model_config = ConfigDict(extra="forbid")

    kind: Optional[str] = None  # generic | domain: a built-in prompt set (optional with a prompts file)
    target: Optional[str] = None  # base | commerce | HF directory | LoRA adapter directory
    out: Optional[Path] = None  # default: default_out(label, target digest)
    prompts: str = "1200"  # FILE.jsonl, or N prompts of `kind`
    limit: Optional[int] = None  # first N prompts of a prompts file
    substituted: int = Field(0, ge=0)  # extra domain prompts whose values no generator pool has (task.augment)
    init: Optional[str] = None  # start from this head (bundled name or directory) instead of a random one
    sampled: float = 0.5  # extra sampled answers, as a share of the prompts
    temperature: float = 0.7
    max_tokens: int = 192
    steps: Optional[int] = None  # overrides epochs
    epochs: float = 1.0
    ttt_steps: int = 5
    draft_vocab: int = 8192
    lr: float = 1e-3
    batch_tokens: int = 2048
    max_minutes: Optional[float] = None
    save_every: int = 50
    seed: int = 0
    enforce_eager: bool = False
    device: str = "auto"  # auto | cpu | cuda
    fsdp: bool = False
    replace_bundled: bool = False

    @property
    def from_file(self) -> bool:
        return not self.prompts.isdigit()

    @property
    def label(self) -> str:
        """The head's name: its prompt set, or "custom" for a user's prompts without one."""
        return (self.kind or "custom") if self.from_file else str(self.kind)

    @property
    def target_name(self) -> str:
        return self.target or ("base" if self.kind == "generic" else "commerce")


class HeadTrainingResult(BaseModel):
    """What ``build_head`` exported (rank 0)."""

    out: Path
    size_bytes: int
    steps: int
    training_seconds: float
    acc_per_step_last20: list[Any]


def _builtin_prompts(kind: str, tok: Any, n: int, seed: int) -> tuple[list[list[int]], str]:
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


def _substituted_prompts(tok: Any, n: int, seed: int) -> tuple[list[list[int]], str]:
    from ..task.augment import substituted_requests
    from ..task.prompts import render

    texts = [render(tok, r) for r in substituted_requests(n, seed)]
    return ([tok(t, add_special_tokens=False).input_ids for t in texts],
            f"substituted_requests({n}, seed={seed}) (training-split search requests whose products, brands, "
            "colours and materials are words of no generator or novel pool)")


def _warm_start(init: str, digest: str) -> Any:
    """The head ``init`` names (a bundled head or a head directory) as a warm start, with its own draft
    vocabulary; refused when it was trained for another target."""
    from ..model.convert import ModelNotFound
    from ..model.registry import head_target, resolve_head
    from .train import WarmStart, head_draft_ids

    try:
        head_dir = resolve_head(init)
    except ModelNotFound as exc:
        raise DraftPipelineError(f"--init {init}: {exc}") from exc
    its = (head_target(head_dir) or {}).get("digest")
    if its and its != digest:
        raise DraftPipelineError(f"--init {init}: that head was trained for target digest {its}, not this target's "
                                 f"{digest}; start from a head of this target or leave --init out")
    return WarmStart(head_dir=head_dir, draft_ids=head_draft_ids(head_dir))


def _start_line(init: str | None, warm: Any) -> str:
    """The provenance's ``start`` line; taken before training, so that a head exported over its own parent
    (``--replace-bundled``) still names the parent's weights."""
    if warm is None:
        return "random initialisation"
    from ..paths import file_digest

    return (f"warm, from `{init}` (`{warm.head_dir}`, model.safetensors digest "
            f"{file_digest(Path(warm.head_dir) / 'model.safetensors')[:16]}), its draft vocabulary widened by the "
            "reply tokens it lacked, seen twice or more")


def _widened(warm: Any, records: list[dict[str, Any]], model_dir: Path, log: Log) -> Any:
    """``warm`` with its draft vocabulary widened by every reply token seen at least twice that it lacks
    (``train.widen_vocab``, as ``cartspec draft refresh`` does): a head cannot learn to draft a token its
    vocabulary does not hold, and new prompts (substituted values) bring new words."""
    import json
    from collections import Counter

    from .train import WarmStart, widen_vocab

    V = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    new_ids, added = widen_vocab(warm.draft_ids, Counter(t for r in records for t in r["output_ids"]), V)
    log(f"warm start from {warm.head_dir}: draft vocabulary {len(warm.draft_ids)} + {len(added)} reply tokens "
        f"it lacked (seen twice or more) = {len(new_ids)}")
    return WarmStart(head_dir=warm.head_dir, draft_ids=new_ids)


def _file_prompts(path: str, tok: Any, limit: int | None) -> tuple[list[list[int]], str]:
    """A user's prompts: cartspec request lines or OpenAI chat lines, rendered with the target's template."""
    from ..task.data import read_requests
    from ..task.prompts import messages

    reqs = read_requests(path)[:limit] if limit else read_requests(path)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"the target's tokenizer has no chat template: cannot render the prompts of {path}")
    texts = [tok.apply_chat_template(messages(r), tokenize=False, add_generation_prompt=True) for r in reqs]
    return ([tok(t, add_special_tokens=False).input_ids for t in texts],
            f"{len(reqs)} requests from `{path}` rendered with the target's chat template")


def build_head(cfg: HeadTrainingConfig, *, command: str | None = None, log: Log = _noop,
               progress: Callable[[], ProgressLike] = Quiet) -> HeadTrainingResult | None:
    """Regenerate the target's answers to the prompts, capture its features, train the head (resumable),
    export it to ``cfg.out`` with PROVENANCE.md and training_log.json. ``command`` is the command line the
    provenance records. Raises DraftPipelineError for settings or inputs it refuses, before the slow part.
    Returns None on ranks other than 0 under torchrun."""
    import torch
    from transformers import AutoTokenizer

    from ..model.convert import ModelNotFound
    from ..model.registry import resolve_model, target_digest
    from ..paths import config_digest, home
    from ..task.data import DataFileError
    from .export import export_head, head_size_bytes
    from .features import FeatureSet, Sampling, build_features
    from .train import TrainConfig, distributed, pick_device, train_head

    if cfg.kind is not None and cfg.kind not in ("generic", "domain"):
        raise DraftPipelineError("--kind must be generic or domain")
    if cfg.substituted and cfg.kind != "domain":
        raise DraftPipelineError("--substituted adds commerce requests: it goes with --kind domain")
    if not cfg.from_file and cfg.kind is None:
        raise DraftPipelineError("give the training prompts: --prompts FILE.jsonl (your own requests or chat "
                                 "lines), or --kind generic|domain for a built-in set")
    try:
        dev = pick_device(cfg.device)
    except ValueError as exc:
        raise DraftPipelineError(str(exc)) from exc
    label, target = cfg.label, cfg.target_name
    try:
        model_dir = resolve_model(target)
    except ModelNotFound as exc:
        raise DraftPipelineError(str(exc)) from exc
    digest = target_digest(model_dir)
    out = cfg.out or default_out(label, digest)
    if is_bundled(out) and not cfg.replace_bundled:
        raise DraftPipelineError(f"--out {out} is inside the bundled heads; a trained head goes elsewhere (default "
                                 "runs/heads/) unless --replace-bundled says to replace a bundled one")
    warm = _warm_start(cfg.init, digest) if cfg.init else None
    start_line = _start_line(cfg.init, warm)
    rank, world = distributed()
    rank_log: Log = log if rank == 0 else _noop
    t_start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(model_dir)
    try:
        prompt_ids, prompt_desc = (_file_prompts(cfg.prompts, tok, cfg.limit) if cfg.from_file
                                   else _builtin_prompts(label, tok, int(cfg.prompts), cfg.seed))
        subst_ids, subst_desc = _substituted_prompts(tok, cfg.substituted, cfg.seed) if cfg.substituted else ([], "")
    except (DataFileError, ValueError) as exc:
        raise DraftPipelineError(str(exc)) from exc
    if subst_desc:
        prompt_desc += f"; plus {subst_desc}"
    # each prompt set is its own feature cache: adding substituted prompts reuses the plain set's features
    sets: list[tuple[str, list[list[int]], list[Any]]] = []
    for tag, ids, seed_base in ((label, prompt_ids, cfg.seed * 100003),
                                (f"{label}-substituted", subst_ids, cfg.seed * 100003 + 50_000_017)):
        if not ids:
            continue
        n_s = int(round(cfg.sampled * len(ids)))
        sets.append((tag, ids + ids[:n_s], [Sampling(0.0, max_tokens=cfg.max_tokens)] * len(ids) + [
            Sampling(cfg.temperature, top_p=0.95, max_tokens=cfg.max_tokens, seed=seed_base + i)
            for i in range(n_s)]))
    n_greedy = len(prompt_ids) + len(subst_ids)
    n_s = sum(len(seqs) for _, seqs, _ in sets) - n_greedy
    rank_log(f"target {model_dir} (digest {digest}): {n_greedy} greedy + {n_s} sampled "
             f"(T={cfg.temperature}) answers")

    def features(log_to: Log, show: bool) -> list[tuple[Path, list[dict[str, Any]], list[Path]]]:
        built = []
        with progress() if show else Quiet() as pg:
            for tag, seqs, sampling in sets:
                task = pg.add_task("features", total=len(seqs), info=f"{tag}: regenerating with vLLM")
                res = build_features(
                    model_dir, seqs, sampling, tag=tag, enforce_eager=cfg.enforce_eager, log=log_to,
                    progress=lambda d, t, task=task: pg.update(task, completed=d, total=t,
                                                               info="HF forward, aux states"),
                    device=dev)
                pg.update(task, completed=len(seqs), info=str(res[0]))
                built.append(res)
        return built

    if world > 1:  # rank 0 builds (or finds cached) features; the others wait, then read the cache
        import torch.distributed as dist

        if rank == 0:
            built = features(log, True)
        dist.barrier()
        if rank != 0:
            built = features(rank_log, False)
    else:
        built = features(log, True)
    t_feat = time.perf_counter() - t_start
    fs = FeatureSet.load([sh for _, _, shards in built for sh in shards])
    records = [r for _, recs, _ in built for r in recs]
    fdir = built[0][0]
    resp_tokens = int(sum(len(r["output_ids"]) for r in records))
    rank_log(f"features: {fs.n_seqs} sequences, {int(fs.offsets[-1])} tokens ({resp_tokens} response) in "
             f"{', '.join(str(d) for d, _, _ in built)}")

    tcfg = TrainConfig(ttt_steps=cfg.ttt_steps, lr=cfg.lr, batch_tokens=cfg.batch_tokens, epochs=cfg.epochs,
                       steps=cfg.steps, draft_vocab_size=cfg.draft_vocab, save_every=cfg.save_every, seed=cfg.seed,
                       max_minutes=cfg.max_minutes, fsdp=cfg.fsdp)
    data_key = "+".join(d.name for d, _, _ in built)
    if warm is not None:
        warm = _widened(warm, records, model_dir, rank_log)
    work = home() / "draft" / "runs" / f"{label}-{config_digest([str(out.resolve()), data_key, cfg.init or ''])}"
    extra_vocab = [t for p in prompt_ids + subst_ids for t in p]
    with progress() if rank == 0 else Quiet() as pg:
        task = pg.add_task("train", total=1, info="")

        def on_step(step: int, total: int, rec: dict) -> None:
            accs = " ".join(f"{a:.2f}" if a is not None else "-" for a in rec["acc"])
            pg.update(task, completed=step, total=total, info=f"loss {rec['loss']:.3f} acc/step [{accs}]")

        head, summary = train_head(fs, model_dir, work, tcfg, extra_vocab_tokens=extra_vocab, data_key=data_key,
                                   on_step=on_step, log=rank_log, device=dev, warm=warm)
    if rank != 0:
        return None
    export_head(head, out, metadata={"kind": label, "target": str(model_dir)},
                target={"digest": digest, "name": target, "path": str(model_dir)})
    (out / "training_log.json").write_text((work / "training_log.json").read_text())
    size = head_size_bytes(out)
    write_head_provenance(
        out, command=command or f"cartspec draft train --kind {label}", cfg=cfg, tcfg=tcfg, model_dir=model_dir,
        digest=digest, prompt_desc=prompt_desc, n_greedy=n_greedy, n_sampled=n_s, features=fs,
        features_dir=fdir, response_tokens=resp_tokens, head=head, summary=summary, size_bytes=size, device=dev,
        start=start_line,
        world=world, seconds={"features": t_feat, "total": time.perf_counter() - t_start},
        threads=torch.get_num_threads())
    return HeadTrainingResult(out=out, size_bytes=size, steps=summary["steps"], training_seconds=summary["seconds"],
                              acc_per_step_last20=summary["acc_per_step_last20"])


def write_head_provenance(out: Path, *, command: str, cfg: HeadTrainingConfig, tcfg: Any, model_dir: Path,
                          digest: str, prompt_desc: str, n_greedy: int, n_sampled: int, features: Any,
                          features_dir: Path, response_tokens: int, head: Any, summary: dict[str, Any],
                          size_bytes: int, device: str, world: int, seconds: dict[str, float],
                          threads: int, start: str = "random initialisation") -> Path:
    """PROVENANCE.md beside the exported head: the command, the target, the data and how training went."""
    import json

    from .features import model_key
    from .head import param_count

    fs = features
    meta = json.loads((features_dir / "meta.json").read_text())
    path = out / "PROVENANCE.md"
    path.write_text(f"""# EAGLE-3 head: `{cfg.label}`

Built with

```
{command}
```

- target: `{model_dir}` (`{cfg.target_name}`, target digest {digest}, recorded in config.json; weights key
  {model_key(model_dir)})
- prompts: {prompt_desc}; answers regenerated by the target with vLLM offline:
  {n_greedy} greedy + {n_sampled} sampled (temperature {cfg.temperature}, top-p 0.95), max {cfg.max_tokens} tokens;
  {fs.n_seqs} sequences, {int(fs.offsets[-1])} tokens, {response_tokens} response tokens
- aux layers (vLLM ids = HF hidden_states indices): {fs.layer_ids}; features captured in
  {meta.get("capture_dtype", "bfloat16 (cached before capture followed the machine's dtype)")}
- start: {start}
- head: {param_count(head) / 1e6:.2f} M parameters, draft vocabulary {summary['draft_vocab_size']},
  norm_before_residual={tcfg.norm_before_residual}; `model.safetensors` bf16, {size_bytes / 1e6:.1f} MB
- training-time test: k={cfg.ttt_steps} steps, weights 0.8^step, lr {cfg.lr} (cosine), {cfg.batch_tokens} tokens/batch,
  {summary['steps']} optimiser steps ({summary['steps_per_epoch']} per epoch){' — stopped early by --max-minutes' if summary['stopped_early'] else ''}
- per-step accuracy (mean of the last 20 batches, vs the target's greedy token): {summary['acc_per_step_last20']}
- trained on {device}{f" with {world} processes ({summary['sharding'].upper()})" if world > 1 else ""}, compute dtype {summary.get('compute_dtype', '?')}
- time on this machine ({threads} threads): features {seconds['features'] / 60:.1f} min (incl. regeneration,
  cached on reruns), training {summary['seconds'] / 60:.1f} min, total {seconds['total'] / 60:.1f} min
- training log (loss and accuracy per step, every batch): `training_log.json`
""")
    return path


# --- the hybrid's pointer -------------------------------------------------------


class PointerTrainingConfig(BaseModel):
    """Everything ``build_pointer`` needs; the defaults are ``cartspec draft pointer``'s."""

    model_config = ConfigDict(extra="forbid")

    target: str = "commerce"
    prompts: str = "2400"  # N training-split requests with their gold replies, or FILE.jsonl with replies
    dev: str = "200"  # N dev-split requests, or FILE.jsonl, checked after every epoch (0: none)
    out: Optional[Path] = None  # default: default_out(target name, digest, "pointers")
    epochs: int = 8
    lr: float = 3e-3
    seed: int = 0
    replace_bundled: bool = False


class PointerTrainingResult(BaseModel):
    out: Path
    examples: int
    seconds: float
    last_epoch: dict[str, Any]


def build_pointer(cfg: PointerTrainingConfig, *, log: Log = _noop) -> PointerTrainingResult:
    """Train the hybrid's pointer on the requests' replies (no generation: the replies are what the model was
    fine-tuned to write) and save it to ``cfg.out``. Raises DraftPipelineError for what it refuses."""
    from transformers import AutoTokenizer

    from ..model.convert import ModelNotFound
    from ..model.registry import POINTERS_DIR, resolve_model, target_digest
    from ..drafting.tokens import TokenInfo
    from ..task.data import DataFileError, read_requests
    from .acceptance import load_data
    from .pointer import sequences_from_gold, train_pointer

    try:
        model_dir = resolve_model(cfg.target)
    except ModelNotFound as exc:
        raise DraftPipelineError(str(exc)) from exc
    digest = target_digest(model_dir)
    out = cfg.out or default_out(Path(cfg.target).name, digest, "pointers")
    if is_bundled(out, POINTERS_DIR) and not cfg.replace_bundled:
        raise DraftPipelineError(f"--out {out} is inside the bundled pointers; a trained pointer goes elsewhere "
                                 "unless --replace-bundled says to replace the bundled one")

    def requests(spec: str, split: str):
        if spec.isdigit():
            return (load_data(split, int(spec)) if int(spec) else []), f'generate("{split}", {spec}, seed=0)'
        return read_requests(spec), f"`{spec}`"

    try:
        train_reqs, train_desc = requests(cfg.prompts, "train")
        dev_reqs, dev_desc = requests(cfg.dev, "dev")
    except (DataFileError, FileNotFoundError) as exc:
        raise DraftPipelineError(str(exc)) from exc
    tok = AutoTokenizer.from_pretrained(model_dir)
    seqs, dev_seqs = sequences_from_gold(tok, train_reqs), sequences_from_gold(tok, dev_reqs)
    if not seqs:
        raise DraftPipelineError(f"none of the {len(train_reqs)} requests of {train_desc} has a reply to learn "
                                 "from: give each a gold answer, or end each chat line with the assistant's reply")
    log(f"pointer for {model_dir} (digest {digest}): {len(seqs)} replies of {train_desc}, "
        f"checked on {len(dev_seqs)} of {dev_desc}")
    info = TokenInfo.from_tokenizer(tok)
    summary = train_pointer(model_dir, seqs, info, out, epochs=cfg.epochs, lr=cfg.lr, seed=cfg.seed, dev=dev_seqs,
                            target={"name": cfg.target, "digest": digest}, log=log)
    last = dict(summary["epochs"][-1])
    for k, v in (summary["numbers"]["epochs"][-1:] or [{}])[0].items():  # the number net's, where trained
        if k != "epoch":
            last[k if k.startswith("dev_number") else f"number_{k}"] = v
    return PointerTrainingResult(out=out, examples=summary["examples"] + summary["numbers"]["examples"],
                                 seconds=summary["seconds"], last_epoch=last)


# --- what `draft acceptance` measures -------------------------------------------


def hybrid_config(lookup_min: int | None = None, lookup_max: int | None = None, rule: str | None = None,
                  scope: str | None = None, head_p: float | None = None, pointer: str | None = None,
                  target: str | None = None, head: str | None = None) -> Any:
    """The hybrid's ``HybridConfig`` from ``draft acceptance``'s settings (None: the default's; the rule: the
    default for ``target``, ``drafting.config.default_rule``, as ``serve`` deploys), its pointer resolved where
    the rule is ``pointer``: without ``pointer``, the one kept in ``head``'s directory where it has one (a
    refreshed version's), else the bundled one. Raises DraftPipelineError for a setting it refuses."""
    from ..drafting.config import DEFAULT, NEEDS_POINTER, HybridConfig, default_rule, for_target
    from ..model.convert import ModelNotFound
    from ..model.registry import head_pointer, resolve_head, resolve_model

    try:
        head_dir = resolve_head(head) if head else None
        if rule is None:
            own = head_pointer(head_dir)
            rule = default_rule(resolve_model(target) if target else None, pointer or (str(own) if own else None))
        if pointer and rule not in NEEDS_POINTER:
            raise DraftPipelineError(f"--pointer is a setting of --rule {' or '.join(NEEDS_POINTER)}")
        return for_target(HybridConfig(n_min=lookup_min or DEFAULT.n_min, n_max=lookup_max or DEFAULT.n_max,
                                       rule=rule, scope=scope or DEFAULT.scope, pointer=pointer or "",
                                       head_p=head_p), None, head_dir)
    except (ValueError, ModelNotFound) as exc:
        raise DraftPipelineError(str(exc)) from exc


def check_drafters(head: str, target: str, pointer: str | None = None, *, force: bool = False,
                   warn: Log = _noop) -> None:
    """Refuse a head (and the hybrid's pointer) trained for another target than ``target`` (``force``: warn
    instead). Raises DraftPipelineError."""
    from ..model.convert import ModelNotFound
    from ..model.registry import HeadMismatch, check_head, resolve_head, resolve_model

    try:
        check_head(resolve_head(head), resolve_model(target), force=force, warn=warn)
        if pointer:
            check_head(Path(pointer), resolve_model(target), force=force, warn=warn, what="pointer")
    except (HeadMismatch, ModelNotFound) as exc:
        raise DraftPipelineError(str(exc)) from exc
