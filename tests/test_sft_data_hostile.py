"""SFT data as hostile input: damaged files and records fail with ``file:line`` (folders,
bad UTF-8, deep nesting, wrongly typed fields, malformed tool schemas, calls never answered),
a conversation far past the context is skipped before it is tokenized, unknown message keys
are dropped and counted (``weight`` refused), and a fuzz of the loader (5,000 generated
lines, read and rendered) raises nothing but ``SFTDataError``."""

from __future__ import annotations

import json
import random
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from json_fuzz import JsonFuzzer

from post_training_cookbook.codecs import get_codec
from post_training_cookbook.sft import SFTDataError, read_conversations
from post_training_cookbook.sft.conversations import (
    Conversation,
    conversation_of_line,
    load_conversations,
)
from post_training_cookbook.sft.data import render_examples

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
USER = {"role": "user", "content": "hi"}
ANSWER = {"role": "assistant", "content": "yo"}
TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}


@pytest.fixture(scope="module")
def codec(tiny_llama_tokenizer):
    return get_codec("hermes", tiny_llama_tokenizer)


def write(path: Path, *records: Any) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def conversation(*messages: Any, **fields: Any) -> dict[str, Any]:
    return {"messages": list(messages), **fields}


BAD_RECORDS: dict[str, tuple[Any, str]] = {
    "tool_calls a number": (
        conversation(USER, {"role": "assistant", "tool_calls": 5}),
        "message 1: tool_calls must be a list",
    ),
    "tool_call_id a list": (
        conversation(
            USER,
            {"role": "assistant", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": ["c1"], "content": "1"},
            ANSWER,
        ),
        "message 2: tool_call_id must be a string",
    ),
    "a call never answered": (
        conversation(USER, {"role": "assistant", "tool_calls": [CALL]}, ANSWER),
        r"message 2: tool call\(s\) \['c1'\] of message 1 got no tool result",
    ),
    "a tool without its function": (
        conversation(USER, ANSWER, tools=[{"type": "function"}]),
        r"tools\[0\]: a tool is",
    ),
    "parameters a string": (
        conversation(
            USER, ANSWER, tools=[{"type": "function", "function": {"name": "f", "parameters": "s"}}]
        ),
        r"tools\[0\]: parameters must be a JSON schema object",
    ),
    "two tools of one name": (
        conversation(USER, ANSWER, tools=[TOOL, TOOL]),
        r"tools\[1\]: two tools are named 'f'",
    ),
    "a weight": (
        conversation(USER, {**ANSWER, "weight": 0}),
        'message 1: "weight" is not supported',
    ),
}


@pytest.mark.parametrize("case", BAD_RECORDS)
def test_a_damaged_record_names_the_file_and_line(tmp_path: Path, case: str) -> None:
    record, message = BAD_RECORDS[case]
    path = write(tmp_path / "data.jsonl", conversation(USER, ANSWER), record)
    with pytest.raises(SFTDataError, match=f"{path}:2: {message}"):
        read_conversations(path)


def test_a_damaged_file_names_the_file_and_line(tmp_path: Path) -> None:
    good = json.dumps(conversation(USER, ANSWER)).encode()
    bad_utf8 = tmp_path / "latin1.jsonl"
    bad_utf8.write_bytes(good + b"\n" + good.replace(b"yo", b"\xff\xfe") + b"\n")
    with pytest.raises(SFTDataError, match=f"{bad_utf8}:2: not UTF-8"):
        read_conversations(bad_utf8)
    nested = tmp_path / "nested.jsonl"
    nested.write_bytes(good + b"\n" + b"[" * 100_000 + b"]" * 100_000 + b"\n")
    with pytest.raises(SFTDataError, match=f"{nested}:2: nested too deeply"):
        read_conversations(nested)
    for given in (tmp_path, str(tmp_path)):  # as conversations and as val_conversations
        with pytest.raises(SFTDataError, match=f"{tmp_path}: is a folder, not a JSONL file"):
            load_conversations(given)
    with pytest.raises(SFTDataError, match="no such file"):
        load_conversations(tmp_path / "missing.jsonl")


def test_unknown_message_keys_are_dropped_and_counted(tmp_path: Path, codec: Any) -> None:
    path = write(
        tmp_path / "data.jsonl",
        conversation(USER, {**ANSWER, "refusal": None, "annotations": []}),
        conversation({**USER, "refusal": None}, ANSWER),
    )
    conversations = read_conversations(path)
    assert all("refusal" not in m for c in conversations for m in c.messages)
    data = render_examples(codec, conversations, "all", 1024)
    assert len(data.examples) == 2
    assert data.ignored_keys == {"refusal": 2, "annotations": 1}


def test_a_conversation_far_past_the_context_is_skipped_before_it_is_tokenized(
    codec: Any,
) -> None:
    huge = Conversation([USER, {"role": "assistant", "content": "word " * 400_000}])
    small = Conversation([USER, ANSWER], source="small")
    rendered: list[int] = []
    render = codec.render_conversation

    def counted(messages: Any, tools: Any = None) -> Any:
        rendered.append(sum(len(m.get("content") or "") for m in messages))
        return render(messages, tools)

    codec.render_conversation = counted
    try:
        started = time.perf_counter()
        data = render_examples(codec, [huge, small], "all", 1024)
        elapsed = time.perf_counter() - started
    finally:
        del codec.render_conversation
    assert data.skipped_too_long == [huge.source]
    assert [example.source for example in data.examples] == ["small"]
    assert max(rendered) < 100, "the 2 MB conversation was tokenized"
    assert elapsed < 2.0


# ---------------------------------------------------------------- fuzz of the loader

FUZZ_LINES = 5_000
GOOD_RECORD = conversation(
    {"role": "system", "content": "s"},
    USER,
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "1"},
    ANSWER,
    tools=[TOOL],
)


