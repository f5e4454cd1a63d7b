"""Packed and shared-prefix micro-batches give the plain path's log-probabilities, loss and
gradients, on tiny random Qwen2 and Llama models built here (``trainer/packing.py``)."""

from __future__ import annotations

import copy
import logging
import random

import pytest
import torch
import transformers

from post_training_cookbook.trainer.packing import plan_packed, stream_tokens
from post_training_cookbook.trainer.trainer import Trainer
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings, TrainingSample

VOCAB = 128
MODES = ("off", "packed", "shared_prefix")


def tiny_model(family: str, seed: int = 0, **config: object) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    shape = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape, **config))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, **config))


def group_samples(seed: int = 0) -> list[TrainingSample]:
    """Three groups of episodes: a shared prompt, then turns; in the first group two
    episodes also agree on their first turn (and two are identical), in the last the
    episodes share nothing but the first token."""
    rng = random.Random(seed)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(count)]

    episodes: list[tuple[list[int], int]] = []  # tokens, where the sampled part starts
    prompt = tokens(14)
    turn = tokens(5)
    first = [prompt + turn + tokens(6), prompt + turn + tokens(3), prompt + tokens(9)]
    episodes += [(t, len(prompt)) for t in [*first, list(first[0])]]
    prompt = tokens(9)
    episodes += [(prompt + tokens(rng.randint(3, 10)), len(prompt)) for _ in range(3)]
    start = tokens(1)
    episodes += [(start + tokens(rng.randint(5, 12)), 1) for _ in range(3)]
    samples = []
    for token_list, sampled_from in episodes:
        mask = [0.0] * len(token_list)
        for t in range(sampled_from, len(token_list)):
            mask[t] = 0.0 if t % 7 == 6 else 1.0  # a forced tool-result token now and then
        advantage = rng.choice([-1.0, 0.5, 1.0])
        samples.append(
            TrainingSample(
                tokens=token_list,
                mask=mask,
                sampler_logprobs=[(-4.8 + rng.uniform(-0.3, 0.3)) * m for m in mask],
                advantages=[advantage * m for m in mask],
            )
        )
    return samples


def make_trainer(
    model: transformers.PreTrainedModel, use_lora: bool, mode: str, **kw: object
) -> Trainer:
    options: dict[str, object] = {
        "autocast_bf16": False, "lora_rank": 4, "seed": 1, "packing": mode != "off",
        "shared_prefix": mode == "shared_prefix", **kw,
    }  # fmt: skip
    trainer = Trainer(copy.deepcopy(model), TrainerSettings(use_lora=use_lora, **options))  # type: ignore[arg-type]
    assert trainer.packing_mode == mode  # the comparison is not plain against plain
    return trainer


