"""Train an agent that already speaks the OpenAI API: ``AgentEnvs(agent)`` is an env factory
whose episodes run the agent against the policy server (``serve/``) and become training
samples from exactly what the server sampled. ``env`` runs the agent, ``episode`` records its
calls and cuts them into segments. docs/agents.md. ``VerifiersEnvs`` is an ``AgentEnvs``
whose agent is a ``verifiers`` environment's rollout, run in verifiers' own venv by
``verifiers_worker.py`` (``verifiers_envs``; docs/verifiers.md).
"""

from post_training_cookbook.agents.env import MODEL_NAME, Agent, AgentEnv, AgentEnvs, RewardFn
from post_training_cookbook.agents.episode import EpisodeEndpoint, Turn, segments
from post_training_cookbook.agents.verifiers_envs import (
    VerifiersEnv,
    VerifiersEnvs,
    VerifiersError,
    VerifiersUnavailable,
)

__all__ = [
    "MODEL_NAME",
    "Agent",
    "AgentEnv",
    "AgentEnvs",
    "EpisodeEndpoint",
    "RewardFn",
    "Turn",
    "VerifiersEnv",
    "VerifiersEnvs",
    "VerifiersError",
    "VerifiersUnavailable",
    "segments",
]
