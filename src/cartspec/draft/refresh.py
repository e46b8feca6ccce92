"""A new version of a registered head, trained on the traffic the agent recorded (``cartspec draft refresh``).

``refresh_head`` reads the traffic files (``cartspec.task.traffic``), keeps one record per distinct request
(the most recent), and sets the most recent share aside by time as held-out: it is never trained on, and
the offline gate measures candidates on it. The replies of the rest are the served target's own:

* a reply written at temperature 0 is the target's greedy continuation of its prompt, so it is used as it
  is: the prompt is the record's ``messages`` rendered with the target's chat template (generation prompt
  added, no special tokens added: what vLLM's chat endpoint does), the reply its text tokenised the same
  way, followed by the tokenizer's EOS unless the reply was cut at the token cap (``output_tokens`` equals
  the reply's token count: vLLM counts the EOS it stops on);
* a reply sampled at temperature > 0 is not what the head must predict: the target regenerates it greedily
  with vLLM offline (``features.vllm_generate``), as ``--regenerate all`` does for every record.

Features are captured with the same ``extract`` as ``cartspec draft train`` and cached by content (the
target's weights, every prompt and reply, the aux layers), so a rerun reuses them; the held-out records'
replies are made and captured the same way. Training starts from the registry's current version (``--init
current``: its weights, its draft vocabulary widened by every training reply token it lacks, copied values
included) or from scratch (``--init fresh``), for a budget of optimiser steps that grows with the traffic
(``budget.default_budget``), stopping early when the head's simulated τ on the held-out records stops
improving (``budget.EarlyStop``; the best head measured is kept). It resumes from its checkpoint after a
crash, and the head is registered as a candidate version with its provenance (target and adapter digests,
data and held-out windows, parent, vocabulary figures, the command, seconds per phase) in the version's
``version.json`` and ``PROVENANCE.md``. Under ``torchrun`` rank 0 prepares the features while the other
ranks wait at a barrier, every rank trains, rank 0 registers.

The hybrid's pointer is trained on the same sequences (``refresh_pointer``, unless ``--no-pointer``), from the
parent's own pointer, else the bundled one where it was trained for the target, else random weights, and kept
in the version's ``pointer/``: head and pointer are one version of the deployed drafter.

Heavy imports (torch, transformers) stay inside the functions: the CLI imports this module for its
defaults, and ``--help`` must stay instant.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field

from .budget import MIN_DELTA, PATIENCE, default_budget, default_eval_every
from .pipeline import DraftPipelineError, Log, ProgressLike, Quiet, _noop

MIN_RECORDS = 20  # distinct requests needed to refresh a head at all
WARM = {"lr": 5e-4}  # a warm start only adapts a trained head: a gentler rate
FRESH = {"lr": 1e-3}
EVAL_GAMMA = 3  # draft length of the held-out τ that early stopping reads (simulated chain drafting)
# the hybrid's pointer, trained on the same traffic: a warm start adapts the parent's; fresh: `draft pointer`'s
POINTER_WARM = {"epochs": 3, "lr": 1e-3}
POINTER_FRESH = {"epochs": 8, "lr": 3e-3}


class RefreshError(DraftPipelineError):
    """Traffic, a registry or a setting that a refresh refuses; the message says what to do."""


class RefreshConfig(BaseModel):
    """Everything ``refresh_head`` needs; the defaults are ``cartspec draft refresh``'s."""

    model_config = ConfigDict(extra="forbid")

    traffic: Path  # a traffic directory (traffic-*.jsonl) or one file
    head: str  # the head registry's name
    from_head: Optional[str] = None  # seeds a registry that does not exist yet: a bundled head name or a head dir
    target: Optional[str] = None  # default: the target the current version was trained for
    init: Literal["current", "fresh"] = "current"
    held_out: float = Field(0.2, ge=0.0, lt=1.0)  # most recent share by time, never trained on
    regenerate: Literal["sampled", "all"] = "sampled"
    # added draft tokens; None: every training reply token the draft vocabulary lacks seen >= min_count times
    widen: Optional[int] = Field(None, ge=0)
    min_count: int = Field(1, ge=1)  # 1: a value copied from one shopper's request is added too
    draft_vocab: int = 8192  # --init fresh only
    steps: Optional[int] = Field(None, ge=0)  # the budget in optimiser steps; default: budget.default_budget
    epochs: Optional[float] = Field(None, gt=0)  # instead of --steps: a budget of this many passes over the data
    eval_every: Optional[int] = Field(None, ge=0)  # held-out τ every N steps; default: budget-derived; 0: never
    patience: int = Field(PATIENCE, ge=0)  # stop after this many evaluations without improvement; 0: never
    min_delta: float = Field(MIN_DELTA, ge=0.0)  # an improvement: τ up by more than this
    lr: Optional[float] = None  # default: WARM / FRESH
    ttt_steps: int = 5
    batch_tokens: int = 2048
    max_tokens: int = 192  # cap when regenerating a sampled reply
    max_minutes: Optional[float] = None
    save_every: int = 50
    seed: int = 0
    min_records: int = MIN_RECORDS
    enforce_eager: bool = False
    device: str = "auto"
    fsdp: bool = False
    force: bool = False  # refresh although the head or the traffic is pinned to another target
    pointer: bool = True  # train the hybrid's pointer too, kept in the version's pointer/ (False: none of its own)
    pointer_epochs: Optional[int] = Field(None, ge=0)  # default: POINTER_WARM / POINTER_FRESH

    def budget(self, n_train: int, steps_per_epoch: int) -> tuple[int, str]:
        """The optimiser steps to train for (at most: early stopping may end sooner) and where the number comes
        from: --steps, else --epochs passes of ``steps_per_epoch``, else ``default_budget(n_train)``."""
        if self.steps is not None:
            return self.steps, "--steps"
        if self.epochs is not None:
            return max(1, math.ceil(self.epochs * steps_per_epoch)), f"--epochs {self.epochs:g}"
        return default_budget(n_train, self.init), f"default for {n_train} training records"

    def eval_every_for(self, budget: int) -> int:
        return self.eval_every if self.eval_every is not None else default_eval_every(budget)

    @property
    def lr_or_default(self) -> float:
        return self.lr if self.lr is not None else (WARM if self.init == "current" else FRESH)["lr"]


