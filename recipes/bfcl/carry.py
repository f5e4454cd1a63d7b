"""Carry a BFCL multi-turn run across machines through the repository: a run takes longer than
one working session here, and only what is committed outlives one.

    python recipes/bfcl/carry.py save OUT docs/runs/bfcl_multi_turn/run1
    python recipes/bfcl/carry.py restore docs/runs/bfcl_multi_turn/run1 OUT

``save`` copies into the docs folder what the run cannot rebuild cheaply: every finished
stage's JSON; every evaluation folder's ``bfcl_results.jsonl``; RFT's kept samples
(``RFT_DEMOS``); a finished SFT run's (``SFT_RUNS``: (c) and (d)) config, metrics and adapter
(the newest checkpoint's trainable weights and ``trainer_state.json``, not its optimizer
state); and for each GRPO run, and an SFT run that has not finished, its config, metrics and
newest checkpoint, whole (optimizer and RNG states included, 53-62 MB at LoRA rank 8), so
that resuming it is exact. ``restore`` rebuilds ``OUT`` from them: the stage files, each
finished SFT run's ``final_model`` merged from its start model and its adapter (the same
weights the stage wrote), and each run folder carried whole, which then resumes from its
checkpoint. The
demonstrations (``demos`` stage, a minute) are not carried: the recipe writes them again.
Use the same ``OUT`` path on both sides: a GRPO run's config names its start model by path,
and a resumed run must keep its config.
"""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from pathlib import Path

SFT_RUNS = ("sft", "rft")
"""The protocol's SFT runs, in the order they are restored: (d) starts from (c)'s final model."""
RESULTS_FILE = "bfcl_results.jsonl"
"""Each evaluation folder's calls as BFCL's checker takes them (``results_file.py``), carried
into ``bfcl_results/<evaluation folder>.jsonl``: small, and the evidence a reader re-scores."""
ADAPTER_FILES = ("trainable.safetensors", "trainer_state.json")
RFT_DEMOS = "rft_demos_part*.jsonl"
"""The turns of RFT's samples that BFCL passed, a file a part: the ``rft`` stage trains on
them, and sampling them again takes hours. Carried gzipped into ``rft_demos/`` (every
conversation repeats its tool documentation)."""
NOT_CARRIED = {"demos.json"}
"""Its stage writes ``demos.jsonl`` beside it, which is not carried: the stage runs again."""
NOT_RESTORED = {"report.json"}
"""Carried for readers, not restored: the report stage runs again over whatever has run."""


def grpo_runs(out: Path) -> list[Path]:
    return sorted(p for p in out.glob("grpo*") if p.is_dir() and (p / "config.yaml").exists())


def adapter(name: str) -> str:
    """The docs folder's name for a finished SFT run's adapter."""
    return f"{name}_adapter"


def resumable_runs(out: Path) -> list[Path]:
    """The training runs carried whole, to resume: every GRPO run, and each SFT run that has
    not finished (a finished one is carried as its adapter)."""
    unfinished = [
        out / name
        for name in SFT_RUNS
        if (out / name / "config.yaml").exists() and not (out / name / "final_model").is_dir()
    ]
    return unfinished + grpo_runs(out)


def newest_checkpoint(run: Path) -> Path | None:
    from post_training_cookbook.runs.checks import checkpoint_folders

    found = checkpoint_folders(run / "checkpoints")  # newest first, as a resume reads them
    return found[0] if found else None


def save(out: Path, docs: Path) -> None:
    docs.mkdir(parents=True, exist_ok=True)
    for stage in sorted(out.glob("*.json")):
        if stage.name not in NOT_CARRIED:
            shutil.copy2(stage, docs / stage.name)
    for name in SFT_RUNS:
        save_finished_sft(out / name, docs)
    for results in sorted(out.glob(f"evals/*/{RESULTS_FILE}")):  # BFCL's own checker reads these
        (docs / "bfcl_results").mkdir(exist_ok=True)
        shutil.copy2(results, docs / "bfcl_results" / f"{results.parent.name}.jsonl")
    for demos in sorted(out.glob(RFT_DEMOS)):
        (docs / "rft_demos").mkdir(exist_ok=True)
        carried = gzip.compress(demos.read_bytes(), mtime=0)  # unchanged, the same bytes
        (docs / "rft_demos" / f"{demos.name}.gz").write_bytes(carried)
    for run in resumable_runs(out):
        shutil.copy2(run / "config.yaml", docs / f"{run.name}_config.yaml")
        for earlier in run.glob("config.before_*.yaml"):  # a resume that changed a setting
            shutil.copy2(earlier, docs / f"{run.name}_{earlier.name}")
        shutil.copy2(run / "metrics.jsonl", docs / f"{run.name}_metrics.jsonl")
        checkpoint = newest_checkpoint(run)
        if checkpoint is None:
            continue
        target = docs / f"{run.name}_checkpoint"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(checkpoint, target)
        print(f"{run.name}: carried {checkpoint.name}")


