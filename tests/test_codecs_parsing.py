"""Parsing the new families' samples: XML values typed by the schema, Llama's one JSON call,
and no exception on any model output (adversarial text, ids out of vocabulary)."""

from __future__ import annotations

import json
import random

import pytest
from test_codecs_common import make_tokenizer, real_template

from post_training_cookbook.codecs import Codec, get_codec
from post_training_cookbook.types import ToolSpec

TOOLS: list[ToolSpec] = [
    {
        "type": "function",
        "function": {
            "name": "book",
            "description": "Book a table.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "people": {"type": "integer"},
                    "budget": {"type": "number"},
                    "terrace": {"type": "boolean"},
                    "dishes": {"type": "array"},
                    "notes": {"type": "object"},
                    "deposit": {"type": ["integer", "null"]},
                    "code": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                    "anything": {"description": "no type"},
                },
            },
        },
    }
]


def xml_codec(name: str = "qwen3.6", **options: object) -> Codec:
    files = {"qwen3.5": "qwen3_5_think", "qwen3.6": "qwen3_6", "qwen3.8": "qwen3_8"}
    return get_codec(name, make_tokenizer(real_template(files[name])), **options)


def parse(codec: Codec, text: str, tools: list[ToolSpec] | None = TOOLS):
    return codec.parse(codec.tokenizer.encode(text, add_special_tokens=False), tools)


def call_text(*parameters: tuple[str, str], name: str = "book") -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
    return f"done\n</think>\n\n<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def arguments(codec: Codec, text: str, tools: list[ToolSpec] | None = TOOLS) -> dict:
    parsed = parse(codec, text + "<|im_end|>", tools)
    assert parsed.message is not None, parsed.error
    return json.loads(parsed.message["tool_calls"][0]["function"]["arguments"])


@pytest.mark.parametrize(
    ("key", "raw", "value"),
    [
        ("city", "42", "42"),  # a string parameter keeps its text, even when it reads as JSON
        ("city", '{"a": 1}', '{"a": 1}'),
        ("city", "\n two lines \n", "\n two lines \n"),
        ("people", "42", 42),
        ("budget", "42", 42),
        ("budget", "1.5", 1.5),
        ("people", "4.0", 4),
        ("terrace", "true", True),
        ("terrace", "False", False),  # Qwen3.5's template prints Python booleans
        ("dishes", '["soup", 2]', ["soup", 2]),
        ("notes", '{"window": true}', {"window": True}),
        ("deposit", "None", None),
        ("deposit", "null", None),
        ("deposit", "12", 12),
        ("code", "007", "007"),  # not JSON: the string branch of the union
        ("code", "7", 7),
        ("anything", "[1]", [1]),  # no declared type: JSON when it reads as JSON
        ("anything", "plain", "plain"),
    ],
)
def test_xml_values_are_typed_by_the_tools_schema(key, raw, value):
    assert arguments(xml_codec(), call_text((key, raw))) == {key: value}


def test_without_tool_schemas_values_that_read_as_json_are_taken_as_json():
    text = call_text(("city", "42"), ("people", "x"))
    assert arguments(xml_codec(), text, tools=None) == {"city": 42, "people": "x"}


def test_several_calls_and_the_content_before_them_are_parsed_in_order():
    text = (
        "weigh it\n</think>\n\nI will book twice.\n\n"
        "<tool_call>\n<function=book>\n<parameter=people>\n2\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=book>\n</function>\n</tool_call><|im_end|>"
    )
    parsed = parse(xml_codec(), text)
    assert parsed.message is not None, parsed.error
    assert parsed.message["content"] == "I will book twice."
    assert parsed.message["reasoning_content"] == "weigh it"
    calls = parsed.message["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"people": 2}, {}]
    assert calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (call_text(("guests", "2")), "unknown parameter 'guests'"),
        (call_text(name="order"), "unknown tool 'order'"),
        (call_text(("people", "two")), "parameter 'people' of 'book' is not integer"),
        (call_text(("people", "1" * 5000)), "is not integer"),  # too long to convert
        (call_text(("notes", "[" * 100_000)), "is not object"),  # nested past recursion
        (call_text(("people", "2"), ("people", "3")), "given twice"),
        (
            "x\n</think>\n\n<tool_call>\n<function=book>\n<parameter=people>\n2\n"
            "</function>\n</tool_call>",
            "malformed",
        ),
        (
            "x\n</think>\n\n<tool_call>\n<function=book>\njunk\n</function>\n</tool_call>",
            "malformed",
        ),
        ("x\n</think>\n\n<tool_call>\nbook(people=2)\n</tool_call>", "<function=NAME>"),
        ("x\n</think>\n\n<tool_call>\n<function=book>\n</function>\n", "unterminated <tool_call>"),
        ("x\n</think>\n\nok</tool_call>", "without a matching"),
        ("x\n</think>\n\n<function=book>\n</function>", "outside <tool_call>"),
        ("thinking until the budget ran out", "unterminated <think>"),
        ("x\n</think>\n\nanswer <think>again</think>", "stray"),
    ],
)
def test_malformed_or_unknown_xml_calls_are_parse_failures(text, reason):
    parsed = parse(xml_codec(), text + "<|im_end|>")
    assert not parsed.ok and parsed.error is not None and reason in parsed.error, parsed.error


