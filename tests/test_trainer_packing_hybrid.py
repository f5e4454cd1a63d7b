"""Packed and shared-prefix micro-batches of Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE)
give the padded rows' log-probabilities, loss and gradients (``trainer/linear_attention.py``):
the causal conv and the delta rule restart at each sample's start, and each continuation
starts from its shared prefix's state, not from the end of the stream's previous sample.
Tiny random models built here: 3 linear-attention layers and 1 full-attention layer.

The comparisons run on every device present (``scripts/gpu_hybrid_check.sh`` runs the CUDA
cases) with the CPU's bounds: TF32 is off (``full_fp32``), so a CUDA case differs from its
padded path by fp32 rounding in another order, as a CPU case does. Where the fused Gated
DeltaNet kernels are installed (they take bf16 only), the fp32 cases skip on CUDA and the
bf16 one runs them."""

from __future__ import annotations

import copy
import importlib
import logging
import random

import pytest
import torch
import transformers
from devices import DEVICES, skip_unless_fp32_gated_delta_runs
from test_trainer_packing import (
    MODES,
    VOCAB,
    assert_same,
    group_samples,
    make_trainer,
    moved_weights,
    run,
    warmed_adapter,
)

from post_training_cookbook.trainer import linear_attention
from post_training_cookbook.trainer.packed_layout import Segment
from post_training_cookbook.trainer.packing import collate_packed
from post_training_cookbook.trainer.types import LossConfig, TrainingSample

HYBRID = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    tie_word_embeddings=True,
)  # fmt: skip
ON_DEVICES = pytest.mark.parametrize("device", DEVICES)
pytestmark = pytest.mark.usefixtures("full_fp32")


def tiny_hybrid(family: str, seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    if family == "qwen3_5":
        return transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**HYBRID))
    config = transformers.Qwen3_5MoeTextConfig(
        **HYBRID, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2,
    )  # fmt: skip
    return transformers.Qwen3_5MoeForCausalLM(config)


def long_prompt_samples(seed: int = 0) -> list[TrainingSample]:
    """A 70-token prompt (past the delta rule's 64-token chunk) shared by 4 episodes, two
    of which also share their first 20 sampled tokens."""
    rng = random.Random(seed)
    prompt = [rng.randrange(VOCAB) for _ in range(70)]
    turn = [rng.randrange(VOCAB) for _ in range(20)]
    tails = [turn + [rng.randrange(VOCAB) for _ in range(9)] for _ in range(2)]
    tails += [[rng.randrange(VOCAB) for _ in range(rng.randint(5, 30))] for _ in range(2)]
    samples = []
    for tail in tails:
        tokens = prompt + tail
        mask = [0.0] * len(prompt) + [1.0] * len(tail)
        samples.append(
            TrainingSample(tokens, mask, [-4.6 * m for m in mask], [rng.choice([-1.0, 1.0]) * m
                                                                     for m in mask])
        )  # fmt: skip
    return samples


CASES = [  # family, LoRA, gradient checkpointing, micro-batch tokens
    ("qwen3_5", False, False, 4096),
    ("qwen3_5", True, True, 4096),
    ("qwen3_5", False, False, 40),  # groups split across micro-batches
    ("qwen3_5_moe", False, False, 4096),
    ("qwen3_5_moe", True, False, 30),
]


@ON_DEVICES
@pytest.mark.parametrize(("family", "use_lora", "checkpointing", "budget"), CASES)
def test_hybrid_packed_and_shared_prefix_equal_the_padded_path_in_fp32(
    family: str, use_lora: bool, checkpointing: bool, budget: int, device: str
) -> None:
    """Episodes sharing a prompt, a prompt and a turn, or only their first token (a
    continuation whose conv window reaches back across two pieces of the tree)."""
    skip_unless_fp32_gated_delta_runs(device)
    model, samples = tiny_hybrid(family), group_samples()
    loss = LossConfig(loss_type="grpo", kl_beta=0.05, tis_cap=2.0)
    start = warmed_adapter(model) if use_lora else moved_weights(model)
    options = {
        "gradient_checkpointing": checkpointing, "micro_batch_tokens": budget,
        "reference_model": True, "logprob_chunk_tokens": 16, "device": device,
    }  # fmt: skip
    results = [
        run(make_trainer(model, use_lora, m, **options), samples, loss, start) for m in MODES
    ]
    assert results[0][1]["loss/kl_ref"] > 1e-6  # the policy has moved from the reference
    for other in results[1:]:
        assert_same(results[0], other, rtol=1e-5, atol=1e-6)


@ON_DEVICES
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_a_prompt_longer_than_a_delta_rule_chunk_is_shared_exactly(
    family: str, device: str
) -> None:
    skip_unless_fp32_gated_delta_runs(device)
    model, samples = tiny_hybrid(family, seed=1), long_prompt_samples()
    results = [
        run(make_trainer(model, False, m, device=device), samples, LossConfig(), None)
        for m in MODES
    ]
    for other in results[1:]:
        assert_same(results[0], other, rtol=1e-5, atol=1e-6)
    # The prompt's layers got gradient from every continuation through its final state.
    assert any(g.abs().sum() > 0 for n, g in results[2][2].items() if "linear_attn" in n)