def save_finished_sft(run: Path, docs: Path) -> None:
    """A finished SFT run as its config, metrics and adapter (an unfinished one is carried
    whole by ``save``, as a GRPO run is)."""
    checkpoint = newest_checkpoint(run)
    if not (run / "final_model").is_dir():
        return
    if checkpoint is None:
        # a folder ``restore`` rebuilt: its final model was merged from the carried adapter
        assert (docs / adapter(run.name)).is_dir(), f"{run} has a final model but no checkpoint"
        return
    shutil.copy2(run / "config.yaml", docs / f"{run.name}_config.yaml")
    shutil.copy2(run / "metrics.jsonl", docs / f"{run.name}_metrics.jsonl")
    shutil.rmtree(docs / f"{run.name}_checkpoint", ignore_errors=True)  # carried unfinished
    (docs / adapter(run.name)).mkdir(exist_ok=True)
    for name in ADAPTER_FILES:
        shutil.copy2(checkpoint / name, docs / adapter(run.name) / name)


def restore(docs: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for stage in sorted(docs.glob("*.json")):
        if not (out / stage.name).exists() and stage.name not in NOT_CARRIED | NOT_RESTORED:
            shutil.copy2(stage, out / stage.name)
    for carried in sorted(docs.glob(f"rft_demos/{RFT_DEMOS}.gz")):
        target = out / carried.name.removesuffix(".gz")
        if not target.exists():
            target.write_bytes(gzip.decompress(carried.read_bytes()))
    for name in SFT_RUNS:
        if (docs / adapter(name)).is_dir() and not (out / name / "final_model").exists():
            merge_adapter(docs, out / name)
    unfinished = [  # SFT runs carried whole, to resume
        docs / f"{name}_config.yaml"
        for name in SFT_RUNS
        if (docs / f"{name}_checkpoint").is_dir() and not (docs / adapter(name)).is_dir()
    ]
    for config in unfinished + sorted(docs.glob("grpo*_config.yaml")):
        name = config.name.removesuffix("_config.yaml")
        run = out / name
        if run.exists():
            continue
        checkpoint = docs / f"{name}_checkpoint"
        (run / "checkpoints").mkdir(parents=True)
        shutil.copy2(config, run / "config.yaml")
        shutil.copy2(docs / f"{name}_metrics.jsonl", run / "metrics.jsonl")
        if checkpoint.is_dir():
            step = json.loads((checkpoint / "loop_state.json").read_text())["step"]
            shutil.copytree(checkpoint, run / "checkpoints" / f"step_{step:06d}")
            print(f"{name}: resumes from step {step}")


def merge_adapter(docs: Path, run: Path) -> None:
    """``run/final_model``: the run's start model with its carried adapter merged, written by
    a trainer set up as the SFT stage's was (so the weights are the ones it wrote). (d)'s
    start is (c)'s final model, restored before it."""
    sys.path.insert(0, str(Path(__file__).parent))
    from qwen_coder import qwen_coder_folder, qwen_coder_tagged_folder

    from post_training_cookbook.models import resolve_model
    from post_training_cookbook.sft import SFTConfig
    from post_training_cookbook.sft.train import service_spec
    from post_training_cookbook.trainer.trainer import Trainer

    config = SFTConfig.from_yaml(docs / f"{run.name}_config.yaml")
    if not Path(config.model).exists():  # the base model's folder, converted from its wheels
        tagged = config.model.endswith("-tool-tags")  # the SFT stage's start (tag rows trained)
        made = (qwen_coder_tagged_folder if tagged else qwen_coder_folder)()
        assert str(made) == config.model, f"{config.model} is not where this machine makes it"
    settings = service_spec(config, resolve_model(config.model, codec=config.codec)).trainer
    trainer = Trainer(config.model, settings)
    trainer.load_training_checkpoint(docs / adapter(run.name), load_optimizer=False)
    trainer.save_inference_checkpoint(run / "final_model")
    shutil.copy2(docs / f"{run.name}_config.yaml", run / "config.yaml")
    shutil.copy2(docs / f"{run.name}_metrics.jsonl", run / "metrics.jsonl")
    print(f"{run.name}: final model merged from {docs / adapter(run.name)}")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("save", "restore"):
        sys.exit(__doc__)
    action, source, target = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    (save if action == "save" else restore)(source, target)
