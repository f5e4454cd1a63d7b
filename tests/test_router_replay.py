"""Router replay (``models/moe_routing.py``): the engine records the experts each MoE router
chose for every token it read, the records travel with the episode to the training batch, and
the trainer's forward routes each recorded token through them, with its own router weights
mixing them (R3).

Tiny random MoE models built from configs: Qwen3-MoE, and Qwen3.5-MoE (its sparse block with a
shared expert; with full attention only, and as the hosted guide's hybrid, Gated DeltaNet
layers beside a full-attention one).

The engine's records, own-routes exactness and the bf16 gap run on every device present
(``scripts/gpu_hybrid_check.sh`` runs the CUDA cases), with TF32 off (``full_fp32``); the
Qwen3.5-MoE cases skip where this transformers has no Qwen3.5-MoE, the Qwen3-MoE ones run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import itertools
import types

import numpy as np
import pytest
import torch
from devices import DEVICES, skip_unless_fp32_gated_delta_runs
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from post_training_cookbook.engine.local import LocalEngine
from post_training_cookbook.engine.types import SampledSequence, SamplingParams
from post_training_cookbook.envs import Env, StepResult, Task
from post_training_cookbook.grpo.advantages import episode_samples
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.settings import RunSettings
from post_training_cookbook.models import default_engine, resolve_model
from post_training_cookbook.models.bundled import BUNDLED_MODEL_ID
from post_training_cookbook.models.moe_routing import (
    NOT_RECORDED,
    ROUTER_KINDS,
    moe_routers,
    replayed_weights,
)
from post_training_cookbook.rollout import Episode
from post_training_cookbook.trainer.trainer import Trainer
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings, TrainingSample
from post_training_cookbook.types import Message

PROMPTS = [[1, 5, 9, 12, 7, 30], [3, 3, 7], [2, 40, 41, 42, 43, 44, 45]]
ON_DEVICES = pytest.mark.parametrize("device", DEVICES)
pytestmark = pytest.mark.usefixtures("full_fp32")


def qwen3_moe(*, seed: int = 0, router_std: float = 1.0) -> Qwen3MoeForCausalLM:
    """Two sparse layers, 4 experts, 2 a token. Router weights of ``router_std`` (large: no
    accidental near-ties between two fp32 forwards)."""
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for router in moe_routers(model):
            router.weight.normal_(0.0, router_std)
    return model


def qwen3_5_moe(layer_types: list[str]) -> torch.nn.Module:
    """Skips the test where this transformers has no Qwen3.5-MoE (older than the GPU check
    may find)."""
    module = pytest.importorskip("transformers.models.qwen3_5_moe")
    torch.manual_seed(1)
    config = module.Qwen3_5MoeTextConfig(
        vocab_size=96, hidden_size=32, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=len(layer_types), layer_types=layer_types, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, max_position_embeddings=256,
    )  # fmt: skip
    model = module.Qwen3_5MoeForCausalLM(config).eval()
    with torch.no_grad():
        for router in moe_routers(model):
            router.weight.normal_(0.0, 1.0)
    return model


HYBRID = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def own_routes(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    """``[tokens, moe_layers, top_k]``: what the model's routers choose in a plain forward
    (on the device the model is on)."""
    chosen: list[torch.Tensor] = []
    handles = [
        router.register_forward_hook(lambda m, a, out: chosen.append(out[2]))
        for router in moe_routers(model)
    ]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([tokens], device=next(model.parameters()).device))
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(chosen, dim=1).cpu().numpy().astype(np.int16)


def sample(
    model: torch.nn.Module, dtype: torch.dtype, seed: int = 1, device: str = "cpu"
) -> list[SampledSequence]:
    async def scenario() -> list[SampledSequence]:
        params = SamplingParams(max_tokens=10, seed=seed)
        engine = LocalEngine(model, dtype=dtype, device=device, record_routes=True)
        async with engine:
            batches = await asyncio.gather(*(engine.sample(p, 2, params) for p in PROMPTS))
        return [sequence for batch in batches for sequence in batch]

    return asyncio.run(scenario())


def training_samples(sequences: list[SampledSequence], routes: bool = True) -> list[TrainingSample]:
    """One sample per sequence (prompt + completion), advantage 1, the sampler's plain
    (temperature-1) log-probabilities."""
    prompts = [prompt for prompt in PROMPTS for _ in range(2)]
    samples = []
    for prompt, sequence in zip(prompts, sequences, strict=True):
        mask = [0.0] * len(prompt) + [1.0] * len(sequence.tokens)
        logprobs = [0.0] * len(prompt) + sequence.raw_logprobs
        recorded = sequence.routed_experts if routes else None
        samples.append(TrainingSample(prompt + sequence.tokens, mask, logprobs, mask, recorded))
    return samples


def trainer_for(model: torch.nn.Module, **options) -> Trainer:
    options = {"use_lora": False, "device": "cpu", "autocast_bf16": False, **options}
    return Trainer(model, TrainerSettings(router_replay=True, **options))


def mean_gap(samples: list[TrainingSample], logprobs: list[list[float]]) -> float:
    gaps = [
        abs(sample.sampler_logprobs[i] - row[i])
        for sample, row in zip(samples, logprobs, strict=True)
        for i, m in enumerate(sample.mask)
        if m
    ]
    return sum(gaps) / len(gaps)


# ---------------------------------------------------------------- the routers


@pytest.mark.parametrize("name", sorted(ROUTER_KINDS))
def test_replaying_a_routers_own_choice_gives_its_own_mixing_weights_bit_for_bit(name):
    """Every router class router replay knows exists in transformers under that name, and
    ``replayed_weights`` at its own top-k is its own output (softmax and normalisation as its
    block does them), for both ``norm_topk_prob`` settings."""
    family = {
        "Qwen2Moe": "qwen2_moe", "Qwen3Moe": "qwen3_moe", "Qwen3Next": "qwen3_next",
        "Olmoe": "olmoe", "Qwen3_5Moe": "qwen3_5_moe", "Qwen3VLMoeText": "qwen3_vl_moe",
        "Mixtral": "mixtral",
    }[name.removesuffix("TopKRouter")]  # fmt: skip
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    for normalise in (False, True):
        config = types.SimpleNamespace(
            num_experts_per_tok=3, num_experts=8, num_local_experts=8, hidden_size=16,
            norm_topk_prob=normalise,
        )  # fmt: skip
        router = getattr(module, name)(config)
        torch.nn.init.normal_(router.weight)
        hidden = torch.randn(5, 16)
        logits, weights, indices = router(hidden)
        assert torch.equal(replayed_weights(router, logits, indices), weights)


# ---------------------------------------------------------------- the engine


def moe(family: str) -> torch.nn.Module:
    """qwen3_moe; qwen3_5_moe with full attention only; qwen3_5_moe_hybrid with Gated DeltaNet
    layers beside a full-attention one (the hosted guide's MoE architecture)."""
    if family == "qwen3_moe":
        return qwen3_moe()
    return qwen3_5_moe(HYBRID if family == "qwen3_5_moe_hybrid" else ["full_attention"] * 2)


@ON_DEVICES
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_hybrid"])
def test_the_engine_records_the_experts_its_routers_chose_for_every_token_it_read(family, device):
    """fp32: the record of each sequence (prompt and sampled tokens, batched, rows joining and
    leaving) is what a plain forward of the same tokens chooses, and the last sampled token,
    never read, is not recorded. A second turn that extends a first one reuses its KV from
    the prefix cache, and its record still covers the whole prompt."""
    model = moe(family)
    if family == "qwen3_5_moe_hybrid":
        skip_unless_fp32_gated_delta_runs(device)
    model.to(device)
    sequences = sample(model, torch.float32, device=device)
    prompts = [prompt for prompt in PROMPTS for _ in range(2)]
    moe_layers = len(moe_routers(model))
    for prompt, sequence in zip(prompts, sequences, strict=True):
        routes = sequence.routed_experts
        assert routes is not None and routes.dtype == np.int16
        tokens = prompt + sequence.tokens
        assert routes.shape == (len(tokens), moe_layers, 2)
        np.testing.assert_array_equal(routes[:-1], own_routes(model, tokens)[:-1])
        assert (routes[-1] == NOT_RECORDED).all()

    async def second_turn() -> tuple[SampledSequence, int]:
        async with LocalEngine(model, device=device, record_routes=True) as engine:
            params = SamplingParams(max_tokens=6, seed=3)
            (first,) = await engine.sample(PROMPTS[0], 1, params)
            prompt = PROMPTS[0] + first.tokens + [11, 12]
            (second,) = await engine.sample(prompt, 1, params)
            return first, second, prompt, engine.stats().prefill_tokens_reused

    first, second, prompt, reused = asyncio.run(second_turn())
    assert reused == len(PROMPTS[0]) + len(first.tokens) - 1
    assert second.routed_experts is not None
    tokens = prompt + second.tokens
    np.testing.assert_array_equal(second.routed_experts[:-1], own_routes(model, tokens)[:-1])


def test_prompts_sharing_a_long_prefix_prefilled_once_still_get_whole_records():
    """Distinct prompts of one prefill that share 70 tokens: the engine computes the shared
    prefix once, into its prefix cache, and each prompt's record still covers it."""
    model = qwen3_moe()
    shared = [(7 * i + 3) % 90 + 1 for i in range(70)]
    prompts = [[*shared, 11, 12], [*shared, 13], [*shared, 14, 15, 16]]

    async def scenario() -> tuple[list[SampledSequence], int]:
        async with LocalEngine(model, record_routes=True) as engine:
            params = SamplingParams(max_tokens=4, seed=5)
            batches = await asyncio.gather(*(engine.sample(p, 1, params) for p in prompts))
            return [batch[0] for batch in batches], engine.stats().prefill_tokens_reused

    sequences, reused = asyncio.run(scenario())
    assert reused == 3 * len(shared)
    for prompt, sequence in zip(prompts, sequences, strict=True):
        tokens = prompt + sequence.tokens
        assert sequence.routed_experts is not None
        np.testing.assert_array_equal(sequence.routed_experts[:-1], own_routes(model, tokens)[:-1])


def test_an_engine_asked_to_record_a_dense_models_routes_refuses():
    from post_training_cookbook.models.bundled import BUNDLED_MODEL_DIR
    from post_training_cookbook.models.loading import load_causal_lm

    dense = load_causal_lm(BUNDLED_MODEL_DIR, torch.float32)
    with pytest.raises(ValueError, match="router_replay needs a mixture-of-experts model"):
        LocalEngine(dense, record_routes=True)


# ---------------------------------------------------------------- the episode


def test_an_episode_keeps_the_first_record_of_each_token_over_its_turns():
    """Forced tokens have no record until a prompt holding them is sampled from; then the
    prompt's record fills them, and tokens recorded earlier keep their record."""

    def sequence(prompt_routes: list[int], sampled: list[int]) -> SampledSequence:
        routes = np.array(prompt_routes + sampled + [NOT_RECORDED], dtype=np.int16)
        routes = np.broadcast_to(routes[:, None, None], (len(routes), 1, 2)).copy()
        tokens = list(range(len(sampled) + 1))
        return SampledSequence(tokens, [0.0] * len(tokens), "stop", [], [], routes)

    episode = Episode(task=None, tokens=[], mask=[], sampler_logprobs=[], versions=[])
    episode.add_forced([1, 2, 3])
    episode.add_sampled(sequence([10, 11, 12], [13, 14]))  # 3 prompt, 3 sampled tokens
    episode.add_forced([4, 5])
    episode.add_sampled(sequence([20, 21, 22, 23, 24, 25, 26, 27], [28]))
    assert episode.routed_experts is not None
    recorded = episode.routed_experts[:, 0, 0].tolist()
    # the first turn's last sampled token was first read by the second turn's prefill
    assert recorded == [10, 11, 12, 13, 14, 25, 26, 27, 28, NOT_RECORDED]
    (piece,) = episode_samples(episode, [0.0] * len(episode.tokens))
    np.testing.assert_array_equal(piece.routed_experts, episode.routed_experts)


# ---------------------------------------------------------------- the trainer


@ON_DEVICES
@pytest.mark.parametrize(
    "family, packing",
    [("qwen3_moe", True), ("qwen3_moe", False), ("qwen3_5_moe", False), ("qwen3_5_moe", True)],
    ids=[
        "qwen3_moe-shared_prefix",
        "qwen3_moe-padded",
        "qwen3_5_moe_hybrid-padded",
        "qwen3_5_moe_hybrid-shared_prefix",
    ],
)
def test_replaying_the_models_own_routes_is_its_own_forward_exactly(family, packing, device):
    """fp32: samples whose records are the model's own choices give the same log-probabilities
    and loss with replay as without, bit for bit (so the stream and padded layouts put each
    record at its token), and the disagreement metric is 0. Then forcing other experts on a
    few tokens changes the log-probabilities, and the metric counts exactly those tokens."""
    model = qwen3_moe() if family == "qwen3_moe" else qwen3_5_moe(HYBRID)
    if family == "qwen3_5_moe":
        skip_unless_fp32_gated_delta_runs(device)
    model.to(device)  # the records are the trainer's device's own choices
    prompt = [4, 8, 15, 16, 23, 42]
    completions = [[50, 51, 52, 53], [50, 61, 60], [70, 71, 72, 73, 74]]
    samples = []
    for completion in completions:  # one prompt: a shared-prefix stream shares it
        tokens = prompt + completion
        mask = [0.0] * len(prompt) + [1.0] * len(completion)
        routes = own_routes(model, tokens)
        samples.append(TrainingSample(tokens, mask, [0.0] * len(tokens), mask, routes))
    plain = [dataclasses.replace(s, routed_experts=None) for s in samples]
    trainer = trainer_for(model, packing=packing, device=device)
    if packing:
        assert trainer.packing_mode == "shared_prefix"
    assert trainer.forward(samples) == trainer.forward(plain)
    replayed = trainer.forward_backward(samples, LossConfig())
    own = trainer.forward_backward(plain, LossConfig())
    assert replayed.loss == own.loss
    assert replayed.router is not None and replayed.router.disagreement == 0.0
    # every token the decoder read: a shared-prefix stream reads the prompt and [50] once
    read = len(prompt) + 1 + 3 + 2 + 5 if packing else 3 * len(prompt) + 4 + 3 + 5
    assert replayed.router.replayed_tokens == read

    forced = [dataclasses.replace(s, routed_experts=s.routed_experts.copy()) for s in samples]
    for sample in forced:  # the last token of each but one: the 2 experts its router left out
        routes = sample.routed_experts[-2, 0]
        routes[:] = sorted(set(range(4)) - set(routes.tolist()))
    assert trainer.forward(forced) != trainer.forward(plain)
    result = trainer.forward_backward(forced, LossConfig())
    assert result.router is not None and result.router.disagreement == 3 / read


def test_a_record_of_another_shape_than_the_models_routing_is_refused():
    trainer = trainer_for(qwen3_moe())
    routes = np.zeros((3, 5, 2), dtype=np.int16)  # 5 MoE layers; the model has 2
    sample = TrainingSample([1, 2, 3], [0.0, 1.0, 1.0], [0.0] * 3, [0.0] * 3, routes)
    with pytest.raises(ValueError, match="model has 2 MoE layers of top-2 routing"):
        trainer.forward([sample])


def test_a_trainer_asked_to_replay_a_dense_models_routes_refuses():
    with pytest.raises(ValueError, match="router_replay needs a mixture-of-experts model"):
        Trainer(
            resolve_model(BUNDLED_MODEL_ID).source,
            TrainerSettings(use_lora=False, router_replay=True),
        )


# ---------------------------------------------------------------- sampler and trainer


def drifting_moe(family: str) -> torch.nn.Module:
    """Near-tied routers (every expert's router row is one shared row plus a little noise), so
    bf16 rounding of the hidden states flips the top-k, and experts that differ a lot, so a
    flip moves the log-probabilities."""
    model = qwen3_moe(seed=2) if family == "qwen3_moe" else qwen3_5_moe(["full_attention"] * 2)
    with torch.no_grad():
        for router in moe_routers(model):
            shared = torch.randn(1, router.weight.shape[1])
            router.weight.copy_(shared + 0.02 * torch.randn_like(router.weight))
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.normal_(0.0, 0.5)
            layer.mlp.experts.down_proj.normal_(0.0, 0.5)
    return model


@ON_DEVICES
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_replay_narrows_the_gap_between_a_bf16_sampler_and_an_fp32_trainer(family, device):
    """A bf16 engine samples; an fp32 trainer scores the same samples with replay on and
    off: routing drift happens (the trainer's own routers would have chosen otherwise for
    some tokens), and replay makes the log-probability gap smaller (on this machine, by 4-10x
    over model seeds: 0.0013 against 0.0094 for Qwen3-MoE, 0.0012 against 0.0112 for
    Qwen3.5-MoE)."""
    model = drifting_moe(family)
    sequences = sample(model, torch.bfloat16, device=device)
    trainer = trainer_for(model, device=device)
    samples = training_samples(sequences)
    replayed = mean_gap(samples, trainer.forward(samples))
    own = mean_gap(samples, trainer.forward(training_samples(sequences, routes=False)))
    drift = trainer.forward_backward(samples, LossConfig()).router.disagreement
    assert drift > 0.05
    assert replayed < 0.5 * own


# ---------------------------------------------------------------- the config


def test_router_replay_with_vllm_is_refused_when_the_config_is_built():
    with pytest.raises(ValueError, match='generation_engine="vllm"'):
        GRPOConfig(model=BUNDLED_MODEL_ID, router_replay=True, generation_engine="vllm")


def test_router_replay_makes_auto_pick_the_torch_engine_where_it_would_pick_vllm():
    """On a GPU, ``generation_engine="auto"`` samples the hosted guide's MoE hybrid with vLLM,
    which records no routes; with router replay on it takes the torch engine, which does."""
    info = resolve_model("Qwen/Qwen3.6-35B-A3B")
    assert default_engine(info, on_gpu=True) == "vllm"
    assert default_engine(info, on_gpu=True, router_replay=True) == "torch"
    only_vllm = dataclasses.replace(info, engines=("vllm",))
    assert default_engine(only_vllm, on_gpu=True, router_replay=True) == "vllm"


def test_router_replay_on_a_model_only_vllm_samples_is_refused_by_its_settings():
    """A model the torch engine cannot sample goes to vLLM under ``"auto"``: the run's
    settings refuse it, naming vLLM, before any weights are looked for."""
    info = dataclasses.replace(resolve_model("Qwen/Qwen3.6-35B-A3B"), engines=("vllm",))
    config = GRPOConfig(model=info.model_id, router_replay=True)
    with pytest.raises(ValueError, match='generation_engine="vllm"'):
        RunSettings.from_config(config, info)


def test_router_replay_on_a_dense_model_is_refused_before_any_weights_load(tmp_path, monkeypatch):
    from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TASKS, ToolUseGameEnv
    from post_training_cookbook.grpo import train as grpo_train

    def no_loading(*args, **kwargs):
        raise AssertionError("a service was opened")

    monkeypatch.setattr(grpo_train, "open_service", no_loading)
    config = GRPOConfig(
        model=BUNDLED_MODEL_ID, router_replay=True, runs_dir=str(tmp_path / "runs"), num_steps=1
    )
    with pytest.raises(ValueError, match="router_replay needs a mixture-of-experts model"):
        grpo_train.train_multi_turn(config, TOOL_USE_GAME_TASKS[:2], lambda task: ToolUseGameEnv())
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- a GRPO run


class TwoTurnParityEnv(Env):
    """Asks again after the first reply (forced tokens between two sampled turns); the second
    reply's length parity is the reward (variance without a trained model)."""

    async def reset(self, task: Task) -> list[Message]:
        self._messages = [Message(role="user", content=task.prompt)]
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        self._messages.append(message)
        if len(self._messages) < 3:
            self._messages.append(Message(role="user", content="Once more."))
            return StepResult(False, False, list(self._messages))
        reward = float(len(message.get("content") or "") % 2)
        return StepResult(True, False, list(self._messages), reward=reward)

    @property
    def tool_specs(self) -> list:
        return []

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)


