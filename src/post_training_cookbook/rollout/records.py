"""An episode as one JSON record: the line a run's rollout dump and an evaluation's
episodes.jsonl both write, so that one viewer reads both."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from post_training_cookbook.rollout.types import Episode
from post_training_cookbook.types import Message

MAX_CONTENT_CHARS = 20_000
"""A message's content beyond this is cut in the record (a tool that returns a web page
would otherwise make every rollout dump megabytes long); the tokens are kept whole."""


def episode_record(episode: Episode) -> dict[str, Any]:
    """Everything about ``episode``: task, messages, reward, how it ended, its tokens with
    their mask and policy versions. Callers add where it belongs (step, group, episode)."""
    task = episode.task
    return {
        "task": {"prompt": task.prompt, "target": task.target, "metadata": task.metadata},
        "messages": [_bounded(message) for message in episode.messages],
        "reward": episode.reward,
        "truncation": episode.truncation.value if episode.truncation else None,
        "num_turns": episode.num_turns,
        "num_tokens": len(episode.tokens),
        "num_sampled_tokens": episode.num_sampled_tokens,
        "length_capped_turns": episode.length_capped_turns,
        "unparsed_turns": episode.unparsed_turns,
        "metrics": episode.metrics,
        "env_error": episode.env_error,
        "close_error": episode.close_error,
        "retried_env_errors": episode.retried_env_errors,
        "token_ids": episode.tokens,
        "mask": [int(bit) for bit in episode.mask],
        # the behaviour policy's log-probabilities, so that a recorded batch
        # (grpo/recorded_batch.py) gives the loss the step trained with
        "sampler_logprobs": episode.sampler_logprobs,
        "versions": episode.versions,
        "segment_starts": episode.segment_starts,
        "turn_rewards": episode.turn_rewards,
        "token_turns": episode.token_turns,
        "endpoint_usage": asdict(episode.endpoint_usage) if episode.endpoint_usage else None,
    }


def _bounded(message: Message) -> Message:
    content = message.get("content")
    if not isinstance(content, str) or len(content) <= MAX_CONTENT_CHARS:
        return message
    cut = len(content) - MAX_CONTENT_CHARS
    shown = content[:MAX_CONTENT_CHARS] + f"…[{cut} more characters not shown]"
    return {**message, "content": shown}
