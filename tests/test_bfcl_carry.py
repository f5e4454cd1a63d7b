"""``recipes/bfcl/carry.py``: a run saved into a docs folder and restored elsewhere gives the
same SFT model, bit for bit, and a GRPO run that resumes from its carried checkpoint; and
``qwen_coder.init_token_rows``, the recipe's start for untrained token rows."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sft_common import demonstration_files, small_config
from sft_common import run as sft_run
from transformers import AutoModelForCausalLM

from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TASKS, ToolUseGameEnv
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.models import BUNDLED_MODEL_DIR
from post_training_cookbook.sft import train_sft

sys.path.insert(0, str(Path(__file__).parents[1] / "recipes" / "bfcl"))
import carry

pytestmark = pytest.mark.skipif(
    not (BUNDLED_MODEL_DIR / "config.json").is_file(), reason="the bundled model is not built"
)


def weights(folder: Path) -> dict:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def grpo(out: Path, num_steps: int, resume: bool):
    config = GRPOConfig(
        model="post-training-cookbook/tool-use-tiny", batch_size=2, episodes_per_task=4,
        num_steps=num_steps, validation_interval=0, checkpoint_interval=1,
        runs_dir=str(out), run_name="grpo", resume=resume, wandb_project=None,
    )  # fmt: skip
    return train_multi_turn(config, list(TOOL_USE_GAME_TASKS[:8]), lambda t: ToolUseGameEnv())


def test_a_carried_run_gives_the_same_sft_model_and_resumes_its_grpo_run(tiny_llama_dir, tmp_path):
    out, docs, elsewhere = tmp_path / "out", tmp_path / "docs", tmp_path / "elsewhere"
    sft_run(tiny_llama_dir, tmp_path / "sft_data", "sft", num_steps=2, use_lora=True)
    (tmp_path / "sft_data" / "runs" / "sft").rename(out.mkdir() or out / "sft")
    grpo(out, num_steps=2, resume=False)
    (out / "eval_sft.json").write_text('{"turn_accuracy": 0.5}\n')

    carry.save(out, docs)
    assert (docs / "sft_adapter" / "trainable.safetensors").is_file()
    assert not (docs / "sft_adapter" / "optimizer.safetensors").exists()  # weights only
    assert json.loads((docs / "grpo_checkpoint" / "loop_state.json").read_text())["step"] == 2

    carry.restore(docs, elsewhere)
    assert (elsewhere / "eval_sft.json").read_text() == '{"turn_accuracy": 0.5}\n'
    merged, original = (
        weights(elsewhere / "sft" / "final_model"),
        weights(out / "sft" / "final_model"),
    )
    assert merged.keys() == original.keys()
    assert all((merged[name] == original[name]).all() for name in merged)

    original_lines = (out / "grpo" / "metrics.jsonl").read_text().splitlines()
    run = grpo(elsewhere, num_steps=3, resume=True)
    lines = (run.path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]
    assert lines[:2] == original_lines  # steps 0-1 carried, step 2 trained here
    assert sorted(p.name for p in (run.path / "checkpoints").iterdir()) == [
        "step_000002",
        "step_000003",
    ]


def test_an_unfinished_sft_run_is_carried_whole_and_resumes_where_it_stopped(
    tiny_llama_dir, tmp_path
):
    out, docs, elsewhere = tmp_path / "out", tmp_path / "docs", tmp_path / "elsewhere"
    sft_run(tiny_llama_dir, tmp_path / "sft_data", "sft", num_steps=2, use_lora=True)
    (tmp_path / "sft_data" / "runs" / "sft").rename(out.mkdir() or out / "sft")
    shutil.rmtree(out / "sft" / "final_model")  # stopped after its checkpoint of step 2
    (out / "evals" / "eval_sft_base").mkdir(parents=True)
    (out / "evals" / "eval_sft_base" / "bfcl_results.jsonl").write_text('{"id": "x"}\n')

    carry.save(out, docs)
    assert not (docs / "sft_adapter").exists()
    assert (docs / "sft_checkpoint" / "optimizer.safetensors").is_file()  # exact resume
    assert (docs / "bfcl_results" / "eval_sft_base.jsonl").read_text() == '{"id": "x"}\n'

    carry.restore(docs, elsewhere)
    original_lines = (out / "sft" / "metrics.jsonl").read_text().splitlines()
    config = small_config(tiny_llama_dir, elsewhere, "sft", num_steps=3, use_lora=True, resume=True)
    run = train_sft(config, *demonstration_files(tmp_path / "sft_data"))
    lines = (run.path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines][:3] == [0, 1, 2]
    assert lines[:2] == original_lines[:2]  # steps 0-1 carried, step 2 trained here
    carry.save(elsewhere, docs)  # finished now: carried as its adapter
    assert (docs / "sft_adapter" / "trainable.safetensors").is_file()
    assert not (docs / "sft_checkpoint").exists()


def test_rfts_sft_run_from_the_sft_model_is_carried_unfinished_then_as_its_adapter(
    tiny_llama_dir, tmp_path
):
    out, docs, elsewhere, third = (tmp_path / n for n in ("out", "docs", "elsewhere", "third"))
    data = demonstration_files(tmp_path / "sft_data")
    sft_run(tiny_llama_dir, tmp_path / "sft_data", "sft", num_steps=2, use_lora=True)
    (tmp_path / "sft_data" / "runs" / "sft").rename(out.mkdir() or out / "sft")
    start = out / "sft" / "final_model"
    train_sft(small_config(start, out, "rft", num_steps=2, use_lora=True), *data)
    shutil.rmtree(out / "rft" / "final_model")  # stopped after its checkpoint of step 2

    carry.save(out, docs)
    assert (docs / "sft_adapter").is_dir() and not (docs / "rft_adapter").exists()
    assert (docs / "rft_checkpoint" / "optimizer.safetensors").is_file()  # exact resume

    carry.restore(docs, elsewhere)
    assert (elsewhere / "sft" / "final_model").is_dir()  # (c) merged, (d)'s start
    original = (out / "rft" / "metrics.jsonl").read_text().splitlines()
    config = small_config(start, elsewhere, "rft", num_steps=3, use_lora=True, resume=True)
    run = train_sft(config, *data)
    lines = (run.path / "metrics.jsonl").read_text().splitlines()
    assert lines[:2] == original[:2]  # steps 0-1 carried, step 2 trained here

    carry.save(elsewhere, docs)  # finished now: carried as its adapter
    assert (docs / "rft_adapter" / "trainable.safetensors").is_file()
    assert not (docs / "rft_checkpoint").exists()
    carry.restore(docs, third)
    merged, trained = weights(third / "rft" / "final_model"), weights(run.final_model_dir)
    assert merged.keys() == trained.keys()
    assert all((merged[name] == trained[name]).all() for name in merged)


def test_rfts_kept_samples_are_carried_gzipped_and_restored_as_they_were(tmp_path):
    out, docs, again = tmp_path / "out", tmp_path / "docs", tmp_path / "again"
    out.mkdir()
    lines = "".join(
        json.dumps({"messages": [{"role": "user", "content": "x" * i}]}) + "\n" for i in range(50)
    )
    (out / "rft_demos_part3.jsonl").write_text(lines)
    (out / "rft_samples_part3.json").write_text("{}")
    carry.save(out, docs)
    carried = docs / "rft_demos" / "rft_demos_part3.jsonl.gz"
    assert carried.stat().st_size < len(lines) / 4
    first = carried.read_bytes()
    carry.save(out, docs)  # saved again unchanged: the same bytes, nothing for git to see
    assert carried.read_bytes() == first
    carry.restore(docs, again)
    assert (again / "rft_demos_part3.jsonl").read_text() == lines
    assert (again / "rft_samples_part3.json").exists()


def test_new_token_rows_start_as_the_mean_of_the_rows_of_their_text(tiny_llama_dir, tmp_path):
    from qwen_coder import init_token_rows, token_halves
    from transformers import AutoTokenizer

    target = tmp_path / "tagged"
    init_token_rows(tiny_llama_dir, target, ("<tool_call>", "</tool_call>"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    before, after = weights(tiny_llama_dir), weights(target)
    name = "model.embed_tokens.weight"
    changed = set()
    for tag in ("<tool_call>", "</tool_call>"):
        row = tokenizer.convert_tokens_to_ids(tag)
        pieces = [
            i for t in token_halves(tag) for i in tokenizer(t, add_special_tokens=False).input_ids
        ]
        assert row not in pieces and len(pieces) >= 2
        expected = before[name][pieces].double().mean(0).float()
        assert torch.allclose(after[name][row], expected) and not torch.equal(
            after[name][row], before[name][row]
        )
        changed.add(row)
    others = [i for i in range(before[name].shape[0]) if i not in changed]
    assert torch.equal(after[name][others], before[name][others])
    assert AutoModelForCausalLM.from_pretrained(target) is not None
