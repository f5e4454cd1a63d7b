"""A GRPO run whose episodes call the sandboxed ``python`` tool: results and tool errors
reach the model, and every episode's scratch folder is gone when the run ends."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from test_grpo_common import IM_END, quick_config, step_metrics, train_dump

from post_training_cookbook.engine.types import PolicySegment, SampledSequence, SamplingParams
from post_training_cookbook.envs import Task, ToolEnv, exact_answer
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.service import LocalModelService
from post_training_cookbook.tool_backends.sandbox import (
    SandboxConfig,
    SandboxPool,
    SandboxUnavailableError,
    code_tools,
)

PROGRAMS = {"good": "print(6 * 7)", "loop": "while True:\n    pass"}


def install_scripted_policy(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy runs the program its system prompt names (``program=<name>``), then
    replies with the last tool result's first line."""

    async def sample(
        service: LocalModelService, prompt_tokens: list[int], n: int, params: SamplingParams
    ) -> list[SampledSequence]:
        prompt = tokenizer.decode(prompt_tokens, skip_special_tokens=False)
        responses = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", prompt, re.DOTALL)
        if responses:
            reply = responses[-1].strip().splitlines()[0] + IM_END
        else:
            program = PROGRAMS[re.findall(r"program=(\w+)", prompt)[-1]]
            call = json.dumps({"name": "python", "arguments": {"code": program}})
            reply = f"<tool_call>\n{call}\n</tool_call>{IM_END}"
        tokens = list(tokenizer.encode(reply, add_special_tokens=False))
        version = service.policy_state().applied_weights_version
        return [
            SampledSequence(tokens, [-1.0] * len(tokens), "stop", [PolicySegment(0, version)])
            for _ in range(n)
        ]

    monkeypatch.setattr(LocalModelService, "sample", sample)


def test_a_grpo_run_uses_the_sandbox_and_leaves_no_scratch_behind(
    tiny_llama_dir: Path,
    tiny_llama_tokenizer: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    try:
        pool = SandboxPool(SandboxConfig(cpu_time_s=1, timeout_s=60), max_concurrent=4)
    except SandboxUnavailableError as exc:
        pytest.skip(f"no sandbox: {exc}")
    install_scripted_policy(tiny_llama_tokenizer, monkeypatch)
    built: dict[str, int] = {}

    def make_env(task: Task) -> ToolEnv:
        # the first episode of each task runs a program that never ends
        index = built[task.prompt] = built.get(task.prompt, -1) + 1
        program = "loop" if index == 0 else "good"
        return ToolEnv(
            code_tools(pool, ["python"]), system_prompt=f"program={program}", reward_fn=exact_answer
        )

    try:
        tasks = [Task(prompt="What is 6 * 7?", target="42")]
        config = quick_config(tiny_llama_dir, tmp_path, batch_size=1, episodes_per_task=3)
        run = train_multi_turn(config, tasks, make_env)
        records = train_dump(run.path, 0)
        assert sorted(record["reward"] for record in records) == [0.0, 1.0, 1.0]
        assert step_metrics(run.path)[0]["rollout/env/num_tool_errors"] == pytest.approx(1 / 3)
        texts = json.dumps(records)
        assert "tool_error: SIGXCPU: its CPU time limit (1 s) ran out" in texts
        assert list(pool.root.iterdir()) == []  # each env's close removed its scratch
    finally:
        pool.close()
