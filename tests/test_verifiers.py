"""verifiers' own environments, trained and evaluated through the policy server by
``VerifiersEnvs``: ``reverse_text`` (single-turn, an LCS rubric) and ``glossary`` (multi-turn,
one MCP tool), vendored in tests/verifiers_envs (see its NOTICE). Each trains 2 GRPO steps on
the bundled model, its training tokens exactly what the server sampled, and is evaluated, each
episode's reward being what the task's own rubric gives the same transcript when re-scored.
``fact_lookup`` (the cookbook's own: the tool-use game in verifiers, a shared MCP toolset) is
played by the bundled model with the reward variance GRPO learns from.

The episodes run in verifiers' venv (``scripts/verifiers_venv.sh``; ``scripts/test.sh
--heavy`` builds it); without one these tests skip. A verifiers rollout starts a python
program per episode (and glossary an MCP server per episode): tens of seconds on 2 cores.
"""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

import pytest
from test_agents import ServiceSamples, assert_trained_as_sampled
from test_grpo_common import RecordedSamples, step_metrics

from post_training_cookbook.agents import VerifiersEnvs, VerifiersUnavailable
from post_training_cookbook.agents.verifiers_envs import verifiers_python
from post_training_cookbook.engine.local import LocalEngine
from post_training_cookbook.engine.types import PolicySegment, SampledSequence
from post_training_cookbook.evaluation import evaluate
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.models import BUNDLED_MODEL_ID
from post_training_cookbook.models.catalog import resolve_model
from post_training_cookbook.models.loading import load_codec
from post_training_cookbook.rollout import TruncationCause
from post_training_cookbook.service import LocalModelService

pytestmark = pytest.mark.heavy

ENVS = Path(__file__).parent / "verifiers_envs"
FAILED_PARSE_REWARD = -0.5
"""Training: the bundled model rarely writes the tags the rubrics read (reward 0), so its
groups have variance from the replies that do not parse."""


@pytest.fixture(scope="module")
def worker_env(tmp_path_factory):
    """The worker's caches in a folder of the test's, and no hub lookups."""
    home = tmp_path_factory.mktemp("verifiers-home")
    return {
        "HOME": str(home), "XDG_CACHE_HOME": str(home / "cache"), "HF_HUB_OFFLINE": "1",
        "DO_NOT_TRACK": "1", "PYTHONDONTWRITEBYTECODE": "1",
    }  # fmt: skip


def verifiers_envs(name, worker_env):
    try:
        python = verifiers_python()
    except VerifiersUnavailable as missing:
        pytest.skip(str(missing))
    return VerifiersEnvs(
        name, python=python, paths=[ENVS / name], max_turns=4, worker_env=worker_env
    )


def train_config(tmp_path, name, episodes_per_task=2, max_tokens_per_turn=48):
    return GRPOConfig(
        model=BUNDLED_MODEL_ID, runs_dir=str(tmp_path), run_name=name, wandb_project=None,
        batch_size=2, episodes_per_task=episodes_per_task, num_steps=2, max_turns=4,
        max_model_length=1024, max_tokens_per_turn=max_tokens_per_turn, learning_rate=1e-4,
        validation_interval=0, checkpoint_interval=0, failed_parse_reward=FAILED_PARSE_REWARD,
    )  # fmt: skip


def assert_rewards_are_the_rubrics(env_factory, episodes, failed_parse_reward):
    """Each episode's reward is what verifiers' rubric gave the rollout, and what it gives
    the transcript the policy server recorded (re-scored offline by the worker)."""
    for episode in episodes:
        assert episode.env_error is None, episode.env_error
        scored = env_factory.score(episode.task, episode.messages)
        rollout = {k.removeprefix("verifiers_"): v for k, v in episode.metrics.items()
                   if k.startswith("verifiers_")}  # fmt: skip
        assert rollout == scored.rewards  # the rollout's rubric parts, re-scored the same
        if episode.truncation is TruncationCause.PARSE_FAILURE:
            assert episode.reward == failed_parse_reward  # the run's rule, as AgentEnvs'
        else:
            assert episode.truncation is None
            assert episode.reward == scored.reward


