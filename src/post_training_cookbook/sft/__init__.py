"""Supervised fine-tuning on conversations, on the trainer service GRPO uses: the loss on the
assistant's tokens only (docs/sft.md). ``collect_demonstrations`` makes such conversations
from an env's episodes."""

from post_training_cookbook.sft.config import SFTConfig, TrainOn
from post_training_cookbook.sft.conversations import (
    Conversation,
    SFTDataError,
    load_conversations,
    read_conversations,
)
from post_training_cookbook.sft.data import SFTExample, render_examples
from post_training_cookbook.sft.demonstrations import (
    Demonstrations,
    ScriptedChat,
    ScriptedPolicy,
    collect_demonstrations,
)
from post_training_cookbook.sft.train import train_sft

__all__ = [
    "Conversation",
    "Demonstrations",
    "SFTConfig",
    "SFTDataError",
    "SFTExample",
    "ScriptedChat",
    "ScriptedPolicy",
    "TrainOn",
    "collect_demonstrations",
    "load_conversations",
    "read_conversations",
    "render_examples",
    "train_sft",
]
