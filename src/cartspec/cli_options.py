"""Command-line options that several ``cartspec`` commands share, declared once.

Each function returns a ``typer.Option`` to use as a parameter's default, so a command keeps Typer's
ordinary style while the flag, default, metavar and the shared part of the help live here::

    from ..cli_options import dtype_option, enforce_eager_option, server_api_key_env_option

    def study(
        dtype: str = dtype_option(of="of every deployment"),
        enforce_eager: bool = enforce_eager_option(),
        server_api_key_env: Optional[str] = server_api_key_env_option(records="run.json"),
    ) -> None: ...

The arguments only fill in what differs between commands (what the option applies to, what records it);
the parameter's name and annotation stay at the command, where Typer reads them. Nothing heavy is imported
here: ``--help`` must stay instant.
"""

from __future__ import annotations

from typing import Any, Optional

import typer

#: The serving dtypes a user may ask for; "auto" is resolved per machine by ``machine.auto_dtype``.
DTYPE_CHOICES = "auto (float32 on a CPU without native bf16, else bfloat16) | bfloat16 | float32 | float16"

#: The quality metrics a verdict may rest on (``quality/``'s paired tests compute all of them).
QUALITY_METRICS = "exact_match | field_accuracy | json_valid | schema_valid"

#: What a study's run directory is, for every command that reads one.
RUN_DIR_HELP = "a study's run directory (holds results.jsonl)"


def dtype_option(of: str = "", note: str = "") -> Any:
    """``--dtype``: the serving dtype; ``of`` names what it applies to, ``note`` adds a command's own rule."""
    return typer.Option("auto", help=f"serving dtype{' ' + of if of else ''}: {DTYPE_CHOICES}{note}")


def enforce_eager_option(when: str = "") -> Any:
    """``--enforce-eager``: vLLM without torch.compile; ``when`` says which vLLM, where the command starts one
    only for part of its work."""
    return typer.Option(False, help=f"start vLLM without torch.compile{' ' + when if when else ''} "
                             "(faster start, slower decode)")


def server_api_key_env_option(records: str) -> Any:
    """``--server-api-key-env VAR``: where --server's key is read from; ``records`` names the output that
    keeps VAR (the key itself is never written anywhere)."""
    return typer.Option(None, "--server-api-key-env", metavar="VAR",
                        help="the environment variable holding --server's API key, sent as 'Authorization: "
                             f"Bearer KEY' (NIM, hosted APIs); {records} records VAR, never the key")


def served_name_option(on: str = "--server", default: Optional[str] = None) -> Any:
    """``--served-name`` (or another flag's model name): the model name on an endpoint we did not start.
    Without a default the endpoint's first model is used."""
    suffix = " (default: its first model)" if default is None else ""
    return typer.Option(default, help=f"model name on {on}{suffix}")


def force_option(doing: str) -> Any:
    """``--force``: go on with a head trained for another target (a warning, not a refusal)."""
    return typer.Option(False, "--force", help=f"{doing} trained for another target anyway (warns)")


def replace_bundled_option(what: str) -> Any:
    """``--replace-bundled``: let --out point inside the bundled ``what`` (heads, pointers)."""
    return typer.Option(False, "--replace-bundled", help=f"allow --out inside the bundled {what} (maintainers only)")


def run_dir_option(repeat: str = "") -> Any:
    """``--run DIR``: a study's run directory; ``repeat`` explains, where the option may repeat, what that does
    (the parameter is then annotated ``list[Path]``)."""
    return typer.Option(..., "--run", help=RUN_DIR_HELP + (f"; {repeat}" if repeat else ""))


def target_rps_option(default_note: str = "") -> Any:
    """``--target-rps``: the load that instances are sized for in the report's capacity table."""
    return typer.Option(None, help=f"load to size instances for (req/s){'; ' + default_note if default_note else ''}")


def model_option(what: str = "target model", default: str = "commerce") -> Any:
    """``--model``/``--target``: a model by its registry name or directory (``model.registry.resolve_model``)."""
    return typer.Option(default, help=f"{what}: commerce | base | PATH to an HF directory")


def structured_option(note: str = "") -> Any:
    """``--structured``: replies constrained to the task's JSON schema by vLLM's structured outputs."""
    return typer.Option(False, help=f"constrain replies to the task's JSON schema (vLLM structured outputs){note}")
