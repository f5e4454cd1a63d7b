"""Trainer on a tiny random Qwen2: logprobs, micro-batching, steps, merged weights, checkpoints."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from post_training_cookbook.files import BadFileError
from post_training_cookbook.runs.reporting import training_metrics
from post_training_cookbook.trainer.precision import bf16_autocast_is_fast
from post_training_cookbook.trainer.trainer import Trainer
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings, TrainingSample

VOCAB = 256
GRPO = LossConfig(loss_type="grpo")


def tiny_model(seed: int = 0) -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(config)


def make_trainer(
    use_lora: bool, model: transformers.PreTrainedModel | None = None, **kw: object
) -> Trainer:
    kw = {"autocast_bf16": False, "lora_rank": 4, "seed": 1, **kw}
    return Trainer(
        model if model is not None else tiny_model(), TrainerSettings(use_lora=use_lora, **kw)
    )  # type: ignore[arg-type]


def make_samples(
    count: int = 5, seed: int = 0, advantage: float | None = None
) -> list[TrainingSample]:
    """Episodes of varied length: a forced prompt, then alternating sampled and forced spans."""
    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        length = rng.randint(6, 24)
        mask = [0.0] * length
        for t in range(3, length):
            mask[t] = 1.0 if (t // 4) % 2 == 0 else 0.0
        a = advantage if advantage is not None else rng.choice([-1.0, 0.5, 1.0])
        samples.append(
            TrainingSample(
                tokens=[rng.randrange(VOCAB) for _ in range(length)],
                mask=mask,
                sampler_logprobs=[(-5.5 + rng.uniform(-0.3, 0.3)) * m for m in mask],
                advantages=[a * m for m in mask],
            )
        )
    return samples


def grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {
        n: p.grad.clone() for n, p in trainer.trainable_parameters().items() if p.grad is not None
    }


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.trainable_parameters().items()}


def optimizer_tensors(trainer: Trainer) -> dict[str, torch.Tensor]:
    state = trainer._optimizer.state_dict()["state"]
    return {f"{i}.{k}": v.clone() for i, s in state.items() for k, v in s.items()}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def reference_logprobs(model: transformers.PreTrainedModel, sample: TrainingSample) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([sample.tokens])).logits[0].float()
    log_softmax = torch.log_softmax(logits[:-1], dim=-1)
    chosen = log_softmax.gather(-1, torch.tensor(sample.tokens[1:])[:, None]).squeeze(-1)
    return [0.0] + [
        v if m > 0 else 0.0 for v, m in zip(chosen.tolist(), sample.mask[1:], strict=True)
    ]


# ------------------------------------------------------------------ forward


def test_forward_matches_the_models_own_logits_on_trained_positions() -> None:
    model = tiny_model()
    trainer = make_trainer(False, copy.deepcopy(model), micro_batch_tokens=40)
    samples = make_samples()
    logprobs = trainer.forward(samples)
    assert trainer._scorer.route == "head"
    for sample, row in zip(samples, logprobs, strict=True):
        assert len(row) == len(sample.tokens) and row[0] == 0.0
        assert row == pytest.approx(reference_logprobs(model.eval(), sample), abs=1e-5)


class ScaledLogitsQwen2(transformers.Qwen2ForCausalLM):
    """Post-processes its logits like Gemma's soft-capping: the LM head alone is not enough."""

    def forward(
        self, *args: object, **kwargs: object
    ) -> transformers.modeling_outputs.CausalLMOutputWithPast:
        output = super().forward(*args, **kwargs)
        output.logits = output.logits * 2.0
        return output


def test_models_that_post_process_logits_take_their_own_forward_on_the_hidden_states() -> None:
    model = ScaledLogitsQwen2(tiny_model().config)
    trainer = make_trainer(False, copy.deepcopy(model))
    assert trainer._scorer.route == "forward_on_hidden"
    sample = make_samples(1)[0]
    assert trainer.forward([sample])[0] == pytest.approx(
        reference_logprobs(model.eval(), sample), abs=1e-5
    )


