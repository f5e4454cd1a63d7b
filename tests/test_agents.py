"""Training an agent written against the ``openai`` client, through the policy server: GRPO steps
lockstep and async on the bundled model, training tokens that are exactly what the server
sampled, a history-rewriting agent's episode split into segments, and the adapter's rules for
agents that fail, loop or run late."""

from __future__ import annotations

import importlib.util
import itertools
import threading
from pathlib import Path

import openai
import pytest
from test_grpo_common import RecordedSamples, step_metrics, train_dump
from test_serve_common import SplitSampler

from post_training_cookbook.agents import AgentEnvs
from post_training_cookbook.envs.tool_use_game import (
    SYSTEM_PROMPT,
    TOOL_USE_GAME_TRAIN_TASKS,
    TOOL_USE_GAME_VAL_TASKS,
)
from post_training_cookbook.evaluation import evaluate
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.models import BUNDLED_MODEL_ID
from post_training_cookbook.models.catalog import resolve_model
from post_training_cookbook.models.loading import load_codec
from post_training_cookbook.rollout import EnvStepError, TruncationCause
from post_training_cookbook.service import LocalModelService

RECIPES = Path(__file__).parent.parent / "recipes" / "agents"


def load_recipe(name):
    spec = importlib.util.spec_from_file_location(name, RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FACT_AGENT = load_recipe("fact_agent")


def tasks_with_facts(tasks):
    import sys

    sys.path.insert(0, str(RECIPES))  # the training script imports fact_agent as a module
    try:
        return load_recipe("train_fact_agent").tasks_with_facts(tasks)
    finally:
        sys.path.remove(str(RECIPES))


def agent_config(tmp_path, **overrides):
    settings = {
        "model": BUNDLED_MODEL_ID, "runs_dir": str(tmp_path), "run_name": "agent",
        "wandb_project": None, "batch_size": 2, "episodes_per_task": 4, "num_steps": 3,
        "max_turns": 6, "max_model_length": 768, "max_tokens_per_turn": 64,
        "learning_rate": 1e-4, "validation_interval": 0, "checkpoint_interval": 0,
    }  # fmt: skip
    return GRPOConfig(**{**settings, **overrides})


class ServiceSamples:
    """Wraps ``LocalModelService.sample`` (the real one, or ``split``'s re-split of it) and
    keeps every prompt and what it returned: what the policy server got from the sampler."""

    def __init__(self, monkeypatch, split=False):
        self.by_prompt: dict[tuple[int, ...], list] = {}
        original = LocalModelService.sample
        recorded = self
        tokenizer = load_codec(resolve_model(BUNDLED_MODEL_ID)).tokenizer

        async def sample(service, prompt_tokens, n, params):
            sequences = await original(service, prompt_tokens, n, params)
            if split:
                sequences = [SplitSampler(None, tokenizer).split(s) for s in sequences]
            recorded.by_prompt.setdefault(tuple(prompt_tokens), []).extend(sequences)
            return sequences

        monkeypatch.setattr(LocalModelService, "sample", sample)


def sampled_runs(sample):
    """(start, end) of each run of trained positions."""
    runs, start = [], None
    for index, bit in enumerate([*sample.mask, 0.0]):
        if bit and start is None:
            start = index
        elif not bit and start is not None:
            runs.append((start, index))
            start = None
    return runs


def assert_trained_as_sampled(batches, samples):
    """Every trained run is one sequence the sampler returned for exactly the tokens before
    it, with its logprobs: no turn was re-rendered or re-tokenized on the way."""
    runs = 0
    for sample in (sample for batch in batches for sample in batch):
        for start, end in sampled_runs(sample):
            returned = samples.by_prompt.get(tuple(sample.tokens[:start]))
            assert returned is not None, "a trained turn follows a prompt the sampler never got"
            (match,) = [s for s in returned if s.tokens == sample.tokens[start:end]][:1]
            assert sample.sampler_logprobs[start:end] == match.logprobs
            runs += 1
    assert runs > 0
    return runs


@pytest.mark.parametrize("loop", ["lockstep", "async"])
def test_an_openai_client_agent_trains_three_grpo_steps(tmp_path, monkeypatch, loop):
    samples = ServiceSamples(monkeypatch)
    batches = RecordedSamples(monkeypatch)
    extra = {"max_steps_off_policy": 1, "groups_in_flight": 2} if loop == "async" else {}
    config = agent_config(tmp_path, **extra)
    tasks = tasks_with_facts(TOOL_USE_GAME_TRAIN_TASKS[:12])
    with AgentEnvs(FACT_AGENT.fact_agent) as env_factory:
        run = train_multi_turn(config, tasks, env_factory)
    metrics = step_metrics(run.path)
    assert sorted(metrics) == [0, 1, 2]
    assert sum(m["train/samples"] for m in metrics.values()) > 0
    assert metrics[2]["policy/version"] >= 1  # it trained
    for step in metrics.values():
        assert step["rollout/env/agent_segments"] == 1.0  # the agent never rewrites history
        assert step["rollout/env/agent_history_breaks"] == 0.0
        assert step["rollout/env/agent_requests"] >= 1.0
    assert_trained_as_sampled(batches.batches, samples)
    if loop == "async":
        assert any(m["async/policy_age_max"] >= 1 for m in metrics.values())
    for record in train_dump(run.path, 2):  # the dump's versions are the sampler's
        sampled = [v for v, bit in zip(record["versions"], record["mask"], strict=True) if bit]
        assert sampled and min(sampled) >= 0


COUNTER = itertools.count()
COUNTER_LOCK = threading.Lock()
TOOLS = FACT_AGENT.TOOLS


def rewriting_agent(base_url, api_key, task):
    """Two calls on one history, then a third on a history it summarised: the server cannot
    extend that one, so the episode splits there."""
    with COUNTER_LOCK:
        reward = float(next(COUNTER) % 2)  # half the episodes of each group: rewards vary
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    history = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task.prompt},
    ]
    notes = []
    for _ in range(2):
        reply = client.chat.completions.create(
            model="policy", messages=history, tools=TOOLS, max_tokens=24
        )
        message = reply.choices[0].message
        history.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            history.append({"role": "tool", "tool_call_id": call.id, "content": "17"})
            notes.append(f"{call.function.name} gave 17")
        if not message.tool_calls:
            history.append({"role": "user", "content": "Check that with the tools."})
            notes.append(f"guessed {message.content}")
    summary = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"{task.prompt} Notes so far: {'; '.join(notes)}."},
    ]
    client.chat.completions.create(model="policy", messages=summary, tools=TOOLS, max_tokens=24)
    return reward


