"""``trainable_tokens``: chosen tokens' embedding and LM-head rows train in full beside LoRA,
reach the inference weights (and so the engine and exported models), and resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_grpo_common import build_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from post_training_cookbook.trainer.trainer import Trainer
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings, TrainingSample

TAG = "<tool_call>"
SFT = LossConfig(loss_type="sft")


@pytest.fixture(scope="module", params=["tied", "untied"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    if request.param == "untied":  # a separate LM head, as Qwen2.5-0.5B's folders have
        model = AutoModelForCausalLM.from_pretrained(folder)
        model.config.tie_word_embeddings = False
        head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
        head.weight.data = model.get_input_embeddings().weight.detach().clone()
        model.set_output_embeddings(head)
        model.save_pretrained(folder)
    return folder


def tag_samples(tokenizer: object) -> list[TrainingSample]:
    """A context with the tag in it that ends in the tag, the last one trained (its input row
    gets a gradient through the first, its output row through the last)."""
    tokens = tokenizer.encode(TAG + " hello world " + TAG)  # type: ignore[attr-defined]
    trained = [0.0] * (len(tokens) - 1) + [1.0]
    zeros = [0.0] * len(tokens)
    return [TrainingSample(tokens, trained, zeros, zeros)]


def tag_logprob(trainer: Trainer, samples: list[TrainingSample]) -> float:
    return trainer.forward(samples)[0][-1]


def train(trainer: Trainer, samples: list[TrainingSample], steps: int = 15) -> None:
    for _ in range(steps):
        trainer.forward_backward(samples, SFT)
        trainer.optim_step(1e-2)


def make(model_dir: Path, tokens: tuple[str, ...]) -> Trainer:
    return Trainer(
        model_dir,
        TrainerSettings(
            use_lora=True,
            lora_rank=2,
            trainable_tokens=tokens,
            seed=0,
            device="cpu",
            autocast_bf16=False,
        ),
    )


def test_only_the_named_rows_move_and_they_reach_the_exported_model(
    model_dir: Path, tmp_path: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tag = tokenizer.convert_tokens_to_ids(TAG)
    samples = tag_samples(tokenizer)
    base = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    trainer = make(model_dir, (TAG,))
    before = tag_logprob(trainer, samples)
    train(trainer, samples)
    assert tag_logprob(trainer, samples) > before + 1.0

    weights = trainer.state_dict_for_inference()
    assert set(weights) == set(base)  # the base model's names, no adapter entries
    for name in {"model.embed_tokens.weight", "lm_head.weight"}:
        moved = (weights[name] != base[name]).any(dim=1).nonzero().flatten().tolist()
        assert moved == [tag], name  # (LoRA targets no embedding or head here)

    exported = AutoModelForCausalLM.from_pretrained(
        trainer.save_inference_checkpoint(tmp_path / "final")
    )
    ids = torch.tensor([samples[0].tokens])
    logprobs = exported(ids).logits[0, -2].float().log_softmax(-1)
    assert logprobs[tag].item() == pytest.approx(tag_logprob(trainer, samples), abs=1e-4)


def test_without_trainable_tokens_lora_leaves_the_rows_as_they_were(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    trainer = make(model_dir, ())
    train(trainer, tag_samples(tokenizer), steps=3)
    weights = trainer.state_dict_for_inference()
    assert torch.equal(weights["lm_head.weight"], base["lm_head.weight"])
    assert "trainable_tokens" not in trainer.lora_settings  # older checkpoints still load


def test_the_rows_resume_from_a_training_checkpoint(model_dir: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = tag_samples(tokenizer)
    trainer = make(model_dir, (TAG,))
    train(trainer, samples, steps=3)
    trainer.save_training_checkpoint(tmp_path / "ckpt")
    resumed = make(model_dir, (TAG,))
    resumed.load_training_checkpoint(tmp_path / "ckpt")
    assert tag_logprob(resumed, samples) == pytest.approx(tag_logprob(trainer, samples), abs=1e-6)
    with pytest.raises(ValueError, match="LoRA"):  # the rows are part of what must match
        make(model_dir, ()).load_training_checkpoint(tmp_path / "ckpt")


def test_bad_settings_are_refused_before_the_model_loads(model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"not one token.*pieces"):
        make(model_dir, ("<no_such_token>",))
    with pytest.raises(ValueError, match="twice"):
        make(model_dir, (TAG, TAG))
    with pytest.raises(ValueError, match="full-weight"):
        Trainer(model_dir, TrainerSettings(use_lora=False, trainable_tokens=(TAG,), device="cpu"))


def test_vllm_gets_merged_weights_when_rows_train_beside_the_adapter() -> None:
    from post_training_cookbook.service.ray import syncs_adapter_alone

    plain, rows = TrainerSettings(), TrainerSettings(trainable_tokens=(TAG,))
    assert syncs_adapter_alone(plain, None, "vllm")  # vLLM's LoRA slots by default
    assert not syncs_adapter_alone(rows, None, "vllm")  # they cannot hold the rows
    assert not syncs_adapter_alone(rows, "merged", "vllm")
    with pytest.raises(ValueError, match="without trainable_tokens' rows"):
        syncs_adapter_alone(rows, "adapter", "vllm")
    with pytest.raises(ValueError, match="needs generation_engine='vllm'"):
        syncs_adapter_alone(plain, "adapter", "torch")
