"""``check_env`` on intermediate rewards: a step that does not end the episode and gives a
reward is a note (no fault), saying that only ``turn_rewards="per_step"`` trains on it."""

from __future__ import annotations

from post_training_cookbook.envs import StepResult, check_env
from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TASKS, ToolUseGameEnv
from post_training_cookbook.types import Message


class ToolCallBonusEnv(ToolUseGameEnv):
    """The tool-use game with 0.1 for every step that calls a tool and goes on."""

    async def step(self, message: Message) -> StepResult:
        result = await super().step(message)
        ended = result.terminated or result.truncated
        bonus = 0.1 if message.get("tool_calls") and not ended else 0.0
        return StepResult(
            result.terminated, result.truncated, result.messages, result.reward + bonus,
            result.metrics,
        )  # fmt: skip


def test_intermediate_rewards_are_noted_with_what_turn_rewards_makes_of_them() -> None:
    report = check_env(lambda task: ToolCallBonusEnv(), TOOL_USE_GAME_TASKS, num_tasks=1)
    assert report.ok and report.gives_intermediate_rewards
    (note,) = report.notes
    assert "intermediate rewards" in note and "turn_rewards='per_step'" in note
    assert "turn_rewards='final' (the default) reads only the last step's reward" in note
    assert str(report).splitlines()[0].endswith(", 1 note in 8 episodes")
    assert f"  NOTE {note}" in str(report)


def test_an_env_rewarding_only_its_last_step_gets_no_note() -> None:
    report = check_env(lambda task: ToolUseGameEnv(), TOOL_USE_GAME_TASKS, num_tasks=1)
    assert report.notes == [] and not report.gives_intermediate_rewards
    assert "note" not in str(report).splitlines()[0]
