"""``collect_demonstrations`` with a scripted, a local and a hosted policy, and the game's
scripted solver; ``post-training-cookbook sft``."""

from __future__ import annotations

import json

import pytest
from sft_common import demonstration_files

from post_training_cookbook.cli import main
from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.envs.tool_use_game import (
    TOOL_USE_GAME_TRAIN_TASKS,
    TOOL_USE_GAME_VAL_TASKS,
    ToolUseGameEnv,
)
from post_training_cookbook.envs.tool_use_game.scripted_player import parse_question
from post_training_cookbook.envs.tool_use_game.solver import GameSolver
from post_training_cookbook.evaluation import HostedModel
from post_training_cookbook.models import BUNDLED_MODEL_ID
from post_training_cookbook.rollout.chat import ChatTurn
from post_training_cookbook.serve import start_server
from post_training_cookbook.sft import read_conversations
from post_training_cookbook.sft.demonstrations import ScriptedChat, collect_demonstrations
from post_training_cookbook.types import Message


def game_env(task):
    return ToolUseGameEnv()


def test_the_solver_solves_every_level_on_train_and_unseen_entities_through_the_tools():
    tasks = [*TOOL_USE_GAME_TRAIN_TASKS[:60], *TOOL_USE_GAME_VAL_TASKS[:30]]
    assert {task.metadata["level"] for task in tasks} == {1, 2, 3}
    demos = collect_demonstrations(GameSolver(), game_env, tasks)
    assert demos.num_episodes == 90 and demos.reward_mean == 1.0 and demos.keep_rate == 1.0
    for task, conversation in zip(tasks, demos.conversations, strict=True):
        calls = [
            call["function"]["name"]
            for message in conversation.messages
            for call in message.get("tool_calls") or []
        ]
        level = task.metadata["level"]
        assert calls.count("lookup") == (2 if level == 3 else 1)
        assert calls.count("calculator") == (0 if level == 1 else 1)
        assert conversation.messages[-1]["content"] == task.target


class WrongOnLevelOne:
    """The solver, but it answers level-1 questions with a wrong number without a lookup."""

    async def chat(self, messages: list[Message], tools, params: SamplingParams) -> ChatTurn:
        if parse_question(messages[1]["content"]).operation is not None:
            return await ScriptedChat(GameSolver()).chat(messages, tools, params)
        return ChatTurn(Message(role="assistant", content="-1"), "stop")


def test_only_episodes_that_reach_the_threshold_are_kept_and_written_with_the_tools(tmp_path):
    tasks = TOOL_USE_GAME_TRAIN_TASKS[:40]
    output = tmp_path / "demos" / "train.jsonl"
    demos = collect_demonstrations(WrongOnLevelOne(), game_env, tasks, output=output)
    solved = [task for task in tasks if task.metadata["level"] > 1]
    assert 0 < len(solved) < len(tasks)
    assert len(demos.conversations) == len(solved)
    assert demos.rejected_rewards == [0.0] * (len(tasks) - len(solved))
    read = read_conversations(output)
    assert [c.messages for c in read] == [c.messages for c in demos.conversations]
    names = [tool["function"]["name"] for tool in read[0].tools or []]
    assert names == ["list_fact_keys", "lookup", "calculator"]
    everything = collect_demonstrations(WrongOnLevelOne(), game_env, tasks, reward_threshold=0.0)
    assert len(everything.conversations) == len(tasks)


@pytest.fixture(scope="module")
def tiny_server():
    with start_server(BUNDLED_MODEL_ID) as server:
        yield server


def test_a_local_and_a_hosted_model_keep_the_same_episodes(tiny_server):
    """The bundled model solves some tasks: greedy, locally and through our OpenAI-compatible
    server as a hosted endpoint, the same ones pass the threshold."""
    tasks = TOOL_USE_GAME_VAL_TASKS[:16]
    options = {"temperature": 0.0, "max_turns": 6}
    local = collect_demonstrations(BUNDLED_MODEL_ID, game_env, tasks, **options)
    hosted_model = HostedModel("tool-use-tiny", tiny_server.base_url, api_key_env=None)
    hosted = collect_demonstrations(hosted_model, game_env, tasks, **options)
    assert 0 < len(local.conversations) < len(tasks)
    assert [c.source for c in hosted.conversations] == [c.source for c in local.conversations]
    for conversation in local.conversations:
        assert conversation.tools and conversation.messages[-1]["role"] == "assistant"


# ---------------------------------------------------------------- the CLI


def write_config(path, model, data: dict, **fields) -> None:
    lines = [f"model: {model}", "codec: hermes", "wandb_project: null", "use_lora: false"]
    lines += [f"{key}: {value}" for key, value in fields.items()]
    lines += ["data:"] + [f"  {key}: {value}" for key, value in data.items()]
    path.write_text("\n".join(lines) + "\n")


def test_the_sft_command_trains_from_a_yaml_file(tiny_llama_dir, tmp_path, capsys):
    train, val = demonstration_files(tmp_path)
    config = tmp_path / "sft.yaml"
    write_config(config, tiny_llama_dir, {"train": train, "val": val}, runs_dir=tmp_path / "runs")
    status = main(
        ["sft", str(config), "--set", "optimizer.num_steps=2", "--set", "checkpoints.run_name=cli"]
    )
    assert status == 0, capsys.readouterr().err
    run = tmp_path / "runs" / "cli"
    assert (run / "final_model" / "config.json").is_file()
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").open()] == [0, 1, 2]


def test_the_sft_command_reports_bad_data_and_config_in_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    config = tmp_path / "sft.yaml"
    write_config(config, tmp_path / "missing-model", {"train": bad})
    assert main(["sft", str(config)]) == 2
    assert f"{bad}:1: message 0: unknown role 'robot'" in capsys.readouterr().err
    write_config(config, tmp_path, {"train": bad}, batch_size=4)
    assert main(["sft", str(config)]) == 2
    assert "unknown SFTConfig key 'batch_size'" in capsys.readouterr().err
    config.write_text("model: x\n")
    assert main(["sft", str(config)]) == 2
    assert "a 'data' section with 'train: FILE.jsonl' is required" in capsys.readouterr().err


def test_the_sft_yaml_of_docs_cli_md_loads(tmp_path, monkeypatch):
    from pathlib import Path

    from post_training_cookbook.cli.sft import load_sft_config

    text = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    block = text.split("## `sft`", 1)[1].split("```yaml\n", 1)[1].split("```")[0]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demos").mkdir()
    for name in ("train", "val"):
        (tmp_path / "demos" / f"{name}.jsonl").write_text("")
    (tmp_path / "sft.yaml").write_text(block)
    config, train, val = load_sft_config(tmp_path / "sft.yaml", ["optimizer.num_steps=2"])
    assert config.run_name == "warm-start" and config.num_steps == 2
    assert (train, val) == (Path("demos/train.jsonl"), Path("demos/val.jsonl"))
