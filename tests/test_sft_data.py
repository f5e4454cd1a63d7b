"""SFT data and loss: which tokens are trained, bad data, batches, the config (no model run).

The codec cases use the tiny Llama folder's tokenizer with the Hermes codec; the loss cases
are hand-computed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from post_training_cookbook.codecs import get_codec
from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TRAIN_TASKS, ToolUseGameEnv
from post_training_cookbook.envs.tool_use_game.solver import GameSolver
from post_training_cookbook.sft import SFTConfig, SFTDataError, read_conversations
from post_training_cookbook.sft.conversations import Conversation
from post_training_cookbook.sft.data import plan_batches, prompt_key, render_examples
from post_training_cookbook.sft.demonstrations import collect_demonstrations
from post_training_cookbook.trainer.objective import BatchTotals, get_loss_fn
from post_training_cookbook.trainer.types import LossConfig


@pytest.fixture(scope="module")
def codec(tiny_llama_tokenizer):
    return get_codec("hermes", tiny_llama_tokenizer)


@pytest.fixture(scope="module")
def game_conversation() -> Conversation:
    """A solved level-3 game episode: three assistant turns with tool calls, then the answer."""
    level_3 = next(t for t in TOOL_USE_GAME_TRAIN_TASKS if t.metadata["level"] == 3)
    demos = collect_demonstrations(GameSolver(), lambda task: ToolUseGameEnv(), [level_3])
    (conversation,) = demos.conversations
    return conversation


def trained_text(codec, tokens: list[int], mask: list[int]) -> str:
    return codec.tokenizer.decode([t for t, m in zip(tokens, mask, strict=True) if m])


# ---------------------------------------------------------------- the loss


def test_the_sft_loss_gives_tokens_outside_the_mask_exactly_zero_gradient():
    """Hand-computed: log-probs -1, -2, -3, -4 on one row and -5, -6 on another, trained at
    positions (1, 3) and (1): L = (2 + 4 + 6) / 3 = 4, dL/dlogp = -1/3 there, 0 elsewhere."""
    logprobs = torch.tensor([[-1.0, -2.0, -3.0, -4.0], [-5.0, -6.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    zeros = torch.zeros_like(mask)
    loss, metrics = get_loss_fn("sft")(logprobs, zeros, zeros, mask, LossConfig(loss_type="sft"))
    loss.backward()
    assert loss.item() == pytest.approx(4.0)
    assert metrics["loss/nll"] == pytest.approx(4.0)
    third = -1.0 / 3.0
    expected = torch.tensor([[0.0, third, 0.0, third], [0.0, third, 0.0, 0.0]])
    assert torch.equal(logprobs.grad == 0, mask == 0)  # exactly zero off the mask
    assert torch.allclose(logprobs.grad, expected)


def test_the_sft_loss_is_normalised_by_the_whole_batch_so_any_split_sums_to_it():
    """Rows split into micro-batches (or packed differently later) give the same loss: each
    share is divided by the batch's trained tokens, not its own."""
    torch.manual_seed(0)
    logprobs = -torch.rand(3, 5)
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 1, 1, 1, 1], [0, 0, 1, 0, 0]], dtype=torch.float)
    zeros = torch.zeros_like(mask)
    config = LossConfig(loss_type="sft")
    loss_fn = get_loss_fn("sft")
    whole, _ = loss_fn(logprobs, zeros, zeros, mask, config)
    totals = BatchTotals.of(mask)
    shares = [
        loss_fn(logprobs[rows], zeros[rows], zeros[rows], mask[rows], config, totals=totals)[0]
        for rows in ([0], [1, 2])
    ]
    assert sum(shares).item() == pytest.approx(whole.item())
    assert whole.item() == pytest.approx(-(logprobs * mask).sum().item() / 7)


def test_sft_is_a_trainer_loss_but_not_a_grpo_loss_type():
    assert LossConfig(loss_type="sft").loss_type == "sft"
    from post_training_cookbook.grpo.config import GRPOConfig

    with pytest.raises(ValueError, match="loss_type"):
        GRPOConfig(loss_type="sft", wandb_project=None)