def test_with_thinking_off_the_sample_is_all_content():
    parsed = parse(xml_codec(enable_thinking=False), "Just the answer.<|im_end|>")
    assert parsed.message == {"role": "assistant", "content": "Just the answer."}


def llama(name: str = "llama3.1") -> Codec:
    files = {"llama3.1": "llama3_1", "llama3.2": "llama3_2"}
    return get_codec(name, make_tokenizer(real_template(files[name]), family="llama3"))


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "book", "parameters": {"people": 2}}',
        '<|python_tag|>{"name": "book", "parameters": {"people": 2}}',
        '  {"name": "book", "arguments": {"people": 2}}\n',
    ],
)
def test_llama_reads_one_json_call_with_parameters_or_arguments(text):
    parsed = parse(llama(), text + "<|eot_id|>")
    assert parsed.message is not None, parsed.error
    assert parsed.message["content"] == ""
    [call] = parsed.message["tool_calls"]
    assert call["function"] == {"name": "book", "arguments": '{"people": 2}'}


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}', "one call per turn"),
        ('{"name": "a", "parameters": {"x": 1}', "invalid JSON"),
        ('{"name": "a", "parameters": [1]}', "must be a JSON object"),
        ('{"name": "", "parameters": {}}', '"name"'),
    ],
)
def test_llama_call_objects_that_are_not_one_valid_call_are_parse_failures(text, reason):
    parsed = parse(llama(), text + "<|eot_id|>")
    assert not parsed.ok and parsed.error is not None and reason in parsed.error


@pytest.mark.parametrize("text", ['{"name": "x"} is a JSON object.', "The answer is 4.", "{}"])
def test_llama_text_that_is_not_a_call_is_content(text):
    parsed = parse(llama(), text + "<|eot_id|>")
    assert parsed.message == {"role": "assistant", "content": text}


def test_llama_refuses_to_render_two_calls_in_one_turn_as_its_template_does():
    codec = llama()
    call = {"id": "c", "type": "function", "function": {"name": "a", "arguments": "{}"}}
    message = {"role": "assistant", "content": "", "tool_calls": [call, call]}
    with pytest.raises(ValueError, match="exactly one tool call"):
        codec.render_conversation([{"role": "user", "content": "q"}, message])  # type: ignore[list-item]


def test_llama32_uses_todays_date_unless_given_one():
    import datetime

    today = datetime.datetime.now().strftime("%d %b %Y")
    assert llama("llama3.2").date_string == today  # type: ignore[attr-defined]
    assert llama("llama3.1").date_string == "26 Jul 2024"  # type: ignore[attr-defined]


def test_qwen38_rejects_an_unknown_reasoning_effort_and_qwen35_has_no_preserve_thinking():
    with pytest.raises(ValueError, match="reasoning_effort must be one of"):
        xml_codec("qwen3.8", reasoning_effort="max")
    with pytest.raises(ValueError, match="no preserve_thinking option"):
        xml_codec("qwen3.5", preserve_thinking=True)


ADVERSARIAL = [
    "[" * 100_000,
    '{"a":' * 20_000,
    "9" * 100_000,
    "<tool_call>" * 1000,
    "</think>" + "<tool_call>\n<function=book>\n<parameter=notes>\n" + "{" * 50_000,
    "</think><tool_call><function=book><parameter=people>" + "1" * 10_000 + "</parameter>",
    '<|python_tag|>{"name": "book", "parameters": ' + "[" * 100_000,
    '{"name": "book", "parameters": {"people": ' + "9" * 10_000 + "}}",
    "</think>\n<parameter=x>\n</parameter>" * 500,
    "\x00\x7f </think> <function=\n> <parameter=>",
]


@pytest.mark.parametrize(
    "name", ["qwen3.5", "qwen3.5-nothink", "qwen3.6", "qwen3.8", "llama3.1", "llama3.2"]
)
def test_parse_never_raises_on_adversarial_samples_or_arbitrary_ids(name):
    codec = llama(name) if name.startswith("llama") else xml_codec(name.split("-")[0])
    vocabulary = len(codec.tokenizer)
    rng = random.Random(name)
    samples = [codec.tokenizer.encode(text, add_special_tokens=False) for text in ADVERSARIAL]
    samples += [[rng.randrange(vocabulary) for _ in range(rng.randint(0, 60))] for _ in range(300)]
    samples += [[-1], [vocabulary + 10**6], [2**40], [2**70]]
    for tools in (TOOLS, None):
        for sample in samples:
            parsed = codec.parse(sample, tools)
            assert parsed.ok != (parsed.error is not None)
