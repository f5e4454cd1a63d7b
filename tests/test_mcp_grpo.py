"""GRPO runs of a ``ToolEnv`` whose tools come from a real MCP server (``tests/mcp_server.py``):
a server killed mid-episode is an env error the run goes on past under ``"truncate"``, and
the bundled model trains on the tool-use game's tools served over MCP."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp")

from test_grpo_common import IM_END, quick_config, step_metrics, train_dump

from post_training_cookbook.engine.types import (
    PolicySegment,
    SampledSequence,
    SamplingParams,
)
from post_training_cookbook.envs import Task, ToolEnv, exact_answer, numeric_answer
from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TRAIN_TASKS
from post_training_cookbook.envs.tool_use_game.env import SYSTEM_PROMPT
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.models import BUNDLED_MODEL_ID
from post_training_cookbook.service import LocalModelService
from post_training_cookbook.tool_backends.mcp_connection import MCPStdioServer
from post_training_cookbook.tool_backends.mcp_tools import MCPToolbox

ROOT = Path(__file__).resolve().parents[1]


def server(call_log: Path) -> MCPStdioServer:
    return MCPStdioServer(
        sys.executable,
        (str(ROOT / "tests" / "mcp_server.py"), "stdio"),
        env={"PYTHONPATH": str(ROOT / "src"), "MCP_TEST_CALL_LOG": str(call_log)},
    )


def calls_logged(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def install_scripted_policy(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy calls the tool its system prompt names (``call=<tool>``), then, once a
    tool has answered, replies with the answer the task wants."""

    async def sample(
        service: LocalModelService, prompt_tokens: list[int], n: int, params: SamplingParams
    ) -> list[SampledSequence]:
        prompt = tokenizer.decode(prompt_tokens, skip_special_tokens=False)
        if "<tool_response>" in prompt:
            reply = "2" + IM_END
        else:
            name = re.findall(r"call=(\w+)", prompt)[-1]
            arguments = {"a": 1, "b": 1} if name == "add" else {}
            call = json.dumps({"name": name, "arguments": arguments})
            reply = f"<tool_call>\n{call}\n</tool_call>{IM_END}"
        tokens = list(tokenizer.encode(reply, add_special_tokens=False))
        version = service.policy_state().applied_weights_version
        return [
            SampledSequence(tokens, [-1.0] * len(tokens), "stop", [PolicySegment(0, version)])
            for _ in range(n)
        ]

    monkeypatch.setattr(LocalModelService, "sample", sample)


def test_a_server_killed_mid_episode_is_an_env_error_and_the_run_goes_on_under_truncate(
    tiny_llama_dir: Path,
    tiny_llama_tokenizer: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install_scripted_policy(tiny_llama_tokenizer, monkeypatch)
    log = tmp_path / "calls.jsonl"
    toolbox = MCPToolbox(server(log), lifetime="episode", tool_names=["add", "die"])
    built: dict[str, int] = {}
    envs: list[ToolEnv] = []

    def make_env(task: Task) -> ToolEnv:
        # the first episode of each task calls the tool that kills its server
        index = built[task.prompt] = built.get(task.prompt, -1) + 1
        tool = "die" if index == 0 else "add"
        env = ToolEnv(toolbox.tools(), system_prompt=f"call={tool}", reward_fn=exact_answer)
        envs.append(env)
        return env

    tasks = [Task(prompt="Add one and one.", target="2")]
    config = quick_config(
        tiny_llama_dir, tmp_path, batch_size=1, episodes_per_task=3, env_errors="truncate"
    )
    run = train_multi_turn(config, tasks, make_env)
    records = train_dump(run.path, 0)
    failed = [record for record in records if record["env_error"] is not None]
    assert len(records) == 3 and len(failed) == 1
    for record in failed:
        assert record["truncation"] == "env" and record["reward"] == 0.0
        assert "MCP server 'python " in record["env_error"]
        assert "connection closed during tools/call 'die'" in record["env_error"]
    assert [record["reward"] for record in records if record["env_error"] is None] == [1.0] * 2
    assert step_metrics(run.path)[0]["rollout/env_error_ratio"] == pytest.approx(1 / 3)
    called = [call["tool"] for call in calls_logged(log)]
    assert sorted(called) == ["add", "add", "die"]
    assert len({call["pid"] for call in calls_logged(log)}) == 3  # a server per episode
    assert (run.final_model_dir / "config.json").is_file()  # the run went on to its end


def test_the_bundled_model_trains_on_the_games_tools_served_over_mcp(tmp_path: Path) -> None:
    log = tmp_path / "calls.jsonl"
    tool_names = ["list_fact_keys", "lookup", "calculator"]
    with MCPToolbox(server(log), tool_names=tool_names) as toolbox:
        config = quick_config(
            BUNDLED_MODEL_ID,
            tmp_path,
            codec=None,
            batch_size=2,
            episodes_per_task=2,
            num_steps=2,
            max_turns=4,
            max_model_length=1024,
            max_tokens_per_turn=96,
            env_errors="truncate",
        )
        run = train_multi_turn(
            config,
            list(TOOL_USE_GAME_TRAIN_TASKS[:8]),
            lambda task: ToolEnv(
                toolbox.tools(),
                system_prompt=SYSTEM_PROMPT,
                reward_fn=numeric_answer,
                max_turns=4,
            ),
        )
    assert sorted(step_metrics(run.path)) == [0, 1]
    records = [record for step in (0, 1) for record in train_dump(run.path, step)]
    assert all(record["env_error"] is None for record in records)
    # the bundled model calls the game's tools; here they answered from the MCP server
    assert {call["tool"] for call in calls_logged(log)} <= set(tool_names)
    assert len(calls_logged(log)) >= 2
    assert (run.final_model_dir / "config.json").is_file()
