"""``evaluate(model, benchmark="tau2:...")`` and ``eval --benchmark tau2:...``: τ²'s tasks played
through ``Tau2Env`` and scored with τ²'s pass^k per domain, each with its standard error over
tasks: the arithmetic by hand, a scripted policy whose successes are known (telecom solo), a
tiny local model and a hosted endpoint against a loopback user simulator (airline), and the
refusals, all before any model loads."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
from tau2_common import REPLY_TOKEN, require_tau2, saying_one_token_model

require_tau2()

from tau2_user_server import UserServer, serving  # noqa: E402

from post_training_cookbook.bundled_envs.tau2 import UserSimulatorSettings  # noqa: E402
from post_training_cookbook.bundled_envs.tau2.data import from_task  # noqa: E402
from post_training_cookbook.bundled_envs.tau2.replay import (  # noqa: E402
    GoldScript,
    agent_messages,
    expected_without_actions,
)
from post_training_cookbook.cli import main  # noqa: E402
from post_training_cookbook.envs.base import Task  # noqa: E402
from post_training_cookbook.evaluation import BenchmarkSpec, evaluate, format_result  # noqa: E402
from post_training_cookbook.evaluation.tau2_benchmark import (  # noqa: E402
    standard_error,
    tasks_pass_hat_k,
    tau2_success,
)
from post_training_cookbook.rollout import Episode  # noqa: E402
from post_training_cookbook.rollout.chat import ChatTurn  # noqa: E402
from post_training_cookbook.types import Message  # noqa: E402

NO_MODEL = "no/such-model"
"""A model that cannot load: a refusal that names something else came before loading it."""


# --- pass^k by hand ---------------------------------------------------------------------------


def test_pass_hat_k_is_c_choose_k_over_n_choose_k_averaged_with_the_se_over_tasks() -> None:
    trials = [[True] * 4, [True, True, False, False], [True, False, False, False], [False] * 4]
    per_task = tasks_pass_hat_k(trials)
    assert list(per_task) == [1, 2, 3, 4]  # τ² reports k = 1 .. trials
    assert per_task[1] == [1.0, 0.5, 0.25, 0.0]
    assert per_task[2] == pytest.approx([1.0, 1 / 6, 0.0, 0.0])  # C(2,2)/C(4,2)
    assert per_task[3] == per_task[4] == [1.0, 0.0, 0.0, 0.0]
    # mean 0.4375; squared deviations 0.31640625 + 0.00390625 + 0.03515625 + 0.19140625
    assert standard_error(per_task[1]) == pytest.approx(math.sqrt(0.546875 / 3) / 2)
    assert standard_error(per_task[3]) == pytest.approx(0.25)  # sd 0.5 (of 1, 0, 0, 0) / 2
    assert standard_error([0.7]) == 0.0
    # unequal trials: k up to the fewest (τ²'s rule), each task over its own n
    assert tasks_pass_hat_k([[True, True], [True, False, True]]) == {
        1: [1.0, pytest.approx(2 / 3)],
        2: [1.0, pytest.approx(1 / 3)],
    }


@pytest.mark.parametrize(
    ("reward", "success"),
    [(1.0, True), (1 - 1e-7, True), (0.999, False), (0.0, False), (None, False)],
)
def test_a_success_is_tau2s_reward_of_one_and_an_unscored_episode_fails(
    reward: float | None, success: bool
) -> None:
    metrics = {} if reward is None else {"tau2_reward": reward}
    episode = Episode(Task(prompt=""), [], [], [], [], reward=1.0, metrics=metrics)
    assert tau2_success(episode) is success


# --- specs, and refusals before any model loads -----------------------------------------------


def test_specs_name_domains_and_tau2s_splits() -> None:
    assert str(BenchmarkSpec.parse("tau2")) == "tau2:airline,retail,telecom@base"
    spec = BenchmarkSpec.parse("tau2:telecom_solo,airline@test")
    assert (spec.categories, spec.split) == (("telecom_solo", "airline"), "test")
    assert BenchmarkSpec.parse("tau2:telecom_solo@small").split == "small"


@pytest.mark.parametrize(
    ("benchmark", "user", "refusal"),
    [
        ("tau2:bank", None, "unknown τ² domain 'bank'"),
        ("tau2:retail@small", None, "τ²'s retail domain has no split 'small'"),
        ("tau2:telecom_solo@nope", None, "telecom domain has no split 'nope'"),
        ("tau2:airline", None, "airline need.* τ²'s user simulator: pass user_simulator="),
        ("tau2", None, "airline, retail, telecom need"),
        ("tau2:telecom_solo", GoldScript(), "has no user: drop user_simulator"),
        ("bfcl", GoldScript(), "user_simulator is τ²'s simulated user"),
    ],
)
def test_a_bad_tau2_benchmark_is_refused_before_any_model_loads(
    benchmark: str, user: Any, refusal: str
) -> None:
    with pytest.raises(ValueError, match=refusal):
        evaluate(NO_MODEL, benchmark=benchmark, user_simulator=user, runs_dir=None)


def test_a_user_simulator_without_a_tau2_benchmark_is_refused() -> None:
    with pytest.raises(ValueError, match=r"user_simulator is for benchmark='tau2:\.\.\.'"):
        evaluate(NO_MODEL, [Task(prompt="x")], lambda t: None, user_simulator=GoldScript())


def test_the_cli_refuses_a_tau2_benchmark_without_its_user_before_any_model_loads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["eval", NO_MODEL, "--benchmark", "tau2:retail", "--no-save"]) == 2
    assert "--user-model" in capsys.readouterr().err
    assert main(["eval", NO_MODEL, "--benchmark", "tau2:retail", "--user-base-url", "x"]) == 2
    assert "simulator's --user-base-url: name its --user-model" in capsys.readouterr().err
    assert main(["eval", NO_MODEL, "--benchmark", "tau2:airline@small", "--no-save"]) == 2
    assert "has no split 'small'" in capsys.readouterr().err


# --- a scripted policy: known successes, telecom solo -----------------------------------------


class GoldOrGiveUp:
    """A chat policy for solo tasks, told apart by their ticket: a task's episodes, in the
    order they start, play its gold actions where ``plan[ticket]`` says True (τ²'s full
    reward), else call ``done`` at once (τ²'s 0 on telecom)."""

    name = "gold-or-give-up"

    def __init__(self, plan: dict[str, list[bool]], tasks: list[Task]) -> None:
        self.plan = {ticket: list(trials) for ticket, trials in plan.items()}
        records = {task.prompt: from_task(task)[1] for task in tasks}
        self.gold = {ticket: agent_messages(r, solo=True) for ticket, r in records.items()}
        self.give_up = {
            ticket: agent_messages(r, solo=True, actions=False) for ticket, r in records.items()
        }

    async def chat(self, messages: list[Message], tools: Any, params: Any) -> ChatTurn:
        system = str(messages[0]["content"])  # the solo prompt holds the task's ticket
        ticket = max((ticket for ticket in self.gold if ticket in system), key=len)
        played = sum(message["role"] == "assistant" for message in messages)
        if played == 0 and not self.plan[ticket].pop(0):
            return ChatTurn(self.give_up[ticket][0], "stop")
        return ChatTurn(self.gold[ticket][played], "stop")


def test_pass_hat_k_of_a_scripted_policy_on_telecom_solo(tmp_path: Path) -> None:
    from post_training_cookbook.bundled_envs.tau2 import tau2_tasks

    tasks = tau2_tasks("telecom", "base", solo=True, limit=2)
    assert tasks[0].prompt != tasks[1].prompt  # the policy tells them apart by their ticket
    plan = {tasks[0].prompt: [True, True, False], tasks[1].prompt: [True, False, False]}
    result = evaluate(
        GoldOrGiveUp(plan, tasks),
        benchmark="tau2:telecom_solo",
        limit=2,
        episodes_per_task=3,
        runs_dir=tmp_path,
    )
    rewards = [sorted(episode.reward for episode in group.episodes) for group in result.groups]
    assert rewards == [[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]]  # τ²'s evaluator: gold 1, done 0
    score = result.benchmark
    assert score is not None and score.benchmark == "tau2:telecom_solo@base"
    # per task, C(c, k) / C(3, k): pass^1 2/3 and 1/3; pass^2 1/3 and 0; pass^3 0 and 0
    assert score.pass_hat_k == {"telecom_solo": pytest.approx({1: 0.5, 2: 1 / 6, 3: 0.0})}
    # over tasks: sd of (2/3, 1/3) and of (1/3, 0) is sqrt(2)/6, over sqrt(2) tasks
    errors = score.pass_hat_k_standard_error["telecom_solo"]
    assert errors == pytest.approx({1: 1 / 6, 2: 1 / 6, 3: 0.0})
    assert score.accuracy == pytest.approx({"telecom_solo": 0.5}) and score.overall == 0.5
    solo = score.per_category["telecom_solo"]
    assert (solo.correct, solo.total) == (3, 6)
    table = format_result(result)
    assert re.search(r"tau2 telecom_solo pass\^1\s+0\.500 ± 0\.167\n", table)
    assert re.search(r"tau2 telecom_solo pass\^2\s+0\.167 ± 0\.167\n", table)
    assert re.search(r"tau2 telecom_solo pass\^3\s+0\.000 ± 0\.000\n", table)
    assert result.output_dir is not None
    summary = json.loads((result.output_dir / "summary.json").read_text())
    assert summary["benchmark"]["pass_hat_k"]["telecom_solo"]["2"] == pytest.approx(1 / 6)


# --- a local model and a hosted one, with a loopback user simulator (airline) -----------------


class OpensThenStops(UserServer):
    """The user simulator's endpoint: its first turn asks for help, its next one stops, so
    τ²'s reward is what its evaluator gives an agent that does nothing (airline's test split:
    task 2 gets 0, task 6 gets 1)."""

    def next_behaviour(self, body: dict[str, Any]) -> str:
        super().next_behaviour(body)  # recorded
        opening = len(body["messages"]) <= 2  # τ²'s user prompt and the agent's greeting
        return "say:Hi, I need help with my trip." if opening else "say:Thanks. ###STOP###"


AIRLINE_TEST = "tau2:airline@test"


def airline_expected() -> list[float]:
    from post_training_cookbook.bundled_envs.tau2 import tau2_tasks

    expected = [expected_without_actions(task) for task in tau2_tasks("airline", "test", limit=2)]
    assert expected == [0.0, 1.0]  # so pass^k is neither 0 nor 1
    return expected


@pytest.fixture(scope="module")
def long_context_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return saying_one_token_model(tmp_path_factory.mktemp("tau2-eval") / "tiny-llama-16k", 16384)


def test_a_local_model_is_scored_on_airline_with_the_user_at_an_endpoint(
    long_context_tiny_model: Path,
) -> None:
    server = OpensThenStops()
    with serving(server) as url:
        user = UserSimulatorSettings("fake-user", base_url=url, api_key_env=None)
        result = evaluate(
            str(long_context_tiny_model),
            benchmark=AIRLINE_TEST,
            limit=2,
            user_simulator=user,
            episodes_per_task=2,
            codec="hermes",
            max_model_length=16384,
            max_tokens_per_turn=8,
            runs_dir=None,
        )
    assert result.engine is not None and result.engine.decode_tokens > 0  # the model replied
    for group, reward in zip(result.groups, airline_expected(), strict=True):
        for episode in group.episodes:
            assert episode.num_turns == 1 and episode.truncation is None, episode.env_error
            reply, stop = episode.messages[-2:]  # the model's reply, the user's stop
            assert reply["content"] == REPLY_TOKEN * 8 and "###STOP###" in stop["content"]
            assert episode.metrics["tau2_end_user_stop"] == 1.0
            assert episode.metrics["tau2_reward"] == reward
    assert len(server.requests) == 8  # per episode: the opening, the stop
    score = result.benchmark
    assert score is not None and score.pass_hat_k == {"airline": {1: 0.5, 2: 0.5}}
    assert score.pass_hat_k_standard_error == {"airline": {1: 0.5, 2: 0.5}}


def test_the_cli_scores_a_hosted_model_with_its_user_simulator(
    capsys: pytest.CaptureFixture[str],
) -> None:
    policy, user = UserServer(default="say:Thank you, goodbye!"), OpensThenStops()
    with serving(policy) as policy_url, serving(user) as user_url:
        status = main(
            ["eval", "hosted:fake-agent", "--base-url", policy_url, "--no-api-key",
             "--benchmark", AIRLINE_TEST, "--limit", "2", "--episodes-per-task", "2",
             "--user-model", "fake-user", "--user-base-url", user_url, "--user-no-api-key",
             "--no-save"]
        )  # fmt: skip
    captured = capsys.readouterr()
    assert status == 0, captured.err
    airline_expected()
    assert re.search(r"tau2 airline pass\^1\s+0\.500 ± 0\.500\n", captured.out)
    assert re.search(r"tau2 airline pass\^2\s+0\.500 ± 0\.500\n", captured.out)
    assert len(policy.requests) == 4  # one reply an episode
    tools = {tool["function"]["name"] for tool in policy.requests[0]["tools"]}
    assert "book_reservation" in tools  # τ²'s airline agent tools
    assert [body["model"] for body in user.requests] == ["fake-user"] * 8
