"""Recorded batches (``grpo/recorded_batch.py``): rebuilt from a run's rollout dump, a step's
batch is exactly what the trainer got that step and gives the loss the run reported; the
file round-trips; a dump that is not the step's batch and a file that is not a recorded
batch are refused with what is wrong.

The runs are the GRPO loop's own, on the tiny model with the scripted policy
(``test_grpo_common``): live tasks (right and wrong answers) and dead ones (always wrong),
so that dynamic sampling leaves groups in the dump that the step did not train on.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_grpo_common import (
    DEAD,
    LIVE,
    Closes,
    RecordedSamples,
    ScriptedPolicy,
    mode_envs,
    mode_tasks,
    quick_config,
    step_metrics,
)

from post_training_cookbook.files import BadFileError
from post_training_cookbook.grpo.recorded_batch import (
    FORMAT,
    RecordedBatch,
    main,
    read_recorded_batch,
    record_batch,
    write_recorded_batch,
)
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.trainer.trainer import Trainer
from post_training_cookbook.trainer.types import TrainingSample

COMMITTED = Path(__file__).parents[1] / "benchmarks" / "batches"


class LoopRun:
    def __init__(self, path: Path, batches: list[list[TrainingSample]]) -> None:
        self.path = path
        self.batches = batches
        """What the trainer's ``forward_backward`` got, step by step."""


@pytest.fixture(scope="module")
def loop_run(
    tiny_llama_dir: Path, tiny_llama_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LoopRun]:
    tasks = mode_tasks(LIVE, DEAD, DEAD, LIVE, DEAD, LIVE, LIVE, DEAD, LIVE)
    with pytest.MonkeyPatch.context() as monkeypatch:
        ScriptedPolicy(tiny_llama_tokenizer).install(monkeypatch)
        recorded = RecordedSamples(monkeypatch)
        config = quick_config(
            tiny_llama_dir, tmp_path_factory.mktemp("runs"), batch_size=2,
            episodes_per_task=4, num_steps=3, max_sampling_attempts=3,
        )  # fmt: skip
        run = train_multi_turn(config, tasks, mode_envs(Closes()))
        yield LoopRun(run.path, recorded.batches)


def fields_of(sample: TrainingSample) -> tuple[list[Any], ...]:
    return sample.tokens, sample.mask, sample.sampler_logprobs, sample.advantages


def test_each_steps_recorded_batch_is_what_the_trainer_got_that_step(loop_run: LoopRun) -> None:
    metrics = step_metrics(loop_run.path)
    assert len(loop_run.batches) == 3  # every step trained
    assert any(m["rollout/groups"] > m["train/groups"] for m in metrics.values())  # dead ones
    for step, trained in enumerate(loop_run.batches):
        batch = record_batch(loop_run.path, step, model="tiny")
        assert [fields_of(s) for s in batch.samples] == [fields_of(s) for s in trained]
        assert batch.num_groups == metrics[step]["train/groups"]
        # each group's episodes are consecutive and share the group's prompt
        assert batch.sample_groups == sorted(batch.sample_groups)
        assert batch.source.sampler_logprobs_recorded
        assert batch.source.model == "tiny" and batch.source.step == step


def test_the_recorded_batch_gives_the_loss_the_run_reported(
    loop_run: LoopRun, tiny_llama_dir: Path
) -> None:
    batch = record_batch(loop_run.path, 0)
    trainer = Trainer(tiny_llama_dir, batch.trainer)  # the run's initial weights
    loss = trainer.forward_backward(batch.samples, batch.loss).loss
    assert loss != 0.0
    assert loss == pytest.approx(step_metrics(loop_run.path)[0]["loss/loss"], rel=1e-5)


def test_a_batch_round_trips_through_its_file_byte_for_byte(
    loop_run: LoopRun, tmp_path: Path
) -> None:
    batch = record_batch(loop_run.path, 1)
    first = write_recorded_batch(batch, tmp_path / "a.json.gz")
    read = read_recorded_batch(first)
    assert [fields_of(s) for s in read.samples] == [fields_of(s) for s in batch.samples]
    assert (read.sample_groups, read.trainer, read.loss, read.source) == (
        batch.sample_groups, batch.trainer, batch.loss, batch.source,
    )  # fmt: skip
    second = write_recorded_batch(read, tmp_path / "b.json.gz")
    assert first.read_bytes() == second.read_bytes()


def copy_run(run: Path, target: Path, edit_line: Any = None) -> Path:
    """The run's config, metrics and step-0 dump in ``target``, each dump record edited."""
    (target / "rollouts").mkdir(parents=True)
    for name in ("config.yaml", "metrics.jsonl"):
        (target / name).write_text((run / name).read_text())
    dump = "rollouts/train_step_000000.jsonl"
    records = [json.loads(line) for line in (run / dump).read_text().splitlines()]
    if edit_line is not None:
        records = [edit_line(record) for record in records]
    (target / dump).write_text("".join(json.dumps(record) + "\n" for record in records))
    return target