# ---------------------------------------------------------------- which tokens are trained


def test_only_assistant_tokens_are_trained_and_train_on_last_keeps_only_the_last_turn(
    codec, game_conversation
):
    messages = game_conversation.messages
    assistants = [m for m in messages if m["role"] == "assistant"]
    assert len(assistants) == 4  # two lookups, the calculator, the answer
    (every,) = render_examples(codec, [game_conversation], "all", 4096).examples
    (last,) = render_examples(codec, [game_conversation], "last", 4096).examples
    assert every.tokens == last.tokens
    assert every.mask[0] == 0 and last.mask[0] == 0
    # "all": the trained text is the assistant turns as the model samples them, nothing else.
    trained = trained_text(codec, every.tokens, every.mask)
    assert trained.count("<|im_end|>") == 4
    assert "<tool_call>" in trained and "lookup" in trained and "calculator" in trained
    for message in messages:
        if message["role"] in ("system", "user"):
            assert message["content"] not in trained
    assert "<tool_response>" not in trained and "<|im_start|>" not in trained
    # "last": only the final answer and its stop token; a subset of "all".
    assert trained_text(codec, last.tokens, last.mask) == assistants[-1]["content"] + "<|im_end|>"
    assert all(m_last <= m_all for m_last, m_all in zip(last.mask, every.mask, strict=True))
    assert sum(last.mask) < sum(every.mask)


def test_a_conversation_longer_than_the_context_is_skipped_and_counted_not_cut(
    codec, game_conversation
):
    length = len(codec.render_conversation(game_conversation.messages, game_conversation.tools)[0])
    data = render_examples(codec, [game_conversation], "all", length - 1)
    assert data.examples == [] and data.skipped_too_long == [game_conversation.source]
    data = render_examples(codec, [game_conversation], "all", length)
    assert len(data.examples[0].tokens) == length and data.skipped_too_long == []


# ---------------------------------------------------------------- bad data


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
BAD_LINES = {
    "not JSON": ("{not json", r":2: not JSON"),
    "unknown role": (
        json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
        r":2: message 0: unknown role 'robot'",
    ),
    "tool call without id": (
        json.dumps({"messages": [{"role": "assistant", "tool_calls": [{**CALL, "id": ""}]}]}),
        r":2: message 0: tool call without id",
    ),
    "tool result for no call": (
        json.dumps(
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [CALL]},
                    {"role": "tool", "tool_call_id": "c2", "content": "1"},
                ]
            }
        ),
        r":2: message 1: tool result for no call",
    ),
    "no assistant": (json.dumps({"messages": [{"role": "user", "content": "x"}]}), r":2: no"),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_bad_data_names_the_file_and_line(tmp_path, case):
    line, message = BAD_LINES[case]
    path = write_lines(tmp_path / "data.jsonl", [json.dumps(GOOD), line])
    with pytest.raises(SFTDataError, match=f"{path}{message}"):
        read_conversations(path)


def test_a_tool_result_answers_each_call_once(tmp_path):
    record = {
        "messages": [
            {"role": "assistant", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "1"},
            {"role": "tool", "tool_call_id": "c1", "content": "1"},
        ]
    }
    path = write_lines(tmp_path / "data.jsonl", [json.dumps(record)])
    with pytest.raises(SFTDataError, match=r":1: message 2: tool result for no call"):
        read_conversations(path)


def test_good_data_reads_back_with_its_tools(tmp_path, game_conversation):
    path = write_lines(tmp_path / "data.jsonl", [game_conversation.to_json(), ""])
    (read,) = read_conversations(path)
    assert read.messages == game_conversation.messages
    assert read.tools == game_conversation.tools and read.tools
    assert read.source == f"{path}:1"


# ---------------------------------------------------------------- batches and config


