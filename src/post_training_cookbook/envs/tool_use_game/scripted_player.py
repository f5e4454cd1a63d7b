"""Scripted players of the tool-use game: an oracle that always solves a task through the
tools, and an imperfect player whose trajectories the bundled model was fine-tuned on.
("Teacher" is on-policy distillation's word, ``distill/``: these only play.)

Both read the question, call the tools, and use only the values the tools return. The
imperfect player makes deliberate, decision-level mistakes (a wrong attribute, arithmetic done "in
its head" instead of with the calculator, a guess without looking anything up), so a model
that imitates it succeeds on a fraction of episodes and RL has a clear signal: the fix is
always to take the right decision, never to learn a new skill.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Generator
from dataclasses import dataclass
from itertools import count

from post_training_cookbook.envs.base import Env, StepResult, Task
from post_training_cookbook.envs.tool_use_game.world import ATTRIBUTES, OPERATIONS
from post_training_cookbook.types import Message, ToolCall

_QUESTION = re.compile(
    r"What is the (?P<attr>\w+) of (?P<entity>\w+)"
    r"(?: (?P<opword>plus|minus|times)"
    r" (?:(?P<constant>\d+)|the (?P<attr2>\w+) of (?P<entity2>\w+)))?\?$"
)


@dataclass(frozen=True)
class Question:
    keys: tuple[str, ...]
    operation: str | None
    constant: int | None


@dataclass(frozen=True)
class PlayerMistakes:
    """Probabilities of the player's deliberate mistakes (all 0 = the oracle)."""

    wrong_attribute: float = 0.0
    """Per lookup: look up another attribute of the right entity."""
    skip_calculator: float = 0.0
    """Levels 2-3: answer without the calculator..."""
    mental_arithmetic_wrong: float = 0.85
    """...and then get the arithmetic wrong with this probability."""
    guess_without_lookup: float = 0.0
    """Level 1: answer with a guess, no tool call at all."""
    list_keys_first: float = 0.0
    """Call list_fact_keys on the entity before looking it up (harmless, adds variety)."""
    parallel_lookups: float = 0.0
    """Level 3: both lookups in one message instead of two turns (harmless)."""


ORACLE = PlayerMistakes(mental_arithmetic_wrong=0.0)
BUNDLED_MODEL_PLAYER = PlayerMistakes(
    wrong_attribute=0.2,
    skip_calculator=0.45,
    guess_without_lookup=0.25,
    list_keys_first=0.15,
    parallel_lookups=0.3,
)


def parse_question(prompt: str) -> Question:
    match = _QUESTION.match(prompt.strip())
    if match is None:
        raise ValueError(f"not a tool-use game question: {prompt!r}")
    keys = [f"{match['entity']}.{match['attr']}"]
    if match["entity2"]:
        keys.append(f"{match['entity2']}.{match['attr2']}")
    operation = OPERATIONS[match["opword"]] if match["opword"] else None
    constant = int(match["constant"]) if match["constant"] else None
    return Question(keys=tuple(keys), operation=operation, constant=constant)


_call_ids = count()


def tool_call(name: str, **arguments: str) -> ToolCall:
    return {
        "id": f"call_{next(_call_ids)}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def _assistant(*calls: ToolCall, content: str = "") -> Message:
    message = Message(role="assistant", content=content)
    if calls:
        message["tool_calls"] = list(calls)
    return message


Script = Generator[Message, list[Message], None]


def play(question: Question, rng: random.Random, errors: PlayerMistakes) -> Script:
    """Yield the player's messages; receive the tool messages each one produced."""
    if question.operation is None and rng.random() < errors.guess_without_lookup:
        yield _assistant(content=str(rng.randint(2, 99)))
        return
    keys = [_maybe_wrong(key, rng, errors.wrong_attribute) for key in question.keys]
    if rng.random() < errors.list_keys_first:
        yield _assistant(tool_call("list_fact_keys", prefix=keys[0].split(".")[0]))
    if len(keys) > 1 and rng.random() < errors.parallel_lookups:
        results = yield _assistant(*(tool_call("lookup", key=key) for key in keys))
    else:
        results = []
        for key in keys:
            results += yield _assistant(tool_call("lookup", key=key))
    values = [int(result["content"]) for result in results]
    if question.operation is None:
        yield _assistant(content=str(values[0]))
        return
    right = values[1] if len(values) > 1 else question.constant
    expression = f"{values[0]} {question.operation} {right}"
    if rng.random() < errors.skip_calculator:
        answer = eval_simple(expression)  # the player's "mental" arithmetic
        if rng.random() < errors.mental_arithmetic_wrong:
            answer += rng.choice([-1, 1]) * rng.randint(1, 12)
        yield _assistant(content=str(answer))
        return
    (result,) = yield _assistant(tool_call("calculator", expression=expression))
    yield _assistant(content=result["content"])


def eval_simple(expression: str) -> int:
    left, op, right = expression.split()
    return {"+": int(left) + int(right), "-": int(left) - int(right)}.get(
        op, int(left) * int(right)
    )


def _maybe_wrong(key: str, rng: random.Random, probability: float) -> str:
    if rng.random() >= probability:
        return key
    entity, attribute = key.split(".")
    return f"{entity}.{rng.choice([a for a in ATTRIBUTES if a != attribute])}"


async def play_episode(
    env: Env, task: Task, rng: random.Random, errors: PlayerMistakes = ORACLE
) -> tuple[list[Message], StepResult]:
    """Run one scripted episode on ``env``; return the final conversation and last step."""
    await env.reset(task)
    script = play(parse_question(task.prompt), rng, errors)
    message = next(script)
    try:
        while True:
            seen = len(env.messages) + 1
            result = await env.step(message)
            if result.terminated or result.truncated:
                return result.messages, result
            message = script.send(result.messages[seen:])
    except StopIteration:
        raise RuntimeError(f"the script ended before the episode did: {task.prompt!r}") from None
    finally:
        await env.close()