class TrafficSplit(BaseModel):
    """The records a refresh trains on and the held-out ones, with the figures provenance records."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    train: list[Any]
    held_out: list[Any]
    read: int
    first_ts: float
    last_ts: float

    @property
    def after_dedupe(self) -> int:
        return len(self.train) + len(self.held_out)

    def windows(self, share: float) -> dict[str, Any]:
        held = ({"since": self.held_out[0].ts, "until": self.held_out[-1].ts} if self.held_out
                else {"since": None, "until": None})
        return {"records": {"read": self.read, "first_ts": self.first_ts, "last_ts": self.last_ts,
                            "after_dedupe": self.after_dedupe, "train": len(self.train),
                            "held_out": len(self.held_out)},
                "data_window": {"since": self.train[0].ts if self.train else None,
                                "until": self.train[-1].ts if self.train else None},
                "held_out": {**held, "share": share, "n": len(self.held_out)}}


class RefreshResult(BaseModel):
    """The registered candidate and what went into it (rank 0)."""

    ref: str
    path: Path
    parent: Optional[str]
    steps: int
    training_seconds: float
    acc_per_step_last20: list[Any]
    provenance: dict[str, Any]
    reused: bool = False  # the same run was registered before: that version is returned


# --- the traffic -------------------------------------------------------------------------------------

def split_recent(records: Sequence[Any], share: float) -> tuple[list[Any], list[Any]]:
    """(older, most recent ``share``) by time (``traffic.split_by_time``); a training record sharing the first
    held-out record's timestamp moves to the held-out side, so every training record is older than every
    held-out one (the gate takes the records after ``data_window.until`` as held-out)."""
    from ..task.traffic import split_by_time

    train, held = split_by_time(records, share)
    if held and train:
        since = held[0].ts
        held = [r for r in train if r.ts >= since] + held
        train = [r for r in train if r.ts < since]
    return train, held


def load_traffic(path: Path, share: float, min_records: int = MIN_RECORDS) -> TrafficSplit:
    """Read the traffic, keep the latest record of each request (``traffic.dedupe``) and split it by time;
    RefreshError when there is none, or too little."""
    from ..task.traffic import FILE_GLOB, dedupe, read_traffic

    path = Path(path).expanduser()
    if not path.exists():
        raise RefreshError(f"no traffic at {path}: record some with `cartspec serve --record-traffic {path}`")
    if path.is_dir() and not any(path.glob(FILE_GLOB)):
        raise RefreshError(f"{path} holds no traffic files (traffic-*.jsonl): record traffic with "
                           f"`cartspec serve --record-traffic {path}`, or point --traffic at the directory it wrote")
    records = [r for r in read_traffic(path) if r.messages]  # a completion's raw prompt: no chat turns to train on
    if not records:
        raise RefreshError(f"the traffic files in {path} hold no records yet")
    kept = dedupe(records)
    if len(kept) < min_records:
        raise RefreshError(f"{path} holds {len(kept)} distinct requests ({len(records)} records): a refresh needs "
                           f"at least {min_records}; record more traffic first")
    train, held = split_recent(kept, share)
    if not train:
        raise RefreshError(f"nothing left to train on after setting {share:.0%} aside as held-out "
                           f"({len(kept)} distinct requests, all at one time?): lower --held-out")
    return TrafficSplit(train=train, held_out=held, read=len(records), first_ts=records[0].ts,
                        last_ts=records[-1].ts)


# --- the registry and the target ---------------------------------------------------------------------

def registry_current(cfg: RefreshConfig, log: Log = _noop) -> Any:
    """The registry's current version; seeds a registry that does not exist from ``cfg.from_head``."""
    from ..model.convert import ModelNotFound
    from ..model.heads import HeadRegistry, HeadRegistryError
    from ..model.registry import resolve_head

    try:
        reg = HeadRegistry(cfg.head)
    except HeadRegistryError as exc:
        raise RefreshError(str(exc)) from exc
    if not reg.exists():
        if not cfg.from_head:
            raise RefreshError(f"there is no head registry {cfg.head!r} ({reg.dir}): seed it with the head it "
                               f"starts from, e.g. `--from domain` (a bundled head) or `--from DIR`")
        try:
            src = resolve_head(cfg.from_head)
        except ModelNotFound as exc:
            raise RefreshError(f"--from {cfg.from_head}: {exc}") from exc
        v = reg.add(src, provenance={"seeded_from": cfg.from_head, "command": f"seeded by `cartspec draft refresh "
                                     f"--head {cfg.head} --from {cfg.from_head}`"})
        log(f"head registry {cfg.head!r} seeded from {src}: {v.ref} is current")
    elif cfg.from_head:
        log(f"head registry {cfg.head!r} exists: --from {cfg.from_head} is not needed and is ignored")
    cur = reg.current()
    if cur is None:
        raise RefreshError(f"the head registry {cfg.head!r} has no current version: promote one with "
                           f"`cartspec heads promote {cfg.head}@vN`")
    return cur