def test_batches_keep_to_the_token_budget_and_depend_only_on_the_seed():
    lengths = [100, 300, 50, 700, 200, 1200, 90]
    plan = plan_batches(lengths, 800, num_epochs=2, num_steps=None, seed=3)
    assert plan == plan_batches(lengths, 800, num_epochs=2, num_steps=None, seed=3)
    assert plan != plan_batches(lengths, 800, num_epochs=2, num_steps=None, seed=4)
    for batch in plan:
        assert len(batch) == 1 or sum(lengths[i] for i in batch) <= 800
    per_epoch = len(plan) // 2
    assert sorted(i for batch in plan[:per_epoch] for i in batch) == list(range(len(lengths)))
    longer = plan_batches(lengths, 800, num_epochs=1, num_steps=len(plan) + 3, seed=3)
    assert len(longer) == len(plan) + 3 and longer[: len(plan)] == plan


def test_batches_by_prompt_never_mix_prompts_and_still_cover_every_example_each_epoch():
    lengths = [100, 300, 50, 700, 200, 120, 90, 400, 60, 80, 500]
    prompts = ["a", "b", "a", "c", "b", "a", "c", "a", "b", "a", "c"]
    plan = plan_batches(lengths, 800, num_epochs=3, num_steps=None, seed=1, prompts=prompts)
    assert plan == plan_batches(lengths, 800, 3, None, seed=1, prompts=prompts)
    for batch in plan:
        assert len({prompts[i] for i in batch}) == 1
        assert len(batch) == 1 or sum(lengths[i] for i in batch) <= 800
    seen = [i for batch in plan for i in batch]
    epochs = [seen[k * len(lengths) : (k + 1) * len(lengths)] for k in range(3)]
    assert all(sorted(epoch) == list(range(len(lengths))) for epoch in epochs)
    # each prompt's examples come together, in an order the seed shuffles
    assert len({tuple(epoch) for epoch in epochs}) > 1
    firsts = [[prompts[i] for i in epoch] for epoch in epochs]
    assert all(f == sorted(f, key=lambda p: f.index(p)) for f in firsts)


def test_the_prompt_key_is_the_tools_and_system_message():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    user = {"role": "user", "content": "hi"}
    system = {"role": "system", "content": "be brief"}
    key = prompt_key(Conversation([system, user], tools))
    assert key == prompt_key(Conversation([system, {"role": "user", "content": "other"}], tools))
    assert key != prompt_key(Conversation([user], tools))
    assert key != prompt_key(Conversation([system, user], None))
    assert key != prompt_key(Conversation([{"role": "system", "content": "be long"}, user], tools))


def test_the_config_checks_its_fields_and_round_trips_through_yaml(tmp_path):
    with pytest.raises(ValueError, match="train_on must be one of 'all', 'last'"):
        SFTConfig(train_on="first")
    with pytest.raises(ValueError, match="SFTConfig") as error:
        SFTConfig(batch_tokens=0, num_steps=2, warmup_steps=5)
    assert "batch_tokens" in str(error.value) and "warmup_steps" in str(error.value)
    with pytest.raises(ValueError, match="unknown SFTConfig key 'batch_size'"):
        SFTConfig.from_dict({"batch_size": 8})
    config = SFTConfig(run_name="r", learning_rate=1, train_on="last", wandb_project=None)
    assert config.learning_rate == 1.0
    path = config.to_yaml(tmp_path / "config.yaml")
    assert SFTConfig.from_yaml(path) == config


def test_docs_sft_md_has_a_row_for_every_field_and_no_other():
    from dataclasses import fields

    from post_training_cookbook.runs.composed import sections

    text = (Path(__file__).parents[1] / "docs" / "sft.md").read_text()
    table = text.split("## SFTConfig", 1)[1]
    documented = [line.split("`")[1] for line in table.splitlines() if line.startswith("| `")]
    held = sections(SFTConfig)
    by_path = [
        *(f"{name}.{f.name}" for name, kind in held.items() for f in fields(kind)),
        *(f.name for f in fields(SFTConfig) if f.name not in held),
    ]
    assert documented == by_path
