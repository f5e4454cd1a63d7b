"""The rollout layer: episodes and groups of them — how they are played (``play``; ``chat``
for models that speak messages, such as hosted endpoints), within what limits and as what
records (``types``), the numbers that describe them (``metrics``) and the JSON line each
becomes (``records``).

Nothing here imports torch or transformers: the sampler and the codec are handed in.
"""

from post_training_cookbook.rollout.chat import (
    ChatRunner,
    ChatSampler,
    ChatTurn,
    play_chat_group,
    run_chat_episode,
)
from post_training_cookbook.rollout.checks import (
    UnusableRolloutsError,
    check_episode_inputs,
    check_rollouts_usable,
)
from post_training_cookbook.rollout.metrics import (
    RewardOf,
    env_reward,
    episode_metrics,
    has_reward_variance,
    per_env_metrics,
)
from post_training_cookbook.rollout.play import (
    EpisodeRunner,
    EpisodesInFlight,
    derive_seed,
    play_group,
    play_groups,
    run_episode,
    with_retries,
)
from post_training_cookbook.rollout.records import episode_record
from post_training_cookbook.rollout.types import (
    ENV_ERROR_POLICIES,
    EndpointUsage,
    EnvErrorPolicy,
    EnvStepError,
    Episode,
    EpisodeLimits,
    Group,
    Sampler,
    TruncationCause,
)

__all__ = [
    "ENV_ERROR_POLICIES",
    "ChatRunner",
    "ChatSampler",
    "ChatTurn",
    "EndpointUsage",
    "EnvErrorPolicy",
    "EnvStepError",
    "Episode",
    "EpisodeLimits",
    "EpisodeRunner",
    "EpisodesInFlight",
    "Group",
    "RewardOf",
    "Sampler",
    "TruncationCause",
    "UnusableRolloutsError",
    "check_episode_inputs",
    "check_rollouts_usable",
    "derive_seed",
    "env_reward",
    "episode_metrics",
    "episode_record",
    "has_reward_variance",
    "per_env_metrics",
    "play_chat_group",
    "play_group",
    "play_groups",
    "run_chat_episode",
    "run_episode",
    "with_retries",
]
