"""The rollout layer: episodes and groups of them — how they are played (``play``: the
episode frame ``run_episode`` and the token driver; ``chat``: the driver for models that
speak messages, such as hosted endpoints; an external agent's env brings its own,
``DrivenEnv``), within what limits and as what records (``types``), the numbers that
describe them (``metrics``) and the JSON line each becomes (``records``).

Nothing here imports torch or transformers: the sampler and the codec are handed in.
"""

from post_training_cookbook.rollout.chat import (
    ChatDriver,
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
    TokenDriver,
    derive_seed,
    play_group,
    play_groups,
    run_episode,
)
from post_training_cookbook.rollout.records import episode_record
from post_training_cookbook.rollout.types import (
    ENV_ERROR_POLICIES,
    DrivenEnv,
    EndpointUsage,
    EnvErrorPolicy,
    EnvStepError,
    Episode,
    EpisodeDriver,
    EpisodeLimits,
    Group,
    Sampler,
    TruncationCause,
)

# Not kept as a deprecated alias: ``with_retries(limits, params, seed, play_once)``, removed
# when ``run_episode`` became the one episode frame. It retried any ``play_once`` callback;
# ``run_episode(task, runner, params, seed)`` retries inside itself, building each try's env
# from the runner, so it cannot serve the old signature, and no other function now does.

__all__ = [
    "ENV_ERROR_POLICIES",
    "ChatDriver",
    "ChatRunner",
    "ChatSampler",
    "ChatTurn",
    "DrivenEnv",
    "EndpointUsage",
    "EnvErrorPolicy",
    "EnvStepError",
    "Episode",
    "EpisodeDriver",
    "EpisodeLimits",
    "EpisodeRunner",
    "EpisodesInFlight",
    "Group",
    "RewardOf",
    "Sampler",
    "TokenDriver",
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
]
