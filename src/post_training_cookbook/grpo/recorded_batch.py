"""A recorded batch: the training batch one step of a GRPO run trained on, in a file that
benchmarks and tests read back (``benchmarks/packing.py --batches FILE``).

    python -m post_training_cookbook.grpo.recorded_batch runs/<run> --step 50 \\
        --model post-training-cookbook/tool-use-tiny --out benchmarks/batches/game.json.gz

It is rebuilt from what the run wrote, with no re-run: ``config.yaml`` and the step's rollout
dump (``rollouts/train_step_NNNNNN.jsonl``: every group the step played, informative or
not, in the order played) go through the loop's own rules: the first ``batch_size``
informative groups (``lockstep.collect_groups``; the async loop admits no more than that),
their samples and advantages by ``build_training_batch``. The result is checked against the
step's line in ``metrics.jsonl`` (samples, groups, trained tokens), and refused where they
differ (a step whose line was never written, a run killed before it, is recorded unchecked:
its ``run_metrics`` are empty).

The file is gzip-compressed JSON (``FORMAT``, ``VERSION``): where it came from (run, step,
the model the benchmark should load and the run's own model path, the codec), the trainer's
settings and the loss as the run had them, and per sample its group, tokens, mask,
advantages and sampler log-probabilities. A group's prompt repeats in every episode, which
the compression takes out.

Sampler log-probabilities: rollout dumps carry them since recorded batches exist; an older
dump does not, and its batch says so (``sampler_logprobs_recorded`` False, zeros in the
samples). A reader then fills them with the trainer's own log-probabilities (the ratio is 1:
an on-policy step at the weights it loads); the layout of the step, and so what packing
saves, does not depend on them.

Not reproducible, and refused: runs with a distillation teacher (its advantages are not in
the dump) and with router replay (nor are the routes).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from post_training_cookbook.envs.base import Task
from post_training_cookbook.files import BadFileError
from post_training_cookbook.grpo.advantages import (
    TrainingBatch,
    build_training_batch,
    is_informative,
)
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.settings import advantage_settings, grpo_trainer_settings
from post_training_cookbook.grpo.validation import loss_config_of
from post_training_cookbook.rollout import Episode, Group, TruncationCause
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings, TrainingSample

FORMAT = "post_training_cookbook/recorded_batch"
VERSION = 1
CHECKED_METRICS = ("train/samples", "train/groups", "train/trained_tokens")
"""The step's metrics the rebuilt batch must reproduce."""


@dataclass(frozen=True)
class BatchSource:
    run: str
    """The run folder's name, after its runs folder's (``runs/grpo-tool-use-tiny-...``)."""
    step: int
    model: str
    """The model a reader loads: a catalog id or a name ``benchmarks/packing.py`` knows."""
    run_model: str
    """The run's ``config.model`` (often a path on the machine that ran it)."""
    codec: str | None
    sampler_logprobs_recorded: bool
    run_metrics: dict[str, float]
    """The step's metrics the batch was checked against, and its ``loss/loss``."""


@dataclass(frozen=True)
class RecordedBatch:
    source: BatchSource
    trainer: TrainerSettings
    loss: LossConfig
    samples: list[TrainingSample]
    sample_groups: list[int]
    """Per sample: the informative group (0, 1, ...) it came from."""

    @property
    def num_groups(self) -> int:
        return len(set(self.sample_groups))

    def with_sampler_logprobs(self, logprobs: Sequence[list[float]]) -> RecordedBatch:
        """The batch with these sampler log-probabilities (one list per sample; 0 is kept
        where the mask is 0). ``source`` still says whether the recorded ones were there."""
        samples = []
        for sample, row in zip(self.samples, logprobs, strict=True):
            kept = [lp if m > 0 else 0.0 for lp, m in zip(row, sample.mask, strict=True)]
            samples.append(replace(sample, sampler_logprobs=kept))
        return replace(self, samples=samples)


# ---------------------------------------------------------------- from a run


