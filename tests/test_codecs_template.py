"""The template-driven codec on real templates it was not written for, and its refusals.

gpt-oss and Gemma 4 (two revisions) are the templates; their response parsers are TRL's
(``trl.chat_template_utils.gptoss_template`` / ``gemma4_template``, 1.16.0, copied below
because importing TRL needs its dependencies), set as ``tokenizer.response_template`` the way
a model repository ships one. Over random conversations within what each template can
render, the codec either passes ``check_episode`` (the family tests' properties) or refuses
an extension with ``NotPrefixPreserving`` naming the model, and then the template really did
re-render earlier turns.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from test_codecs_common import make_tokenizer, random_episode, real_template
from test_codecs_families import SIZES, check_episode, for_each_conversation

from post_training_cookbook.codecs import NotPrefixPreserving, TemplateCodec, get_codec
from post_training_cookbook.codecs.tool_calls import make_tool_call, to_template_messages
from post_training_cookbook.models import check_codec_options, resolve_model
from post_training_cookbook.types import Message

FUNCTION = {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}
GPTOSS_RESPONSE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|start|>assistant",
    "fields": {
        "thinking": {
            "open": "<|channel|>analysis<|message|>",
            "close_pattern": r"<\|end\|>\s*",
            "content": "text",
        },
        "content": {
            "open": "<|channel|>final<|message|>",
            "close_pattern": r"<\|return\|>\s*",
            "content": "text",
        },
        "tool_calls": {
            "open_pattern": (
                r"to=functions\.(?P<name>\S+?)<\|channel\|>commentary\s+json<\|message\|>"
            ),
            "close_pattern": r"<\|call\|>\s*",
            "repeats": True,
            "content": "json",
            "transform": {
                "type": "function",
                "function": {"name": "{name}", "arguments": "{content}"},
            },
        },
    },
}
GEMMA4_RESPONSE = {
    "defaults": {"role": "assistant"},
    "start_anchor_pattern": r"(?:<\|turn>model\n|<tool_response\|>)",
    "fields": {
        "reasoning_content": {
            "open": "<|channel>thought\n",
            "close_pattern": r"<channel\|>\s*",
            "content": "text",
        },
        "tool_calls": {
            "open_pattern": r"<\|tool_call>call:(?P<name>\w+)",
            "close_pattern": r"<tool_call\|>\s*",
            "repeats": True,
            "content": "json",
            "content_args": {"string_delims": [['<|"|>', '<|"|>']], "unquoted_keys": True},
            "transform": FUNCTION,
        },
        "content": {
            "close_pattern": r"(?:<turn\|>|<\|tool_response>|<eos>)\s*|$",
            "content": "text",
        },
    },
}  # fmt: skip
QWEN3_RESPONSE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {
            "open": "<think>", "close_pattern": r"</think>\s*", "content": "text"
        },
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}  # fmt: skip


def template_tokenizer(template_file: str, family: str, response: dict[str, Any] | None) -> Any:
    """A test tokenizer with a real template, named like a model, with a response template."""
    tokenizer = copy.deepcopy(make_tokenizer(real_template(template_file), family=family))
    tokenizer.name_or_path = f"test/{template_file}"
    tokenizer.response_template = response
    return tokenizer


def within_gptoss(episode: Any) -> Any:
    """What gpt-oss's template can render: one call per turn, tool results only after a call,
    an analysis message in either content or thinking of a calling turn (not both)."""
    opening, turns, tools = episode
    adapted = []
    for assistant, after in turns:
        assistant = dict(assistant)
        calls = assistant.get("tool_calls") or []
        if calls and assistant.get("reasoning_content"):
            assistant["content"] = ""
        adapted.append((assistant, after if calls else without_tools(after)))
    return opening, adapted, tools


def within_gemma4(episode: Any) -> Any:
    """What Gemma 4's call format can print back unambiguously: no null values (it prints
    ``None``) and nested object keys that are identifiers (it prints them unquoted); tool
    results only after a call."""

    def printable(value: Any) -> Any:
        if value is None:
            return False
        if isinstance(value, list):
            return [printable(item) for item in value]
        if isinstance(value, dict):
            return {f"k{i}": printable(item) for i, item in enumerate(value.values())}
        return value

    opening, turns, tools = episode
    adapted = []
    for assistant, after in turns:
        for call in assistant.get("tool_calls") or []:
            arguments = json.loads(call["function"]["arguments"])
            arguments = {key: printable(value) for key, value in arguments.items()}
            call["function"]["arguments"] = json.dumps(arguments)
        adapted.append((assistant, after if assistant.get("tool_calls") else without_tools(after)))
    return opening, adapted, tools


def without_tools(messages: list[Message]) -> list[Message]:
    """Tool results answer calls: none after a turn that made no call."""
    return [message for message in messages if message["role"] != "tool"]


def check_or_refuse(codec: TemplateCodec, episode: Any, stops: tuple[str, ...]) -> bool:
    """check_episode, or a NotPrefixPreserving refusal; whether it was refused."""
    try:
        check_episode(codec, episode, {}, stops)
    except NotPrefixPreserving as error:
        assert codec.model in str(error) and "prefix-preserving" in str(error)
        return True
    return False


@pytest.mark.parametrize("conversations", SIZES)
def test_the_template_codec_runs_gpt_oss_or_refuses_where_the_template_re_renders(conversations):
    codec = get_codec("template", template_tokenizer("gptoss", "gptoss", GPTOSS_RESPONSE))
    refused = []
    for_each_conversation(
        "gptoss",
        conversations,
        lambda rng: refused.append(
            check_or_refuse(
                codec,
                within_gptoss(random_episode(rng, reasoning=True, max_calls=1)),
                ("<|return|>", "<|call|>"),
            )
        ),
    )
    assert 0 < sum(refused) < len(refused)  # both happen: tool loops extend, final answers don't


@pytest.mark.parametrize("conversations", SIZES)
@pytest.mark.parametrize("template_file", ["gemma4", "gemma4_v2"])
def test_the_template_codec_runs_gemma4_or_refuses_where_the_template_re_renders(
    template_file, conversations
):
    codec = get_codec("template", template_tokenizer(template_file, "gemma4", GEMMA4_RESPONSE))
    refused = []
    for_each_conversation(
        template_file,
        conversations,
        lambda rng: refused.append(
            check_or_refuse(
                codec,
                within_gemma4(
                    random_episode(rng, reasoning=True, typed=True, system_follow_ups=False)
                ),
                ("<turn|>", "<|tool_response>"),
            )
        ),
    )
    assert sum(refused) < len(refused)


@pytest.mark.parametrize("conversations", SIZES)
def test_the_template_codec_on_a_prefix_preserving_template_matches_it_everywhere(conversations):
    codec = get_codec("template", template_tokenizer("qwen2_5", "chatml", QWEN3_RESPONSE))
    for_each_conversation(
        "template-qwen2.5",
        conversations,
        lambda rng: check_episode(codec, random_episode(rng), {}, ("<|im_end|>",)),
    )


# ---- refusals, each naming the model ----


def test_a_tokenizer_without_a_response_template_is_refused_when_the_codec_is_built():
    tokenizer = template_tokenizer("gptoss", "gptoss", None)
    with pytest.raises(ValueError, match=r"'test/gptoss'.*response_template"):
        TemplateCodec(tokenizer)


def test_a_template_that_drops_tool_calls_is_refused():
    chatml = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    tokenizer = copy.deepcopy(make_tokenizer(chatml))
    tokenizer.name_or_path = "test/no-tools"
    tokenizer.response_template = QWEN3_RESPONSE
    with pytest.raises(ValueError, match=r"'test/no-tools'.*does not render tool calls"):
        TemplateCodec(tokenizer)


def test_an_extension_the_template_would_render_differently_is_refused():
    codec = TemplateCodec(template_tokenizer("qwen3", "chatml", QWEN3_RESPONSE))
    sampled = codec.tokenizer.encode(
        "<think>\nTwo and two.\n</think>\n\n4<|im_end|>", add_special_tokens=False
    )
    # a tool result keeps the reasoning of the turn before it: the extension is exact
    extension = codec.render_extension([Message(role="tool", content="ok")], sampled_tokens=sampled)
    assert codec.tokenizer.decode(extension, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # a new user query drops it from the re-rendered history: no exact extension exists
    with pytest.raises(NotPrefixPreserving, match=r"'test/qwen3'.*not prefix-preserving"):
        codec.render_extension([Message(role="user", content="And 3+3?")], sampled_tokens=sampled)


def test_template_options_go_to_the_template_and_are_checked_against_what_it_reads(tmp_path):
    tokenizer = template_tokenizer("qwen3", "chatml", QWEN3_RESPONSE)
    codec = get_codec("template", tokenizer, enable_thinking=False)
    prompt = codec.render_prompt([Message(role="user", content="hi")])
    assert codec.tokenizer.decode(prompt, skip_special_tokens=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    info = resolve_model(str(tmp_path), codec="template")
    assert check_codec_options(info, {"enable_thinking": False}) == {"enable_thinking": False}
    with pytest.raises(ValueError, match="has no codec option 'reasoning_effort'"):
        check_codec_options(info, {"reasoning_effort": "low"})


def test_the_template_codec_closes_a_length_capped_sample_with_the_turns_stop_token():
    codec = TemplateCodec(template_tokenizer("qwen2_5", "chatml", QWEN3_RESPONSE))
    capped = codec.tokenizer.encode("half an ans", add_special_tokens=False)
    extension = codec.render_extension([Message(role="user", content="?")], sampled_tokens=capped)
    text = codec.tokenizer.decode(extension, skip_special_tokens=False)
    assert text == "<|im_end|>\n<|im_start|>user\n?<|im_end|>\n<|im_start|>assistant\n"
    assert set(codec.stop_token_ids) == {codec.tokenizer.convert_tokens_to_ids("<|im_end|>")}


def test_the_template_codec_parses_calls_through_the_response_template():
    codec = TemplateCodec(template_tokenizer("gptoss", "gptoss", GPTOSS_RESPONSE))
    call = make_tool_call("lookup", {"city": "Paris", "days": 3})
    conversation = [Message(role="user", content="q")]
    prompt = codec.tokenizer.decode(codec.render_prompt(conversation), skip_special_tokens=False)
    whole = codec.tokenizer.apply_chat_template(
        to_template_messages([*conversation, Message(role="assistant", tool_calls=[call])]),
        tokenize=False,
    )
    assert whole.startswith(prompt)
    parsed = codec.parse(codec.tokenizer.encode(whole[len(prompt) :], add_special_tokens=False))
    assert parsed.message is not None, parsed.error
    [parsed_call] = parsed.message["tool_calls"]
    assert parsed_call["function"] == {
        "name": "lookup",
        "arguments": '{"city": "Paris", "days": 3}',
    }
    assert parsed_call["id"] != call["id"]
