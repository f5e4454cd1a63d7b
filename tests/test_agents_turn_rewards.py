"""An external agent's per-call rewards: one per ``chat.completions`` call it made, kept as
the episode's turn rewards, each call's tokens trained on its own under
``turn_rewards="per_step"``; a list of the wrong length is an env error saying so."""

from __future__ import annotations

import itertools
import threading

import openai
from test_agents import evaluate_agent, tasks_with_facts

from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_VAL_TASKS
from post_training_cookbook.grpo.advantages import (
    AdvantageSettings,
    RewardShaping,
    build_training_batch,
)
from post_training_cookbook.rollout import TruncationCause

CALLS_PER_TASK: dict[str, itertools.count[int]] = {}
COUNTER_LOCK = threading.Lock()


def two_call_agent(base_url, api_key, task):
    """Two calls on one history; the first is rewarded in every other episode of a task (so
    each group's first-call rewards vary), the second never."""
    with COUNTER_LOCK:
        counter = CALLS_PER_TASK.setdefault(task.prompt, itertools.count())
        first_reward = float(next(counter) % 2)
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    history = [{"role": "user", "content": task.prompt}]
    for _ in range(2):
        reply = client.chat.completions.create(model="policy", messages=history, max_tokens=6)
        history.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        history.append({"role": "user", "content": "Go on."})
    return [first_reward, 0.0]


def test_an_agents_per_call_rewards_train_each_calls_tokens_on_its_own():
    # greedy, so that whether a task's replies parse does not depend on the draw: a group
    # counts only when both its episodes finished
    result = evaluate_agent(
        two_call_agent, tasks=tasks_with_facts(TOOL_USE_GAME_VAL_TASKS[:6]), temperature=0.0
    )
    episodes = [e for g in result.groups for e in g.episodes]
    finished = [e for e in episodes if e.truncation is None]
    assert finished, "every episode was cut short: nothing to check"
    for episode in finished:
        assert episode.num_turns == 2 and len(episode.turn_rewards) == 2
        assert episode.reward == episode.turn_rewards[-1] == 0.0  # the last call's
        sampled_turns = {t for t, m in zip(episode.token_turns, episode.mask, strict=True) if m}
        assert sampled_turns == {0, 1}
    per_step = AdvantageSettings(
        RewardShaping(max_model_length=4096), "mean", turn_rewards="per_step"
    )
    informative = [g for g in result.groups if all(e.truncation is None for e in g.episodes)]
    batch = build_training_batch(informative, per_step)
    assert batch.samples
    for sample in batch.samples:
        # the second call's reward is 0 everywhere: only first-call tokens carry credit
        episode = next(e for e in finished if e.tokens == sample.tokens)
        for advantage, turn in zip(sample.advantages, episode.token_turns, strict=True):
            assert (advantage != 0.0) == (turn == 0)


def wrong_count_agent(base_url, api_key, task):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": task.prompt}]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    return [1.0, 0.0, 0.0]


def test_per_call_rewards_that_do_not_match_the_calls_are_an_env_error():
    result = evaluate_agent(wrong_count_agent, env_errors="truncate")
    for episode in (e for g in result.groups for e in g.episodes):
        if episode.truncation is TruncationCause.PARSE_FAILURE:
            continue  # a 4-token reply may not parse: then failed_parse_reward stands
        assert episode.truncation is TruncationCause.ENV
        assert "3 per-call rewards for 1 calls" in (episode.env_error or "")


def huge_reward_agent(base_url, api_key, task):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": task.prompt}]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    return [1e308]


def test_per_call_rewards_too_large_for_the_advantage_arithmetic_are_an_env_error():
    """The rollout guard's rule (``reward_problem``): 1e308 per call would overflow the
    per-step returns; refused as the episode's env error, never summed."""
    result = evaluate_agent(huge_reward_agent, env_errors="truncate")
    for episode in (e for g in result.groups for e in g.episodes):
        if episode.truncation is TruncationCause.PARSE_FAILURE:
            continue
        assert episode.truncation is TruncationCause.ENV
        assert "of size at most 1e+09" in (episode.env_error or ""), episode.env_error
