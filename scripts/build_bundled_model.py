"""Build the bundled tool-use model from scratch, reproducibly, on CPU.

    python scripts/build_bundled_model.py            # ~80 min on one core

1. Play the tool-use game's TRAIN split with the oracle and the imperfect player
   (``envs/tool_use_game/scripted_player.py``) to get conversations. Each episode is played in a
   copy of the world with freshly drawn values, so the model cannot memorise the facts of
   the train entities: it has to learn to copy values from tool results.
2. Train a byte-level BPE tokenizer on those conversations, rendered by the Hermes chat
   template. Entity names are split into their syllables and digits into single tokens, so
   the tokenizer cannot memorise names or numbers (validation entities are never seen).
3. Initialise a small Llama model and fine-tune it with ``post_training_cookbook.sft``
   (assistant tokens only).
4. Save weights (safetensors), tokenizer and chat template to the package, then measure
   calibration on the VALIDATION split with ``scripts/calibrate_bundled_model.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import render_jinja_template

from post_training_cookbook.codecs import HERMES_CHAT_TEMPLATE, get_codec
from post_training_cookbook.envs.tool_use_game import (
    TOOL_USE_GAME_TRAIN_TASKS,
    ToolUseGameEnv,
    default_world,
)
from post_training_cookbook.envs.tool_use_game.scripted_player import (
    BUNDLED_MODEL_PLAYER,
    ORACLE,
    PlayerMistakes,
    play_episode,
)
from post_training_cookbook.envs.tool_use_game.world import SYLLABLES
from post_training_cookbook.models.bundled import BUNDLED_MODEL_DIR
from post_training_cookbook.sft import SFTConfig, SFTStepLog, tokenize_conversations, train_sft
from post_training_cookbook.types import Message, ToolSpec

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
Conversation = tuple[list[Message], list[ToolSpec]]


def player_conversations(
    num_episodes: int, seed: int, errors: PlayerMistakes = BUNDLED_MODEL_PLAYER
) -> list[Conversation]:
    """Teacher episodes on the train split, cycling through its tasks in shuffled order."""
    rng = random.Random(seed)
    tasks = list(TOOL_USE_GAME_TRAIN_TASKS)
    world = default_world()

    async def play_all() -> list[Conversation]:
        conversations = []
        for index in range(num_episodes):
            if index % len(tasks) == 0:
                rng.shuffle(tasks)
            # a world with fresh values per episode: facts must be read, not memorised
            env = ToolUseGameEnv(world.revalued(rng))
            messages, _ = await play_episode(env, tasks[index % len(tasks)], rng, errors)
            conversations.append((messages, env.tool_specs))
        return conversations

    return asyncio.run(play_all())


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE without word boundaries, so template boilerplate compresses into few
    tokens. Entity names always split into their syllables, so no name is memorised (the
    validation entities are never seen in training). Two choices make copying a tool's
    result cheap for a tiny model: a digit run is one pre-token (BPE merges every value of
    the game, 2-99, into one token), and ``<tool_response>`` is ordinary text, which BPE
    merges with its newlines into one marker token right before the value."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("|".join(SYLLABLES)), behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=48,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=HERMES_CHAT_TEMPLATE,
        model_max_length=2048,
    )
    return wrapped


def build_model(
    tokenizer: PreTrainedTokenizerFast, seed: int, layers: int = 4, heads: int = 4
) -> LlamaForCausalLM:
    """A small Llama. (Not Qwen2: transformers 5 loads the tokenizer of any ``qwen2``-type
    folder as ``Qwen2Tokenizer``, which swaps in Qwen's pre-tokenizer, so ``AutoTokenizer``
    would silently tokenize differently from the tokenizer trained here.)"""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=640,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=0.02,
        bos_token_id=tokenizer.pad_token_id,  # <|endoftext|>
        eos_token_id=tokenizer.eos_token_id,  # <|im_end|>
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=BUNDLED_MODEL_DIR)
    parser.add_argument("--episodes", type=int, default=60_000)
    parser.add_argument("--vocab-size", type=int, default=1536)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-bf16", dest="bf16", action="store_false", help="train in fp32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-every", type=int, default=250)
    parser.add_argument(
        "--oracle-fraction",
        type=float,
        default=0.5,
        help="share of the steps trained on the oracle's episodes first",
    )
    parser.add_argument(
        "--player-learning-rate",
        "--teacher-learning-rate",  # its old name, kept for one release
        type=float,
        default=None,
        help="peak lr of the player phase (default: --learning-rate); a lower one keeps the "
        "copying learned on the oracle's episodes while taking on the player's habits",
    )
    parser.add_argument(
        "--from-oracle-checkpoint",
        type=Path,
        default=None,
        help="skip the oracle phase: start the player phase from the checkpoint an earlier "
        "build with the same arguments saved at the phase's end (checkpoints/step_N); each "
        "phase seeds its own data order and optimizer, so the player phase runs as it would "
        "in a build from scratch",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.time()

    # Curriculum: the oracle's clean episodes first (every number the model writes is one
    # it can copy from its context), then the imperfect player whose mistakes RL will fix.
    oracle = player_conversations(args.episodes // 3, args.seed + 1, ORACLE)
    conversations = player_conversations(args.episodes, args.seed)
    print(f"[build] {len(oracle)} oracle + {len(conversations)} player episodes")
    texts = [
        render_jinja_template(
            [[dict(m) for m in messages]],
            tools=[dict(tool) for tool in tools],
            chat_template=HERMES_CHAT_TEMPLATE,
        )[0][0]
        for messages, tools in conversations[:5000]
    ]
    tokenizer = train_tokenizer(texts, args.vocab_size)
    codec = get_codec("hermes", tokenizer, default_system=None)
    oracle_examples = tokenize_conversations(codec, oracle)
    examples = tokenize_conversations(codec, conversations)
    lengths = sorted(len(example.tokens) for example in examples)
    trained = sum(sum(example.mask) for example in examples)
    print(
        f"[build] tokenizer: {len(tokenizer)} tokens; episode tokens median "
        f"{lengths[len(lengths) // 2]}, max {lengths[-1]}; trained share "
        f"{trained / sum(lengths):.2f} ({time.time() - started:.0f}s)"
    )

    model = build_model(tokenizer, args.seed, args.layers, args.heads)
    print(f"[build] model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    args.out.mkdir(parents=True, exist_ok=True)
    oracle_steps = round(args.steps * args.oracle_fraction)
    player_learning_rate = args.player_learning_rate or args.learning_rate
    phases = [
        ("oracle", oracle_examples, oracle_steps, args.learning_rate),
        ("player", examples, args.steps - oracle_steps, player_learning_rate),
    ]
    done = 0
    if args.from_oracle_checkpoint is not None:
        model = load_oracle_checkpoint(args.from_oracle_checkpoint, tokenizer)
        phases, done = phases[1:], oracle_steps
        print(f"[build] oracle phase loaded from {args.from_oracle_checkpoint}")
    for phase, phase_examples, steps, learning_rate in phases:
        if steps <= 0:
            continue
        config = SFTConfig(
            learning_rate=learning_rate,
            batch_size=args.batch_size,
            num_steps=steps,
            warmup_steps=min(50, steps // 10),
            seed=args.seed,
            autocast_bf16=args.bf16,
        )

        def on_step(log: SFTStepLog, phase: str = phase, offset: int = done) -> None:
            step = offset + log.step
            if log.step % 50 == 0:
                print(
                    f"[sft:{phase}] step {step:5d} loss {log.loss:.4f} "
                    f"lr {log.learning_rate:.2e} grad {log.grad_norm:.2f} "
                    f"({time.time() - started:.0f}s)",
                    flush=True,
                )
            if (step + 1) % args.checkpoint_every == 0:
                save(model, tokenizer, args.out / "checkpoints" / f"step_{step + 1}")

        train_sft(
            model, phase_examples, config, pad_token_id=tokenizer.pad_token_id, on_step=on_step
        )
        done += steps
    save(model, tokenizer, args.out)
    (args.out / "build_args.json").write_text(json.dumps(vars(args), default=str, indent=2))
    print(f"[build] saved to {args.out} ({time.time() - started:.0f}s)")


def load_oracle_checkpoint(folder: Path, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    saved = PreTrainedTokenizerFast.from_pretrained(folder)
    if saved.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"{folder} was built with other arguments: its tokenizer differs")
    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    main(sys.argv[1:])
