"""Phase 1 of a step: play groups until the batch has enough informative ones.

Dynamic sampling: a group whose episodes all get the same (shaped) reward teaches nothing.
Each of up to ``max_sampling_attempts`` rounds plays as many new tasks as the batch still
lacks informative groups; the step trains on what it has after the last round.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.groups import EpisodeRunner, Group, play_groups
from post_training_cookbook.grpo.advantages import shaped_reward
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.data import TaskStream
from post_training_cookbook.rollout import derive_seed


@dataclass
class Collection:
    groups: list[Group] = field(default_factory=list)
    """Every group played this step, informative or not, in order."""
    attempts: int = 0

    def informative(self, config: GRPOConfig) -> list[Group]:
        return [group for group in self.groups if is_informative(group, config)]

    def metrics(self, config: GRPOConfig) -> dict[str, float]:
        skipped = len(self.groups) - len(self.informative(config))
        return {
            "rollout/sampling_attempts": float(self.attempts),
            "rollout/groups": float(len(self.groups)),
            "rollout/zero_variance_skip_ratio": skipped / max(1, len(self.groups)),
        }


def is_informative(group: Group, config: GRPOConfig) -> bool:
    rewards = [shaped_reward(episode, config) for episode in group.episodes]
    return max(rewards) > min(rewards)


async def collect_groups(
    runner: EpisodeRunner, stream: TaskStream, config: GRPOConfig, params: SamplingParams
) -> Collection:
    collection = Collection()
    while collection.attempts < config.max_sampling_attempts:
        missing = config.batch_size - len(collection.informative(config))
        if missing <= 0:
            break
        collection.attempts += 1
        taken = stream.take(missing if collection.attempts > 1 else config.batch_size)
        tasks = [task for _, task in taken]
        seeds = [derive_seed(config.seed, "train", position) for position, _ in taken]
        collection.groups += await play_groups(
            runner, tasks, config.episodes_per_task, params, seeds
        )
    return collection
