"""Training data for the draft head: the served target's own responses and its features.

1. ``regenerate``: the target answers the prompts (greedy and/or sampled) with
   vLLM offline (a subprocess; ~40-290 tok/s on 2 cores vs ~15 for HF generate).
2. ``extract``: one HF forward pass per batch with ``output_hidden_states=True``
   over prompt + response gives, per token,

   * ``aux``: the states vLLM hands the head. vLLM 0.32 records, for aux layer
     id ``j``, the residual stream *entering* decoder layer ``j``
     (``hidden + residual`` after layer ``j-1``; ``llama.py`` /
     ``EagleModelMixin._maybe_add_hidden_state``), which is HF's
     ``hidden_states[j]`` (entry 0 = embeddings; only the last entry is normed).
   * ``final``: the target's final normed hidden state; ``final @ lm_head.T`` is
     the target's next-token logits, restricted to the draft vocabulary at train
     time (storing H numbers per token instead of a 49k-vocab distribution).
   * ``argmax``: the target's greedy next token over the full vocabulary.

Shards (safetensors) and the generated records live under
``$CARTSPEC_HOME/draft/features/<key>/``; the key hashes the model weights, the
prompts, the sampling settings and the layer ids, so a rerun reuses them and an
interrupted extraction resumes at the first missing shard.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from ..paths import config_digest, file_digest, home
from ..private_files import open_private, write_private


def aux_layer_ids_for(model_dir: Path) -> list[int]:
    from .head import default_aux_layer_ids

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return default_aux_layer_ids(int(cfg["num_hidden_layers"]))


def model_key(model_dir: Path) -> str:
    """Content key of a model directory (weights + config), cached beside it by mtime."""
    model_dir = Path(model_dir)
    parts = []
    for f in sorted(model_dir.glob("*.safetensors")) + [model_dir / "config.json"]:
        st = f.stat()
        parts.append((f.name, st.st_size, int(st.st_mtime)))
    cache = home() / "draft" / "model-keys.json"
    known = json.loads(cache.read_text()) if cache.exists() else {}
    stamp = config_digest([str(model_dir), parts])
    if stamp not in known:
        digest = config_digest([(f.name, file_digest(f)) for f in
                                sorted(model_dir.glob("*.safetensors")) + [model_dir / "config.json"]])
        known[stamp] = digest
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(known, indent=1))
    return known[stamp]


def features_dir() -> Path:
    p = home() / "draft" / "features"
    p.mkdir(parents=True, exist_ok=True)
    return p


# --- 1. regenerate -----------------------------------------------------------------

@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 192
    seed: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens,
                "seed": self.seed}


def vllm_generate(model_dir: Path, prompts: Sequence[Sequence[int]], sampling: Sequence[Sampling], out: Path,
                  enforce_eager: bool = False, max_model_len: int = 1024, log: Callable[[str], None] = print,
                  ) -> list[dict[str, Any]]:
    """Run ``cartspec.draft.vllm_generate`` in a subprocess; returns its records (cached at ``out``). Its
    stderr, vLLM's log with the patches cartspec's vLLM plugin applied, is written beside ``out`` (``.log``)
    as it runs, and its progress goes to ``log`` a line at a time; a vLLM that ran without the plugin is
    refused."""
    from ..serving.engine import engine_env, resolve_dtype
    from ..vllm_plugin import not_loaded, read_report, summary

    out = Path(out)
    if out.exists():
        return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    out.parent.mkdir(parents=True, exist_ok=True)
    job = {"model": str(model_dir), "prompts": [list(map(int, p)) for p in prompts],
           "sampling": [s.as_dict() for s in sampling], "enforce_eager": enforce_eager,
           "max_model_len": max_model_len, "dtype": resolve_dtype("auto")}
    job_path = out.with_suffix(".job.json")
    write_private(job_path, json.dumps(job))  # the prompts: recorded traffic on a refresh
    tmp = out.with_suffix(".tmp")
    env = {**os.environ, **engine_env()}
    t0 = time.perf_counter()
    log_path = out.with_suffix(".log")
    log(f"vLLM generation: {len(prompts)} prompts; vLLM's log: {log_path}")
    stats = "{}"
    with open_private(log_path, "w") as err:  # written as vLLM runs, so a user can follow it
        proc = subprocess.Popen([sys.executable, "-m", "cartspec.draft.vllm_generate", str(job_path), str(tmp)],
                                env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        for line in proc.stdout:
            try:  # the child's JSON lines; anything else on its stdout is not ours to read
                said = json.loads(line)
            except ValueError:
                continue
            if not isinstance(said, dict):
                continue
            stats = line.strip()
            if "progress" in said:
                log(f"vLLM generation: {said['progress']}/{said['total']} answers, {said['elapsed_s']:.0f}s")
        proc.wait()
    stderr = log_path.read_text()
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM generation failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    patches = read_report(stderr)
    if not patches:
        raise RuntimeError(not_loaded(sys.executable))
    log(f"vLLM generation: {len(prompts)} prompts in {time.perf_counter() - t0:.0f}s ({stats}); cartspec's "
        f"patches: {summary(patches)}; vLLM's log: {log_path}")
    tmp.replace(out)
    job_path.unlink(missing_ok=True)
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


# --- 2. extract --------------------------------------------------------------------

def capture(model, input_ids, attention_mask, layer_ids: Sequence[int]):
    """(aux [B, T, n*H], final [B, T, H], argmax [B, T]) from one HF forward pass."""
    import torch

    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    hs = out.hidden_states
    aux = torch.cat([hs[j] for j in layer_ids], dim=-1)
    return aux, hs[-1], out.logits.argmax(-1)


def _batches_by_length(lengths: list[int], max_tokens: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, cur, cur_max = [], [], 0
    for i in order:
        m = max(cur_max, lengths[i])
        if cur and m * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, m = [], lengths[i]
        cur.append(i)
        cur_max = m
    if cur:
        batches.append(cur)
    return batches


def extract(model_dir: Path, records: list[dict[str, Any]], out_dir: Path, layer_ids: Sequence[int],
            shard_size: int = 256, batch_tokens: int = 4096, max_len: int = 1024,
            progress: Callable[[int, int], None] | None = None, device: str = "cpu") -> list[Path]:
    """Write shards of features for ``records`` (``prompt_ids`` + ``output_ids``); resumable."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_shards = (len(records) + shard_size - 1) // shard_size
    paths = [out_dir / f"shard-{k:05d}.safetensors" for k in range(n_shards)]
    todo = [k for k, p in enumerate(paths) if not p.exists()]
    if not todo:
        return paths
    from ..serving.engine import compute_dtype

    # bf16 only where it is native; stored as bf16 either way
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=compute_dtype(device)).to(device)
    model.eval()
    done = (n_shards - len(todo)) * shard_size
    for k in todo:
        recs = records[k * shard_size:(k + 1) * shard_size]
        seqs = [(list(r["prompt_ids"]) + list(r["output_ids"]))[:max_len] for r in recs]
        plens = [min(len(r["prompt_ids"]), max_len) for r in recs]
        per_seq: list[dict[str, torch.Tensor]] = [None] * len(seqs)  # type: ignore[list-item]
        for batch in _batches_by_length([len(s) for s in seqs], batch_tokens):
            T = max(len(seqs[i]) for i in batch)
            ids = torch.zeros(len(batch), T, dtype=torch.long)
            att = torch.zeros(len(batch), T, dtype=torch.long)
            for r, i in enumerate(batch):
                ids[r, :len(seqs[i])] = torch.tensor(seqs[i])
                att[r, :len(seqs[i])] = 1
            aux, final, arg = capture(model, ids.to(device), att.to(device), layer_ids)
            aux, final, arg = aux.cpu(), final.cpu(), arg.cpu()
            for r, i in enumerate(batch):
                n = len(seqs[i])
                per_seq[i] = {"aux": aux[r, :n].to(torch.bfloat16).clone(),
                              "final": final[r, :n].to(torch.bfloat16).clone(),
                              "argmax": arg[r, :n].to(torch.int32).clone()}
            done += len(batch)
            if progress:
                progress(min(done, len(records)), len(records))
        lens = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
        tensors = {
            "input_ids": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
            "aux": torch.cat([p["aux"] for p in per_seq]),
            "final": torch.cat([p["final"] for p in per_seq]),
            "argmax": torch.cat([p["argmax"] for p in per_seq]),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]),
            "prompt_lens": torch.tensor(plens, dtype=torch.int64),
        }
        tmp = paths[k].with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata={"layer_ids": json.dumps(list(layer_ids))})
        tmp.replace(paths[k])
    return paths