# ---------------------------------------------------------------- single-turn: reverse_text


def test_reverse_text_trains_two_grpo_steps_and_evaluates_with_its_rubrics_reward(
    tmp_path, monkeypatch, worker_env
):
    samples = ServiceSamples(monkeypatch)
    batches = RecordedSamples(monkeypatch)
    with verifiers_envs("reverse_text", worker_env) as env_factory:
        tasks = env_factory.tasks()
        assert [t.prompt for t in tasks][:2] == ["hello world", "policy server"]
        assert tasks[0].target == "dlrow olleh"
        # 4 episodes a task: a group whose replies all parse, or all fail to, trains nothing
        config = train_config(tmp_path, "reverse_text", episodes_per_task=4)
        run = train_multi_turn(config, tasks[:2], env_factory)
        metrics = step_metrics(run.path)
        assert sorted(metrics) == [0, 1]
        assert_trained_as_sampled(batches.batches, samples)  # it trained, token-exact
        assert metrics[1]["policy/version"] >= 1
        for step in metrics.values():
            assert step["rollout/env/agent_requests"] == 1.0  # single-turn: its stop hook
            assert step["rollout/env/agent_segments"] == 1.0

        result = evaluate(
            run.path, tasks[:2], env_factory, 2, runs_dir=None, max_turns=4,
            max_model_length=1024, max_tokens_per_turn=48,
        )  # fmt: skip
        episodes = [e for g in result.groups for e in g.episodes]
        assert len(episodes) == 4
        assert_rewards_are_the_rubrics(env_factory, episodes, 0.0)
        # the rubric itself, on hand-written transcripts: LCS of the tagged answer
        opening = [{"role": "user", "content": "hello world"}]
        right = {"role": "assistant", "content": "<reversed_text>dlrow olleh</reversed_text>"}
        half = {"role": "assistant", "content": "<reversed_text>dlrow</reversed_text>"}
        assert env_factory.score(tasks[0], [*opening, right]).reward == 1.0
        assert 0.0 < env_factory.score(tasks[0], [*opening, half]).reward < 1.0


# ---------------------------------------------------------------- multi-turn: glossary


class GlossaryScript:
    """A scripted policy for glossary: look the task's entity up with ``facts_lookup`` (every
    other episode of a task under a name the tool does not know, so every group of two has
    one reward of each), then answer with what the tool said."""

    def __init__(self):
        self.codec = load_codec(resolve_model(BUNDLED_MODEL_ID))
        self.lookups: collections.Counter[str] = collections.Counter()

    def reply(self, prompt_tokens, params, version):
        prompt = self.codec.tokenizer.decode(prompt_tokens, skip_special_tokens=False)
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", prompt, re.S)
        if results:
            text = f"<answer>{results[-1]}</answer>"
        else:
            entity = re.findall(r'look up "([^"]+)"', prompt)[-1]
            self.lookups[entity] += 1
            name = entity if self.lookups[entity] % 2 else "Nobody In Particular"
            call = {"name": "facts_lookup", "arguments": {"name": name}}
            text = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        tokens = [*self.codec.tokenizer.encode(text, add_special_tokens=False)]
        tokens = [*tokens[: params.max_tokens - 1], self.codec.stop_token_ids[0]]
        logprobs = [-0.5] * len(tokens)
        return SampledSequence(tokens, logprobs, "stop", [PolicySegment(0, version)])

    def install(self, monkeypatch, owner):
        script = self

        async def sample(sampler, prompt_tokens, n, params):
            version = (
                sampler.policy_state().applied_weights_version
                if isinstance(sampler, LocalModelService)
                else 0
            )
            return [script.reply(prompt_tokens, params, version) for _ in range(n)]

        monkeypatch.setattr(owner, "sample", sample)


