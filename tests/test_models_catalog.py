"""The model catalog: ids, local folders, and refusals that come before any weights load."""

import re

import pytest
from test_eval_common import DAMAGED_MODEL_FOLDERS, cut_in_half, damaged_model_folder
from transformers import LlamaConfig, LlamaForCausalLM

from post_training_cookbook.models import (
    BUNDLED_MODEL_ID,
    list_models,
    require_generator_support,
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
