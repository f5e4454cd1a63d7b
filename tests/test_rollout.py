"""The rollout core: token-in-token-out episodes and every way an episode ends."""

import asyncio

import pytest
from test_codecs_common import make_tokenizer

from post_training_cookbook.codecs import HERMES_CHAT_TEMPLATE, get_codec
from post_training_cookbook.engine.types import PolicySegment, SampledSequence, SamplingParams
from post_training_cookbook.envs import StepResult, Task
from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TASKS, ToolUseGameEnv
from post_training_cookbook.envs.tool_use_game.scripted_player import tool_call
from post_training_cookbook.rollout import (
    EnvStepError,
    EpisodeLimits,
    EpisodeRunner,
    Group,
    TruncationCause,
    run_episode,
)
from post_training_cookbook.rollout.metrics import episode_metrics
from post_training_cookbook.types import Message

CODEC = get_codec("hermes", make_tokenizer(HERMES_CHAT_TEMPLATE), default_system=None)
PARAMS = SamplingParams(max_tokens=64)


def sampled_tokens(message: Message) -> list[int]:
    """The tokens a model samples to say ``message`` (its assistant span in a render)."""
    ids, mask = CODEC.render_conversation([Message(role="user", content="q"), message])
    return [token for token, bit in zip(ids, mask, strict=True) if bit]


class ScriptedSampler:
    """Returns scripted token sequences in order and records the prompts it was given."""

    def __init__(self, replies: list[list[int]], version: int = 3) -> None:
        self.replies = list(replies)
        self.prompts: list[list[int]] = []
        self.version = version

    async def sample(self, prompt_tokens, n, params):
        assert n == 1
        self.prompts.append(list(prompt_tokens))
        tokens = self.replies.pop(0)
        stop = "stop"
        if len(tokens) > params.max_tokens:
            tokens, stop = tokens[: params.max_tokens], "length"
        logprobs = [-0.25] * len(tokens)
        return [SampledSequence(tokens, logprobs, stop, [PolicySegment(0, self.version)])]


class CountingEnv(ToolUseGameEnv):
    closes = 0

    async def close(self) -> None:
        CountingEnv.closes += 1


def limits(**overrides) -> EpisodeLimits:
    values = {"max_turns": 6, "max_model_length": 2048, "max_tokens_per_turn": 64}
    return EpisodeLimits(**{**values, **overrides})


def play(replies, env_class=CountingEnv, task=None, **limit_overrides):
    task = task or next(t for t in TOOL_USE_GAME_TASKS if t.metadata["level"] == 1)
    sampler = ScriptedSampler(replies)
    episode = asyncio.run(
        run_episode(
            task,
            EpisodeRunner(lambda _: env_class(), sampler, CODEC, limits(**limit_overrides)),
            PARAMS,
        )
    )
    return episode, sampler


def lookup_then_answer(task: Task, answer: str) -> list[list[int]]:
    call = tool_call("lookup", key=task.metadata["keys"][0])
    return [
        sampled_tokens(Message(role="assistant", content="", tool_calls=[call])),
        sampled_tokens(Message(role="assistant", content=answer)),
    ]


def test_a_solved_episode_terminates_with_the_envs_reward_and_final_metrics():
    task = next(t for t in TOOL_USE_GAME_TASKS if t.metadata["level"] == 1)
    episode, _ = play(lookup_then_answer(task, task.target), task=task)
    assert episode.terminated and episode.truncation is None
    assert episode.reward == 1.0 and episode.metrics["correct"] == 1.0
    assert episode.num_turns == 2 and episode.messages[-1]["content"] == task.target


def test_each_turns_prompt_extends_the_previous_prompt_plus_the_sampled_tokens():
    task = next(t for t in TOOL_USE_GAME_TASKS if t.metadata["level"] == 1)
    replies = lookup_then_answer(task, task.target)
    episode, sampler = play([list(r) for r in replies], task=task)
    first, second = sampler.prompts
    assert second[: len(first) + len(replies[0])] == first + replies[0]
    assert episode.tokens[: len(second)] == second
    assert episode.tokens[len(second) :] == replies[1]


def test_the_mask_logprobs_and_versions_mark_exactly_the_sampled_tokens():
    task = next(t for t in TOOL_USE_GAME_TASKS if t.metadata["level"] == 1)
    replies = lookup_then_answer(task, task.target)
    episode, _ = play(replies, task=task)
    trained = [t for t, m in zip(episode.tokens, episode.mask, strict=True) if m]
    assert trained == replies[0] + replies[1]
    assert all(
        (lp == -0.25) == bool(m)
        for lp, m in zip(episode.sampler_logprobs, episode.mask, strict=True)
    )
    assert {v for v, m in zip(episode.versions, episode.mask, strict=True) if m} == {3}
    assert episode.start_version == 3
    # the whole episode is what the template renders for the final conversation
    ids, _ = CODEC.render_conversation(episode.messages, ToolUseGameEnv().tool_specs)
    assert ids[: len(episode.tokens)] == episode.tokens
    assert CODEC.tokenizer.decode(ids[len(episode.tokens) :]) == "\n"  # after the last <|im_end|>


def test_an_unparseable_message_ends_the_episode_as_parse_failure_with_its_reward():
    broken = CODEC.tokenizer.encode(
        '<tool_call>\n{"name": "lookup", "argu', add_special_tokens=False
    )
    CountingEnv.closes = 0
    episode, _ = play([broken + list(CODEC.stop_token_ids[:1])], failed_parse_reward=-0.5)
    assert episode.truncation is TruncationCause.PARSE_FAILURE
    assert episode.reward == -0.5 and CountingEnv.closes == 1


