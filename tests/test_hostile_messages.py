"""Message content that is not a string, in a played episode: the OpenAI content-parts form
is rendered into the training tokens; an int, a dict or bytes (which would render as nothing)
is an env error under the policy, in the loop and not only in ``check_env``."""

from __future__ import annotations

from typing import Any

import pytest
from test_hostile_tools import answer_reward, call_message, echo
from test_rollout import CODEC, PARAMS, ScriptedSampler, limits, sampled_tokens

from post_training_cookbook.envs import Task, ToolEnv
from post_training_cookbook.rollout import EpisodeRunner, TruncationCause, run_episode
from post_training_cookbook.types import Message, ToolCall


class RewrittenToolMessage(ToolEnv):
    """Puts ``content`` in place of its tool messages' text."""

    content: Any = None

    async def run_tool(self, call: ToolCall) -> bool:
        should_stop = await super().run_tool(call)
        self._messages[-1] = Message(**{**self._messages[-1], "content": self.content})
        return should_stop


def play_with_tool_content(content: Any) -> Any:
    import asyncio

    def env_factory(_: Task) -> ToolEnv:
        env = RewrittenToolMessage([echo], reward_fn=answer_reward)
        env.content = content
        return env

    replies = [
        sampled_tokens(call_message("echo", key="k")),
        sampled_tokens(Message(role="assistant", content="done")),
    ]
    runner = EpisodeRunner(
        env_factory, ScriptedSampler(replies), CODEC, limits(env_errors="truncate")
    )
    return asyncio.run(run_episode(Task(prompt="q"), runner, PARAMS))


def test_content_parts_are_rendered_into_the_training_tokens() -> None:
    parts = [{"type": "text", "text": "PARTS-"}, {"type": "text", "text": "XYZ"}]
    episode = play_with_tool_content(parts)
    assert episode.env_error is None and episode.truncation is None
    assert "PARTS-XYZ" in CODEC.tokenizer.decode(episode.tokens)
    assert episode.messages[2]["content"] == "PARTS-XYZ"


@pytest.mark.parametrize(
    "content",
    [5, {"text": "x"}, b"bytes", [{"type": "image_url", "image_url": {"url": "x"}}], ["x"]],
    ids=["int", "dict", "bytes", "image part", "bare string part"],
)
def test_content_no_codec_can_render_is_an_env_error(content: Any) -> None:
    episode = play_with_tool_content(content)
    assert episode.truncation is TruncationCause.ENV
    assert "content" in episode.env_error and "(tool)" in episode.env_error
