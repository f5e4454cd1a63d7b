"""``collect_demonstrations``: SFT data from an env's episodes, by rejection sampling.

Episodes are played with any policy: a scripted one (a ``ScriptedPolicy``, whose
``next_message`` answers a conversation, such as the tool-use game's ``GameSolver``; or any
``ChatSampler``), a hosted OpenAI-compatible endpoint (``HostedModel``, the
path ``evaluate`` takes), or a local model (a catalog id, a Hugging Face folder, a run or a
checkpoint, sampled by the engine through the model's codec, as ``evaluate`` does). The
episodes whose reward reaches ``reward_threshold`` are kept, each as a ``Conversation``
with its env's tool specs, and written as SFT JSONL (one conversation a line) when
``output`` is given.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.envs.base import Env, EnvFactory, Task
from post_training_cookbook.evaluation.hosted import HostedModel
from post_training_cookbook.evaluation.results import EvalSettings
from post_training_cookbook.files import write_text_atomic
from post_training_cookbook.rollout import EpisodeLimits, Group, check_episode_inputs
from post_training_cookbook.rollout.chat import ChatRunner, ChatSampler, ChatTurn, play_chat_group
from post_training_cookbook.rollout.guards import env_property
from post_training_cookbook.sft.conversations import Conversation, check_messages
from post_training_cookbook.sync import run_sync
from post_training_cookbook.types import Message, ToolSpec


@runtime_checkable
class ScriptedPolicy(Protocol):
    """A policy that knows its env: the next assistant message for the conversation so far."""

    def next_message(self, messages: list[Message]) -> Message: ...


@dataclass(frozen=True)
class ScriptedChat:
    """A ``ChatSampler`` over a ``ScriptedPolicy`` (it ignores the sampling params)."""

    policy: ScriptedPolicy

    @property
    def name(self) -> str:
        return type(self.policy).__name__

    async def chat(
        self, messages: list[Message], tools: list[ToolSpec], params: SamplingParams
    ) -> ChatTurn:
        return ChatTurn(self.policy.next_message(messages), "stop")


Policy = ScriptedPolicy | ChatSampler | HostedModel | str | os.PathLike[str]


@dataclass
class Demonstrations:
    conversations: list[Conversation]
    """The kept episodes, in task order."""
    num_episodes: int
    reward_mean: float
    """Over every episode played, kept or not."""
    output: Path | None = None
    """The JSONL file written, if any."""
    rejected_rewards: list[float] = field(default_factory=list)

    @property
    def keep_rate(self) -> float:
        return len(self.conversations) / max(self.num_episodes, 1)


def collect_demonstrations(
    policy: Policy,
    env_factory: EnvFactory,
    tasks: Sequence[Task],
    *,
    episodes_per_task: int = 1,
    reward_threshold: float = 1.0,
    output: str | os.PathLike[str] | None = None,
    max_turns: int = 6,
    max_model_length: int = 2048,
    max_tokens_per_turn: int = 256,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    codec: str | None = None,
    device: str = "auto",
) -> Demonstrations:
    """Play ``episodes_per_task`` episodes of each task with ``policy`` and keep those whose
    reward is at least ``reward_threshold``. The limits mean what they mean in training
    (``EpisodeLimits``); ``codec`` and ``device`` apply to a local model. ``output``: a
    JSONL file that ``train_sft`` reads, written atomically. Bad input raises ``ValueError``
    before any episode is played."""
    tasks = list(tasks)
    check_episode_inputs(tasks, env_factory, purpose="evaluate")
    limits = EpisodeLimits(
        max_turns=max_turns,
        max_model_length=max_model_length,
        max_tokens_per_turn=max_tokens_per_turn,
    )
    settings = EvalSettings(
        episodes_per_task=episodes_per_task, limits=limits, temperature=temperature, top_p=top_p
    )
    groups = run_sync(_play(policy, env_factory, tasks, settings, seed, codec, device))
    tools = [_tool_specs(env_factory, task) for task in tasks]
    kept: list[Conversation] = []
    rejected: list[float] = []
    rewards: list[float] = []
    for index, group in enumerate(groups):
        for number, episode in enumerate(group.episodes):
            rewards.append(episode.reward)
            if episode.reward < reward_threshold or episode.env_error is not None:
                rejected.append(episode.reward)
                continue
            source = f"task {index} episode {number}"
            check_messages(episode.messages, source)  # what train_sft will require
            kept.append(Conversation(list(episode.messages), tools[index], source))
    demonstrations = Demonstrations(
        kept, len(rewards), sum(rewards) / max(len(rewards), 1), rejected_rewards=rejected
    )
    if output is not None:
        target = Path(output)
        target.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(target, "".join(c.to_json() + "\n" for c in kept))
        demonstrations.output = target
    return demonstrations


async def _play(
    policy: Policy,
    env_factory: EnvFactory,
    tasks: list[Task],
    settings: EvalSettings,
    seed: int,
    codec: str | None,
    device: str,
) -> list[Group]:
    if isinstance(policy, HostedModel | str | os.PathLike):
        from post_training_cookbook.evaluation.runner import aevaluate

        local = not isinstance(policy, HostedModel)
        result = await aevaluate(
            policy, tasks, env_factory, settings, runs_dir=None,
            codec=codec if local else None, device=device,  # device: local models only
        )  # fmt: skip
        return list(result.groups)
    sampler = ScriptedChat(policy) if isinstance(policy, ScriptedPolicy) else policy
    runner = ChatRunner(env_factory, sampler, settings.limits)
    params = SamplingParams(
        max_tokens=settings.limits.max_tokens_per_turn,
        temperature=settings.temperature,
        top_p=settings.top_p,
    )
    return list(
        await asyncio.gather(
            *(
                play_chat_group(runner, task, settings.episodes_per_task, params, seed + index)
                for index, task in enumerate(tasks)
            )
        )
    )


def _tool_specs(env_factory: EnvFactory, task: Task) -> list[ToolSpec] | None:
    """The tools the task's env offers: read from a fresh env, reset on the task when it
    has none before (an env whose tools depend on the task, as BFCL's entries do)."""
    env = env_factory(task)
    specs = list(env_property(env, "tool_specs") or [])
    if not specs and isinstance(env, Env):
        specs = run_sync(_tools_after_reset(env, task))
    return specs or None


async def _tools_after_reset(env: Env, task: Task) -> list[ToolSpec]:
    try:
        await env.reset(task)
        return list(env_property(env, "tool_specs") or [])
    finally:
        await env.close()