def adapter_digest_of(model_dir: Path) -> str | None:
    """The adapter digest a merged target records (its ``cartspec.json`` merge marker), else None."""
    marker = Path(model_dir) / "cartspec.json"
    if not marker.exists():
        return None
    m = json.loads(marker.read_text())
    return m.get("adapter_digest") if m.get("stage") == "merge" else None


def check_pins(cfg: RefreshConfig, current: Any, model_dir: Path, digest: str, records: Sequence[Any],
               warn: Log = _noop) -> None:
    """Refuse a current head, or traffic served by a version of this registry, pinned to another target than
    ``model_dir`` (``cfg.force``: warn instead)."""
    from ..model.convert import ModelNotFound
    from ..model.heads import HeadRegistry, HeadRegistryError
    from ..model.registry import HeadMismatch, check_head

    try:
        check_head(current.path, model_dir, force=cfg.force, warn=warn)
    except HeadMismatch as exc:
        raise RefreshError(f"{current.ref}: {exc}. Refresh with the target it was trained for (--target), or "
                           "start another registry (--head OTHER --from HEAD)") from exc
    if current.target_digest and current.target_digest != digest and not cfg.force:
        # a head made for the target's base drafts for it, but the registry keeps one target per name
        raise RefreshError(f"the head registry {cfg.head!r} is pinned to target {current.target_digest} "
                           f"({current.target_name or '?'}), --target {model_dir} has digest {digest}: the new "
                           "version would be pinned to another target than its registry. Refresh for "
                           f"{current.target_name or 'that target'} (--target), start another registry "
                           "(--head OTHER --from HEAD), or pass --force")
    reg = HeadRegistry(cfg.head)
    other: dict[str, str] = {}
    for version in sorted({r.head_version for r in records if r.head == cfg.head and r.head_version}):
        try:
            v = reg.get(version)
        except (ModelNotFound, HeadRegistryError):
            continue
        if v.target_digest and v.target_digest != digest:
            other[v.ref] = v.target_digest
    if other:
        msg = (f"the traffic was served with {', '.join(other)} pinned to another target "
               f"({', '.join(sorted(set(other.values())))}) than --target {model_dir} (digest {digest}): its replies "
               "are another model's. Refresh with that target (--target), or pass --force")
        if not cfg.force:
            raise RefreshError(msg)
        warn("WARNING (--force): " + msg.split(". Refresh")[0])


# --- prompts, replies and features -------------------------------------------------------------------

