"""The model catalog: ids, local folders, and refusals that come before any weights load."""

import re

import pytest
from hybrid_common import build_tiny_hybrid
from test_eval_common import DAMAGED_MODEL_FOLDERS, cut_in_half, damaged_model_folder
from transformers import LlamaConfig, LlamaForCausalLM

from post_training_cookbook.models import (
    BUNDLED_MODEL_ID,
    check_codec_options,
    default_engine,
    list_models,
    require_engine_support,
    require_generator_support,
    require_weights,
    resolve_model,
)


def test_the_catalog_lists_the_bundled_model_first_with_generator_support():
    models = list_models()
    assert models[0].model_id == BUNDLED_MODEL_ID
    assert models[0].generator_support and models[0].codec == "hermes"
    assert models[0].is_local


def test_a_trainer_only_model_is_refused_for_grpo_naming_the_model_and_the_reason():
    info = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert info.trainer_only
    with pytest.raises(ValueError) as error:
        require_generator_support(info)
    message = str(error.value)
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in message
    assert "trainer-only" in message and "drops tools" in message
    assert BUNDLED_MODEL_ID in message  # names models that would work


def test_a_local_folder_infers_its_codec_from_the_chat_template(tiny_llama_dir):
    info = resolve_model(str(tiny_llama_dir))
    assert info.codec == "hermes" and info.generator_support
    assert info.max_context == 2048


def test_an_unknown_model_id_fails_with_the_known_ids_listed():
    with pytest.raises(ValueError, match=r"unknown model 'nope/nothing'.*tool-use-tiny"):
        resolve_model("nope/nothing")


# ---- the hosted guide's models and today's families ----

HOSTED_GUIDE_MODELS = {"Qwen/Qwen3.8-27B": "qwen3.8", "Qwen/Qwen3.6-35B-A3B": "qwen3.6"}
FAMILY_MODELS = {
    **HOSTED_GUIDE_MODELS,
    "Qwen/Qwen3-4B": "qwen3",
    "Qwen/Qwen3-8B": "qwen3",
    "Qwen/Qwen3-4B-Instruct-2507": "qwen3-2507",
    "Qwen/Qwen2.5-7B-Instruct": "hermes",
    "meta-llama/Llama-3.1-8B-Instruct": "llama3.1",
    "meta-llama/Llama-3.2-3B-Instruct": "llama3.2",
}


@pytest.mark.parametrize(("model", "codec"), FAMILY_MODELS.items())
def test_the_catalog_knows_the_hosted_guides_models_and_todays_families(model, codec):
    info = resolve_model(model)
    assert info.codec == codec and info.generator_support and info.source == model
    assert info.training_modes == ("lora", "full") and info.default_dtype == "bfloat16"
    assert info.max_context >= 32768
    require_generator_support(info)
    assert check_codec_options(info, {}) == {}


def test_the_hosted_guides_hybrid_models_default_to_vllm_on_a_gpu_and_torch_on_a_cpu():
    for model in HOSTED_GUIDE_MODELS:
        info = resolve_model(model)
        assert info.max_context == 262144 and info.linear_attention
        require_engine_support(info, "vllm")
        require_engine_support(info, "torch")
        assert default_engine(info, on_gpu=True) == "vllm"
        assert default_engine(info, on_gpu=False) == "torch"
    dense = resolve_model("Qwen/Qwen3-8B")
    assert not dense.linear_attention
    assert default_engine(dense, on_gpu=True) == default_engine(dense, on_gpu=False) == "torch"


def test_a_local_folder_of_a_hybrid_model_is_known_as_one_from_its_config(tmp_path):
    folder = build_tiny_hybrid(tmp_path / "hybrid", moe=True)
    info = resolve_model(str(folder), codec="hermes")
    assert info.linear_attention and info.engines == ("vllm", "torch")
    assert default_engine(info, on_gpu=False) == "torch"


@pytest.mark.parametrize("model", HOSTED_GUIDE_MODELS)
def test_without_weights_the_hosted_guides_models_fail_naming_the_model_and_how_to_provide_it(
    model, tmp_path, monkeypatch
):
    from huggingface_hub import constants

    # HF_HUB_OFFLINE=1 and an empty HF_HOME, as the hub reads them (at import, so patched)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    info = resolve_model(model)  # what a run with the hosted guide's model id resolves first
    with pytest.raises(ValueError) as error:
        require_weights(info)
    message = str(error.value)
    assert f"'{model}'" in message and "not available" in message
    assert f"hf download {model}" in message  # the download command
    assert "local folder" in message and "config.json" in message
    assert "HF_TOKEN" in message and "HF_HUB_OFFLINE" in message


def test_weights_come_from_a_local_folder_or_a_cached_snapshot(tmp_path, monkeypatch):
    import huggingface_hub.constants

    # offline whatever the caller's environment: a missing snapshot must not ask the hub
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    bundled = resolve_model(BUNDLED_MODEL_ID)
    assert require_weights(bundled).kind == "local"
    snapshot = tmp_path / "models--Qwen--Qwen3.8-27B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (tmp_path / "models--Qwen--Qwen3.8-27B" / "refs").mkdir()
    (tmp_path / "models--Qwen--Qwen3.8-27B" / "refs" / "main").write_text("abc123")
    (snapshot / "config.json").write_text("{}")
    info = resolve_model("Qwen/Qwen3.8-27B")
    with pytest.raises(ValueError, match="not in the Hugging Face cache"):
        require_weights(info, cache_dir=tmp_path)  # a config alone is not the weights
    (snapshot / "model.safetensors.index.json").write_text("{}")
    source = require_weights(info, cache_dir=tmp_path)
    assert source.kind == "cache" and source.location == str(snapshot)


