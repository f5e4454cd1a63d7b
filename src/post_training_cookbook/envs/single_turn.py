"""Single-turn GRPO as an env: the user's prompt, one assistant reply, a reward."""

from __future__ import annotations

from collections.abc import Callable

from post_training_cookbook.envs.base import Env, StepResult, Task
from post_training_cookbook.types import Message, ToolSpec


class SingleTurnEnv(Env):
    """Ends after the first reply, scored by ``reward_fn(reply, task.target)``."""

    def __init__(self, reward_fn: Callable[[str, str], float], system_prompt: str | None) -> None:
        self._reward_fn = reward_fn
        self._system_prompt = system_prompt
        self._messages: list[Message] = []
        self._target = ""

    async def reset(self, task: Task) -> list[Message]:
        self._target = task.target
        system = (
            [Message(role="system", content=self._system_prompt)] if self._system_prompt else []
        )
        self._messages = [*system, Message(role="user", content=task.prompt)]
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        self._messages.append(message)
        reward = float(self._reward_fn(message.get("content") or "", self._target))
        return StepResult(True, False, list(self._messages), reward=reward)

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return []

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)