def record_batch(
    run_dir: str | os.PathLike[str], step: int, model: str | None = None
) -> RecordedBatch:
    """Step ``step``'s training batch of the run in ``run_dir``; ``model`` names the model a
    reader should load (default: the run's ``config.model``)."""
    folder = Path(run_dir)
    config = GRPOConfig.from_yaml(folder / "config.yaml")
    if config.teacher is not None:
        raise ValueError(f"{folder}: a distillation run's batch holds the teacher's advantages, "
                         "which the rollout dump does not: it cannot be recorded")  # fmt: skip
    if config.router_replay:
        raise ValueError(f"{folder}: the rollout dump holds no routed experts, which a router "
                         "replay run trained with: its batch cannot be recorded")  # fmt: skip
    dump = folder / "rollouts" / f"train_step_{step:06d}.jsonl"
    groups, logprobs_recorded = read_groups(dump)
    settings = advantage_settings(config)
    trained = [group for group in groups if is_informative(group, settings)][: config.batch_size]
    samples: list[TrainingSample] = []
    sample_groups: list[int] = []
    masked = 0
    for index, group in enumerate(trained):  # advantages are per group: one at a time
        part = build_training_batch([group], settings)
        samples += part.samples
        sample_groups += [index] * len(part.samples)
        masked += part.masked_episodes
    rebuilt = TrainingBatch(samples, len(trained), 0, masked).metrics()
    run_metrics = step_metrics(folder / "metrics.jsonl", step)
    for key in CHECKED_METRICS:
        if key in run_metrics and run_metrics[key] != rebuilt[key]:
            raise ValueError(
                f"{dump}: the rebuilt batch has {key}={rebuilt[key]:g}, but the run's "
                f"metrics.jsonl says {run_metrics[key]:g} for step {step}: these episodes are "
                "not the batch the step trained on"
            )
    if not samples:
        raise ValueError(f"{dump}: step {step} trained on nothing (no informative group)")
    source = BatchSource(
        run="/".join(folder.resolve().parts[-2:]), step=step, model=model or config.model,
        run_model=config.model, codec=config.codec, sampler_logprobs_recorded=logprobs_recorded,
        run_metrics={k: v for k, v in run_metrics.items() if k in (*CHECKED_METRICS, "loss/loss")},
    )  # fmt: skip
    trainer = replace(grpo_trainer_settings(config), device=None)
    return RecordedBatch(source, trainer, loss_config_of(config), samples, sample_groups)