@ON_DEVICES
def test_bf16_hybrid_packed_stays_within_bf16_rounding_of_the_padded_path(device: str) -> None:
    model, samples = tiny_hybrid("qwen3_5"), group_samples(seed=3)
    options = {"autocast_bf16": True, "device": device}
    results = [run(make_trainer(model, False, m, **options), samples, LossConfig(), None)
               for m in MODES]  # fmt: skip
    for other in results[1:]:
        assert_same(results[0], other, rtol=3e-2, atol=3e-2)


def test_each_continuation_starts_from_its_shared_prefix_not_the_previous_sample() -> None:
    """The tree the recurrent layers read: [p p p a a] then [b] branching after the prompt
    and [c c] after the first ``a``; ``b`` continues from the prompt's last token, ``c``
    from the first ``a``, and only the conv windows that cross into another path are
    recomputed."""
    prompt, a, b, c = [5, 6, 7], [8, 9], [10], [11, 12]
    token_lists = [prompt + a, prompt + a[:1] + c, prompt + b]
    samples = [TrainingSample(t, [0.0] + [1.0] * (len(t) - 1), [0.0] * len(t), [0.0] * len(t))
               for t in token_lists]  # fmt: skip
    layout = collate_packed(samples, [0, 1, 2], torch.device("cpu"), share_prefixes=True)
    assert layout.packed is not None
    assert layout.packed.input_ids[0].tolist() == [5, 6, 7, 8, 9, 11, 12, 10]
    tree = layout.packed.recurrent
    assert tree.piece_starts == [0, 3, 4, 5, 7]  # prompt, a₀, a₁, c, b
    assert tree.previous == [-1, 0, 1, 2, 3, 3, 5, 2]
    # By depth, then length: the prompt; a₀ and b; c; a₁.
    assert [bucket.pieces for bucket in tree.buckets] == [[0], [1, 4], [3], [2]]
    assert [bucket.parents for bucket in tree.buckets] == [None, [0, 0], [1], [1]]
    windows = tree.conv_windows(4)
    fixed = dict(zip(windows.positions.tolist(), windows.windows.tolist(), strict=True))
    assert fixed == {5: [1, 2, 3, 5], 6: [2, 3, 5, 6], 7: [0, 1, 2, 7]}
    assert Segment([5, 6], [0, 1, 2, 3, 5, 6]) in layout.packed.segments


def test_recurrent_models_without_a_packed_forward_keep_padded_rows_and_say_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    config = transformers.Qwen3NextConfig(
        **{k: v for k, v in HYBRID.items() if k not in ("layer_types", "num_hidden_layers")},
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], num_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="post_training_cookbook.trainer.packing"):
        trainer = make_trainer(transformers.Qwen3NextForCausalLM(config), False, "off",
                               packing=True)  # fmt: skip
    assert trainer.packing_mode == "off"
    (message,) = [r.getMessage() for r in caplog.records if "packing is off" in r.getMessage()]
    assert "Qwen3NextForCausalLM" in message and "recurrent layers" in message
    assert linear_attention.use_for(tiny_hybrid("qwen3_5")) == 3  # the hybrid's are known


def test_a_deep_copy_of_the_model_runs_its_own_layers() -> None:
    """The reference model is a deep copy: its packed forwards must read the copy's
    weights, not the policy's (a bound method copied with its module)."""
    model = tiny_hybrid("qwen3_5")
    linear_attention.use_for(model)
    copied = copy.deepcopy(model)
    pairs = [(a, b) for a, b in zip(model.modules(), copied.modules(), strict=True)
             if linear_attention.has_packed_forward(a)]  # fmt: skip
    assert len(pairs) == 3
    assert all(b.forward.__self__ is b and a.forward.__self__ is a for a, b in pairs)


def test_where_the_delta_rule_refuses_fp32_a_trainer_that_autocasts_still_packs() -> None:
    """flash-linear-attention's fused chunk kernel, which transformers takes on a GPU where
    it is installed, asserts bf16/fp16 inputs. Given that refusal (the reference rule behind
    the same assertion), a trainer that autocasts still builds and packs (its logits route
    and its layouts checked under autocast) and gives the padded path's loss within bf16
    rounding; an fp32 trainer fails, naming the refusal."""
    modeling = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    reference = modeling.torch_chunk_gated_delta_rule

    def bf16_only(query: torch.Tensor, *args: object, **kwargs: object) -> object:
        assert query.dtype != torch.float32, "the chunk kernel does not support float32"
        return reference(query, *args, **kwargs)

    model, samples = tiny_hybrid("qwen3_5"), group_samples(seed=3)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling, "torch_chunk_gated_delta_rule", bf16_only)
        results = [run(make_trainer(model, False, m, autocast_bf16=True), samples, LossConfig(),
                       None) for m in MODES[::2]]  # fmt: skip
        with pytest.raises(AssertionError, match="does not support float32"):
            make_trainer(model, False, "off", autocast_bf16=False)
    assert_same(*results, rtol=3e-2, atol=3e-2)