class TextReadingEnv(CountingEnv):
    unparsed_replies = "as_text"


def test_an_env_that_reads_unparsed_replies_as_text_gets_one_and_goes_on():
    broken = CODEC.tokenizer.encode(
        '<tool_call>\n{"name": "lookup", "argu', add_special_tokens=False
    )
    replies = [broken + list(CODEC.stop_token_ids[:1])]
    episode, _ = play(replies, env_class=TextReadingEnv, failed_parse_reward=-0.5)
    assert episode.truncation is None  # the game reads a text reply as its answer
    assert episode.unparsed_turns == 1 and episode.reward == 0.0
    reply = episode.messages[-1]
    assert reply["role"] == "assistant" and not reply.get("tool_calls")
    assert reply["content"].startswith('<tool_call>\n{"name": "lookup"')
    metrics = episode_metrics([Group(episode.task, [episode])])
    assert metrics["rollout/parse_rate"] == 0.0  # still counted as a reply that did not parse


def test_an_episode_that_never_answers_is_cut_at_max_turns():
    call = tool_call("list_fact_keys", prefix="ka")
    reply = sampled_tokens(Message(role="assistant", content="", tool_calls=[call]))
    CountingEnv.closes = 0
    episode, sampler = play([reply] * 3, max_turns=3)
    assert episode.truncation is TruncationCause.MAX_TURNS
    assert episode.num_turns == 3 and len(sampler.prompts) == 3 and CountingEnv.closes == 1


def test_a_turn_cut_by_the_context_budget_is_a_context_overflow():
    call = tool_call("list_fact_keys", prefix="ka")
    reply = sampled_tokens(Message(role="assistant", content="", tool_calls=[call]))
    prompt_length = len(play([reply, reply], max_turns=1)[1].prompts[0])
    episode, _ = play([reply], max_model_length=prompt_length + 3)
    assert episode.truncation is TruncationCause.CONTEXT_OVERFLOW
    assert len(episode.tokens) == prompt_length + 3


def test_tool_results_that_would_not_fit_are_a_context_overflow():
    call = tool_call("list_fact_keys", prefix="ka")
    reply = sampled_tokens(Message(role="assistant", content="", tool_calls=[call]))
    prompt_length = len(play([reply, reply], max_turns=1)[1].prompts[0])
    episode, _ = play([reply], max_model_length=prompt_length + len(reply) + 5)
    assert episode.truncation is TruncationCause.CONTEXT_OVERFLOW
    assert episode.num_turns == 1


class TruncatingEnv(CountingEnv):
    async def step(self, message: Message) -> StepResult:
        result = await super().step(message)
        return StepResult(False, True, result.messages, reward=0.25, metrics={"why": 1.0})


def test_an_env_truncation_is_cause_env_with_the_envs_reward():
    call = tool_call("list_fact_keys", prefix="ka")
    reply = sampled_tokens(Message(role="assistant", content="", tool_calls=[call]))
    episode, _ = play([reply], env_class=TruncatingEnv)
    assert episode.truncation is TruncationCause.ENV
    assert episode.reward == 0.25 and episode.metrics == {"why": 1.0}


class RaisingEnv(CountingEnv):
    async def step(self, message: Message) -> StepResult:
        raise KeyError("boom")


class HangingEnv(CountingEnv):
    async def step(self, message: Message) -> StepResult:
        await asyncio.sleep(60)
        raise AssertionError("unreachable")


@pytest.mark.parametrize("env_class", [RaisingEnv, HangingEnv])
def test_an_env_error_stops_the_run_naming_the_task_and_turn_and_still_closes(env_class):
    CountingEnv.closes = 0
    task = TOOL_USE_GAME_TASKS[0]
    with pytest.raises(EnvStepError, match="turn 1") as error:
        play(
            [sampled_tokens(Message(role="assistant", content="1"))],
            env_class=env_class,
            task=task,
            env_step_timeout_s=0.2,
        )
    assert task.prompt in str(error.value)
    assert CountingEnv.closes == 1


@pytest.mark.parametrize("env_class", [RaisingEnv, HangingEnv])
def test_under_the_truncate_policy_an_env_error_ends_the_episode_as_env(env_class):
    CountingEnv.closes = 0
    episode, _ = play(
        [sampled_tokens(Message(role="assistant", content="1"))],
        env_class=env_class,
        env_errors="truncate",
        env_step_timeout_s=0.2,
    )
    assert episode.truncation is TruncationCause.ENV and episode.reward == 0.0
    assert episode.env_error is not None and CountingEnv.closes == 1


def test_a_cancelled_episode_still_closes_its_env():
    class SlowSampler(ScriptedSampler):
        async def sample(self, prompt_tokens, n, params):
            await asyncio.sleep(60)

    async def cancel_midway():
        CountingEnv.closes = 0
        task = asyncio.ensure_future(
            run_episode(
                TOOL_USE_GAME_TASKS[0],
                EpisodeRunner(lambda _: CountingEnv(), SlowSampler([]), CODEC, limits()),
                PARAMS,
            )
        )
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    assert CountingEnv.closes == 1


def test_a_turn_cut_at_max_tokens_per_turn_is_parsed_as_it_is():
    answer = sampled_tokens(Message(role="assistant", content="123456789"))
    episode, _ = play([answer], max_tokens_per_turn=3)
    assert episode.length_capped_turns == 1
    assert episode.terminated and episode.reward == 0.0