def test_bf16_autocast_gives_logprobs_close_to_fp32() -> None:
    assert isinstance(bf16_autocast_is_fast(torch.device("cpu")), bool)
    model = tiny_model()
    samples = make_samples()
    fp32 = make_trainer(False, copy.deepcopy(model)).forward(samples)
    bf16 = make_trainer(False, copy.deepcopy(model), autocast_bf16=True).forward(samples)
    for a, b in zip(fp32, bf16, strict=True):
        assert b == pytest.approx(a, abs=0.05)


# ------------------------------------------------------------------ forward_backward


@pytest.mark.parametrize("use_lora", [False, True])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "gspo", "cispo", "sft"])
def test_gradients_do_not_depend_on_micro_batching(use_lora: bool, loss_type: str) -> None:
    loss = LossConfig(loss_type=loss_type, kl_beta=0.05, tis_cap=2.0)  # type: ignore[arg-type]
    model, samples = tiny_model(), make_samples(6)
    if use_lora:  # B = 0 at init gives LoRA A no gradient: start from a trained adapter
        warm = make_trainer(True, copy.deepcopy(model))
        warm.forward_backward(samples, GRPO)
        warm.optim_step(1e-2)
    results = []
    for budget in (4096, 30):  # rows grouped by length only vs one or two short rows each
        trainer = make_trainer(
            use_lora, copy.deepcopy(model), micro_batch_tokens=budget, reference_model=True
        )
        if use_lora:
            with torch.no_grad():
                for name, p in trainer.trainable_parameters().items():
                    p.copy_(warm.trainable_parameters()[name])
        results.append((trainer.forward_backward(samples, loss), grads(trainer)))
    (whole, whole_grads), (split, split_grads) = results
    assert split.loss == pytest.approx(whole.loss, abs=1e-6)
    assert split.num_tokens == whole.num_tokens == sum(s.num_trained_tokens for s in samples)
    for key, value in whole.metrics.items():
        assert split.metrics[key] == pytest.approx(value, abs=1e-5), key
    assert whole_grads.keys() == split_grads.keys() and whole_grads
    for name, grad in whole_grads.items():
        torch.testing.assert_close(split_grads[name], grad, atol=1e-5, rtol=1e-4)


def test_micro_batches_group_rows_of_similar_length_so_padding_stays_under_a_quarter() -> None:
    trainer = make_trainer(False, micro_batch_tokens=10_000, packing=False)
    samples = make_samples(40, seed=3)
    batches = list(trainer._micro_batches(samples))
    assert sorted(i for b in batches for i in b.indices) == list(range(40))
    for batch in batches:
        real = sum(len(samples[i].tokens) for i in batch.indices)
        assert real >= 0.75 * batch.input_ids.numel()
    # lengths 6-24 span more than a factor 4/3 twice over: one batch would pad far more
    assert len(batches) >= 3


def test_forward_backward_reports_the_loss_metrics() -> None:
    trainer = make_trainer(False, reference_model=True)
    result = trainer.forward_backward(make_samples(), LossConfig(kl_beta=0.1, tis_cap=2.0))
    expected = {
        "loss/clip_low_fraction", "loss/clip_high_fraction", "loss/entropy",
        "loss/sampler_trainer_abs_diff", "loss/kl_ref", "loss/tis_weight_mean",
    }  # fmt: skip
    assert set(result.metrics) == expected
    assert 0 < result.metrics["loss/entropy"] <= torch.log(torch.tensor(VOCAB)).item()
    assert result.metrics["loss/kl_ref"] == pytest.approx(0.0, abs=1e-6)  # policy == reference


def test_a_sample_without_trained_tokens_changes_nothing() -> None:
    model, samples = tiny_model(), make_samples()
    silent = TrainingSample([1, 2, 3, 4], [0.0] * 4, [0.0] * 4, [0.0] * 4)
    results = []
    for batch in (samples, [silent, *samples]):
        trainer = make_trainer(False, copy.deepcopy(model))
        results.append((trainer.forward_backward(batch, GRPO), grads(trainer)))
    (plain, plain_grads), (padded, padded_grads) = results
    assert padded.loss == pytest.approx(plain.loss, abs=1e-6)  # not counted in G
    for name, grad in plain_grads.items():
        torch.testing.assert_close(padded_grads[name], grad, atol=1e-6, rtol=1e-5)
    assert make_trainer(False).forward([silent]) == [[0.0] * 4]


