"""``cartspec build-model``: training options that would do nothing, and a retrain that would overwrite the
bundled adapter, are refused before anything is converted or trained; what it does train goes where asked.

Nothing here converts or trains: the bundled adapter is a temporary directory and the model stages are stubs
(they raise in the refusal tests, so a refusal that came too late fails the test)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from cartspec import cli
from cartspec.model import convert, lora, registry

runner = CliRunner()


@pytest.fixture
def bundled(tmp_path, monkeypatch) -> Path:
    """A bundled adapter that exists (the real one must never be touched by a test)."""
    path = tmp_path / "assets" / "lora" / "commerce"
    path.mkdir(parents=True)
    (path / "adapter_model.safetensors").write_bytes(b"bundled weights")
    monkeypatch.setattr(registry, "BUNDLED_ADAPTER", path)
    # wide enough that a path in an error message is never wrapped
    monkeypatch.setattr(cli, "console", Console(stderr=True, width=10_000))
    return path


@pytest.fixture
def nothing_runs(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("build-model converted, trained or merged although it refused")

    for module, name in ((convert, "convert_gguf"), (lora, "train_lora"), (registry, "merged_commerce")):
        monkeypatch.setattr(module, name, forbidden)


class Stages:
    """The model stages as stubs that record what they were asked to do."""

    def __init__(self, tmp_path: Path):
        self.base = tmp_path / "base"
        self.trained: list[tuple[Path, lora.LoraConfig, int]] = []
        self.merged: list[Path] = []

    def convert(self, gguf=None):
        return self.base

    def train(self, base, requests, out, cfg):
        Path(out).mkdir(parents=True, exist_ok=True)
        self.trained.append((Path(out), cfg, len(requests)))

    def merge(self, adapter):
        self.merged.append(Path(adapter))
        return Path(adapter).parent / "merged"


@pytest.fixture
def stages(tmp_path, monkeypatch) -> Stages:
    s = Stages(tmp_path)
    monkeypatch.setattr(convert, "convert_gguf", s.convert)
    monkeypatch.setattr(lora, "train_lora", s.train)
    monkeypatch.setattr(registry, "merged_commerce", s.merge)
    return s


def _run(*args: str):
    r = runner.invoke(cli.app, ["build-model", *args])
    return r, " ".join(r.output.split())


@pytest.mark.parametrize("flag", [["--lr", "0.002"], ["--neftune-alpha", "5"], ["--epochs", "2"], ["--rank", "8"],
                                  ["--batch-size", "4"], ["--train-size", "300"], ["--seed", "1"]])
def test_a_training_option_without_retrain_is_refused_when_the_adapter_exists(bundled, nothing_runs, flag):
    r, out = _run(*flag)
    assert r.exit_code == 2, r.output
    assert flag[0] in out and "nothing would be trained" in out and str(bundled) in out
    assert "add --retrain --adapter-out runs/lora/NAME" in out


def test_a_training_option_is_refused_even_at_its_default_value(bundled, nothing_runs):
    r, out = _run("--lr", "0.001", "--seed", "0")  # typed by the user, so meant: still nothing would train
    assert r.exit_code == 2 and "--lr, --seed" in out


def test_an_existing_adapter_out_needs_retrain_too(bundled, nothing_runs, tmp_path):
    mine = tmp_path / "runs" / "lora" / "v9"
    mine.mkdir(parents=True)
    (mine / "adapter_model.safetensors").write_bytes(b"v9")
    r, out = _run("--adapter-out", str(mine), "--rank", "8")
    assert r.exit_code == 2 and str(mine) in out and "add --retrain to train" in out


def test_retrain_without_adapter_out_would_overwrite_the_bundled_adapter(bundled, nothing_runs):
    r, out = _run("--retrain", "--lr", "0.002")
    assert r.exit_code == 2, r.output
    assert "overwrite the bundled adapter" in out and "--adapter-out runs/lora/NAME" in out
    assert (bundled / "adapter_model.safetensors").read_bytes() == b"bundled weights"


def test_retrain_into_a_new_directory_trains_there_with_the_options(bundled, stages, tmp_path):
    new = tmp_path / "runs" / "lora" / "v10"
    r, _ = _run("--retrain", "--adapter-out", str(new), "--lr", "0.002", "--rank", "8", "--train-size", "12")
    assert r.exit_code == 0, r.output
    [(out, cfg, n)] = stages.trained
    assert out == new and (cfg.lr, cfg.r, cfg.alpha, n) == (0.002, 8, 16, 12)
    assert "--lr 0.002 --rank 8" in (new / "PROVENANCE.md").read_text()
    assert stages.merged == [new]
    assert (bundled / "adapter_model.safetensors").read_bytes() == b"bundled weights"


def test_a_new_adapter_out_trains_without_retrain(bundled, stages, tmp_path):
    new = tmp_path / "fresh"
    r, _ = _run("--adapter-out", str(new), "--epochs", "2", "--train-size", "12")
    assert r.exit_code == 0, r.output
    assert [(o, c.epochs) for o, c, _ in stages.trained] == [(new, 2.0)]


def test_retrain_of_the_bundled_adapter_when_named_explicitly(bundled, stages):
    r, _ = _run("--retrain", "--adapter-out", str(bundled), "--train-size", "12")
    assert r.exit_code == 0, r.output
    assert [o for o, _, _ in stages.trained] == [bundled] and stages.merged == [bundled]


def test_plain_build_uses_the_existing_adapter_as_is(bundled, stages):
    r, _ = _run()
    assert r.exit_code == 0, r.output
    assert stages.trained == [] and stages.merged == [bundled]


def test_first_build_without_any_adapter_trains_into_the_bundled_directory(bundled, stages):
    (bundled / "adapter_model.safetensors").unlink()  # a checkout without the asset
    r, _ = _run("--train-size", "12", "--lr", "0.002")
    assert r.exit_code == 0, r.output
    assert [(o, c.lr) for o, c, _ in stages.trained] == [(bundled, 0.002)] and stages.merged == [bundled]
