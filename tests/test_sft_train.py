"""``train_sft`` on the tiny Llama through the trainer service: the run folder, the loss it
trains, skipped conversations, errors before loading, and kill -9 then resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from sft_common import demonstration_files, run, small_config
from transformers import AutoModelForCausalLM

from post_training_cookbook.models import resolve_model
from post_training_cookbook.plots import plot_run
from post_training_cookbook.sft import SFTConfig, SFTDataError, train_sft
from post_training_cookbook.sft.plots import SFT_PANEL_TITLES
from post_training_cookbook.sft.train import service_spec
from post_training_cookbook.trainer.trainer import Trainer

TESTS = Path(__file__).parent


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(autouse=True)
def _quiet_tokenizers(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def test_a_run_writes_its_folder_lowers_the_loss_and_saves_a_model_that_loads(
    tiny_llama_dir, tmp_path
):
    train, val = demonstration_files(tmp_path)
    overlong = json.loads(train.read_text().splitlines()[0])
    overlong["messages"][1]["content"] += " pad" * 2000  # far past max_model_length
    with train.open("a") as file:
        file.write(json.dumps(overlong) + "\n")
    config = small_config(tiny_llama_dir, tmp_path / "runs", "run")
    directory = train_sft(config, train, val)

    lines = read_jsonl(directory.metrics_path)
    assert [line["step"] for line in lines] == [0, 1, 2, 3, 4, 5, 6]
    assert all("loss/nll" in line for line in lines[:-1]) and "loss/nll" not in lines[-1]
    validation = [line["val/nll"] for line in lines if "val/nll" in line]
    assert len(validation) == 4  # before steps 0, 2, 4 and at the end
    assert validation[-1] < validation[0]
    assert all(
        line["train/tokens"] <= 3000 for line in lines[:-1] if line["train/conversations"] > 1
    )
    summary = json.loads((directory.path / "data.json").read_text())
    assert summary["skipped_too_long"] == [f"{train}:25"]
    assert summary["train_conversations"] == 24
    assert SFTConfig.from_yaml(directory.config_path) == config
    assert sorted(p.name for p in directory.checkpoints_dir.iterdir())[-1] == "step_000006"
    model = AutoModelForCausalLM.from_pretrained(directory.final_model_dir)
    assert sum(p.numel() for p in model.parameters()) > 0
    figure = plot_run(directory.path)  # an SFT run's figure: its loss, not rewards
    assert [axes.get_title() for axes in figure.axes[:2]] == list(SFT_PANEL_TITLES)


def test_the_service_trains_the_masked_nll_of_the_conversation(tiny_llama_dir, tmp_path):
    """The trainer's gradient with the "sft" loss equals autograd of the masked NLL computed
    by hand from the model's own logits: the assistant tokens' mean −log p."""
    from post_training_cookbook.models.loading import load_codec
    from post_training_cookbook.sft import read_conversations, render_examples
    from post_training_cookbook.trainer.types import LossConfig

    train, _ = demonstration_files(tmp_path)
    info = resolve_model(str(tiny_llama_dir), codec="hermes")
    examples = render_examples(load_codec(info), read_conversations(train)[:2], "all", 1024)
    settings = service_spec(small_config(tiny_llama_dir, tmp_path, "x"), info).trainer
    settings = replace(settings, autocast_bf16=False)  # exact fp32, as the reference
    trainer = Trainer(str(tiny_llama_dir), settings)
    samples = [example.training_sample() for example in examples.examples]
    result = trainer.forward_backward(samples, LossConfig(loss_type="sft"))
    got = {name: p.grad.clone() for name, p in trainer.trainable_parameters().items()}

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    total = torch.zeros(())
    for example in examples.examples:
        ids = torch.tensor([example.tokens])
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
        chosen = logprobs.gather(-1, ids[0, 1:, None]).squeeze(-1)
        total = total - (chosen * torch.tensor(example.mask[1:], dtype=torch.float)).sum()
    loss = total / sum(sum(example.mask) for example in examples.examples)
    loss.backward()
    assert result.loss == pytest.approx(loss.item(), rel=1e-5)
    expected = {name: p.grad for name, p in model.named_parameters()}
    for name, grad in got.items():
        reference = expected[name.removeprefix("_orig_mod.")]
        torch.testing.assert_close(grad, reference, atol=1e-5, rtol=1e-4)


def test_bad_data_and_bad_config_fail_before_any_model_loads(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "assistant", "content": "x"}]}\n{oops\n')
    config = SFTConfig(model=str(tmp_path / "no-such-model"), wandb_project=None)
    with pytest.raises(SFTDataError, match=f"{bad}:2: not JSON"):
        train_sft(config, bad)
    with pytest.raises(SFTDataError, match="no conversations given"):
        train_sft(config, [])


def test_a_run_killed_mid_training_resumes_with_every_step_once(tiny_llama_dir, tmp_path):
    demonstration_files(tmp_path)  # before the child starts, so it only trains
    num_steps = 6
    run_dir = tmp_path / "runs" / "run"
    process = subprocess.Popen(
        [sys.executable, TESTS / "sft_common.py", tiny_llama_dir, tmp_path, str(num_steps)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    second = run_dir / "checkpoints" / "step_000002" / "complete.json"
    deadline = time.monotonic() + 240
    while not second.exists():
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
        assert time.monotonic() < deadline, "no second checkpoint within 240 s"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL
    assert not (run_dir / "final_model").exists(), "the run finished before it was killed"

    resumed = run(tiny_llama_dir, tmp_path, "run", num_steps=num_steps, resume=True)
    reference = run(tiny_llama_dir, tmp_path, "reference", num_steps=num_steps)

    lines = read_jsonl(resumed.metrics_path)
    assert [line["step"] for line in lines] == [*range(num_steps), num_steps]
    expected = read_jsonl(reference.metrics_path)
    for got, want in zip(lines, expected, strict=True):  # the same steps, the same losses
        for key in ("loss/nll", "val/nll", "train/conversations"):
            assert (key in got) == (key in want)
            if key in got:
                assert got[key] == pytest.approx(want[key], rel=1e-5), (got["step"], key)
    AutoModelForCausalLM.from_pretrained(resumed.final_model_dir)


def test_batches_by_prompt_forward_each_shared_system_prompt_once_a_step(tiny_llama_dir, tmp_path):
    """Conversations under two long system prompts: grouped into batches by prompt, the
    trainer forwards far fewer tokens for the same conversations and steps."""
    train, _ = demonstration_files(tmp_path, num_train=12)
    lines = [json.loads(line) for line in train.read_text().splitlines()]
    prompts = [" ".join(f"rule {k} of {name}." for k in range(60)) for name in ("a", "b")]
    for index, record in enumerate(lines):
        record["messages"].insert(0, {"role": "system", "content": prompts[index % 2]})
    mixed = tmp_path / "two_prompts.jsonl"
    mixed.write_text("".join(json.dumps(record) + "\n" for record in lines))
    forwarded, trained = {}, {}
    for by_prompt in (False, True):
        config = small_config(
            tiny_llama_dir, tmp_path / "runs", f"by_prompt_{by_prompt}", num_steps=None,
            batch_tokens=4000, batch_by_prompt=by_prompt, validation_interval=0,
            checkpoint_interval=0, max_model_length=2048,
        )  # fmt: skip
        records = read_jsonl(train_sft(config, mixed).metrics_path)
        forwarded[by_prompt] = sum(r["train/forwarded_tokens"] for r in records)
        trained[by_prompt] = sum(r["train/trained_tokens"] for r in records)
    assert trained[True] == trained[False]  # the same conversations, once each
    assert forwarded[True] < 0.6 * forwarded[False]
