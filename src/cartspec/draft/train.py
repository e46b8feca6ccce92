"""EAGLE-3 training-time test on cached target features; resumable.

Every chain start ``i`` in a response (``i >= prompt_len - 1``, where serving
starts drafting) is unrolled ``k`` steps, feeding the head's own hidden state
back (``Eagle3Head.unroll``). Step ``s`` is scored with the soft cross-entropy
to the target's next-token distribution at position ``i + 1 + s`` restricted to
the draft vocabulary, weighted ``decay ** s``; per-step accuracy is the share
of chains whose step-``s`` draft equals the target's greedy token (full vocab,
so tokens missing from the draft vocabulary count as misses).

Under ``torchrun`` (``WORLD_SIZE`` > 1) the head is wrapped in DDP (gloo on CPU,
nccl on CUDA): every rank walks the same batch schedule and trains on its
share of each batch's sequences; gradients are averaged, rank 0 checkpoints.
With ``TrainConfig.fsdp`` the head is sharded instead (FSDP2, ``fully_shard``):
each rank holds 1/N of the head's parameters, gradients and AdamW state and
gathers the full weights only for its forward and backward; the target's
embedding and draft-vocabulary lm_head rows stay whole on every rank. The
checkpoint holds the full (unsharded) state either way, so a run resumes
under DDP, FSDP or one process alike.

A warm start (``WarmStart``) begins from an exported head instead of a random
one: every weight of the head is copied, its draft vocabulary may be widened
(``widen_vocab``), the rows of ``lm_head`` for the head's own draft tokens are
kept and the rows of the added tokens start from the target's ``lm_head``
rows, as ``init_head`` starts every row of a fresh head.

A checkpoint (head, optimiser, step, vocabulary) is written every
``save_every`` steps into ``OUT/checkpoint``; rerunning the same command with
the same data resumes there, replaying the same batch order.

With an ``evaluate`` function and ``eval_every`` > 0 (``cartspec draft
refresh``: simulated τ on held-out records), the head is measured before the
first step, every ``eval_every`` steps and at the last; training stops early
when ``budget.EarlyStop`` says τ has plateaued, and the best head measured,
not the last, is returned (its weights are checkpointed too).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from ..serving.engine import compute_dtype
from .budget import MIN_DELTA, PATIENCE, EarlyStop
from .features import FeatureSet
from ..model.weights import load_target_weights  # noqa: F401  (its callers import it from here too)
from .head import Eagle3Head, HeadConfig


@dataclass
class TrainConfig:
    ttt_steps: int = 5
    decay: float = 0.8
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    batch_tokens: int = 2048  # padded tokens per batch
    epochs: float = 1.0
    steps: int | None = None  # overrides epochs
    draft_vocab_size: int = 8192
    norm_before_residual: bool = True
    save_every: int = 50
    seed: int = 0
    max_minutes: float | None = None  # stop early (checkpointed, exported) after this long
    threads: int | None = None
    fsdp: bool = False  # under torchrun: shard the head (FSDP2) instead of replicating it (DDP)
    # held-out evaluation (train_head's ``evaluate``) every this many steps and at the last; 0: none
    eval_every: int = 0
    patience: int = PATIENCE  # early stopping (budget.EarlyStop): evaluations without improvement; 0: never
    min_delta: float = MIN_DELTA


def pick_device(device: str = "auto") -> str:
    """``auto``: cuda when torch sees a GPU, else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA device (is this a CPU build of torch?)")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, not {device!r}")
    return device


def distributed() -> tuple[int, int]:
    """(rank, world size); joins the process group torchrun set up (gloo on CPU, nccl on CUDA)."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        cuda = torch.cuda.is_available() and os.environ.get("CARTSPEC_DDP_BACKEND") != "gloo"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl" if cuda else "gloo")
        atexit.register(_leave_process_group)
    return dist.get_rank(), dist.get_world_size()


def _leave_process_group() -> None:
    """Destroy the process group before the interpreter tears down, as PyTorch asks, rather than leaving it to
    gloo's destructor at exit. (A rare SIGABRT of one rank under ``torchrun`` on two CPU cores, "terminate called
    without an active exception", was seen both before and after this; its cause is not known.)"""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()




