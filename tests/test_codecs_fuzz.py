"""Every codec's ``parse`` on hostile model output: over 10,000 samples in all (random token
ids, ids out of the vocabulary, JSON nested past the recursion limit, integers past Python's
conversion limit, unterminated tags), with and without tool schemas: not one exception, and
every failure is a parse failure with a reason (issue: hostile model output)."""

from __future__ import annotations

import random

import pytest
from test_codecs_common import make_tokenizer, real_template
from test_codecs_parsing import ADVERSARIAL, TOOLS
from test_codecs_template import QWEN3_RESPONSE, template_tokenizer

from post_training_cookbook.codecs import CODECS, Codec, get_codec

TEMPLATES = {
    "hermes": ("qwen2_5", "chatml"),
    "qwen2.5": ("qwen2_5", "chatml"),
    "qwen3": ("qwen3", "chatml"),
    "qwen3-2507": ("qwen3_instruct_2507", "chatml"),
    "qwen3.5": ("qwen3_5_think", "chatml"),
    "qwen3.5-nothink": ("qwen3_5_nothink", "chatml"),
    "qwen3.6": ("qwen3_6", "chatml"),
    "qwen3.8": ("qwen3_8", "chatml"),
    "llama3.1": ("llama3_1", "llama3"),
    "llama3.2": ("llama3_2", "llama3"),
}
RANDOM_SAMPLES = 450  # x 2 (with and without tools) x 11 codecs, plus the adversarial ones


def codec_named(name: str) -> Codec:
    if name == "template":
        return get_codec("template", template_tokenizer("qwen2_5", "chatml", QWEN3_RESPONSE))
    template, family = TEMPLATES[name]
    return get_codec(name, make_tokenizer(real_template(template), family=family))


def hostile_samples(codec: Codec, seed: str) -> list[list[int]]:
    rng = random.Random(seed)
    vocabulary = len(codec.tokenizer)
    texts = [
        *ADVERSARIAL,
        '<tool_call>\n{"name": "book", "arguments": ' + "[" * 50_000,
        '<tool_call>\n{"name": "book", "arguments": {"people": ' + "9" * 5_000 + "}}",
        "<tool_call>\n" + '{"name": "book"' * 2_000,
        "<think>" * 3_000,
        "</tool_call></think><tool_call>",
    ]
    samples = [codec.tokenizer.encode(text, add_special_tokens=False) for text in texts]
    special = sorted(set(codec.stop_token_ids) | set(codec.tokenizer.all_special_ids))
    for _ in range(RANDOM_SAMPLES):
        length = rng.choice([0, 1, 3, 20, 60, 200])
        pool = special if rng.random() < 0.2 else range(vocabulary)
        samples.append([rng.choice(pool) for _ in range(length)])
    samples += [[-1], [vocabulary], [vocabulary + 10**6], [2**40], [2**70], [-(2**70)]]
    samples += [[rng.randrange(vocabulary) for _ in range(5)] + [2**63]]
    return samples


@pytest.mark.parametrize("name", sorted(CODECS))
def test_parse_never_raises_and_every_failure_says_why(name):
    codec = codec_named(name)
    parsed_count = 0
    for tools in (TOOLS, None):
        for sample in hostile_samples(codec, name):
            parsed = codec.parse(sample, tools)  # must not raise
            parsed_count += 1
            assert (parsed.message is None) == (parsed.error is not None), sample[:10]
            if parsed.message is not None:
                assert parsed.message["role"] == "assistant"
    assert parsed_count >= 900


def test_the_fuzz_covers_over_ten_thousand_samples_across_the_codecs():
    total = sum(2 * len(hostile_samples(codec_named(name), name)) for name in sorted(CODECS))
    assert total >= 10_000, total