def test_a_grpo_run_carries_each_tokens_experts_from_the_sampler_to_the_trainer(
    tmp_path, monkeypatch
):
    """``GRPOConfig(router_replay=True)`` on a tiny Qwen3-MoE folder: every sample the trainer
    gets has a record for every token but its last (prompts, both sampled turns and the
    forced tokens between them, read by the second turn's prefill), and the step logs the
    disagreement, 0 when the trainer computes in fp32 as the sampler does."""
    from test_grpo_common import RecordedSamples, build_tiny_model, quick_config, step_metrics

    from post_training_cookbook.grpo.train import train_multi_turn
    from post_training_cookbook.trainer.precision import bf16_autocast_is_fast

    folder = build_tiny_model(tmp_path / "moe")
    dense = Qwen3MoeConfig.from_pretrained(folder)  # the Llama's config, read as a Qwen3-MoE's
    config = Qwen3MoeConfig(
        vocab_size=dense.vocab_size, hidden_size=32, intermediate_size=64,
        moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
        max_position_embeddings=2048, bos_token_id=dense.bos_token_id,
        eos_token_id=dense.eos_token_id, pad_token_id=dense.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for router in moe_routers(model):
            router.weight.normal_(0.0, 1.0)
    (folder / "model.safetensors").unlink()
    model.save_pretrained(folder)
    recorded = RecordedSamples(monkeypatch)
    run_config = quick_config(
        folder, tmp_path / "runs", router_replay=True, episodes_per_task=4,
        max_tokens_per_turn=12, dtype="float32", trainer_packing="shared_prefix",
    )  # fmt: skip
    tasks = [Task(prompt=f"Say something {i}.", target="") for i in range(4)]
    run = train_multi_turn(run_config, tasks, lambda task: TwoTurnParityEnv())
    (batch,) = recorded.batches
    assert batch
    for sample in batch:
        routes = sample.routed_experts
        assert routes is not None and routes.shape == (len(sample.tokens), 2, 2)
        assert (routes[:-1] != NOT_RECORDED).all() and (routes[-1] == NOT_RECORDED).all()
        starts = sum(1 for a, b in itertools.pairwise([0.0, *sample.mask]) if b and not a)
        assert starts == 2  # two sampled turns, forced tokens between them
    metrics = step_metrics(run.path)[0]
    assert metrics["router/replayed_tokens"] > 0
    if not bf16_autocast_is_fast(torch.device("cpu")):
        assert metrics["router/disagreement"] == 0.0