def select_draft_vocab(response_tokens: Sequence[int] | Counter, size: int, vocab_size: int,
                       extra_tokens: Sequence[int] = (), must: Sequence[int] = ()) -> torch.Tensor:
    """The ``size`` most frequent response tokens (then prompt tokens, then low ids), sorted by id."""
    counts = response_tokens if isinstance(response_tokens, Counter) else Counter(response_tokens)
    chosen: list[int] = []
    seen: set[int] = set()

    def add(t: int) -> None:
        if len(chosen) < size and 0 <= t < vocab_size and t not in seen:
            seen.add(t)
            chosen.append(t)

    for t in must:
        add(int(t))
    for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        add(int(t))
    for t, _ in sorted(Counter(extra_tokens).items(), key=lambda kv: (-kv[1], kv[0])):
        add(int(t))
    t = 0
    while len(chosen) < min(size, vocab_size):  # low ids: bytes and the most common merges
        add(t)
        t += 1
    return torch.tensor(sorted(chosen), dtype=torch.long)


def init_head(cfg: HeadConfig, draft_ids: torch.Tensor, target: dict[str, torch.Tensor], seed: int) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    for name, p in head.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    head.set_vocab(draft_ids)
    with torch.no_grad():  # start from the target's own output layer and final norm
        head.lm_head.weight.copy_(target["lm_head"][draft_ids].float())
        if "norm" in target:
            head.norm.weight.copy_(target["norm"].float())
    return head


@dataclass
class WarmStart:
    """Start training from the exported head in ``head_dir``, with the draft vocabulary ``draft_ids`` (sorted
    target ids, a superset of the head's own: ``widen_vocab``)."""

    head_dir: Path
    draft_ids: torch.Tensor


def head_draft_ids(head_dir: Path) -> torch.Tensor:
    """The target id of every draft id of an exported head (from its ``d2t``), sorted."""
    from safetensors import safe_open

    with safe_open(str(Path(head_dir) / "model.safetensors"), "pt") as fh:
        d2t = fh.get_tensor("d2t").long()
    return torch.arange(d2t.numel()) + d2t


def widen_vocab(old_ids: Sequence[int] | torch.Tensor, reply_counts: Counter, vocab_size: int,
                widen: int | None = None, min_count: int = 2) -> tuple[torch.Tensor, list[int]]:
    """``old_ids`` plus the most frequent reply tokens not in them: ``widen`` of them, or (``widen`` None) every
    one seen at least ``min_count`` times; never more than ``vocab_size`` ids in all. Returns (the new draft
    vocabulary sorted by id, the added target ids by falling frequency)."""
    old = [int(t) for t in (old_ids.tolist() if isinstance(old_ids, torch.Tensor) else old_ids)]
    have = set(old)
    room = max(0, vocab_size - len(have))
    cands = [t for t, c in sorted(reply_counts.items(), key=lambda kv: (-kv[1], kv[0]))
             if 0 <= int(t) < vocab_size and int(t) not in have and (widen is not None or c >= min_count)]
    added = [int(t) for t in cands[:min(room, len(cands) if widen is None else max(0, widen))]]
    return torch.tensor(sorted(have | set(added)), dtype=torch.long), added


