"""An endpoint teacher's answer, read as hostile input: log-probabilities that are not finite
or out of range, and answers of the wrong shape, are the teacher's failure under
``env_errors`` (the chunk dropped and counted, or the run stopped naming the teacher), never
trained on and never a raw exception; a fuzz of the parser (5,000 generated answers) raises
nothing else."""

from __future__ import annotations

import asyncio
import json
import random
import time
import tracemalloc
from typing import Any

import pytest
from json_fuzz import SPECIAL_FLOATS, JsonFuzzer
from test_serve_common import Scripted, ScriptedEndpoint

from post_training_cookbook.distill import DistillSettings, EndpointTeacher, distill_batch
from post_training_cookbook.distill.types import TeacherCallError, TeacherError
from post_training_cookbook.trainer.types import TrainingSample

TOKENS = [5, 6, 7, 8]
SAMPLE = TrainingSample(TOKENS, [0.0, 0.0, 1.0, 1.0], [0.0] * 4, [0.0] * 4)


class ZeroStudent:
    async def forward(self, samples: list[Any]) -> list[list[float]]:
        return [[0.0] * len(sample.tokens) for sample in samples]


def answer_with(value: str) -> bytes:
    """A ``/v1/completions`` answer scoring each token of ``TOKENS`` ``value`` (JSON text)."""
    entries = ", ".join(f'{{"{token}": {{"logprob": {value}}}}}' for token in TOKENS[1:])
    return f'{{"choices": [{{"index": 0, "prompt_logprobs": [null, {entries}]}}]}}'.encode()


def distil(raw: bytes, env_errors: str) -> tuple[list[TrainingSample], dict[str, float]]:
    endpoint = ScriptedEndpoint([Scripted(raw=raw)], path="/v1/completions")

    async def run() -> tuple[list[TrainingSample], dict[str, float]]:
        teacher = EndpointTeacher(endpoint.base_url, model="m", retries=0)
        settings = DistillSettings(env_errors=env_errors, sequences_per_call=1)  # type: ignore[arg-type]
        try:
            return await distill_batch([SAMPLE], teacher, ZeroStudent(), settings)  # type: ignore[arg-type]
        finally:
            await teacher.close()

    try:
        return asyncio.run(run())
    finally:
        endpoint.stop()


def assert_dropped_and_counted(raw: bytes, named: str) -> None:
    kept, metrics = distil(raw, "truncate")
    assert kept == [], "a bad teacher answer was trained on"
    assert metrics["distill/teacher_failed_samples"] == 1.0
    assert metrics["distill/teacher_malformed_samples"] == 1.0
    with pytest.raises(TeacherError, match=named):
        distil(raw, "raise")


@pytest.mark.parametrize(
    ("value", "named"),
    [("NaN", "nan"), ("Infinity", "inf"), ("-Infinity", "-inf"), ("7.5", "7.5"),
     ("-1e30", "-1e\\+30")],
)  # fmt: skip
def test_a_teacher_log_probability_not_finite_or_out_of_range_is_never_trained_on(
    value: str, named: str
) -> None:
    assert_dropped_and_counted(answer_with(value), named)


def test_a_teacher_log_probability_in_range_is_trained_on() -> None:
    kept, metrics = distil(answer_with("-1.5"), "raise")
    assert metrics["distill/teacher_malformed_samples"] == 0.0
    assert kept[0].advantages == [0.0, 0.0, -1.5, -1.5]  # −(0 − (−1.5)) on each


def choice(entries: Any, **fields: Any) -> dict[str, Any]:
    return {"index": 0, "prompt_logprobs": entries, **fields}


GOOD_ENTRY = {"6": {"logprob": -1.0}}
MALFORMED_ANSWERS: dict[str, Any] = {
    "logprob missing": {"choices": [choice([None, GOOD_ENTRY, {"7": {}}, GOOD_ENTRY])]},
    "logprob a string": {"choices": [choice([None, GOOD_ENTRY, {"7": {"logprob": "x"}}, {}])]},
    "logprob null": {"choices": [choice([None, GOOD_ENTRY, {"7": {"logprob": None}}, {}])]},
    "logprob a bool": {"choices": [choice([None, GOOD_ENTRY, {"7": {"logprob": True}}, {}])]},
    "entry a list": {"choices": [choice([None, GOOD_ENTRY, [["7", -1.0]], GOOD_ENTRY])]},
    "entry null where scored": {"choices": [choice([None, GOOD_ENTRY, None, GOOD_ENTRY])]},
    "choices not a list": {"choices": {"0": choice([None] * 4)}},
    "a choice a string": {"choices": ["prompt_logprobs"]},
    "mixed index types": {"choices": [choice([None] * 4), choice([None] * 4, index="1")]},
    "index a bool": {"choices": [choice([None] * 4, index=True)]},
}


@pytest.mark.parametrize("case", MALFORMED_ANSWERS)
def test_a_malformed_teacher_answer_follows_env_errors(case: str) -> None:
    assert_dropped_and_counted(json.dumps(MALFORMED_ANSWERS[case]).encode(), "teacher")


# ---------------------------------------------------------------- fuzz of the parser

FUZZ_ANSWERS = 5_000


def valid_answer(samples: list[TrainingSample]) -> dict[str, Any]:
    choices = []
    for index, sample in enumerate(samples):
        entries: list[Any] = [None]
        entries += [{str(token): {"logprob": -0.5, "rank": 1}} for token in sample.tokens[1:]]
        choices.append({"index": index, "text": "", "prompt_logprobs": entries})
    return {"id": "x", "object": "text_completion", "choices": choices}


FUZZ = JsonFuzzer(
    ints=[0, 1, -1, 7, 2**70, -(2**70)],
    floats=[-1.0, 0.5, 1e308, -1e308, 5e-324, -0.0, *SPECIAL_FLOATS],
    strings=["", "6", "logprob", "\ud800", "NaN", "x" * 100],
    keys=["6", "7", "logprob", "index"],
    added_keys=["index", "logprob", "7", "extra"],
    replace_below_top=0.3,
)


def test_a_fuzz_of_the_teacher_answer_parser_raises_only_teacher_errors() -> None:
    from post_training_cookbook.distill.endpoint import prompt_logprobs

    rng = random.Random(41)
    samples = [
        TrainingSample([3, 4, 5, 6], [0.0, 1.0, 1.0, 1.0], [0.0] * 4, [0.0] * 4),
        TrainingSample([3, 9, 9], [0.0, 0.0, 1.0], [0.0] * 3, [0.0] * 3),
    ]
    outcomes = {"parsed": 0, "TeacherCallError": 0, "TeacherError": 0}
    slowest = 0.0
    tracemalloc.start()
    try:
        for _ in range(FUZZ_ANSWERS):
            body: Any = valid_answer(samples)
            for _ in range(rng.randrange(1, 4)):
                body = FUZZ.mutate(rng, body)
            started = time.perf_counter()
            try:
                values = prompt_logprobs(body, samples, teacher="t", student="s")
            except TeacherCallError:
                outcomes["TeacherCallError"] += 1
            except TeacherError:
                outcomes["TeacherError"] += 1
            else:
                outcomes["parsed"] += 1
                assert all(-1e3 <= v <= 0.0 for row in values for v in row), values
            slowest = max(slowest, time.perf_counter() - started)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sum(outcomes.values()) == FUZZ_ANSWERS
    assert outcomes["parsed"] > 0 and outcomes["TeacherCallError"] > 0, outcomes
    assert slowest < 1.0 and peak < 50 * 2**20, (slowest, peak)
