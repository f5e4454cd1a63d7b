"""Training time and memory of one step: padded rows vs packed streams vs packed streams
with shared prefixes (``trainer_packing``), side by side in one run, on synthetic shapes or
on batches recorded from real runs.

    python benchmarks/packing.py                       # every shape, at reduced depth
    python benchmarks/packing.py --shapes long --layers 30
    python benchmarks/packing.py --batches benchmarks/batches/game_step50.json.gz

Recorded batches (``--batches``; ``grpo/recorded_batch.py`` writes them, ``benchmarks/batches/``
holds the committed ones): the episodes, advantages and group structure one step of a real
run trained on, with the run's trainer settings (LoRA, checkpointing, micro-batch) and loss;
only ``off`` and ``shared_prefix`` unless ``--modes`` says otherwise. The model is the one the
file names, its real weights: the bundled model, or the recipes' local folders of
Qwen2.5-Coder-0.5B-Instruct (``recipes/bfcl/qwen_coder.py``) and SmolLM2-135M-Instruct
(``recipes/sft/smollm2.py``); ``--model`` gives another folder. A batch recorded from an older
rollout dump has no sampler log-probabilities: each layout fills them with its own, in a
process of its own (ratio 1: an on-policy step at these weights, which every layout computes
alike). ``--fill-layout off`` fills every layout from the padded one's instead; under bf16
autocast the layouts' log-probabilities differ by rounding, so the other layouts' ratios are
then 1 only up to it, which on the BFCL batch (a 4,686-token prompt) moved the shared-prefix
gradient 0.11 from the padded one, against 5.8e-2 vs 6.0e-2 from the fp32 update with each its
own (docs/performance.md).

Shapes (random weights of a real config; nothing is downloaded; the episodes are token
ids shaped like a rollout's: a group's prompt, then sampled turns with forced tool results
between them, each episode's turns its own):

- ``recipe``: the bundled recipe's batch (``recipes/grpo/tool_use_game.py``): the bundled
  4.5M model, full weight, 16 tasks × 8 episodes, the game's 78-token prompt (as the
  hermes codec renders it), 3 turns of 24 sampled tokens with 12-token tool results.
- ``smollm2``: SmolLM2-135M's shape (Llama: hidden 576, 30 layers, 9/3 heads, vocabulary
  49,152), LoRA, 4 tasks × 4 episodes, a 390-token prompt, 3 turns of 64 tokens (with
  16-token tool results): issue 27's side-by-side shape.
- ``long``: the same model, a 2,000-token tool prompt, 8 episodes a group, 2 turns.
- ``hybrid``: a Gated DeltaNet hybrid (transformers' ``Qwen3_5ForCausalLM``: Qwen3.5's
  layout of 3 linear-attention layers to 1 full-attention layer, its head shapes at
  reduced width: hidden 512, 4 query / 1 KV heads of 128, 4 key / 8 value linear heads of
  128; a 32,768-token vocabulary, so that the LM head, the same in every layout, does not
  dwarf a 4-layer decoder), LoRA, one group of 8 completions of 128 tokens sharing a
  1,000-token prompt: issue 38's shape (``trainer/linear_attention.py``). ``--layers``
  sets its depth too (a multiple of 4 keeps the 3:1 pattern).

Each (shape, mode) runs in a fresh subprocess, so that its peak resident set is its own:
one warm-up step (AdamW's moments exist), then ``--steps`` measured ones
(``forward_backward`` + ``optim_step``). Columns: tokens the decoder processes (padding
included), trained tokens, seconds a step, trained tokens per second, the peak of training
above what the built trainer held, the first step's loss, and ``grad Δ``: the relative
difference ‖g − g_off‖ / ‖g_off‖ of the first step's gradients from the padded layout's,
which says whether a layout computes the same update (within 1e-4 in fp32, 3e-2 under bf16
autocast: a larger one is reported, and the run exits with status 1; ``--keep-grads`` and
``--reference-grads`` measure how far bf16 itself moves each layout's gradient from the fp32
padded one, and with a reference a bf16 gap between layouts passes up to that distance of the
padded bf16 gradient when it is past 3e-2: on a long batch bf16 moves the update by more).
Ratios are to ``off`` (padded rows). The peak is the process's peak resident set (``VmHWM``) over
the warm-up and measured steps minus the resident set once the trainer is built (CPU), or
the peak allocated above the allocated weights (CUDA): the warm-up step is counted because
on CPU the allocator keeps what it took, so the growth of a later step alone reads low
for whichever layout's warm-up already reached its peak.

The trainer's settings are ``GRPOConfig``'s defaults unless given: ``micro_batch_tokens``
(2,048 on a CPU; a stream sharing a prefix up to the largest that fits) and gradient
checkpointing from the memory plan (``memory_budget`` 0.5 of free memory), the default
log-probability chunk; a recorded batch's are its run's. ``--fp32`` turns bf16 autocast off
(the check of the update at fp32 tolerance).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import transformers

from post_training_cookbook.files import BadFileError
from post_training_cookbook.grpo.recorded_batch import RecordedBatch, read_recorded_batch
from post_training_cookbook.models import BUNDLED_MODEL_ID, resolve_model
from post_training_cookbook.trainer.packing import stream_tokens
from post_training_cookbook.trainer.trainer import Trainer
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings, TrainingSample

sys.path.insert(0, str(Path(__file__).parent))
from memory import peak_bytes, reset_peak, resident_bytes

SMOLLM2_135M = {
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True, "hidden_act": "silu",
}  # fmt: skip


HYBRID_SMALL = {
    "vocab_size": 32768, "hidden_size": 512, "intermediate_size": 1536,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 128,
    "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 8192, "tie_word_embeddings": True, "hidden_act": "silu",
}  # fmt: skip


@dataclass(frozen=True)
class Shape:
    groups: int
    episodes: int
    prompt: int
    turns: int
    sampled: int
    tool_result: int
    use_lora: bool


SHAPES = {
    "recipe": Shape(16, 8, 78, 3, 24, 12, use_lora=False),
    "smollm2": Shape(4, 4, 390, 3, 64, 16, use_lora=True),
    "long": Shape(1, 8, 2000, 2, 64, 16, use_lora=True),
    "hybrid": Shape(1, 8, 1000, 1, 128, 0, use_lora=True),
}
MODES = ("off", "packed", "shared_prefix")
BATCH_MODES = ("off", "shared_prefix")
RECIPES = Path(__file__).parents[1] / "recipes"
RECIPE_MODELS = {  # a recorded batch's model name: (recipe folder, module, folder function)
    "qwen2.5-coder-0.5b-instruct": ("bfcl", "qwen_coder", "qwen_coder_folder"),
    "smollm2-135m-instruct": ("sft", "smollm2", "smollm2_folder"),
}
SAME_UPDATE = {False: 1e-4, True: 3e-2}
"""The largest relative gradient difference from the padded layout that is the same update,
in fp32 and under bf16 autocast (``tests/test_trainer_packing.py``'s tolerances)."""


@dataclass
class Row:
    shape: str
    mode: str
    processed_tokens: int
    trained_tokens: int
    seconds: float
    peak_step_bytes: int
    loss: float
    """The first step's (every layout starts from the same weights)."""
    autocast_bf16: bool
    settings: str
    """What the trainer ran with: micro-batch tokens, checkpointing, log-prob chunk."""


def episodes(shape: Shape, vocab: int) -> list[TrainingSample]:
    rng = random.Random(0)
    samples = []
    for _ in range(shape.groups):
        prompt = [rng.randrange(vocab) for _ in range(shape.prompt)]
        for _ in range(shape.episodes):
            tokens, mask = list(prompt), [0.0] * shape.prompt
            for turn in range(shape.turns):
                tokens += [rng.randrange(vocab) for _ in range(shape.sampled)]
                mask += [1.0] * shape.sampled
                if turn < shape.turns - 1:
                    tokens += [rng.randrange(vocab) for _ in range(shape.tool_result)]
                    mask += [0.0] * shape.tool_result
            advantage = rng.choice([-1.0, 1.0])
            samples.append(
                TrainingSample(
                    tokens, mask, [-9.0 * m for m in mask], [advantage * m for m in mask]
                )
            )
    return samples


def build_model(name: str, layers: int | None) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if name == "recipe":
        source = resolve_model(BUNDLED_MODEL_ID).source
        return transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    if name == "hybrid":
        text = transformers.Qwen3_5TextConfig(**HYBRID_SMALL, num_hidden_layers=layers or 4)
        return transformers.Qwen3_5ForCausalLM(text)
    config = dict(SMOLLM2_135M)
    if layers is not None:
        config["num_hidden_layers"] = layers
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))