def test_kl_needs_a_reference_model() -> None:
    with pytest.raises(ValueError, match="reference_model"):
        make_trainer(False).forward_backward(make_samples(), LossConfig(kl_beta=0.1))


@pytest.mark.parametrize("use_lora", [False, True])
def test_reference_stays_at_the_initial_policy_while_training_moves_away(use_lora: bool) -> None:
    trainer = make_trainer(use_lora, reference_model=True)
    samples = make_samples()
    for _ in range(3):
        trainer.forward_backward(samples, GRPO)
        trainer.optim_step(5e-2)
    result = trainer.forward_backward(samples, LossConfig(kl_beta=0.1))
    assert result.metrics["loss/kl_ref"] > 1e-4


# ------------------------------------------------------------------ optim_step


@pytest.mark.parametrize("use_lora", [False, True])
def test_a_step_raises_the_logprob_of_positively_advantaged_tokens(use_lora: bool) -> None:
    trainer = make_trainer(use_lora)
    samples = make_samples(2, advantage=1.0)
    before = trainer.forward(samples)
    for _ in range(2):  # LoRA's first step only moves B away from 0
        for sample, logprobs in zip(samples, trainer.forward(samples), strict=True):
            sample.sampler_logprobs = logprobs  # on-policy, so the clip stays inactive
        trainer.forward_backward(samples, GRPO)
        result = trainer.optim_step(1e-3)
        assert not result.skipped and result.grad_norm > 0
    after = trainer.forward(samples)
    assert trainer.version == result.version == 2
    for row_before, row_after, sample in zip(before, after, samples, strict=True):
        trained = [t for t, m in enumerate(sample.mask) if m > 0]
        gain = sum(row_after[t] - row_before[t] for t in trained) / len(trained)
        assert gain > 0


def test_optim_step_needs_a_forward_backward_first() -> None:
    with pytest.raises(RuntimeError, match="forward_backward"):
        make_trainer(False).optim_step(1e-3)


@pytest.mark.parametrize("use_lora", [False, True])
def test_a_nan_loss_skips_the_step_and_touches_nothing(use_lora: bool) -> None:
    trainer = make_trainer(use_lora)
    samples = make_samples()
    trainer.forward_backward(samples, GRPO)
    trainer.optim_step(1e-2)  # so that there is optimizer state to protect
    weights_before, optimizer_before = weights(trainer), optimizer_tensors(trainer)
    poisoned = copy.deepcopy(samples)
    poisoned[0].advantages[-1] = float("inf")
    poisoned[0].mask[-1] = 1.0
    result = trainer.forward_backward(poisoned, GRPO)
    assert not torch.isfinite(torch.tensor(result.loss))
    step = trainer.optim_step(1e-2)
    assert step.skipped and step.version == trainer.version == 1
    assert training_metrics(result, step)["optim/skipped"] == 1.0
    assert_bitwise_equal(weights(trainer), weights_before)
    assert_bitwise_equal(optimizer_tensors(trainer), optimizer_before)
    assert not grads(trainer)
    trainer.forward_backward(samples, GRPO)  # training carries on afterwards
    assert not trainer.optim_step(1e-2).skipped and trainer.version == 2


def test_gradients_are_clipped_to_max_grad_norm() -> None:
    trainer = make_trainer(False, max_grad_norm=1e-3)
    trainer.forward_backward(make_samples(), LossConfig(loss_type="dapo"))
    params = list(trainer.trainable_parameters().values())
    norms_at_update: list[float] = []
    adamw_step = trainer._optimizer.step

    def recording_step() -> None:
        grads = [p.grad for p in params if p.grad is not None]
        norms_at_update.append(torch.nn.utils.get_total_norm(grads).item())
        adamw_step()

    trainer._optimizer.step = recording_step  # type: ignore[method-assign,assignment]
    result = trainer.optim_step(1e-3)
    assert result.grad_norm > 1e-2  # reported before clipping
    assert norms_at_update == [pytest.approx(1e-3, rel=1e-3)]


# ------------------------------------------------------------------ weights out