@dataclass
class FeatureSet:
    """All shards of one feature set, in memory."""

    input_ids: Any  # [N] int32
    aux: Any  # [N, n*H] bf16
    final: Any  # [N, H] bf16
    argmax: Any  # [N] int32
    offsets: Any  # [S+1] int64
    prompt_lens: Any  # [S]
    layer_ids: list[int]

    @property
    def n_seqs(self) -> int:
        return int(self.prompt_lens.numel())

    def seq(self, s: int) -> slice:
        return slice(int(self.offsets[s]), int(self.offsets[s + 1]))

    def response_tokens(self) -> Iterable[int]:
        for s in range(self.n_seqs):
            sl = self.seq(s)
            yield from self.input_ids[sl.start + int(self.prompt_lens[s]):sl.stop].tolist()

    @classmethod
    def load(cls, paths: Sequence[Path]) -> "FeatureSet":
        import torch
        from safetensors import safe_open

        parts: dict[str, list] = {k: [] for k in ("input_ids", "aux", "final", "argmax", "prompt_lens")}
        lens = []
        layer_ids = None
        for p in paths:
            with safe_open(str(p), "pt") as f:
                layer_ids = json.loads(f.metadata()["layer_ids"])
                for k in parts:
                    parts[k].append(f.get_tensor(k))
                off = f.get_tensor("offsets")
                lens.append(off[1:] - off[:-1])
        lens_t = torch.cat(lens)
        return cls(**{k: torch.cat(v) for k, v in parts.items()},
                   offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lens_t.cumsum(0)]),
                   layer_ids=layer_ids or [])


