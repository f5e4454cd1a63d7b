"""``BFCLEnv``: one BFCL question, one reply, BFCL's verdict as the reward.

The env renders the question's messages and BFCL's function docs as tools; the policy
answers once (tool calls, parallel ones included, or text), and the episode ends with
reward 1.0 when ``bfcl-eval``'s checker accepts the reply, else 0.0. The tools are never
run: BFCL scores the calls, not their results. Train on ``bfcl_train_tasks()`` (the live
categories), score on ``bfcl_tasks()`` (the test categories): no question is in both.
"""

from __future__ import annotations

from post_training_cookbook.bundled_envs.bfcl.checker import BFCLVerdict, check_reply, reply_calls
from post_training_cookbook.bundled_envs.bfcl.data import BFCLItem
from post_training_cookbook.envs.base import RecordingEnv, StepResult, Task
from post_training_cookbook.types import Message, ToolSpec


class BFCLEnv(RecordingEnv):
    """A single-turn env over one ``BFCLItem``; build one per episode (``BFCLEnv()``)."""

    def __init__(self) -> None:
        self._item: BFCLItem | None = None
        self._tools: list[ToolSpec] = []
        self._messages: list[Message] = []
        self.verdict: BFCLVerdict | None = None
        """The checker's verdict on the reply, once ``step`` has run."""

    async def reset(self, task: Task) -> list[Message]:
        self._item = BFCLItem.from_task(task)
        self._tools = self._item.tool_specs
        self._messages = [Message(**message) for message in self._item.messages]
        self.verdict = None
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        if self._item is None:
            raise RuntimeError("BFCLEnv.step before reset")
        self._messages.append(message)
        calls = reply_calls(message)
        self.verdict = check_reply(self._item, calls)
        reward = 1.0 if self.verdict.valid else 0.0
        # per category too: a run's rollout/env/bfcl_<category>_valid (episodes that parsed)
        metrics = {
            "bfcl_valid": reward,
            f"bfcl_{self._item.category}_valid": reward,
            "bfcl_calls": float(len(calls)),
        }
        return StepResult(True, False, list(self._messages), reward=reward, metrics=metrics)
