"""Would greedy decoding write the tool-call tags, and open each reply, as the demonstrations do?

    python recipes/bfcl/tag_probe.py OUT [STEP] [--conversations N]

Scores the first N (default 1) demonstrations of ``OUT/demos.jsonl`` with the SFT run's
final model (or its checkpoint STEP; ``0``: the start model), and prints, at each trained
position whose target is ``<tool_call>`` or ``</tool_call>``, the tag's log-probability and
the token the model ranks first; the same at the first token of each assistant reply (a call's
tag, or the text that ends a user turn). A model that ranks something else first (``<|im_start|>``,
a piece of the tag's text) writes no parseable call however good the call itself is
(``docs/models.md``, "Untrained special tokens"). Costs one forward of each conversation.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from qwen_coder import TOOL_CALL_TAGS

from post_training_cookbook.models import ModelInfo, resolve_model
from post_training_cookbook.models.loading import load_codec, load_model
from post_training_cookbook.runs.models import load_eval_weights, resolve_eval_model
from post_training_cookbook.sft.config import SFTConfig
from post_training_cookbook.sft.conversations import read_conversations
from post_training_cookbook.sft.data import render_examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("step", type=int, nargs="?")
    parser.add_argument("--conversations", type=int, default=1)
    args = parser.parse_args()
    config = SFTConfig.from_yaml(args.out / "sft" / "config.yaml")
    info = resolve_model(config.model, codec=config.codec)
    codec = load_codec(info)
    scored = (  # a run's checkpoint is merged into its base as evaluate does
        resolve_model(config.model, codec=config.codec)
        if args.step == 0
        else resolve_eval_model(str(args.out / "sft"), step=args.step, config_type=SFTConfig)
    )
    model = (
        load_model(scored, torch.float32)
        if isinstance(scored, ModelInfo)
        else load_eval_weights(scored, torch.float32)
    )
    print(f"scoring {scored.model_id if isinstance(scored, ModelInfo) else scored.name}")
    conversations = read_conversations(args.out / "demos.jsonl")[: args.conversations]
    examples = render_examples(codec, conversations, "all", config.max_model_length).examples
    tags = {codec.tokenizer.convert_tokens_to_ids(t) for t in TOOL_CALL_TAGS}
    name = codec.tokenizer.convert_ids_to_tokens
    wins = {"tag": [0, 0], "reply opening": [0, 0]}
    with torch.no_grad():
        for example in examples:
            logits = model(torch.tensor([example.tokens])).logits[0].float()
            logprobs = logits.log_softmax(-1)
            for position in range(1, len(example.tokens)):
                target = example.tokens[position]
                opens = example.mask[position] and not example.mask[position - 1]
                if not example.mask[position] or not (target in tags or opens):
                    continue
                kind = "tag" if target in tags else "reply opening"
                row = logprobs[position - 1]
                best = int(row.argmax())
                wins[kind][0] += best == target
                wins[kind][1] += 1
                print(
                    f"{kind:>13} {name(target)!r:>16} lp {row[target].item():7.3f}   first: "
                    f"{name(best)!r} lp {row[best].item():.3f}"
                )
    for kind, (won, total) in wins.items():
        print(f"{kind}: the demonstration's token ranked first at {won} of {total} positions")


if __name__ == "__main__":
    main()
