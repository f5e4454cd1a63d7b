"""Supervised fine-tuning on conversations: cross-entropy on the assistant's tokens only."""

from post_training_cookbook.sft.train import (
    SFTConfig,
    SFTExample,
    SFTStepLog,
    tokenize_conversations,
    train_sft,
)

__all__ = ["SFTConfig", "SFTExample", "SFTStepLog", "tokenize_conversations", "train_sft"]
