"""Which family codec a chat template is written for, from its text alone (no tokenizer, no
torch): the catalog asks it of a model's template, ``infer_codec`` of a tokenizer's."""

from __future__ import annotations


def infer_codec_name(template: str) -> str | None:
    """The family codec for a chat template, recognised by the text only that family has.

    Templates that merely share a marker (Nemotron's XML calls, GLM's ``<tool_call>``) are
    not recognised: they get no codec rather than one that renders something else.
    """
    chatml = "<|im_start|>" in template
    if chatml and "<function=" in template and "vision_start" in template:
        if "reasoning_effort" in template:
            return "qwen3.8"
        if "preserve_thinking" in template:
            return "qwen3.6"
        if "enable_thinking is defined and enable_thinking is true" in template:
            return "qwen3.5-nothink"
        return "qwen3.5"
    if "Cutting Knowledge Date" in template and '"parameters": ' in template:
        return "llama3.2" if "strftime_now" in template else "llama3.1"
    if chatml and "<tool_call>" in template and '{"name": ' in template:
        return "qwen3" if "<think>" in template else "hermes"
    return None