def test_an_unreachable_hub_is_reported_with_the_model_and_the_ways_to_provide_it(
    tmp_path, monkeypatch
):
    import huggingface_hub

    def unreachable(self, repo_id, **kwargs):
        raise ConnectionError("no route to host")

    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: False)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    with pytest.raises(ValueError, match=r"'meta-llama/Llama-3.1-8B-Instruct'.*not reachable"):
        require_weights(resolve_model("meta-llama/Llama-3.1-8B-Instruct"), cache_dir=tmp_path)


@pytest.mark.parametrize(
    ("model", "options", "error"),
    [
        ("Qwen/Qwen3.6-35B-A3B", {"reasoning_effort": "low"}, "no codec option 'reasoning_effort'"),
        ("Qwen/Qwen3.8-27B", {"reasoning_effort": "max"}, r"reasoning_effort='max' is not one of"),
        ("Qwen/Qwen3.8-27B", {"enable_thinking": "yes"}, r"enable_thinking='yes' is not one of"),
        ("Qwen/Qwen3.8-27B", {"enable_thinking": 1}, r"enable_thinking=1 is not one of"),
        ("Qwen/Qwen3-8B", {"preserve_thinking": True}, "no codec option 'preserve_thinking'"),
        ("Qwen/Qwen2.5-7B-Instruct", {"enable_thinking": False}, "its options: none"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", {"enable_thinking": False}, "has no codec"),
    ],
)
def test_codec_options_are_checked_against_the_models_codec_before_anything_loads(
    model, options, error
):
    with pytest.raises(ValueError, match=error) as raised:
        check_codec_options(resolve_model(model), options)
    assert model in str(raised.value)


def test_codec_options_merge_over_the_catalogs_and_none_means_the_default():
    info = resolve_model("Qwen/Qwen3.8-27B")
    chosen = {"enable_thinking": True, "preserve_thinking": None, "reasoning_effort": "low"}
    assert check_codec_options(info, chosen) == {"enable_thinking": True, "reasoning_effort": "low"}
    bundled = resolve_model(BUNDLED_MODEL_ID)
    assert check_codec_options(bundled, {"enable_thinking": None}) == {"default_system": None}


def test_load_codec_applies_the_checked_options(tmp_path):
    from test_codecs_common import make_tokenizer, real_template

    from post_training_cookbook.models.loading import load_codec

    tokenizer = make_tokenizer(real_template("qwen3_8"))
    info = resolve_model("Qwen/Qwen3.8-27B")
    codec = load_codec(info, tokenizer, {"reasoning_effort": "low", "enable_thinking": None})
    assert codec.name == "qwen3.8" and codec.reasoning_effort == "low"  # type: ignore[attr-defined]
    assert codec.preserve_thinking  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="no codec option"):
        load_codec(resolve_model("Qwen/Qwen3.6-35B-A3B"), tokenizer, {"reasoning_effort": "low"})


@pytest.mark.parametrize(
    ("template_file", "codec"),
    [
        ("qwen2_5", "hermes"),
        ("qwen3", "qwen3"),
        ("qwen3_instruct_2507", "hermes"),
        ("qwen3_5_think", "qwen3.5"),
        ("qwen3_5_nothink", "qwen3.5-nothink"),
        ("qwen3_6", "qwen3.6"),
        ("qwen3_8", "qwen3.8"),
        ("llama3_1", "llama3.1"),
        ("llama3_2", "llama3.2"),
        ("nemotron_3_nano", None),  # Qwen3.5's XML calls, another system prompt
        ("glm4moe", None),  # <think> and <tool_call>, but not ChatML
        ("gptoss", None),
        ("gemma4", None),
    ],
)
def test_a_local_folder_gets_the_family_codec_its_real_template_belongs_to(
    template_file, codec, tmp_path
):
    from test_codecs_common import real_template

    (tmp_path / "config.json").write_text('{"model_type": "x", "max_position_embeddings": 4096}')
    (tmp_path / "chat_template.jinja").write_text(real_template(template_file))
    info = resolve_model(str(tmp_path))
    assert info.codec == codec and info.generator_support == (codec is not None)
    if codec is None:
        assert "codec='template'" in info.trainer_only_reason


@pytest.mark.parametrize("case", DAMAGED_MODEL_FOLDERS)
def test_a_damaged_local_model_folder_is_refused_naming_the_file_and_the_problem(
    tiny_llama_dir, tmp_path, case
):
    damaged, problem = damaged_model_folder(tiny_llama_dir, tmp_path / "model", case)
    with pytest.raises(ValueError) as error:
        resolve_model(str(tmp_path / "model"), codec="hermes")
    assert str(error.value).startswith(f"{damaged}: {problem}")


def test_sharded_weights_are_checked_shard_by_shard(tiny_llama_tokenizer, tmp_path):
    config = LlamaConfig(
        vocab_size=len(tiny_llama_tokenizer), hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path, max_shard_size="50KB")
    tiny_llama_tokenizer.save_pretrained(tmp_path)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1
    assert resolve_model(str(tmp_path)).codec == "hermes"
    cut_in_half(shards[-1])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(shards[-1]))}: cut short"):
        resolve_model(str(tmp_path))
    shards[-1].unlink()
    with pytest.raises(ValueError, match=rf"^{re.escape(str(shards[-1]))}: missing"):
        resolve_model(str(tmp_path))