def test_a_history_rewriting_agent_trains_on_split_segments(tmp_path, monkeypatch):
    samples = ServiceSamples(monkeypatch, split=True)  # tokens no re-tokenization gives back
    batches = RecordedSamples(monkeypatch)
    config = agent_config(tmp_path, num_steps=1, batch_size=1, episodes_per_task=4)
    tasks = list(TOOL_USE_GAME_VAL_TASKS[:4])
    with AgentEnvs(rewriting_agent) as env_factory:
        run = train_multi_turn(config, tasks, env_factory)
    codec = load_codec(resolve_model(BUNDLED_MODEL_ID))
    records = train_dump(run.path, 0)
    finished = [r for r in records if r["truncation"] is None]
    assert finished, "every episode was cut short: nothing to check"
    (batch,) = batches.batches
    trained = {tuple(sample.tokens): sample for sample in batch}
    retokenized_differs = False
    for record in finished:
        assert record["metrics"]["agent_segments"] == 2.0
        assert record["metrics"]["agent_history_breaks"] == 1.0
        tokens, mask = record["token_ids"], record["mask"]
        first, second = record["segment_starts"]
        pieces = [(first, second), (second, len(tokens))]
        advantages = set()
        for start, end in pieces:
            sample = trained[tuple(tokens[start:end])]  # each segment is its own sample
            assert sample.mask == [float(bit) for bit in mask[start:end]]
            advantages |= {a for a, bit in zip(sample.advantages, sample.mask, strict=True) if bit}
            for run_start, run_end in sampled_runs(sample):
                run_tokens = sample.tokens[run_start:run_end]
                text = codec.tokenizer.decode(run_tokens, skip_special_tokens=False)
                encoded = codec.tokenizer.encode(text, add_special_tokens=False)
                retokenized_differs |= encoded != run_tokens
        assert len(advantages) == 1  # both segments carry the episode's advantage
        summary = record["messages"][:-1]  # the third call's messages
        second_prompt = tokens[second : second + mask[second:].index(1)]
        assert second_prompt == codec.render_prompt(summary, TOOLS)
    assert retokenized_differs  # so the check below could fail
    assert_trained_as_sampled(batches.batches, samples)
    assert len(batch) == 2 * len(finished) + sum(
        len(r["segment_starts"]) for r in records if r["truncation"] is not None
    )