def build_features(model_dir: Path, prompts: Sequence[Sequence[int]], sampling: Sequence[Sampling],
                   tag: str = "", enforce_eager: bool = False, log: Callable[[str], None] = print,
                   progress: Callable[[int, int], None] | None = None, shard_size: int = 256,
                   device: str = "cpu") -> tuple[Path, list[dict[str, Any]], list[Path]]:
    """Regenerate (cached) and extract (cached, resumable). Returns (dir, records, shards)."""
    from ..serving.engine import compute_dtype

    model_dir = Path(model_dir)
    layer_ids = aux_layer_ids_for(model_dir)
    key = config_digest({"model": model_key(model_dir), "prompts": [list(p) for p in prompts],
                         "sampling": [s.as_dict() for s in sampling], "layers": layer_ids, "v": 1})
    d = features_dir() / f"{tag + '-' if tag else ''}{key}"
    records = vllm_generate(model_dir, prompts, sampling, d / "records.jsonl", enforce_eager=enforce_eager, log=log)
    t0 = time.perf_counter()
    shards = extract(model_dir, records, d, layer_ids, shard_size=shard_size, progress=progress, device=device)
    meta = d / "meta.json"
    if not meta.exists():
        n_resp = sum(len(r["output_ids"]) for r in records)
        meta.write_text(json.dumps({"model": str(model_dir), "layer_ids": layer_ids, "n": len(records),
                                    "response_tokens": n_resp, "extract_seconds": round(time.perf_counter() - t0, 1),
                                    "capture_dtype": str(compute_dtype(device)).removeprefix("torch."),
                                    "sampling": sorted({json.dumps(s.as_dict()) for s in sampling})}, indent=2))
    return d, records, shards