def batch_model_source(name: str, given: str | None) -> str:
    """Where the weights of a recorded batch's model are: ``given``, a recipe's local folder,
    a catalog id's or a local folder."""
    if given is not None:
        return given
    if name in RECIPE_MODELS:
        folder, module, function = RECIPE_MODELS[name]
        sys.path.insert(0, str(RECIPES / folder))
        return str(getattr(importlib.import_module(module), function)())
    return str(resolve_model(name).source)


def batch_trainer(args: argparse.Namespace, batch: RecordedBatch) -> Trainer:
    """The recorded run's trainer, in ``args.mode``'s layout."""
    settings: TrainerSettings = replace(
        batch.trainer, packing=args.mode != "off", shared_prefix=args.mode == "shared_prefix",
        device=args.device, seed=0,
        micro_batch_tokens=args.micro_batch_tokens or batch.trainer.micro_batch_tokens,
        autocast_bf16=False if args.fp32 else batch.trainer.autocast_bf16,
        **({} if args.logprob_chunk_tokens is None
           else {"logprob_chunk_tokens": args.logprob_chunk_tokens}),
    )  # fmt: skip
    source = batch_model_source(batch.source.model, args.model)
    vocab = transformers.AutoConfig.from_pretrained(source).vocab_size
    largest = max(max(sample.tokens) for sample in batch.samples)
    if largest >= vocab:
        raise SystemExit(
            f"{args.batch}: token id {largest} is outside {source}'s vocabulary of {vocab}: "
            f"not the model ({batch.source.model!r}) the batch was recorded with"
        )
    return Trainer(source, settings)