# ---------------------------------------------------------------- the adapter's rules


def evaluate_agent(agent, *, tasks=None, **options):
    with AgentEnvs(agent, **options.pop("adapter", {})) as env_factory:
        return evaluate(
            BUNDLED_MODEL_ID,
            tasks or tasks_with_facts(TOOL_USE_GAME_VAL_TASKS[:2]),
            env_factory,
            2,
            runs_dir=None,
            max_turns=options.pop("max_turns", 6),
            max_tokens_per_turn=64,
            **options,
        )


async def async_fact_agent(base_url, api_key, task):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task.prompt}], max_tokens=8
    )
    await client.close()
    return float(reply.choices[0].finish_reason in ("stop", "length", "tool_calls"))


def test_an_async_agent_and_a_reward_function_score_episodes():
    result = evaluate_agent(async_fact_agent)
    for episode in (e for g in result.groups for e in g.episodes):
        assert episode.num_sampled_tokens > 0
        if episode.truncation is None:
            assert episode.reward == 1.0  # what the agent returned
        else:  # a reply cut at max_tokens=8 may not parse: failed_parse_reward, not the agent's
            assert episode.truncation is TruncationCause.PARSE_FAILURE and episode.reward == 0.0

    def scored(task, messages):
        return 0.25 if messages[-1]["role"] == "assistant" else 0.0

    result = evaluate_agent(FACT_AGENT.fact_agent, adapter={"reward_fn": scored})
    for episode in (e for g in result.groups for e in g.episodes):
        expected = 0.0 if episode.truncation is TruncationCause.PARSE_FAILURE else 0.25
        assert episode.reward == expected


def endless_agent(base_url, api_key, task):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": task.prompt}]
    while True:
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        messages += [reply.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "user", "content": "more"}]


def test_the_call_after_max_turns_is_refused_and_ends_the_episode_as_max_turns():
    result = evaluate_agent(endless_agent, max_turns=2)
    for episode in (e for g in result.groups for e in g.episodes):
        assert episode.truncation in (TruncationCause.MAX_TURNS, TruncationCause.PARSE_FAILURE)
        assert episode.env_error is None and episode.reward == 0.0
        assert episode.num_turns <= 3


def failing_agent(base_url, api_key, task):
    raise RuntimeError("my agent broke")


def wordy_agent(base_url, api_key, task):
    return "great"


def slow_agent(base_url, api_key, task):
    threading.Event().wait(3)
    return 1.0


@pytest.mark.parametrize(
    ("agent", "says", "adapter"),
    [
        (failing_agent, "my agent broke", {}),
        (wordy_agent, "returned 'great'", {}),
        (slow_agent, "timeout_s=0.2", {"timeout_s": 0.2}),
    ],
)
def test_an_agent_that_fails_is_an_env_error_under_the_runs_policy(agent, says, adapter):
    result = evaluate_agent(agent, env_errors="truncate", adapter=adapter)
    episodes = [e for g in result.groups for e in g.episodes]
    assert all(e.truncation is TruncationCause.ENV and says in e.env_error for e in episodes)
    with pytest.raises(EnvStepError, match=says):
        evaluate_agent(agent, env_errors="raise", adapter=adapter)
