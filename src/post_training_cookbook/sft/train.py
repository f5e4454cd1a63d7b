"""Supervised fine-tuning: the loss is the mean cross-entropy over assistant tokens.

A conversation is rendered by the model's codec, which marks the tokens the model would have
sampled (assistant content, tool calls, the closing stop token) with mask 1; everything else
(system and user turns, tool results, template glue) is context only.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from post_training_cookbook.codecs import Codec
from post_training_cookbook.types import Message, ToolSpec


@dataclass(frozen=True)
class SFTConfig:
    learning_rate: float = 1e-3
    """Peak learning rate, reached after ``warmup_steps`` and decayed by a cosine."""
    batch_size: int = 32
    """Conversations per optimizer step."""
    num_steps: int = 1000
    warmup_steps: int = 30
    min_learning_rate_ratio: float = 0.1
    """The cosine ends at ``learning_rate * min_learning_rate_ratio``."""
    weight_decay: float = 0.1
    adam_betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = 1.0
    max_length: int = 1024
    """Longer examples are dropped (and counted) rather than silently cut."""
    autocast_bf16: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("learning_rate", "batch_size", "num_steps", "max_length", "max_grad_norm"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SFTConfig.{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.warmup_steps < self.num_steps:
            raise ValueError("SFTConfig.warmup_steps must be in [0, num_steps)")
        if not 0 <= self.min_learning_rate_ratio <= 1:
            raise ValueError("SFTConfig.min_learning_rate_ratio must be in [0, 1]")

    def learning_rate_at(self, step: int) -> float:
        """Linear warmup, then cosine decay to ``min_learning_rate_ratio``."""
        if step < self.warmup_steps:
            return self.learning_rate * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.num_steps - self.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        floor = self.min_learning_rate_ratio
        return self.learning_rate * (floor + (1 - floor) * cosine)


@dataclass(frozen=True)
class SFTExample:
    tokens: list[int]
    mask: list[int]
    """1 on the tokens trained on (the assistant's), 0 on context."""


@dataclass(frozen=True)
class SFTStepLog:
    step: int
    loss: float
    learning_rate: float
    grad_norm: float
    trained_tokens: int


def tokenize_conversations(
    codec: Codec, conversations: Iterable[tuple[list[Message], list[ToolSpec] | None]]
) -> list[SFTExample]:
    """Render each ``(messages, tools)`` conversation with its assistant mask."""
    examples = []
    for messages, tools in conversations:
        tokens, mask = codec.render_conversation(messages, tools)
        examples.append(SFTExample(tokens=tokens, mask=mask))
    return examples


def _collate(batch: Sequence[SFTExample], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Right-padded ids, attention mask, and labels that are -100 off the assistant mask."""
    width = max(len(example.tokens) for example in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for row, example in enumerate(batch):
        length = len(example.tokens)
        ids[row, :length] = torch.tensor(example.tokens)
        attention[row, :length] = 1
        trained = torch.tensor(example.mask, dtype=torch.bool)
        labels[row, :length] = torch.where(trained, ids[row, :length], -100)
    return ids, attention, labels


def _length_bucketed_batches(
    examples: Sequence[SFTExample], batch_size: int, rng: random.Random
) -> list[list[SFTExample]]:
    """One epoch of batches: shuffled, then sorted by length within windows of 16 batches so
    that a batch pads little, while batch order stays random."""
    order = rng.sample(range(len(examples)), len(examples))
    window = 16 * batch_size
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: len(examples[i].tokens))
        batches += [
            [examples[i] for i in chunk[offset : offset + batch_size]]
            for offset in range(0, len(chunk), batch_size)
        ]
    rng.shuffle(batches)
    return batches


def train_sft(
    model: PreTrainedModel,
    examples: Sequence[SFTExample],
    config: SFTConfig,
    *,
    pad_token_id: int,
    on_step: Callable[[SFTStepLog], None] | None = None,
) -> list[SFTStepLog]:
    """Train ``model`` in place on ``examples`` (sampled without replacement, epoch by epoch)."""
    usable = [example for example in examples if len(example.tokens) <= config.max_length]
    if not usable:
        raise ValueError(f"no SFT example fits max_length={config.max_length}")
    if not any(any(example.mask) for example in usable):
        raise ValueError("no SFT example has an assistant token to train on")
    rng = random.Random(config.seed)
    torch.manual_seed(config.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=config.learning_rate,
        betas=config.adam_betas,
        weight_decay=config.weight_decay,
    )
    batches: list[list[SFTExample]] = []
    logs = []
    model.train()
    for step in range(config.num_steps):
        if not batches:
            batches = _length_bucketed_batches(usable, config.batch_size, rng)
        batch = batches.pop()
        ids, attention, labels = _collate(batch, pad_token_id)
        learning_rate = config.learning_rate_at(step)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.autocast_bf16):
            loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log = SFTStepLog(step, loss.item(), learning_rate, grad_norm, int((labels >= 0).sum()))
        logs.append(log)
        if on_step is not None:
            on_step(log)
    model.eval()
    return logs