def sampled_with(batch: RecordedBatch, fill: Path) -> list[TrainingSample]:
    """The batch's samples with sampler log-probabilities: the recorded ones, or else a
    layout's own (``write_fill``: the measured layout's, or ``--fill-layout``'s)."""
    if batch.source.sampler_logprobs_recorded:
        return batch.samples
    return batch.with_sampler_logprobs(json.loads(fill.read_text())).samples


def write_fill(args: argparse.Namespace) -> None:
    """The padded trainer's log-probabilities of the batch, in a process of its own (the
    forward would otherwise count in the resident set the measured layout starts from)."""
    batch = read_recorded_batch(args.batch)
    Path(args.fill).write_text(json.dumps(batch_trainer(args, batch).forward(batch.samples)))


def measure(args: argparse.Namespace) -> Row:
    if args.batch is not None:
        batch = read_recorded_batch(args.batch)
        trainer = batch_trainer(args, batch)
        samples, loss = sampled_with(batch, Path(args.fill)), batch.loss
    else:
        shape = SHAPES[args.shape]
        model = build_model(args.shape, args.layers)
        samples, loss = episodes(shape, model.config.vocab_size), LossConfig()
        given = (
            {}
            if args.logprob_chunk_tokens is None
            else {"logprob_chunk_tokens": args.logprob_chunk_tokens}
        )
        settings = TrainerSettings(
            use_lora=shape.use_lora, micro_batch_tokens=args.micro_batch_tokens, seed=0,
            packing=args.mode != "off", shared_prefix=args.mode == "shared_prefix",
            device=args.device, gradient_checkpointing=None,
            autocast_bf16=False if args.fp32 else None, **given,
        )  # fmt: skip
        trainer = Trainer(model, settings)
    assert trainer.packing_mode == args.mode
    device = trainer.device
    resident = resident_bytes(device)
    reset_peak(device)
    first = trainer.forward_backward(samples, loss)
    # torch.save writes the gradients' storage as it is: no copy adds to the peak
    gradients = {n: p.grad for n, p in trainer.trainable_parameters().items() if p.grad is not None}
    torch.save(gradients, args.grads)
    trainer.optim_step(1e-6)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        trainer.forward_backward(samples, loss)
        trainer.optim_step(1e-6)
    synchronize(device)  # the optimizer's CUDA work may still be queued
    seconds = (time.perf_counter() - start) / args.steps
    peak = peak_bytes(device) - resident
    processed = stream_tokens(
        samples, trainer.micro_batch_tokens, trainer.packing_mode, trainer.shared_stream_tokens
    )
    trained = sum(s.num_trained_tokens for s in samples)
    settings = (
        f"micro_batch_tokens={trainer.micro_batch_tokens} "
        f"shared_stream_tokens={trainer.shared_stream_tokens} "
        f"gradient_checkpointing={trainer.gradient_checkpointing} "
        f"logprob_chunk_tokens={trainer.logprob_chunk_tokens} "
        f"autocast_bf16={trainer.autocast_bf16} lora={trainer.use_lora}"
    )
    name = Path(args.batch).name.split(".")[0] if args.batch else args.shape
    return Row(name, args.mode, processed, trained, seconds, peak, first.loss,
               trainer.autocast_bf16, settings)  # fmt: skip