def test_lora_trains_only_the_adapter() -> None:
    trainer = make_trainer(True)
    names = list(trainer.trainable_parameters())
    assert names and all("lora_" in n for n in names)
    assert len([n for n in names if "lora_A" in n]) == 2 * 7  # 2 layers × 7 target modules


@pytest.mark.parametrize("use_lora", [False, True])
def test_state_dict_for_inference_has_the_base_names_and_the_merged_weights(use_lora: bool) -> None:
    model = tiny_model()
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = make_trainer(use_lora, model)
    samples = make_samples()
    for _ in range(2):
        trainer.forward_backward(samples, GRPO)
        trainer.optim_step(1e-2)
    adapter_before = weights(trainer)
    state = trainer.state_dict_for_inference()
    assert state.keys() == base_state.keys()
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]  # tied: one tensor
    assert not torch.equal(
        state["model.layers.0.self_attn.q_proj.weight"],
        base_state["model.layers.0.self_attn.q_proj.weight"],
    )
    assert_bitwise_equal(weights(trainer), adapter_before)  # nothing merged in place
    fresh = tiny_model()
    fresh.load_state_dict(state)
    sample = make_samples(1, seed=5)[0]
    assert reference_logprobs(fresh.eval(), sample) == pytest.approx(
        trainer.forward([sample])[0], abs=1e-5
    )
    state["model.norm.weight"].add_(1.0)  # copies: changing them leaves the trainer alone
    assert not torch.equal(
        state["model.norm.weight"], trainer._causal_lm.state_dict()["model.norm.weight"]
    )