def render_prompt(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    """The token ids vLLM's chat endpoint prefills for ``messages``."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def reply_ids(tok: Any, rec: Any, eos: int | None) -> list[int]:
    """The reply's tokens as the target wrote them: the text, then EOS unless it was cut at the token cap."""
    ids = tok(rec.reply, add_special_tokens=False).input_ids
    cut = bool(rec.output_tokens) and rec.output_tokens == len(ids)
    return ids + ([eos] if eos is not None and not cut else [])


def eos_id(tok: Any, model_dir: Path) -> int | None:
    """The token the target ends a chat turn with: the tokenizer's EOS, else the model config's (first)."""
    if tok.eos_token_id is not None:
        return int(tok.eos_token_id)
    e = json.loads((Path(model_dir) / "config.json").read_text()).get("eos_token_id")
    return e if isinstance(e, int) else (e[0] if e else None)


def traffic_records(model_dir: Path, tok: Any, records: Sequence[Any], regenerate: str, max_tokens: int,
                    enforce_eager: bool = False, log: Log = _noop) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Records in ``vllm_generate``'s format (``prompt_ids``, ``output_ids``) for the training traffic: replies
    at temperature 0 as they are, the others (every one with ``regenerate`` "all") regenerated greedily with
    vLLM (cached by prompts and target). Returns (records in traffic order, counts)."""
    from ..paths import config_digest
    from . import features as F_
    from .features import Sampling, features_dir, model_key

    if regenerate not in ("sampled", "all"):
        raise RefreshError(f"--regenerate must be sampled or all, not {regenerate!r}")
    eos = eos_id(tok, model_dir)
    prompts = [render_prompt(tok, list(r.messages)) for r in records]
    regen = [i for i, r in enumerate(records) if regenerate == "all" or r.temperature > 0]
    regen_set = set(regen)
    out: list[dict[str, Any]] = [{}] * len(records)
    for i, r in enumerate(records):
        if i not in regen_set:
            out[i] = {"i": i, "id": r.id, "prompt_ids": prompts[i], "output_ids": reply_ids(tok, r, eos),
                      "finish_reason": "traffic"}
    if regen:
        sampling = [Sampling(0.0, max_tokens=max_tokens)] * len(regen)
        key = config_digest({"model": model_key(model_dir), "prompts": [prompts[i] for i in regen],
                             "sampling": [s.as_dict() for s in sampling], "v": 1})
        gen = F_.vllm_generate(model_dir, [prompts[i] for i in regen], sampling,
                               features_dir() / f"regen-{key}" / "records.jsonl", enforce_eager=enforce_eager, log=log)
        if len(gen) != len(regen):
            raise RefreshError(f"vLLM answered {len(gen)} of {len(regen)} prompts: rerun the command")
        for i, g in zip(regen, gen):
            out[i] = {"i": i, "id": records[i].id, "prompt_ids": list(g["prompt_ids"]),
                      "output_ids": list(g["output_ids"]), "finish_reason": g.get("finish_reason") or "regenerated"}
    return out, {"as_is": len(records) - len(regen), "regenerated": len(regen)}


def traffic_features(model_dir: Path, records: list[dict[str, Any]], tag: str, log: Log = _noop,
                     progress: Callable[[int, int], None] | None = None, device: str = "cpu",
                     shard_size: int = 256) -> tuple[Path, list[Path]]:
    """Capture (cached by content, resumable) the target's features over ``records``. Returns (dir, shards)."""
    from ..paths import config_digest
    from ..serving.engine import compute_dtype
    from .features import aux_layer_ids_for, extract, features_dir, model_key

    layer_ids = aux_layer_ids_for(model_dir)
    key = config_digest({"model": model_key(model_dir), "layers": layer_ids, "v": 1,
                         "seqs": [[list(r["prompt_ids"]), list(r["output_ids"])] for r in records]})
    d = features_dir() / f"{tag}-{key}"
    d.mkdir(parents=True, exist_ok=True)
    recs_path = d / "records.jsonl"
    if not recs_path.exists():
        tmp = recs_path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        tmp.replace(recs_path)
    t0 = time.perf_counter()
    shards = extract(model_dir, records, d, layer_ids, shard_size=shard_size, progress=progress, device=device)
    meta = d / "meta.json"
    if not meta.exists():
        meta.write_text(json.dumps({"model": str(model_dir), "layer_ids": layer_ids, "n": len(records),
                                    "response_tokens": sum(len(r["output_ids"]) for r in records),
                                    "extract_seconds": round(time.perf_counter() - t0, 1),
                                    "capture_dtype": str(compute_dtype(device)).removeprefix("torch."),
                                    "source": "traffic"}, indent=2))
    return d, shards


def outside(tokens: Sequence[int], vocab: set[int]) -> int:
    return sum(1 for t in tokens if t not in vocab)


def held_out_tau(held: Any, gamma: int = EVAL_GAMMA) -> Callable[[Any, Any], float]:
    """The score early stopping reads: a head's simulated τ (``simulate.simulate``, chain drafting at ``gamma``)
    on the held-out records' features ``held`` (a FeatureSet), given the target's embedding; 1.0 (one token per
    step) where nothing was drafted."""
    from .simulate import simulate

    def tau(head: Any, embed: Any) -> float:
        summary, _ = simulate(head, embed, held, gamma)
        return float(summary["tau"]) if summary["tau"] is not None else 1.0

    return tau


# --- the hybrid's pointer ----------------------------------------------------------------------------

def parent_pointer(init: str, current: Any, model_dir: Path) -> tuple[str, Path | None]:
    """Where the refreshed pointer starts: ("parent", the current version's own pointer) where it keeps one,
    else ("bundled", the bundled pointer) where that was trained for this very target, else ("fresh", None);
    ``init`` "fresh" (the whole drafter from scratch): ("fresh", None)."""
    from ..model.registry import head_pointer, matching_bundled_pointer, resolve_pointer

    if init == "fresh":
        return "fresh", None
    own = head_pointer(current.path)
    if own is not None:
        return "parent", own
    bundled = matching_bundled_pointer(Path(model_dir))
    return ("bundled", resolve_pointer(bundled)) if bundled else ("fresh", None)


def refresh_pointer(cfg: RefreshConfig, current: Any, model_dir: Path, target: dict[str, Any],
                    records: Sequence[dict[str, Any]], held_out: Sequence[Any], out: Path,
                    log: Log = _noop) -> dict[str, Any]:
    """Train the hybrid's pointer on the sequences the head trains on (``records``: prompt + reply ids),
    checked on the held-out records written at temperature 0, starting from ``parent_pointer``; save it to
    ``out`` (the head directory's ``pointer/``, pinned to ``target``). Returns its provenance entry."""
    import shutil

    from transformers import AutoTokenizer

    from ..drafting.tokens import TokenInfo
    from ..model.registry import pointer_digest
    from .pointer import train_pointer

    init, start = parent_pointer(cfg.init, current, model_dir)
    defaults = POINTER_WARM if start is not None else POINTER_FRESH
    epochs = cfg.pointer_epochs if cfg.pointer_epochs is not None else int(defaults["epochs"])
    lr = float(defaults["lr"])
    tok = AutoTokenizer.from_pretrained(model_dir)
    eos = eos_id(tok, model_dir)
    seqs = [(list(r["prompt_ids"]) + list(r["output_ids"]), len(r["prompt_ids"])) for r in records]
    dev = []
    for r in held_out:
        if r.temperature == 0:
            p = render_prompt(tok, list(r.messages))
            dev.append((p + reply_ids(tok, r, eos), len(p)))
    if out.exists():
        shutil.rmtree(out)
    log(f"pointer: starting from {start or 'random weights'} ({init}); {epochs} epochs at lr {lr:g} on "
        f"{len(seqs)} replies, checked on {len(dev)} held-out ones")
    try:
        s = train_pointer(model_dir, seqs, TokenInfo.from_tokenizer(tok), out, epochs=epochs, lr=lr,
                          seed=cfg.seed, dev=dev, target=target, init=start, keep_best=True, log=log)
    except ValueError as exc:  # a parent pointer of another hidden size
        raise RefreshError(f"{exc}: refresh without the pointer (--no-pointer) or from scratch (--init fresh)") \
            from exc
    def kept(rows: list[dict[str, Any]], start: dict[str, Any]) -> dict[str, Any]:
        """The held-out figures of the epoch the net kept (0: its start), else of its last epoch."""
        k = rows[-1].get("kept_epoch", len(rows)) if rows else 0
        return {key: v for key, v in (rows[k - 1] if k else start).items() if key.startswith("dev_")}

    numbers = lambda d: {k: v for k, v in d.items() if k.startswith("dev_number_")}  # noqa: E731
    begin = s["start"] or {}
    last = {**kept(s["epochs"], {k: v for k, v in begin.items() if k not in numbers(begin)}),
            **kept(s["numbers"]["epochs"], numbers(begin))}
    kept_epochs = {"strings": (s["epochs"][-1:] or [{}])[0].get("kept_epoch"),
                   "numbers": (s["numbers"]["epochs"][-1:] or [{}])[0].get("kept_epoch")}
    return {"kept_epoch": kept_epochs, "init": init, "parent_path": str(start) if start else None,
            "parent_digest": pointer_digest(start) if start else None, "digest": pointer_digest(out),
            "examples": s["examples"] + s["numbers"]["examples"], "copied": s["copied"] + s["numbers"]["copied"],
            "held_out_examples": s["dev_examples"] + s["numbers"]["dev_examples"], "epochs": epochs, "lr": lr,
            "seconds": s["seconds"], "accuracy_before": s["start"] or None,
            "accuracy": last or (s["start"] if epochs == 0 else {}) or None}


# --- the whole refresh -------------------------------------------------------------------------------

def refresh_head(cfg: RefreshConfig, *, command: str | None = None, log: Log = _noop,
                 progress: Callable[[], ProgressLike] = Quiet) -> RefreshResult | None:
    """Train a new version of the head registry ``cfg.head`` from the traffic in ``cfg.traffic`` and register
    it as a candidate. Raises RefreshError for inputs it refuses, before the slow part. Returns None on ranks
    other than 0 under torchrun."""
    import torch
    from transformers import AutoTokenizer

    from ..model.convert import ModelNotFound
    from ..model.heads import HeadRegistry, HeadRegistryError
    from ..model.registry import HEAD_POINTER, head_digest, head_target, resolve_model, target_digest
    from ..paths import config_digest, file_digest, home
    from .export import export_head, head_size_bytes
    from .features import FeatureSet
    from .train import (TrainConfig, WarmStart, distributed, head_draft_ids, pick_device, steps_per_epoch,
                        train_head, widen_vocab)

    if cfg.init == "fresh" and cfg.widen is not None:
        raise RefreshError("--widen widens the current head's vocabulary: a setting of --init current "
                           "(--init fresh chooses --draft-vocab tokens from the traffic)")
    try:
        dev = pick_device(cfg.device)
    except ValueError as exc:
        raise RefreshError(str(exc)) from exc
    rank, world = distributed()
    rank_log: Log = log if rank == 0 else _noop
    command = command or f"cartspec draft refresh --traffic {cfg.traffic} --head {cfg.head}"
    t_start = time.perf_counter()
    seconds: dict[str, float] = {}

    def prepare(plog: Log, pg_factory: Callable[[], ProgressLike]) -> dict[str, Any]:
        """Everything before training: the same on every rank (rank 0 first; the others find it cached)."""
        t0 = time.perf_counter()
        split = load_traffic(cfg.traffic, cfg.held_out, cfg.min_records)
        current = registry_current(cfg, plog)
        target = cfg.target or current.target_name or (head_target(current.path) or {}).get("name")
        if not target:
            raise RefreshError(f"{current.ref} does not record which target it was trained for: name it with --target")
        try:
            model_dir = resolve_model(target)
        except ModelNotFound as exc:
            raise RefreshError(str(exc)) from exc
        digest = target_digest(model_dir)
        check_pins(cfg, current, model_dir, digest, split.train + split.held_out, warn=plog)
        plog(f"traffic {cfg.traffic}: {split.read} records, {split.after_dedupe} distinct requests; training on "
             f"{len(split.train)}, holding out the {len(split.held_out)} most recent")
        plog(f"{cfg.head}: starting from {current.ref} ({'its weights' if cfg.init == 'current' else 'scratch'}); "
             f"target {model_dir} (digest {digest})")
        seconds["read"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        tok = AutoTokenizer.from_pretrained(model_dir)
        if not getattr(tok, "chat_template", None):
            raise RefreshError(f"the target's tokenizer ({model_dir}) has no chat template: cannot render the "
                               "traffic's messages as the server did")
        with pg_factory() as pg:
            # the held-out replies as the training ones: as written at temperature 0, sampled ones regenerated
            # (one vLLM run for both)
            both = split.train + split.held_out
            n_regen = sum(1 for r in both if cfg.regenerate == "all" or r.temperature > 0)
            task = pg.add_task("features", total=len(both),
                               info=f"regenerating {n_regen} sampled replies with vLLM" if n_regen else "")
            recs_both, _ = traffic_records(model_dir, tok, both, cfg.regenerate, cfg.max_tokens,
                                           enforce_eager=cfg.enforce_eager, log=plog)
            n = len(split.train)
            records = recs_both[:n]
            held_records = [{**r, "i": j} for j, r in enumerate(recs_both[n:])]
            train_regen = sum(1 for r in split.train if cfg.regenerate == "all" or r.temperature > 0)
            counts = {"as_is": n - train_regen, "regenerated": train_regen}
            fdir, shards = traffic_features(
                model_dir, records, f"refresh-{cfg.head}", log=plog, device=dev,
                progress=lambda d, t: pg.update(task, completed=d, total=len(both), info="HF forward, aux states"))
            held_dir, held_shards = None, []
            if held_records and cfg.eval_every != 0:  # for early stopping on held-out τ, cached alike
                held_dir, held_shards = traffic_features(
                    model_dir, held_records, f"refresh-{cfg.head}-held-out", log=plog, device=dev,
                    progress=lambda d, t: pg.update(task, completed=n + d, total=len(both),
                                                    info="HF forward, aux states (held-out)"))
            pg.update(task, completed=len(both), info=str(fdir))
        seconds["features"] = time.perf_counter() - t0
        held_replies = [list(r["output_ids"]) for r in held_records]
        prompt_tokens = [t for r in records for t in r["prompt_ids"]]
        return {"split": split, "current": current, "target": target, "model_dir": model_dir, "digest": digest,
                "records": records, "counts": counts, "fdir": fdir, "shards": shards, "held_replies": held_replies,
                "held_dir": held_dir, "held_shards": held_shards, "prompt_tokens": prompt_tokens}

    if world > 1:
        import torch.distributed as dist

        if rank == 0:
            prep = prepare(log, progress)
        dist.barrier()
        if rank != 0:
            prep = prepare(_noop, Quiet)
    else:
        prep = prepare(log, progress)
    split, current, model_dir, digest = prep["split"], prep["current"], prep["model_dir"], prep["digest"]
    records, fdir = prep["records"], prep["fdir"]
    fs = FeatureSet.load(prep["shards"])
    V = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])

    # the draft vocabulary: the current head's, widened by the training replies' tokens it lacks
    train_replies = [t for r in records for t in r["output_ids"]]
    held_tokens = [t for ids in prep["held_replies"] for t in ids]
    warm = None
    if cfg.init == "current":
        old_ids = head_draft_ids(current.path)
        new_ids, added = widen_vocab(old_ids, Counter(train_replies), V, cfg.widen, cfg.min_count)
        warm = WarmStart(head_dir=current.path, draft_ids=new_ids)
        old_set, new_set = set(old_ids.tolist()), set(new_ids.tolist())
        rank_log(f"draft vocabulary: {len(old_set)} tokens of {current.ref} + {len(added)} from the traffic's "
                 f"replies = {len(new_set)}")
    else:
        old_set = set(head_draft_ids(current.path).tolist())
        new_set = None  # chosen by train_head from the traffic's replies
        added = []
    budget, budget_rule = cfg.budget(len(records), steps_per_epoch(fs, cfg.batch_tokens, cfg.seed))
    held_fs = FeatureSet.load(prep["held_shards"]) if prep["held_shards"] else None
    eval_every = cfg.eval_every_for(budget) if held_fs is not None else 0
    tcfg = TrainConfig(ttt_steps=cfg.ttt_steps, lr=cfg.lr_or_default, batch_tokens=cfg.batch_tokens,
                       steps=budget, draft_vocab_size=cfg.draft_vocab, save_every=cfg.save_every, seed=cfg.seed,
                       max_minutes=cfg.max_minutes, fsdp=cfg.fsdp, eval_every=eval_every, patience=cfg.patience,
                       min_delta=cfg.min_delta)
    parent_digest = file_digest(current.path / "model.safetensors")
    run_key = config_digest({"data": fdir.name, "parent": parent_digest, "init": cfg.init, "widen": cfg.widen,
                             "held_out_data": prep["held_dir"].name if prep["held_dir"] else None,
                             "pointer": [cfg.pointer, cfg.pointer_epochs],
                             "min_count": cfg.min_count, "train": {k: v for k, v in vars(tcfg).items()
                                                                   if k not in ("max_minutes", "save_every", "fsdp")}})
    stage = home() / "draft" / "refresh" / f"{cfg.head}-{run_key}"
    reg = HeadRegistry(cfg.head)
    done = next((v for v in reg.versions() if v.provenance.get("run_key") == run_key), None)
    if done is not None:
        rank_log(f"this refresh was registered before as {done.ref} ({done.status}): nothing to do")
        if rank != 0:
            return None
        s = done.provenance.get("training") or {}
        return RefreshResult(ref=done.ref, path=done.path, parent=done.parent, steps=int(s.get("steps", 0)),
                             training_seconds=float(s.get("seconds", 0.0)),
                             acc_per_step_last20=list(s.get("acc_per_step_last20", [])), provenance=done.provenance,
                             reused=True)
    rank_log(f"features: {fs.n_seqs} sequences, {int(fs.offsets[-1])} tokens ({len(train_replies)} reply tokens) "
             f"in {fdir}; training at most {budget} steps ({budget_rule}) at lr {tcfg.lr:g}, "
             + (f"held-out τ (γ={EVAL_GAMMA}) on {held_fs.n_seqs} records every {eval_every} steps, stopping after "
                f"{cfg.patience} without a gain above {cfg.min_delta:g}" if eval_every
                else "no held-out evaluation: the last head is kept"))
    t0 = time.perf_counter()
    with progress() if rank == 0 else Quiet() as pg:
        task = pg.add_task("train", total=1, info="")

        def on_step(step: int, total: int, rec: dict) -> None:
            accs = " ".join(f"{a:.2f}" if a is not None else "-" for a in rec["acc"])
            pg.update(task, completed=step, total=total, info=f"loss {rec['loss']:.3f} acc/step [{accs}]")

        try:
            head, summary = train_head(fs, model_dir, stage / "run", tcfg, extra_vocab_tokens=prep["prompt_tokens"],
                                       data_key=fdir.name, on_step=on_step, log=rank_log, device=dev, warm=warm,
                                       evaluate=held_out_tau(held_fs) if held_fs is not None else None)
        except ValueError as exc:  # a current head that does not fit the target's shape
            raise RefreshError(f"{current.ref}: {exc} (--init fresh)") from exc
    seconds["train"] = time.perf_counter() - t0
    if rank != 0:
        return None
    pointer_prov = None  # --no-pointer: the version keeps none of its own
    if cfg.pointer:  # the hybrid's pointer, trained on the same sequences, kept in the head directory
        t0 = time.perf_counter()
        pointer_prov = refresh_pointer(cfg, current, model_dir,
                                       {"digest": digest, "name": prep["target"], "path": str(model_dir)},
                                       records, split.held_out, stage / "head" / HEAD_POINTER, log=rank_log)
        seconds["pointer"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if new_set is None:
        new_set = set(head.draft_ids.tolist())
    out = stage / "head"
    export_head(head, out, metadata={"kind": "refresh", "target": str(model_dir)},
                target={"digest": digest, "name": prep["target"], "path": str(model_dir)})
    (out / "training_log.json").write_text((stage / "run" / "training_log.json").read_text())
    vocab = {"parent_size": len(old_set), "added": len(added), "size": len(new_set),
             "widen": cfg.widen, "min_count": cfg.min_count if cfg.widen is None else None,
             "train_reply_tokens": len(train_replies), "train_outside_parent": outside(train_replies, old_set),
             "train_outside_new": outside(train_replies, new_set),
             "held_out_reply_tokens": len(held_tokens), "held_out_outside_parent": outside(held_tokens, old_set),
             "held_out_outside_new": outside(held_tokens, new_set)}
    prov: dict[str, Any] = {
        "command": command, "run_key": run_key, "traffic": str(Path(cfg.traffic).resolve()),
        "target": {"name": prep["target"], "path": str(model_dir), "digest": digest},
        "target_digest": digest, "adapter_digest": adapter_digest_of(model_dir),
        "parent": current.version, "parent_ref": current.ref, "init": cfg.init,
        **split.windows(cfg.held_out),
        "replies": {**prep["counts"], "regenerate": cfg.regenerate,
                    "redacted_records": sum(1 for r in split.train if getattr(r, "redactions", 0))},
        "vocab": vocab,
        "training": {"budget": budget, "budget_rule": budget_rule, "steps": summary["steps"],
                     "steps_per_epoch": summary["steps_per_epoch"],
                     "stopped_early": summary["stopped_early"],
                     "stop_reason": summary["stop_reason"] or f"ran the budget ({budget} steps)" + (
                         "" if eval_every else ", --eval-every 0" if cfg.eval_every == 0
                         else ", no held-out records to stop on"),
                     "eval": ({"gamma": EVAL_GAMMA, "records": held_fs.n_seqs, "every": eval_every,
                               "patience": cfg.patience, "min_delta": cfg.min_delta} if eval_every else None),
                     "tau_curve": summary["evals"], "best_step": summary["best_step"],
                     "best_tau": summary["best_score"], "kept": summary["kept"],
                     "lr": tcfg.lr, "ttt_steps": tcfg.ttt_steps, "batch_tokens": tcfg.batch_tokens,
                     "seconds": summary["seconds"],
                     "final_loss": summary["final_loss"], "acc_per_step_last20": summary["acc_per_step_last20"],
                     "device": dev, "world_size": world, "threads": torch.get_num_threads()},
        "features_dir": str(fdir),
        "head_digest": head_digest(out),  # the head's config and weights; the pointer's is pointer.digest
        "pointer": pointer_prov,
    }
    seconds["export"] = time.perf_counter() - t0
    seconds["total"] = time.perf_counter() - t_start
    prov["seconds"] = {k: round(v, 1) for k, v in seconds.items()}
    write_refresh_provenance(out, prov, name=cfg.head, size_bytes=head_size_bytes(out))
    try:
        v = reg.add(out, parent=current.version, provenance=prov, force=cfg.force)
    except HeadRegistryError as exc:
        raise RefreshError(str(exc)) from exc
    write_refresh_provenance(v.path, prov, name=cfg.head, size_bytes=head_size_bytes(v.path), ref=v.ref)
    rank_log(f"registered {v.ref} ({v.status}), parent {current.ref}; reply tokens outside the draft vocabulary: "
             f"{vocab['train_outside_parent']} -> {vocab['train_outside_new']} of {vocab['train_reply_tokens']} "
             f"(training), {vocab['held_out_outside_parent']} -> {vocab['held_out_outside_new']} of "
             f"{vocab['held_out_reply_tokens']} (held-out)")
    return RefreshResult(ref=v.ref, path=v.path, parent=current.version, steps=summary["steps"],
                         training_seconds=summary["seconds"], acc_per_step_last20=summary["acc_per_step_last20"],
                         provenance=prov)


def _when(ts: float | None) -> str:
    if ts is None:
        return "—"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def pointer_lines(p: dict[str, Any] | None) -> str:
    """PROVENANCE.md's lines about the version's own pointer (``refresh_pointer``'s entry; None: it has none)."""
    if p is None:
        return ("- pointer: none of its own (--no-pointer); a hybrid deployment drafts with the bundled pointer "
                "where it was trained for the target\n")
    start = {"parent": f"the parent's (digest {p['parent_digest']})",
             "bundled": f"the bundled one (digest {p['parent_digest']})", "fresh": "random weights"}[p["init"]]
    fig = lambda a: ", ".join(f"{k} {v}" for k, v in a.items()) if a else "—"  # noqa: E731
    return (f"- pointer (`pointer/`, digest {p['digest']}): from {start}, {p['epochs']} epochs at lr {p['lr']} on "
            f"{p['examples']} value starts of the training replies ({p['copied']} copied), {p['seconds']:.0f} s;\n"
            f"  on {p['held_out_examples']} held-out value starts: {fig(p['accuracy_before'])} before, "
            f"{fig(p['accuracy'])} after\n")


def write_refresh_provenance(out: Path, prov: dict[str, Any], *, name: str, size_bytes: int,
                             ref: str | None = None) -> Path:
    """PROVENANCE.md beside a refreshed head: the command, the target, the traffic windows, the vocabulary and
    how training went (the same figures as the version's ``version.json``)."""
    r, w, h, v, t = prov["records"], prov["data_window"], prov["held_out"], prov["vocab"], prov["training"]
    rep, s = prov["replies"], prov["seconds"]
    pct = lambda a, b: f"{100 * a / b:.1f}%" if b else "—"  # noqa: E731
    held_before = pct(v['held_out_outside_parent'], v['held_out_reply_tokens'])
    held_after = pct(v['held_out_outside_new'], v['held_out_reply_tokens'])
    train_before = pct(v['train_outside_parent'], v['train_reply_tokens'])
    train_after = pct(v['train_outside_new'], v['train_reply_tokens'])
    early = f"stopped early: {t['stop_reason']}" if t["stopped_early"] else t["stop_reason"]
    curve = ", ".join(f"{st}: {tau:.3f}" for st, tau in t["tau_curve"]) or "—"
    kept = (f"the best, step {t['best_step']} (τ {t['best_tau']:.3f})" if t["kept"] == "best"
            else "the last")
    evals = (f"simulated τ at γ={t['eval']['gamma']} on the {t['eval']['records']} held-out records every "
             f"{t['eval']['every']} steps (step: τ): {curve}" if t["eval"] else "no held-out evaluation")
    procs = f" with {t['world_size']} processes" if t["world_size"] > 1 else ""
    path = Path(out) / "PROVENANCE.md"
    path.write_text(f"""# EAGLE-3 head `{ref or name}`, refreshed from traffic

Built with

```
{prov['command']}
```

- target: `{prov['target']['path']}` (`{prov['target']['name']}`, target digest {prov['target_digest']}"""
                    f"""{f", adapter digest {prov['adapter_digest']}" if prov.get('adapter_digest') else ""})
- parent: {prov['parent_ref']}; init: {prov['init']} ({'its weights, vocabulary widened' if prov['init'] == 'current'
                                                     else 'trained from scratch'})
- traffic: `{prov['traffic']}`: {r['read']} records from {_when(r['first_ts'])} to {_when(r['last_ts'])},
  {r['after_dedupe']} distinct requests (the latest record of each request)
- trained on {r['train']} requests, {_when(w['since'])} to {_when(w['until'])}: {rep['as_is']} replies at
  temperature 0 used as written, {rep['regenerated']} regenerated greedily with vLLM (--regenerate {rep['regenerate']})
- held out (never trained on): the most recent {h['share']:.0%}, {h['n']} requests, {_when(h['since'])} to
  {_when(h['until'])}
- draft vocabulary: {v['parent_size']} tokens of the parent + {v['added']} from the traffic's replies = {v['size']}
- reply tokens outside the draft vocabulary, before and after widening:
  - training replies: {v['train_outside_parent']} of {v['train_reply_tokens']} ({train_before}) before,
    {v['train_outside_new']} ({train_after}) after
  - held-out replies (as the target writes them greedily): {v['held_out_outside_parent']} of {v['held_out_reply_tokens']} ({held_before})
    before, {v['held_out_outside_new']} ({held_after}) after
- training-time test: k={t['ttt_steps']}, lr {t['lr']} (cosine), {t['batch_tokens']} tokens/batch,
  {t['steps']} of a budget of {t['budget']} optimiser steps ({t['budget_rule']}); per-step accuracy (mean of
  the last 20 batches): {t['acc_per_step_last20']}
- {evals}
- {early}; head kept: {kept}
- on {t['device']}{procs}, {t['threads']} threads: read {s.get('read', 0):.0f} s, features {s.get('features', 0):.0f} s
  (incl. regeneration, cached on reruns), training {s.get('train', 0):.0f} s, total {s.get('total', 0):.0f} s;
  `model.safetensors` {size_bytes / 1e6:.1f} MB
- training log (loss and accuracy per step): `training_log.json`
{pointer_lines(prov.get('pointer'))}""")
    return path
