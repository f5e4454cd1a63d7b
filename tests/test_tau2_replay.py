"""The replay check on a sample of each domain's tasks, with no model: τ²'s gold actions played
through ``Tau2Env`` (a scripted user; telecom also in solo mode) earn τ²'s full reward, and an
agent that does nothing earns what τ²'s evaluator gives it on the same conversation built
without the env. ``python -m post_training_cookbook.bundled_envs.tau2.replay`` runs the check
on every task (docs/tau2.md has its counts)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import random

import pytest
from tau2_common import require_tau2

require_tau2()

from post_training_cookbook.bundled_envs.tau2 import Tau2Env, tau2_tasks  # noqa: E402
from post_training_cookbook.bundled_envs.tau2.data import from_task  # noqa: E402
from post_training_cookbook.bundled_envs.tau2.replay import (  # noqa: E402
    GoldScript,
    agent_messages,
    expected_without_actions,
    main,
    replay,
)
from post_training_cookbook.envs.base import Task  # noqa: E402


def sample(domain: str, size: int, solo: bool = False) -> list[Task]:
    """A seeded sample of the domain's published tasks, with, where the domain has them, a
    task that asks for information to be communicated and one with no gold action at all."""
    tasks = tau2_tasks(domain, solo=solo)
    records = [from_task(task)[1] for task in tasks]
    chosen = set(random.Random(56).sample(range(len(tasks)), size))
    for wanted in (
        lambda r: bool(r.evaluation_criteria.communicate_info),
        lambda r: not r.evaluation_criteria.actions,
    ):
        chosen.add(next((i for i, r in enumerate(records) if wanted(r)), min(chosen)))
    return [tasks[i] for i in sorted(chosen)]


SAMPLES = [
    ("airline", False, 4),  # ~2 s a task here: three databases built per episode
    ("retail", False, 4),
    ("telecom", False, 12),
    ("telecom", True, 8),
]


@pytest.mark.parametrize(("domain", "solo", "size"), SAMPLES, ids=lambda v: str(v))
def test_gold_actions_earn_full_reward_and_no_actions_earn_what_tau2_gives(
    domain: str, solo: bool, size: int
) -> None:
    for task in sample(domain, size, solo):
        gold = asyncio.run(replay(task, solo=solo))
        assert gold.reward == 1.0, (gold.task_id, gold.reward_info.model_dump(mode="json"))
        assert gold.ending == ("agent_stop" if solo else "user_stop")
        nothing = asyncio.run(replay(task, solo=solo, actions=False))
        assert nothing.reward == expected_without_actions(task, solo=solo), nothing.task_id


def test_the_sample_covers_what_the_check_is_about() -> None:
    airline = [from_task(task)[1] for task in sample("airline", 4)]
    assert any(record.evaluation_criteria.communicate_info for record in airline)
    assert any(not record.evaluation_criteria.actions for record in airline)
    telecom = [from_task(task)[1] for task in sample("telecom", 12)]
    assert any(
        action.requestor == "user" for r in telecom for action in r.evaluation_criteria.actions
    )
    assert any("ACTION" in str(r.evaluation_criteria.reward_basis) for r in telecom)


def test_doing_nothing_earns_full_reward_only_where_tau2_says_so() -> None:
    # airline task 0: the user asks to cancel a reservation the policy does not allow to be
    # cancelled; the right answer changes nothing. Retail task 0 asks for an exchange.
    airline, retail = tau2_tasks("airline", limit=1)[0], tau2_tasks("retail", limit=1)[0]
    assert expected_without_actions(airline) == 1.0
    assert asyncio.run(replay(airline, actions=False)).reward == 1.0
    assert expected_without_actions(retail) == 0.0
    assert asyncio.run(replay(retail, actions=False)).reward == 0.0


def test_the_gold_actions_less_the_last_write_lose_the_reward() -> None:
    task = tau2_tasks("retail", limit=1)[0]
    _, record = from_task(task)
    script = agent_messages(record, solo=False)
    write = "exchange_delivered_order_items"
    assert script[-2]["tool_calls"][0]["function"]["name"] == write
    short = script[:-2] + script[-1:]

    async def play() -> tuple[float, bool]:
        env = Tau2Env(user=GoldScript())
        try:
            await env.reset(task)
            for message in short:
                result = await env.step(message)
            return result.reward, env.reward_info.db_check.db_match
        finally:
            await env.close()

    assert asyncio.run(play()) == (0.0, False)


def test_the_replay_command_counts_a_split() -> None:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(["telecom", "--split", "small"])
    counts = json.loads(printed.getvalue())
    assert counts["tasks"] == 20
    assert counts["gold_full_reward"] == counts["no_actions_as_tau2"] == 20
    assert counts["no_actions_rewarded"] == 0 and counts["failed"] == []