def read_groups(dump: Path) -> tuple[list[Group], bool]:
    """The groups of a rollout dump, in the order played, and whether every episode's
    sampler log-probabilities are in it."""
    groups: dict[int, Group] = {}
    logprobs_recorded = True
    try:
        lines = dump.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise BadFileError(dump, f"cannot be read ({exc.strerror})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            episode = _episode(record)
            index = int(record["group"])
        except (ValueError, KeyError, TypeError) as exc:
            raise BadFileError(dump, f"line {number} is not an episode record ({exc!r})") from None
        logprobs_recorded &= "sampler_logprobs" in record
        groups.setdefault(index, Group(episode.task, [])).episodes.append(episode)
    if not groups:
        raise BadFileError(dump, "holds no episodes")
    return list(groups.values()), logprobs_recorded


def _episode(record: dict[str, Any]) -> Episode:
    """An episode as the trainer saw it, from its record (``rollout/records.py``)."""
    task = record["task"]
    tokens = [int(token) for token in record["token_ids"]]
    logprobs = record.get("sampler_logprobs")
    truncation = record["truncation"]
    return Episode(
        task=Task(str(task["prompt"]), str(task.get("target", "")), task.get("metadata") or {}),
        tokens=tokens,
        mask=[float(bit) for bit in record["mask"]],
        sampler_logprobs=[float(lp) for lp in logprobs] if logprobs else [0.0] * len(tokens),
        versions=[int(version) for version in record["versions"]],
        reward=float(record["reward"]),
        truncation=TruncationCause(truncation) if truncation else None,
        num_turns=int(record["num_turns"]),
        segment_starts=[int(start) for start in record.get("segment_starts") or [0]],
        turn_rewards=[float(reward) for reward in record.get("turn_rewards") or []],
        token_turns=[int(turn) for turn in record.get("token_turns") or []],
    )


def step_metrics(path: Path, step: int) -> dict[str, float]:
    """The numbers of the metrics line of ``step`` (the last one, after a resume), or {}."""
    found: dict[str, float] = {}
    if not path.is_file():
        return found
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill: the loop drops it on resume too
        if isinstance(record, dict) and record.get("step") == step:
            found = {k: float(v) for k, v in record.items() if isinstance(v, int | float)}
    return found


# ---------------------------------------------------------------- the file


def write_recorded_batch(batch: RecordedBatch, path: str | os.PathLike[str]) -> Path:
    """``batch`` as gzip-compressed JSON at ``path``."""
    trainer = asdict(batch.trainer)
    document = {
        "format": FORMAT,
        "version": VERSION,
        "source": asdict(batch.source),
        "trainer": trainer,
        "loss": asdict(batch.loss),
        "samples": [
            {
                "group": group,
                "tokens": sample.tokens,
                "mask": [int(m) if m in (0.0, 1.0) else m for m in sample.mask],
                "advantages": sample.advantages,
                "sampler_logprobs": (
                    sample.sampler_logprobs if batch.source.sampler_logprobs_recorded else None
                ),
            }
            for sample, group in zip(batch.samples, batch.sample_groups, strict=True)
        ],
    }
    target = Path(path)
    text = json.dumps(document, separators=(",", ":"))
    # no name, mtime 0: the same batch gives the same bytes (a re-recorded file, no diff)
    with (
        open(target, "wb") as raw,
        gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as file,
    ):
        file.write(text.encode("utf-8"))
    return target


def read_recorded_batch(path: str | os.PathLike[str]) -> RecordedBatch:
    """The batch in ``path``; ``BadFileError`` says what is wrong with a file that is not
    a recorded batch of this version, or is damaged."""
    source = Path(path)
    try:
        with gzip.open(source, "rb") as file:
            document = json.loads(file.read().decode("utf-8"))
    except gzip.BadGzipFile as exc:
        raise BadFileError(source, f"is not a gzip-compressed recorded batch ({exc})") from None
    except (EOFError, zlib.error) as exc:
        raise BadFileError(source, f"is cut short or damaged ({exc})") from None
    except OSError as exc:
        raise BadFileError(source, f"cannot be read ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadFileError(source, f"does not hold JSON ({exc})") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise BadFileError(source, f"is not a recorded batch (no format {FORMAT!r})")
    if document.get("version") != VERSION:
        raise BadFileError(
            source,
            f"is a recorded batch of version {document.get('version')!r}; this package "
            f"reads version {VERSION}",
        )
    try:
        return _batch_of(document)
    except (KeyError, TypeError, ValueError) as exc:
        raise BadFileError(source, f"is not a valid recorded batch: {exc!r}") from None


TUPLE_SETTINGS = ("trainable_tokens", "lora_target_modules", "betas")
"""``TrainerSettings`` fields that are tuples, which JSON stores as lists."""


def _batch_of(document: dict[str, Any]) -> RecordedBatch:
    source = BatchSource(**document["source"])
    trainer_fields = {f.name for f in fields(TrainerSettings)}
    stored = dict(document["trainer"])
    if set(stored) - trainer_fields:
        raise ValueError(f"unknown trainer settings {sorted(set(stored) - trainer_fields)}")
    for name in TUPLE_SETTINGS:  # JSON lists; absent from batches recorded before them
        if name in stored:
            stored[name] = tuple(stored[name])
    trainer = TrainerSettings(**stored)
    loss = LossConfig(**document["loss"])
    samples, sample_groups = [], []
    for number, entry in enumerate(document["samples"]):
        tokens = [int(token) for token in entry["tokens"]]
        mask = [float(m) for m in entry["mask"]]
        logprobs = entry["sampler_logprobs"]
        if (logprobs is None) == source.sampler_logprobs_recorded:
            raise ValueError(f"sample {number}: sampler_logprobs disagree with the source")
        behaviour = [float(lp) for lp in logprobs] if logprobs else [0.0] * len(tokens)
        advantages = [float(a) for a in entry["advantages"]]
        try:
            samples.append(TrainingSample(tokens, mask, behaviour, advantages))
        except ValueError as exc:
            raise ValueError(f"sample {number}: {exc}") from None
        sample_groups.append(int(entry["group"]))
    if not samples:
        raise ValueError("no samples")
    return RecordedBatch(source, trainer, loss, samples, sample_groups)


# ---------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="the run folder (config.yaml, rollouts/, metrics.jsonl)")
    parser.add_argument("--step", type=int, required=True)
    parser.add_argument("--out", required=True, help="the file to write (.json.gz)")
    parser.add_argument("--model", help="the model a reader loads (default: the run's model)")
    args = parser.parse_args(argv)
    try:
        batch = record_batch(args.run_dir, args.step, args.model)
    except ValueError as exc:  # BadFileError included: say what, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    path = write_recorded_batch(batch, args.out)
    lengths = [len(sample.tokens) for sample in batch.samples]
    trained = sum(sample.num_trained_tokens for sample in batch.samples)
    print(
        f"{path}: step {batch.source.step} of {batch.source.run}: {batch.num_groups} groups, "
        f"{len(lengths)} samples of {min(lengths)}-{max(lengths)} tokens ({sum(lengths)} in all, "
        f"{trained} trained), sampler log-probabilities "
        f"{'recorded' if batch.source.sampler_logprobs_recorded else 'absent'}, "
        f"{'checked against' if batch.source.run_metrics else 'NOT checked: no step line in'} "
        f"metrics.jsonl, {path.stat().st_size / 1024:.0f} KiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