def warm_head(head_dir: Path, draft_ids: torch.Tensor, target: dict[str, torch.Tensor], target_cfg: dict[str, Any],
              layer_ids: Sequence[int]) -> Eagle3Head:
    """A head with the exported head's weights and the draft vocabulary ``draft_ids`` (a superset of its own):
    the old tokens keep their ``lm_head`` rows, the added ones start from the target's ``lm_head`` rows.
    Raises ValueError when the head does not fit the target (other sizes, vocabulary or aux layers)."""
    from .export import load_head
    from .head import canonical_layer_ids

    parent = load_head(Path(head_dir), dtype=torch.float32)
    pc = parent.cfg
    want = HeadConfig.for_target(target_cfg, len(draft_ids), aux_layer_ids=list(layer_ids))
    for field_name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                       "vocab_size", "target_hidden_size"):
        if getattr(pc, field_name) != getattr(want, field_name):
            raise ValueError(f"the head {head_dir} has {field_name} {getattr(pc, field_name)}, the target "
                             f"{getattr(want, field_name)}: it was built for another model; train a fresh head")
    if canonical_layer_ids(pc.aux_layer_ids) != canonical_layer_ids(layer_ids):
        raise ValueError(f"the head {head_dir} reads aux layers {pc.aux_layer_ids}, the features hold "
                         f"{list(layer_ids)}: train a fresh head")
    old = parent.draft_ids
    new = torch.as_tensor(draft_ids, dtype=torch.long)
    pos = torch.searchsorted(new, old)
    if bool((pos >= new.numel()).any()) or not bool((new[pos.clamp(max=new.numel() - 1)] == old).all()):
        raise ValueError("the widened draft vocabulary must hold every draft token of the head it starts from")
    cfg = HeadConfig.from_dict({**pc.to_dict(), "draft_vocab_size": int(new.numel())})
    head = Eagle3Head(cfg)
    head.set_vocab(new)
    state = {k: v for k, v in parent.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    missing, unexpected = head.load_state_dict(state, strict=False)
    if unexpected or set(missing) != {"lm_head.weight", "d2t", "t2d"}:
        raise ValueError(f"the head {head_dir} does not load: missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)}")
    with torch.no_grad():
        rows = target["lm_head"][new].float()
        rows[pos] = parent.lm_head.weight.detach().float()
        head.lm_head.weight.copy_(rows)
    return head


def _plan_batches(fs: FeatureSet, batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Length-bucketed batches of sequence indices, shuffled per epoch (deterministic)."""
    lens = (fs.offsets[1:] - fs.offsets[:-1]).tolist()
    idx = [s for s in range(fs.n_seqs) if lens[s] - int(fs.prompt_lens[s]) >= 2]
    rng = random.Random(seed * 1000 + epoch)
    rng.shuffle(idx)
    # sort within windows of 64 so batches hold similar lengths
    out: list[list[int]] = []
    for w in range(0, len(idx), 64):
        window = sorted(idx[w:w + 64], key=lambda s: lens[s])
        cur: list[int] = []
        for s in window:
            if cur and max(lens[c] for c in cur + [s]) * (len(cur) + 1) > batch_tokens:
                out.append(cur)
                cur = []
            cur.append(s)
        if cur:
            out.append(cur)
    rng.shuffle(out)
    return out


def steps_per_epoch(fs: FeatureSet, batch_tokens: int, seed: int = 0) -> int:
    """Optimiser steps in one pass over ``fs`` at ``batch_tokens`` padded tokens per batch."""
    return len(_plan_batches(fs, batch_tokens, seed, 0))


def make_batch(fs: FeatureSet, seqs: list[int]) -> dict[str, torch.Tensor]:
    lens = [fs.offsets[s + 1] - fs.offsets[s] for s in seqs]
    T = int(max(lens))
    B = len(seqs)
    D = fs.aux.shape[-1]
    H = fs.final.shape[-1]
    ids = torch.zeros(B, T, dtype=torch.long)
    aux = torch.zeros(B, T, D, dtype=fs.aux.dtype)
    final = torch.zeros(B, T, H, dtype=fs.final.dtype)
    argmax = torch.zeros(B, T, dtype=torch.long)
    starts = []
    for b, s in enumerate(seqs):
        sl = fs.seq(s)
        n = sl.stop - sl.start
        ids[b, :n] = fs.input_ids[sl].long()
        aux[b, :n] = fs.aux[sl]
        final[b, :n] = fs.final[sl]
        argmax[b, :n] = fs.argmax[sl].long()
        p = int(fs.prompt_lens[s])
        for i in range(max(p - 1, 0), n - 2):
            starts.append((b, i))
    return {"input_ids": ids, "aux": aux, "final": final, "argmax": argmax,
            "lengths": torch.tensor([int(x) for x in lens]), "starts": torch.tensor(starts, dtype=torch.long)}


def ttt_loss(head: Eagle3Head, embed: torch.Tensor, lm_dv: torch.Tensor, batch: dict[str, torch.Tensor],
             steps: int, decay: float, runner: Any = None) -> tuple[torch.Tensor, list[dict[str, float]]]:
    """Weighted soft cross-entropy over ``steps`` unrolled steps, and per-step stats. ``runner``: what to
    call for the unroll (the head, or its DDP wrapper)."""
    st = batch["starts"]
    bi, ti = st[:, 0], st[:, 1]
    outs = (runner or head.unroll)(embed, batch["input_ids"], batch["aux"].float(), batch["lengths"], st, steps)
    T = batch["input_ids"].shape[1]
    with torch.no_grad():  # the target's distribution over the draft vocabulary, once per position
        B = batch["final"].shape[0]
        p_all = torch.softmax((batch["final"].reshape(B * T, -1).float() @ lm_dv.T).float(), dim=-1).view(B, T, -1)
    total = torch.zeros((), device=embed.device)
    stats = []
    for s, o in enumerate(outs):
        valid = o["valid"]
        if not bool(valid.any()):
            stats.append({"n": 0, "loss": float("nan"), "acc": float("nan")})
            continue
        tpos = (ti + 1 + s).clamp(max=T - 1)
        p = p_all[bi, tpos]
        logq = torch.log_softmax(o["logits"].float(), dim=-1)
        per = -(p * logq).sum(-1)
        loss = per[valid].mean()
        total = total + (decay ** s) * loss
        with torch.no_grad():
            pred = head.to_target(o["logits"].argmax(-1))
            acc = (pred == batch["argmax"][bi, tpos])[valid].float().mean().item()
        stats.append({"n": int(valid.sum()), "loss": loss.item(), "acc": acc})
    return total, stats


def _lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def _agree(flag: bool, world: int, device: str) -> bool:
    """Rank 0's ``flag`` on every rank (ranks' clocks differ; all must stop at the same step)."""
    if world <= 1:
        return flag
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], device=device)
    dist.broadcast(t, src=0)
    return bool(t.item())


def train_head(fs: FeatureSet, target_dir: Path, out_dir: Path, cfg: TrainConfig,
               extra_vocab_tokens: Sequence[int] = (), data_key: str = "",
               on_step: Callable[[int, int, dict[str, Any]], None] | None = None,
               log: Callable[[str], None] = print, device: str = "cpu",
               warm: WarmStart | None = None,
               evaluate: Callable[[Eagle3Head, torch.Tensor], float] | None = None,
               ) -> tuple[Eagle3Head, dict[str, Any]]:
    """Train (or resume) a head; returns it and a summary. ``OUT/checkpoint`` holds the state (written by
    rank 0 under torchrun). ``warm``: start from an exported head (its weights, a widened vocabulary) instead
    of a random head. ``evaluate(head, embed)``: a score to maximise (held-out τ), called on rank 0 every
    ``cfg.eval_every`` steps with the whole head on the CPU in eval mode and the target's float32 embedding
    there; the best-scoring head is returned and training stops when the score plateaus (``EarlyStop``)."""
    rank, world = distributed()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out_dir = Path(out_dir)
    ckpt = out_dir / "checkpoint"
    ckpt.mkdir(parents=True, exist_ok=True)
    target_cfg = json.loads((Path(target_dir) / "config.json").read_text())
    tw = load_target_weights(Path(target_dir))
    embed = tw["embed"].float().to(device)
    V = int(target_cfg["vocab_size"])
    eos = target_cfg.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])

    resume = ckpt / "state.json"
    state: dict[str, Any] | None = json.loads(resume.read_text()) if resume.exists() else None
    # without evaluation the stopping settings change nothing (and a checkpoint from before them still resumes)
    ignored = ("max_minutes", "threads", "save_every", "fsdp") + (("eval_every", "patience", "min_delta")
                                                                    if not cfg.eval_every else ())
    run_id: dict[str, Any] = {"data": data_key, "cfg": {k: v for k, v in asdict(cfg).items() if k not in ignored}}
    if warm is not None:  # a checkpoint of another start (fresh, or from another head) is not resumed
        from ..paths import file_digest

        run_id["warm"] = {"head": file_digest(Path(warm.head_dir) / "model.safetensors"),
                          "draft_ids": [int(t) for t in warm.draft_ids.tolist()]}
    if state is not None and state.get("run_id") != run_id:
        log(f"checkpoint in {ckpt} is for another run (data or settings differ): starting over")
        state = None
    if state is not None:
        draft_ids = torch.tensor(state["draft_ids"], dtype=torch.long)
    elif warm is not None:
        draft_ids = torch.as_tensor(warm.draft_ids, dtype=torch.long)
    else:
        draft_ids = select_draft_vocab(Counter(fs.response_tokens()), min(cfg.draft_vocab_size, V), V,
                                       extra_tokens=extra_vocab_tokens, must=eos_ids)
    if warm is not None:
        torch.manual_seed(cfg.seed)
        head = warm_head(Path(warm.head_dir), draft_ids, tw, target_cfg, fs.layer_ids).to(device)
        hcfg = head.cfg
    else:
        hcfg = HeadConfig.for_target(target_cfg, len(draft_ids), aux_layer_ids=fs.layer_ids,
                                     norm_before_residual=cfg.norm_before_residual)
        head = init_head(hcfg, draft_ids, tw, cfg.seed).to(device)
    if state is not None:
        head.load_state_dict(torch.load(ckpt / "head.pt", weights_only=True, map_location=device))
    sharded = cfg.fsdp and world > 1
    if sharded:  # every rank starts from the same full weights, then keeps its shard
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(head, mesh=init_device_mesh(device, (world,)))
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    step = 0
    history: list[dict[str, Any]] = []
    elapsed_before = 0.0
    if state is not None:
        full_optim = torch.load(ckpt / "optim.pt", weights_only=True, map_location=device)
        if sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(head, opt, full_optim, options=StateDictOptions(full_state_dict=True))
        else:
            opt.load_state_dict(full_optim)
        step = int(state["step"])
        history = state.get("history", [])
        elapsed_before = float(state.get("seconds", 0.0))
        log(f"resuming from step {step} ({ckpt})")
    evaluating = evaluate is not None and cfg.eval_every > 0
    stop = EarlyStop.replay((state or {}).get("evals", []), patience=cfg.patience, min_delta=cfg.min_delta,
                            min_steps=cfg.warmup_steps)
    plateau: str | None = (state or {}).get("plateau")  # a resumed run that had stopped on a plateau stays stopped
    best_sd: dict[str, torch.Tensor] | None = None  # rank 0: the best-scoring head's weights (CPU)
    best_saved = stop.best_step  # the step whose weights best-STEP.pt holds
    if evaluating and stop.best_step is not None and rank == 0:
        best_sd = torch.load(ckpt / f"best-{stop.best_step}.pt", weights_only=True, map_location="cpu")

    lm_dv = tw["lm_head"][draft_ids].float().to(device)
    runner = None
    if sharded:
        runner = head  # calling the module runs FSDP's gather hooks around forward (= unroll)
    elif world > 1:
        from torch.nn.parallel import DistributedDataParallel

        runner = DistributedDataParallel(head, broadcast_buffers=False,
                                         device_ids=[torch.cuda.current_device()] if device == "cuda" else None)

    def full_state() -> tuple[dict[str, Any], dict[str, Any]]:
        """The head's and the optimiser's full state dicts (a collective under FSDP: every rank calls it)."""
        if not sharded:
            return head.state_dict(), opt.state_dict()
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets them, the others {}
        return get_model_state_dict(head, options=opts), get_optimizer_state_dict(head, opt, options=opts)
    per_epoch = steps_per_epoch(fs, cfg.batch_tokens, cfg.seed)
    total = cfg.steps if cfg.steps is not None else max(1, int(math.ceil(cfg.epochs * per_epoch)))
    # the same order on every run: epoch e, batch j -> global step
    schedule: list[list[int]] = []
    e = 0
    while len(schedule) < total:
        schedule += _plan_batches(fs, cfg.batch_tokens, cfg.seed, e)
        e += 1
    schedule = schedule[:total]

    def save(final_step: int, seconds: float) -> None:
        nonlocal best_saved
        model_sd, optim_sd = full_state()
        if rank != 0:
            return
        torch.save(model_sd, ckpt / "head.pt.tmp")
        torch.save(optim_sd, ckpt / "optim.pt.tmp")
        (ckpt / "head.pt.tmp").replace(ckpt / "head.pt")
        (ckpt / "optim.pt.tmp").replace(ckpt / "optim.pt")
        if best_sd is not None and stop.best_step != best_saved:  # state.json below commits it
            torch.save(best_sd, ckpt / "best.pt.tmp")
            (ckpt / "best.pt.tmp").replace(ckpt / f"best-{stop.best_step}.pt")
        tmp = ckpt / "state.json.tmp"
        tmp.write_text(json.dumps({"run_id": run_id, "step": final_step, "total": total, "seconds": seconds,
                                   "draft_ids": draft_ids.tolist(), "history": history, "evals": stop.curve,
                                   "plateau": plateau}))
        tmp.replace(resume)
        if stop.best_step != best_saved:
            for old in ckpt.glob("best-*.pt"):
                if old.name != f"best-{stop.best_step}.pt":
                    old.unlink()
            best_saved = stop.best_step

    embed_cpu: list[torch.Tensor] = []  # the embedding the evaluation reads, made once

    def eval_copy() -> Eagle3Head | None:
        """The head as ``evaluate`` reads it, on rank 0 (None elsewhere): whole and on the CPU (gathered under
        FSDP: a collective, every rank calls it)."""
        if sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            sd = get_model_state_dict(head, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        elif rank != 0:
            return None
        elif device == "cpu":
            return head
        else:
            sd = head.state_dict()
        if rank != 0:
            return None
        plain = Eagle3Head(hcfg)
        plain.load_state_dict({k: v.detach().cpu() for k, v in sd.items()})
        return plain

    def run_eval(at: int) -> bool:
        """Score the head at step ``at``, keep it when it is the best so far; the stopping rule's answer, the
        same on every rank."""
        nonlocal best_sd
        plain = eval_copy()
        stop_now = False
        if plain is not None:
            if not embed_cpu:
                embed_cpu.append(embed if device == "cpu" else tw["embed"].float())
            score = float(evaluate(plain.eval(), embed_cpu[0]))  # type: ignore[misc]
            head.train()
            best = stop.update(at, score)
            if best:
                best_sd = {k: v.detach().cpu().clone() for k, v in plain.state_dict().items()}
            log(f"step {at}/{total}: held-out τ {score:.3f}" + (" (best)" if best else
                                                                 f" (best {stop.best_tau:.3f} at {stop.best_step})"))
            stop_now = stop.should_stop
        return _agree(stop_now, world, device)

    # bf16 autocast only where bf16 is native: an AVX2-only CPU would emulate it (machine.compute_dtype)
    amp_dtype = compute_dtype(device)
    amp = torch.autocast(device, dtype=amp_dtype) if amp_dtype != torch.float32 else contextlib.nullcontext()
    t0 = time.perf_counter()
    head.train()
    stopped_early = plateau is not None
    stop_reason = plateau
    if evaluating and step == 0 and not stop.curve:  # the starting head: the curve's first point
        run_eval(0)
    while step < total and plateau is None:
        seqs = schedule[step]
        if world > 1 and len(seqs) >= world:  # this rank's share of the batch
            seqs = seqs[rank::world]
        batch = {k: v.to(device) for k, v in make_batch(fs, seqs).items()}
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, total, cfg)
        with amp:
            loss, stats = ttt_loss(head, embed, lm_dv, batch, cfg.ttt_steps, cfg.decay, runner=runner)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        loss_v = loss.detach().float()
        if world > 1:  # the batch's loss: the ranks' mean
            import torch.distributed as dist

            dist.all_reduce(loss_v)
            loss_v = loss_v / world
        rec = {"step": step, "loss": round(loss_v.item(), 4), "lr": opt.param_groups[0]["lr"],
               "tokens": int(batch["starts"].shape[0]),
               "acc": [round(s["acc"], 4) if s["n"] else None for s in stats],
               "step_loss": [round(s["loss"], 4) if s["n"] else None for s in stats]}
        history.append(rec)
        seconds = elapsed_before + time.perf_counter() - t0
        if on_step:
            on_step(step, total, rec)
        out_of_time = (cfg.max_minutes is not None and step < total
                       and _agree(seconds > cfg.max_minutes * 60, world, device))
        if evaluating and (step % cfg.eval_every == 0 or step == total or out_of_time):
            if run_eval(step) and step < total:
                plateau = stop.reason()
            seconds = elapsed_before + time.perf_counter() - t0
        if step % cfg.save_every == 0 or step == total or out_of_time or plateau:
            save(step, seconds)
        if out_of_time:
            log(f"stopping after {seconds / 60:.1f} min (--max-minutes) at step {step}/{total}")
            stopped_early, stop_reason = True, f"--max-minutes {cfg.max_minutes:g} reached at step {step}"
            break
        if plateau:
            log(f"stopping at step {step}/{total}: {plateau}")
            stopped_early, stop_reason = True, plateau
            break
    seconds = elapsed_before + time.perf_counter() - t0
    if sharded:  # a plain head with the full weights, on every rank
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(head, options=StateDictOptions(full_state_dict=True))
        head = Eagle3Head(hcfg)
        head.load_state_dict({k: v.detach().cpu() for k, v in full.items()})
    if best_sd is not None:  # rank 0: the best head measured, not the last
        head.load_state_dict(best_sd)
    head.eval()
    tail = history[-min(len(history), 20):]
    acc_tail = [sum(r["acc"][s] for r in tail if r["acc"][s] is not None) /
                max(1, sum(1 for r in tail if r["acc"][s] is not None)) for s in range(cfg.ttt_steps)] if tail else []
    summary = {"steps": step, "total_steps": total, "steps_per_epoch": per_epoch, "seconds": round(seconds, 1),
               "stopped_early": stopped_early, "draft_vocab_size": len(draft_ids),
               "final_loss": tail[-1]["loss"] if tail else None,
               "acc_per_step_last20": [round(a, 4) for a in acc_tail], "config": asdict(cfg)}
    summary["init"] = "warm" if warm is not None else "fresh"
    summary["world_size"] = world
    summary["sharding"] = "fsdp" if sharded else ("ddp" if world > 1 else None)
    summary["device"] = device
    summary["compute_dtype"] = str(amp_dtype).removeprefix("torch.")
    summary["stop_reason"] = stop_reason
    summary["evals"] = [[s_, round(t_, 4)] for s_, t_ in stop.curve]
    summary["best_step"], summary["best_score"] = stop.best_step, stop.best_tau
    summary["kept"] = "best" if best_sd is not None else "last"
    if rank == 0:
        (out_dir / "training_log.json").write_text(json.dumps({"summary": summary, "history": history}))
    return head.cpu(), summary
