"""Train an agent that already speaks the OpenAI API: ``AgentEnvs(agent)`` is an env factory
whose episodes run the agent against the policy server (``serve/``) and become training
samples from exactly what the server sampled. ``env`` runs the agent, ``episode`` records its
calls and cuts them into segments. docs/agents.md.
"""

from post_training_cookbook.agents.env import MODEL_NAME, Agent, AgentEnv, AgentEnvs, RewardFn
from post_training_cookbook.agents.episode import EpisodeEndpoint, Turn, segments

__all__ = [
    "MODEL_NAME",
    "Agent",
    "AgentEnv",
    "AgentEnvs",
    "EpisodeEndpoint",
    "RewardFn",
    "Turn",
    "segments",
]