FUZZ = JsonFuzzer(
    ints=[0, 5, -1, 2**70],
    floats=[0.5, 1e308, float("nan")],
    strings=["", "c1", "assistant", "tool", "{}", "[1]", "<|im_end|>", "x" * 50],
    keys=["role", "content", "tool_calls", "id", "name", "arguments", "weight"],
    added_keys=["tool_call_id", "tool_calls", "weight", "extra"],
    longest_list=2,
)


def line_bytes(rng: random.Random) -> bytes:
    record: Any = GOOD_RECORD
    for _ in range(rng.randrange(3)):
        record = FUZZ.mutate(rng, record)
    raw = json.dumps(record).encode()
    roll = rng.random()
    if roll < 0.05 and raw:  # a byte flipped: bad UTF-8, or JSON no longer
        at = rng.randrange(len(raw))
        raw = raw[:at] + bytes([rng.randrange(128, 256)]) + raw[at + 1 :]
    elif roll < 0.08:
        raw = raw[: rng.randrange(len(raw) + 1)]
    elif roll < 0.1:
        raw = b"[" * rng.choice([10, 5_000]) + raw
    return raw


@pytest.mark.heavy  # 12 s on an idle core, 30-40 s on a loaded one
def test_a_fuzz_of_the_sft_loader_raises_only_sft_data_errors(tmp_path: Path, codec: Any) -> None:
    """Each line read as ``read_conversations`` reads a line (every 50th through a file of
    its own), then rendered."""
    rng = random.Random(41)
    path = tmp_path / "fuzz.jsonl"
    outcomes = {"trained": 0, "skipped": 0, "refused": 0}
    slowest = 0.0
    tracemalloc.start()
    try:
        for index in range(FUZZ_LINES):
            raw = line_bytes(rng)
            started = time.perf_counter()
            try:
                if index % 50 == 0:
                    path.write_bytes(raw + b"\n")
                    conversations = read_conversations(path)
                else:
                    conversations = [conversation_of_line(raw, f"fuzz:{index}")]
                data = render_examples(codec, conversations, "all", 512)
            except SFTDataError:
                outcomes["refused"] += 1
            else:
                outcomes["trained" if data.examples else "skipped"] += 1
            slowest = max(slowest, time.perf_counter() - started)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sum(outcomes.values()) == FUZZ_LINES
    assert outcomes["trained"] > 0 and outcomes["refused"] > 0, outcomes
    assert slowest < 2.0 and peak < 100 * 2**20, (slowest, peak)