def test_glossary_trains_two_grpo_steps_and_evaluates_with_its_rubrics_reward(
    tmp_path, monkeypatch, worker_env
):
    script = GlossaryScript()
    script.install(monkeypatch, LocalModelService)
    samples = ServiceSamples(monkeypatch)  # records what the scripted sampler returned
    batches = RecordedSamples(monkeypatch)
    with verifiers_envs("glossary", worker_env) as env_factory:
        tasks = env_factory.tasks()[:2]
        assert tasks[0].target == "the first computer programmer"
        # the longest fact is 60-odd tokens of the bundled model's tokenizer
        config = train_config(tmp_path, "glossary", max_tokens_per_turn=128)
        run = train_multi_turn(config, tasks, env_factory)
        metrics = step_metrics(run.path)
        assert sorted(metrics) == [0, 1]
        for step in metrics.values():
            assert step["rollout/env/agent_requests"] == 2.0  # tool call, then the answer
            assert step["rollout/env/agent_segments"] == 1.0  # the answer extended the call
            assert step["rollout/env/agent_history_breaks"] == 0.0
            assert step["rollout/reward_mean"] == 0.5  # one of each group looked up the right name
        assert_trained_as_sampled(batches.batches, samples)
        assert metrics[1]["policy/version"] >= 1

        script.install(monkeypatch, LocalEngine)
        result = evaluate(
            run.path, tasks, env_factory, 2, runs_dir=None, max_turns=4,
            max_model_length=1024, max_tokens_per_turn=128,
        )  # fmt: skip
        episodes = [e for g in result.groups for e in g.episodes]
        assert_rewards_are_the_rubrics(env_factory, episodes, 0.0)
        assert sorted(e.reward for e in episodes) == [0.0, 0.0, 1.0, 1.0], [
            e.messages for e in episodes
        ]
        for episode in episodes:
            roles = [m["role"] for m in episode.messages]
            assert roles == ["user", "assistant", "tool", "assistant"], roles
            fact = episode.messages[2]["content"]
            assert fact in (episode.task.target, "no entry found")  # the MCP tool's answer
            assert episode.reward == float(fact == episode.task.target)


# ---------------------------------------------------------------- fact_lookup: what GRPO needs


@pytest.mark.timeout(1200)  # 16 rollouts, each a python program; 600 s ran out at load 7-11
def test_the_bundled_model_plays_fact_lookup_with_reward_variance_for_grpo(worker_env):
    """fact_lookup (the tool-use game's questions in verifiers, served by a shared MCP
    toolset) is a format the bundled model knows: sampled at T = 1 it calls ``lookup`` and is
    right about half the time, so GRPO's groups have reward variance to learn from, where
    glossary gives none (docs/verifiers.md). The run that shows the reward rising is
    recipes/verifiers/fact_lookup.py (45 minutes on 2 loaded cores)."""
    try:
        python = verifiers_python()
    except VerifiersUnavailable as missing:
        pytest.skip(str(missing))
    config = {"id": "fact_lookup", "split": "val", "levels": [1], "limit": 4}
    with VerifiersEnvs(
        config, python=python, paths=[ENVS / "fact_lookup"], max_turns=6,
        worker_env=worker_env, max_concurrent_agents=4,
    ) as env_factory:  # fmt: skip
        tasks = env_factory.tasks()
        assert tasks[0].prompt == "What is the weight of kavis?" and tasks[0].target == "25"
        opening = [{"role": "user", "content": tasks[0].prompt}]
        for reply, reward in (("25", 1.0), (" 25.00\n", 1.0), ("24", 0.0), ("It is 25.", 0.0)):
            answer = {"role": "assistant", "content": reply}
            assert env_factory.score(tasks[0], [*opening, answer]).reward == reward, reply

        result = evaluate(
            BUNDLED_MODEL_ID, tasks, env_factory, 4, runs_dir=None, max_turns=6,
            max_model_length=2048, max_tokens_per_turn=64,
        )  # fmt: skip
        episodes = [e for g in result.groups for e in g.episodes]
        assert_rewards_are_the_rubrics(env_factory, episodes, 0.0)
        calls = collections.Counter(
            call["function"]["name"]
            for episode in episodes
            for message in episode.messages
            for call in message.get("tool_calls") or []
        )
        assert calls["lookup"] >= len(episodes) // 2, calls  # it looks facts up, by the game's name
        assert set(calls) <= {"list_fact_keys", "lookup", "calculator"}
        assert 0.0 < result.reward_mean < 1.0  # right and wrong answers: variance for GRPO
