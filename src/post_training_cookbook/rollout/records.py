"""An episode as one JSON record: the line a run's rollout dump and an evaluation's
episodes.jsonl both write, so that one viewer reads both."""

from __future__ import annotations

from typing import Any

from post_training_cookbook.rollout.types import Episode


def episode_record(episode: Episode) -> dict[str, Any]:
    """Everything about ``episode``: task, messages, reward, how it ended, its tokens with
    their mask and policy versions. Callers add where it belongs (step, group, episode)."""
    task = episode.task
    return {
        "task": {"prompt": task.prompt, "target": task.target, "metadata": task.metadata},
        "messages": episode.messages,
        "reward": episode.reward,
        "truncation": episode.truncation.value if episode.truncation else None,
        "num_turns": episode.num_turns,
        "num_tokens": len(episode.tokens),
        "num_sampled_tokens": episode.num_sampled_tokens,
        "length_capped_turns": episode.length_capped_turns,
        "metrics": episode.metrics,
        "env_error": episode.env_error,
        "token_ids": episode.tokens,
        "mask": [int(bit) for bit in episode.mask],
        "versions": episode.versions,
    }