def child(which: list[str], options: list[str]) -> str:
    """Run this script on one variant in a fresh process; its standard output."""
    done = subprocess.run(
        [sys.executable, __file__, *which, *options], capture_output=True, text=True
    )
    if done.returncode != 0:
        sys.exit(f"{' '.join(which + options)} failed:\n{done.stderr[-4000:]}")
    return done.stdout


def gradient_difference(grads: Path, plain_grads: Path) -> float:
    """‖g − g_off‖ / ‖g_off‖ over every trainable tensor."""
    mine, plain = torch.load(grads), torch.load(plain_grads)
    if mine.keys() != plain.keys():
        return float("inf")
    difference = sum(float((mine[n].float() - plain[n].float()).pow(2).sum()) for n in plain)
    norm = sum(float(plain[n].float().pow(2).sum()) for n in plain)
    return (difference / max(norm, 1e-30)) ** 0.5


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), help="default: all of them "
                        "without --batches, none with")  # fmt: skip
    parser.add_argument("--batches", nargs="+", default=[], metavar="FILE",
                        help="recorded batches (grpo/recorded_batch.py)")  # fmt: skip
    parser.add_argument("--modes", nargs="+", choices=MODES, help="default: every layout for "
                        "shapes, off and shared_prefix for recorded batches")  # fmt: skip
    parser.add_argument("--model", help="with --batches: the model folder to load")
    parser.add_argument(
        "--layers", type=int, default=4, help="depth of the SmolLM2 (30) and hybrid shapes"
    )
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--micro-batch-tokens", type=int, help="default: the memory plan's")
    parser.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    parser.add_argument("--logprob-chunk-tokens", type=int, help="default: the trainer's")
    parser.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    parser.add_argument(
        "--keep-grads",
        type=Path,
        metavar="DIR",
        help="save each layout's first-step gradient: DIR/<shape or batch>_<layout>_<fp32|bf16>.pt",
    )
    parser.add_argument(
        "--reference-grads",
        type=Path,
        metavar="DIR",
        help="also print each layout's distance from DIR/<shape or batch>_off_fp32.pt (a --fp32 "
        "--keep-grads run's padded gradient): how far bf16 moves the update",
    )
    for hidden in ("--shape", "--mode", "--batch", "--fill", "--grads"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--fill-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--fill-layout", choices=("own", *MODES), default="own",
        help="whose log-probabilities fill a recorded batch that has no sampler log-probabilities: "
        "each layout its own (default: every layout's importance ratios are 1), or one layout's "
        "for all",
    )  # fmt: skip
    args = parser.parse_args()
    if args.fill_only:
        write_fill(args)
        return
    if args.mode is not None:  # one variant, in its own process
        print(json.dumps(asdict(measure(args))))
        return
    common = ["--layers", str(args.layers), "--steps", str(args.steps)]
    for flag, value in (
        ("--micro-batch-tokens", args.micro_batch_tokens),
        ("--logprob-chunk-tokens", args.logprob_chunk_tokens),
        ("--device", args.device),
        ("--model", args.model),
    ):
        if value is not None:
            common += [flag, str(value)]  # fmt: skip
    if args.fp32:
        common.append("--fp32")
    shapes = args.shapes or ([] if args.batches else list(SHAPES))
    try:  # a file that is not a recorded batch of this version: say so before anything runs
        recorded = {path: read_recorded_batch(path) for path in args.batches}
    except BadFileError as exc:
        sys.exit(f"error: {exc}")
    print(
        f"torch threads {torch.get_num_threads()}, SmolLM2 and hybrid shapes at "
        f"{args.layers} layers, load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'shape':20} {'mode':14} {'processed':>9} {'trained':>7} {'s/step':>7} {'trained/s':>9}"
          f" {'peak MiB':>8} {'loss':>10} {'grad Δ':>7}  time×  memory×")  # fmt: skip
    differ = False
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        variants = [(["--shape", shape], args.modes or MODES) for shape in shapes] + [
            (["--batch", batch], args.modes or BATCH_MODES) for batch in args.batches
        ]
        for number, (which, modes) in enumerate(variants):
            rows: dict[str, Row] = {}
            for mode in modes:
                grads = work / f"grads{number}_{mode}.pt"
                filled = []
                if "--batch" in which:
                    filler = mode if args.fill_layout == "own" else args.fill_layout
                    filled = ["--fill", str(work / f"fill{number}_{filler}.json")]
                    missing = not recorded[which[1]].source.sampler_logprobs_recorded
                    if missing and not Path(filled[1]).exists():
                        child([*which, *filled], ["--mode", filler, "--fill-only", *common])
                output = child([*which, *filled], ["--mode", mode, "--grads", str(grads), *common])
                row = rows[mode] = Row(**json.loads(output.strip().splitlines()[-1]))
                plain = rows[modes[0]]
                delta = gradient_difference(grads, work / f"grads{number}_{modes[0]}.pt")
                label = Path(which[1]).name.removesuffix(".json.gz")
                precision = "fp32" if args.fp32 else "bf16"
                if args.keep_grads is not None:
                    args.keep_grads.mkdir(parents=True, exist_ok=True)
                    shutil.copy(grads, args.keep_grads / f"{label}_{mode}_{precision}.pt")
                reference = args.reference_grads and args.reference_grads / f"{label}_off_fp32.pt"
                far = (
                    gradient_difference(grads, reference)
                    if reference and reference.exists()
                    else None
                )
                if mode == modes[0]:
                    bf16_scale = far if row.autocast_bf16 and far is not None else 0.0
                # Under bf16, layouts that differ by less than bf16 moves the padded update
                # from fp32 compute the same update as far as bf16 can tell.
                same = delta <= max(SAME_UPDATE[row.autocast_bf16], bf16_scale)
                differ |= not same
                print(
                    f"{row.shape:20} {mode:14} {row.processed_tokens:9d} {row.trained_tokens:7d} "
                    f"{row.seconds:7.2f} {row.trained_tokens / row.seconds:9.0f} "
                    f"{row.peak_step_bytes / 2**20:8.0f} {row.loss:10.3e} {delta:7.1e}"
                    f"{'' if same else '!'} {row.seconds / plain.seconds:5.2f}  "
                    f"{row.peak_step_bytes / max(plain.peak_step_bytes, 1):7.2f}  {row.settings}",
                    flush=True,
                )
                if far is not None:
                    print(f"{'':36}{precision} {mode} from the fp32 padded gradient: {far:.1e}")
    if differ:
        sys.exit("a layout's gradients differ from the padded layout's (marked !)")


if __name__ == "__main__":
    main()