def save_with_tokenizer(model: transformers.PreTrainedModel, folder: Path) -> None:
    vocab = {f"w{i}": i for i in range(VOCAB)}
    backend = Tokenizer(WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.mark.parametrize("use_lora", [False, True])
def test_inference_checkpoint_loads_in_transformers_with_the_trainers_logits(
    use_lora: bool, tmp_path: Path
) -> None:
    save_with_tokenizer(tiny_model(), tmp_path / "base")
    trainer = Trainer(
        tmp_path / "base",
        TrainerSettings(use_lora=use_lora, lora_rank=4, autocast_bf16=False, seed=1),
    )
    samples = make_samples()
    for _ in range(2):
        trainer.forward_backward(samples, GRPO)
        trainer.optim_step(1e-2)
    folder = trainer.save_inference_checkpoint(tmp_path / "inference")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    for sample, row in zip(samples, trainer.forward(samples), strict=True):
        assert reference_logprobs(loaded, sample) == pytest.approx(row, abs=1e-5)
    assert trainer.tokenizer is not None  # picked up from the base model's folder
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer.convert_tokens_to_ids(["w3", "w7"]) == [3, 7]


# ------------------------------------------------------------------ training checkpoints


def train_steps(trainer: Trainer, count: int, seed: int) -> None:
    for step in range(count):
        trainer.forward_backward(
            make_samples(4, seed=seed + step), LossConfig(loss_type="dapo", clip_high=0.28)
        )
        trainer.optim_step(1e-2)


@pytest.mark.parametrize("use_lora", [False, True])
def test_training_resumes_bit_for_bit_from_a_checkpoint(use_lora: bool, tmp_path: Path) -> None:
    tiny_model().save_pretrained(tmp_path / "base")

    def build() -> Trainer:
        return Trainer(
            tmp_path / "base", TrainerSettings(use_lora=use_lora, lora_rank=4, autocast_bf16=False)
        )

    original = build()
    train_steps(original, 2, seed=0)
    original.save_training_checkpoint(tmp_path / "ckpt")
    saved_weights, saved_optimizer = weights(original), optimizer_tensors(original)
    train_steps(original, 2, seed=10)

    resumed = build()
    resumed.load_training_checkpoint(tmp_path / "ckpt")
    assert resumed.version == 2
    assert_bitwise_equal(weights(resumed), saved_weights)
    assert_bitwise_equal(optimizer_tensors(resumed), saved_optimizer)
    assert (
        resumed._optimizer.state_dict()["param_groups"]
        == original._optimizer.state_dict()["param_groups"]
    )
    train_steps(resumed, 2, seed=10)
    assert resumed.version == original.version == 4
    assert_bitwise_equal(weights(resumed), weights(original))
    assert_bitwise_equal(optimizer_tensors(resumed), optimizer_tensors(original))


def test_loading_weights_only_starts_a_fresh_optimizer_at_version_zero(tmp_path: Path) -> None:
    tiny_model().save_pretrained(tmp_path / "base")
    original = Trainer(
        tmp_path / "base", TrainerSettings(use_lora=True, lora_rank=4, autocast_bf16=False)
    )
    train_steps(original, 2, seed=0)
    original.save_training_checkpoint(tmp_path / "ckpt")
    fork = Trainer(
        tmp_path / "base", TrainerSettings(use_lora=True, lora_rank=4, autocast_bf16=False)
    )
    fork.load_training_checkpoint(tmp_path / "ckpt", load_optimizer=False)
    assert fork.version == 0
    assert not fork._optimizer.state_dict()["state"]
    assert_bitwise_equal(weights(fork), weights(original))


def test_a_checkpoint_from_another_training_mode_is_rejected(tmp_path: Path) -> None:
    model = tiny_model()
    make_trainer(True, copy.deepcopy(model)).save_training_checkpoint(tmp_path / "lora")
    with pytest.raises(ValueError, match="use_lora"):
        make_trainer(False, model).load_training_checkpoint(tmp_path / "lora")


CHECKPOINT_DAMAGE = {
    "trainable.safetensors": "cut short: ",
    "optimizer.safetensors": "cut short: ",
    "rng.safetensors": "cut short: ",
    "trainer_state.json": "not valid JSON",
}


@pytest.mark.parametrize("damaged", CHECKPOINT_DAMAGE)
def test_a_damaged_checkpoint_is_refused_naming_the_file_and_leaves_the_trainer_as_it_was(
    tmp_path: Path, damaged: str
) -> None:
    """Every file is read and checked before any is applied: a trainer that a damaged
    checkpoint half-restored must not go on training."""
    source = make_trainer(True)
    train_steps(source, 2, seed=0)
    source.save_training_checkpoint(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / damaged
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    target = make_trainer(True)
    train_steps(target, 1, seed=5)
    before = weights(target), optimizer_tensors(target), torch.get_rng_state()
    with pytest.raises(BadFileError) as error:
        target.load_training_checkpoint(tmp_path / "ckpt")
    assert error.value.path == path
    assert error.value.problem.startswith(CHECKPOINT_DAMAGE[damaged])
    assert target.version == 1
    assert_bitwise_equal(weights(target), before[0])
    assert_bitwise_equal(optimizer_tensors(target), before[1])
    assert torch.equal(torch.get_rng_state(), before[2])


def test_grpo_on_a_one_token_bandit_learns_the_rewarded_actions() -> None:
    """Sample one token after a fixed prompt, reward tokens below 32 (1/8 of the vocabulary),
    train on group-relative advantages: the rewarded mass must grow."""
    # Full weight: the tiny random model's embeddings are too small for LoRA to move much.
    trainer = make_trainer(False)
    prompt = [5, 6, 7]
    every_action = [
        TrainingSample([*prompt, a], [0.0, 0.0, 0.0, 1.0], [0.0] * 4, [0.0] * 4)
        for a in range(VOCAB)
    ]
    generator = torch.Generator().manual_seed(0)

    def action_logprobs() -> torch.Tensor:
        return torch.tensor([row[-1] for row in trainer.forward(every_action)])

    start = action_logprobs()[:32].exp().sum().item()
    for _ in range(15):
        logprobs = action_logprobs()
        actions = torch.multinomial(logprobs.exp(), 16, replacement=True, generator=generator)
        rewards = (actions < 32).float()
        advantages = rewards - rewards.mean()
        samples = [
            TrainingSample(
                [*prompt, a],
                [0.0, 0.0, 0.0, 1.0],
                [0.0, 0.0, 0.0, logprobs[a].item()],
                [0.0, 0.0, 0.0, adv],
            )
            for a, adv in zip(actions.tolist(), advantages.tolist(), strict=True)
        ]
        trainer.forward_backward(samples, GRPO)
        trainer.optim_step(2e-2)
    end = action_logprobs()[:32].exp().sum().item()
    assert start < 0.2 and end > 0.5
