"""``post-training-cookbook sft CONFIG.yaml``: supervised fine-tuning from a YAML file.

The YAML holds ``SFTConfig`` fields and a ``data`` section naming the JSONL files::

    model: post-training-cookbook/tool-use-tiny
    num_epochs: 2
    wandb_project: null
    data:
      train: demos/train.jsonl
      val: demos/val.jsonl      # optional: the validation loss

Paths are relative to the current directory, as ``runs_dir`` is.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from post_training_cookbook.cli.loading import (
    CliError,
    add_set_option,
    built_config,
    config_mapping,
)

if TYPE_CHECKING:
    from post_training_cookbook.sft.config import SFTConfig

DATA_KEYS = ("train", "val")


def load_sft_config(
    path: Path, overrides: Sequence[str] = ()
) -> tuple[SFTConfig, Path, Path | None]:
    """The SFTConfig of an SFT YAML and its train and validation files."""
    from post_training_cookbook.sft.config import SFTConfig

    data = config_mapping(path, "SFTConfig fields and a data section")
    files = _data_section(path, data.pop("data", None))
    config = built_config(SFTConfig, path, data, overrides)
    val = files.get("val")
    return config, Path(files["train"]), Path(val) if val is not None else None


def _data_section(path: Path, section: Any) -> dict[str, str]:
    if not isinstance(section, dict) or "train" not in section:
        raise CliError(f"{path}: a 'data' section with 'train: FILE.jsonl' is required")
    unknown = sorted(set(section) - set(DATA_KEYS))
    if unknown:
        raise CliError(f"{path}: data: unknown key(s) {unknown}; expected {list(DATA_KEYS)}")
    for key, value in section.items():
        if not isinstance(value, str) or not Path(value).is_file():
            raise CliError(f"{path}: data.{key}: {value!r} is not a file")
    return dict(section)


def run_sft(args: argparse.Namespace) -> int:
    from post_training_cookbook.cli.commands import PROG
    from post_training_cookbook.sft import train_sft

    config, train, val = load_sft_config(args.config, args.overrides)
    run = train_sft(config, train, val)
    print(f"run: {run.path}")
    print(f"final model: {run.final_model_dir}")
    print(
        f"next: {PROG} eval {run.path}  |  {PROG} train GRPO.yaml --set model={run.final_model_dir}"
    )
    return 0


def add_sft(subparsers: Any, command: Any) -> None:
    """The ``sft`` subcommand (``command`` is the parser's ``_command`` helper)."""
    parser = command(
        subparsers,
        "sft",
        "Supervised fine-tuning (train_sft) on JSONL conversations from a YAML config.",
        "The YAML holds SFTConfig fields, one mapping per section (docs/sft.md), plus a\n"
        "'data:' section:\n\n"
        "  base:\n"
        "    model: post-training-cookbook/tool-use-tiny\n"
        "  num_epochs: 2\n"
        "  logging:\n"
        "    wandb_project: null\n"
        "  data:\n"
        "    train: demos/train.jsonl\n"
        "    val: demos/val.jsonl\n\n"
        'One conversation a line: {"messages": [...], "tools": [...]} (OpenAI format).\n'
        "example: %(prog)s sft.yaml --set optimizer.num_steps=2 --set checkpoints.run_name=smoke",
    )
    parser.add_argument("config", type=Path, help="YAML file: SFTConfig fields + data section")
    add_set_option(parser, "an SFTConfig field", "num_epochs=2")
    parser.set_defaults(run=run_sft)