def warmed_adapter(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    """LoRA's B starts at 0, which gives A no gradient: compare from a trained adapter."""
    warm = make_trainer(model, True, "off")
    warm.forward_backward(group_samples(seed=5), LossConfig())
    warm.optim_step(1e-2)
    return {n: p.detach().clone() for n, p in warm.trainable_parameters().items()}


def run(
    trainer: Trainer, samples: list[TrainingSample], loss: LossConfig, adapter: dict | None
) -> tuple[float, dict[str, float], dict[str, torch.Tensor], list[list[float]]]:
    if adapter is not None:
        with torch.no_grad():
            for name, parameter in trainer.trainable_parameters().items():
                parameter.copy_(adapter[name])
    result = trainer.forward_backward(samples, loss)
    gradients = {
        n: p.grad.clone() for n, p in trainer.trainable_parameters().items() if p.grad is not None
    }
    return result.loss, result.metrics, gradients, trainer.forward(samples)


def assert_same(plain: tuple, other: tuple, rtol: float, atol: float) -> None:
    loss, metrics, gradients, logprobs = plain
    other_loss, other_metrics, other_gradients, other_logprobs = other
    assert other_loss == pytest.approx(loss, rel=rtol, abs=atol)
    for key, value in metrics.items():
        assert other_metrics[key] == pytest.approx(value, rel=rtol, abs=atol), key
    assert gradients and gradients.keys() == other_gradients.keys()
    for name, gradient in gradients.items():
        scale = gradient.abs().max().item()
        torch.testing.assert_close(
            other_gradients[name], gradient, rtol=rtol, atol=atol * max(scale, 1.0)
        )
    for row, other_row in zip(logprobs, other_logprobs, strict=True):
        assert other_row == pytest.approx(row, rel=rtol, abs=atol)


CASES = [  # family, LoRA, gradient checkpointing, micro-batch tokens
    ("qwen2", False, False, 4096),
    ("qwen2", True, False, 4096),
    ("qwen2", False, True, 40),  # groups split across micro-batches: prefixes recomputed
    ("llama", True, True, 4096),
    ("llama", False, False, 25),
]


@pytest.mark.parametrize(("family", "use_lora", "checkpointing", "budget"), CASES)
def test_packed_and_shared_prefix_equal_the_plain_path_in_fp32(
    family: str, use_lora: bool, checkpointing: bool, budget: int
) -> None:
    model, samples = tiny_model(family), group_samples()
    loss = LossConfig(loss_type="grpo", kl_beta=0.05, tis_cap=2.0)
    start = warmed_adapter(model) if use_lora else moved_weights(model)
    options = {
        "gradient_checkpointing": checkpointing, "micro_batch_tokens": budget,
        "reference_model": True, "logprob_chunk_tokens": 16,
    }  # fmt: skip
    results = [
        run(make_trainer(model, use_lora, m, **options), samples, loss, start) for m in MODES
    ]
    assert results[0][1]["loss/kl_ref"] > 1e-6  # the policy has moved from the reference
    for other in results[1:]:
        assert_same(results[0], other, rtol=1e-5, atol=1e-6)


def moved_weights(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    """Full weight: the same small step away from the initial (reference) weights."""
    generator = torch.Generator().manual_seed(3)
    return {
        name: parameter.detach() + 0.02 * torch.randn(parameter.shape, generator=generator)
        for name, parameter in model.named_parameters()
    }


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo", "gspo", "cispo"])
def test_every_loss_gets_the_same_update_from_shared_prefixes(loss_type: str) -> None:
    model, samples = tiny_model("qwen2"), group_samples(seed=2)
    loss = LossConfig(loss_type=loss_type)  # type: ignore[arg-type]
    plain, shared = (run(make_trainer(model, False, m), samples, loss, None) for m in MODES[::2])
    assert_same(plain, shared, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("use_lora", [False, True])
def test_the_sft_loss_is_the_same_packed_and_unpacked(use_lora: bool) -> None:
    """SFT's conversations go through the same packing: one stream, or shared prefixes once,
    give the padded rows' loss, gradients and log-probabilities."""
    model, samples = tiny_model("llama", seed=3), group_samples(seed=3)
    loss = LossConfig(loss_type="sft")
    plain, packed, shared = (
        run(make_trainer(model, use_lora, m), samples, loss, None) for m in MODES
    )
    assert_same(plain, packed, rtol=1e-5, atol=1e-6)
    assert_same(plain, shared, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["bf16_autocast", "bf16_weights"])
def test_bf16_packed_stays_within_bf16_rounding_of_the_plain_path(precision: str) -> None:
    model, samples = tiny_model("qwen2"), group_samples(seed=3)
    options = {"autocast_bf16": True} if precision == "bf16_autocast" else {"precision": "bf16"}
    results = [run(make_trainer(model, False, m, **options), samples, LossConfig(), None)
               for m in MODES]  # fmt: skip
    for other in results[1:]:
        assert_same(results[0], other, rtol=3e-2, atol=3e-2)


def test_shared_prefixes_are_forwarded_once() -> None:
    samples = group_samples()
    plain = stream_tokens(samples, 4096, "off")
    packed = stream_tokens(samples, 4096, "packed")
    shared = stream_tokens(samples, 4096, "shared_prefix")
    assert packed == sum(len(s.tokens) for s in samples) < plain
    trie = len({tuple(s.tokens[:n]) for s in samples for n in range(1, len(s.tokens) + 1)})
    assert shared == trie  # each distinct prefix once: a prefix tree's tokens
    plan = plan_packed(samples, 4096, share_prefixes=True)
    assert len(plan) == 1 and sorted(plan[0]) == list(range(len(samples)))


def test_a_sample_longer_than_the_budget_gets_a_micro_batch_of_its_own() -> None:
    samples = group_samples()
    plan = plan_packed(samples, 10, share_prefixes=False)
    assert sorted(i for group in plan for i in group) == list(range(len(samples)))
    assert all(len(group) == 1 for group in plan)  # every sample has over 10 tokens


def shaped_groups(groups: int, episodes: int, prompt: int, added: int) -> list[TrainingSample]:
    """``groups`` groups of ``episodes``: a prompt of its own, then ``added`` tokens each."""
    samples, next_token = [], 1
    for _ in range(groups):
        head = list(range(next_token, next_token + prompt))
        next_token += prompt
        for _ in range(episodes):
            tokens = head + list(range(next_token, next_token + added))
            next_token += added
            samples.append(TrainingSample(tokens, [0.0] + [1.0] * (len(tokens) - 1),
                                          [0.0] * len(tokens), [0.0] * len(tokens)))  # fmt: skip
    return samples


def test_a_group_stays_in_one_stream_up_to_the_shared_bound_and_groups_fill_the_target() -> None:
    samples = shaped_groups(groups=3, episodes=4, prompt=50, added=20)  # streams of 130
    groups = [set(range(4 * g, 4 * g + 4)) for g in range(3)]
    plan = plan_packed(samples, 100, share_prefixes=True, shared_tokens=200)
    assert [set(micro) for micro in plan] == groups  # past the target of 100, never joined
    assert stream_tokens(samples, 100, "shared_prefix", 200) == 3 * 130
    # Without room past the target, a group is cut, and its prompt is forwarded once more.
    assert stream_tokens(samples, 100, "shared_prefix") == 3 * (130 + 50)
    # With room, groups fill a micro-batch to the target.
    assert [len(micro) for micro in plan_packed(samples, 260, True, 400)] == [8, 4]


def test_episodes_that_add_more_than_they_share_are_packed_to_the_target_only() -> None:
    samples = shaped_groups(groups=1, episodes=6, prompt=10, added=40)  # each adds 40 > 10
    plan = plan_packed(samples, 100, share_prefixes=True, shared_tokens=1000)
    assert [len(micro) for micro in plan] == [2, 2, 2]  # 50 + 40, thrice
    assert stream_tokens(samples, 100, "shared_prefix", 1000) == 3 * 90


def test_models_where_packing_is_not_exact_keep_padded_rows_and_say_why_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = tiny_model("qwen2", attn_implementation="eager")
    with caplog.at_level(logging.WARNING, logger="post_training_cookbook.trainer.packing"):
        trainer = make_trainer(model, False, "off", packing=True)
        samples = group_samples()
        trainer.forward_backward(samples, LossConfig())
        trainer.forward(samples)
    messages = [r.getMessage() for r in caplog.records if "packing is off" in r.getMessage()]
    assert len(messages) == 1 and "'eager'" in messages[0]
    sliding = tiny_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert make_trainer(sliding, False, "off", packing=True).packing_mode == "off"


def test_paths_longer_than_the_math_attention_take_sdpa_with_the_same_result() -> None:
    """Over 256 keys the CPU attention is SDPA (``attention.MATH_MAX_KEYS``): a shared
    prompt of 300 tokens sends every continuation's path there, with its explicit mask."""
    rng = random.Random(4)
    prompt = [rng.randrange(VOCAB) for _ in range(300)]
    samples = []
    for _ in range(3):
        tokens = prompt + [rng.randrange(VOCAB) for _ in range(rng.randint(4, 9))]
        mask = [0.0] * len(prompt) + [1.0] * (len(tokens) - len(prompt))
        samples.append(
            TrainingSample(tokens, mask, [-4.0 * m for m in mask], [0.5 * m for m in mask])
        )
    model = tiny_model("llama")
    results = [run(make_trainer(model, False, m), samples, LossConfig(), None) for m in MODES]
    for other in results[1:]:
        assert_same(results[0], other, rtol=1e-5, atol=1e-6)


def test_grpo_config_trainer_packing_reaches_the_trainer_settings() -> None:
    from post_training_cookbook.grpo.config import GRPOConfig
    from post_training_cookbook.grpo.settings import RunSettings
    from post_training_cookbook.models import BUNDLED_MODEL_ID, resolve_model

    for mode, packing, shared in (("off", False, False), ("packed", True, False),
                                  ("shared_prefix", True, True)):  # fmt: skip
        config = GRPOConfig(trainer_packing=mode)  # type: ignore[arg-type]
        settings = RunSettings.from_config(config, resolve_model(BUNDLED_MODEL_ID)).service.trainer
        assert (settings.packing, settings.shared_prefix) == (packing, shared)
    assert GRPOConfig().trainer_packing == "shared_prefix"
