"""Bad input to ``train_multi_turn`` fails with a clear ``ValueError`` before any model loads.

Every loader (the service factory, the catalog's loaders, transformers' ``from_pretrained``) is
replaced by one that fails the test, so a check that ran after loading would show up as an
``AssertionError`` instead of the expected ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import pytest
import transformers
from test_grpo_common import Closes, mode_envs, mode_tasks, quick_config

from post_training_cookbook.grpo import train as train_module
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.models import loading

TASKS = mode_tasks(["answer", "wrong"])


@pytest.fixture
def no_loading(monkeypatch):
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a model or tokenizer was loaded before the input was checked")

    monkeypatch.setattr(train_module, "open_service", fail)
    monkeypatch.setattr(loading, "load_model", fail)
    monkeypatch.setattr(loading, "load_tokenizer", fail)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fail)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fail)


def train(config: GRPOConfig, tasks=TASKS, **kwargs: Any) -> None:
    train_multi_turn(config, tasks, kwargs.pop("env_factory", mode_envs(Closes())), **kwargs)


def test_empty_tasks_fail_before_loading(tiny_llama_dir, tmp_path, no_loading):
    with pytest.raises(ValueError, match="tasks is empty"):
        train(quick_config(tiny_llama_dir, tmp_path), tasks=[])
    assert not (tmp_path / "run").exists()


def test_tasks_that_are_not_task_objects_fail_before_loading(tiny_llama_dir, tmp_path, no_loading):
    with pytest.raises(ValueError, match="Task objects"):
        train(quick_config(tiny_llama_dir, tmp_path), tasks=["What is 1 + 1?"])


def test_an_env_factory_that_is_not_callable_fails_before_loading(
    tiny_llama_dir, tmp_path, no_loading
):
    with pytest.raises(ValueError, match="env_factory must be a callable"):
        train(quick_config(tiny_llama_dir, tmp_path), env_factory=None)


def test_a_trainer_only_model_fails_before_loading(tmp_path, no_loading):
    config = quick_config("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path, codec=None)
    with pytest.raises(ValueError, match="trainer-only") as raised:
        train(config)
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in str(raised.value)
    assert not (tmp_path / "run").exists()


def test_an_unknown_model_fails_before_loading(tmp_path, no_loading):
    with pytest.raises(ValueError, match="unknown model"):
        train(quick_config(tmp_path / "nowhere", tmp_path))


def test_max_model_length_above_the_models_context_fails_before_loading(
    tiny_llama_dir, tmp_path, no_loading
):
    with pytest.raises(ValueError, match=r"max_model_length=4096 exceeds .* 2048"):
        train(quick_config(tiny_llama_dir, tmp_path, max_model_length=4096))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("async_settings", "message"),
    [
        ({"weight_sync_type": "background_publish"}, "requires max_steps_off_policy"),
        ({"weight_sync_type": "pipeline", "use_lora": False}, "requires max_steps_off_policy"),
        (
            {"max_steps_off_policy": 1, "weight_sync_type": "pipeline", "use_lora": True},
            "use_lora=False",
        ),
    ],
)
def test_async_settings_the_service_cannot_honour_are_refused_before_loading(
    tiny_llama_dir, tmp_path, no_loading, async_settings, message
):
    with pytest.raises(ValueError, match=message):
        quick_config(tiny_llama_dir, tmp_path, **async_settings)


def test_an_existing_run_folder_without_resume_fails_before_loading_and_is_left_alone(
    tiny_llama_dir, tmp_path, no_loading
):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.yaml").write_text("earlier run\n")
    with pytest.raises(ValueError, match=r"already exists.*resume=True"):
        train(quick_config(tiny_llama_dir, tmp_path))
    assert [path.name for path in folder.iterdir()] == ["config.yaml"]
    assert (folder / "config.yaml").read_text() == "earlier run\n"