def test_a_dump_without_sampler_logprobs_gives_a_batch_that_says_so(
    loop_run: LoopRun, tmp_path: Path
) -> None:
    def without_logprobs(record: dict[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in record.items() if key != "sampler_logprobs"}

    old = copy_run(loop_run.path, tmp_path / "old", without_logprobs)
    batch = read_recorded_batch(write_recorded_batch(record_batch(old, 0), tmp_path / "b.gz"))
    assert not batch.source.sampler_logprobs_recorded
    assert all(lp == 0.0 for sample in batch.samples for lp in sample.sampler_logprobs)
    recorded = loop_run.batches[0]
    assert [s.advantages for s in batch.samples] == [s.advantages for s in recorded]
    filled = batch.with_sampler_logprobs([[-0.5] * len(s.tokens) for s in batch.samples])
    assert [s.sampler_logprobs for s in filled.samples] == [
        [-0.5 * m for m in s.mask] for s in recorded
    ]


def test_a_dump_that_is_not_the_steps_batch_is_refused(loop_run: LoopRun, tmp_path: Path) -> None:
    def all_right(record: dict[str, Any]) -> dict[str, Any]:
        return record | {"reward": 1.0}  # no group varies: nothing would have trained

    changed = copy_run(loop_run.path, tmp_path / "changed", all_right)
    with pytest.raises(ValueError, match=r"metrics.jsonl says .* for step 0"):
        record_batch(changed, 0)


def test_the_command_line_writes_a_batch_and_says_what_is_wrong(
    loop_run: LoopRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "step2.json.gz"
    assert main([str(loop_run.path), "--step", "2", "--out", str(out)]) == 0
    assert f"step 2 of {loop_run.path.parent.name}/run: " in capsys.readouterr().out
    assert read_recorded_batch(out).source.step == 2
    assert main([str(loop_run.path), "--step", "7", "--out", str(out)]) == 2
    assert "train_step_000007.jsonl: cannot be read" in capsys.readouterr().err


def write_gzip(path: Path, data: bytes) -> Path:
    with gzip.open(path, "wb") as file:
        file.write(data)
    return path


def test_files_that_are_not_recorded_batches_are_refused_with_what_is_wrong(
    loop_run: LoopRun, tmp_path: Path
) -> None:
    good = write_recorded_batch(record_batch(loop_run.path, 0), tmp_path / "good.json.gz")
    document = json.loads(gzip.decompress(good.read_bytes()))
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(document))
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    short_mask = json.loads(json.dumps(document))
    short_mask["samples"][0]["mask"].pop()
    cases = {
        plain: "not a gzip-compressed recorded batch",
        cut: "cut short or damaged",
        write_gzip(tmp_path / "text.gz", b"tokens, masks"): "does not hold JSON",
        write_gzip(tmp_path / "other.gz", b'{"format": "x"}'): f"no format '{FORMAT}'",
        write_gzip(
            tmp_path / "v2.gz", json.dumps(document | {"version": 2}).encode()
        ): "version 2; this package reads version 1",
        write_gzip(
            tmp_path / "mask.gz", json.dumps(short_mask).encode()
        ): "sample 0: mask has .* entries but tokens has",
        tmp_path / "missing.gz": "cannot be read",
    }
    for path, problem in cases.items():
        with pytest.raises(BadFileError, match=problem) as caught:
            read_recorded_batch(path)
        assert caught.value.path == path


@pytest.mark.parametrize(
    ("name", "groups", "samples", "model", "shared_prompt"),
    [
        ("game_step50", 9, 72, "post-training-cookbook/tool-use-tiny", 80),
        ("bfcl_multi_turn_step0", 1, 6, "qwen2.5-coder-0.5b-instruct", 4000),
        ("smollm2_grpo_step3", 1, 4, "smollm2-135m-instruct", 398),
    ],
)
def test_the_committed_batches_read_back_as_recorded(
    name: str, groups: int, samples: int, model: str, shared_prompt: int
) -> None:
    batch: RecordedBatch = read_recorded_batch(COMMITTED / f"{name}.json.gz")
    assert (batch.num_groups, len(batch.samples), batch.source.model) == (groups, samples, model)
    assert batch.source.run_metrics["train/samples"] == samples  # checked when recorded
    for group in range(groups):  # each group's episodes share at least its prompt
        pairs = zip(batch.samples, batch.sample_groups, strict=True)
        tokens = [sample.tokens for sample, of in pairs if of == group]
        columns = zip(*tokens, strict=False)  # up to the shortest episode
        shared = next(i for i, column in enumerate(columns) if len(set(column)) > 1)
        assert shared >= shared_prompt
