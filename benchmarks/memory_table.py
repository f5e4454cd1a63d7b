"""The trainer's peak memory per model size, computed from the formula in docs/models.md.

Computed, not measured: it prints the "Memory" table of ``docs/models.md`` (one GRPO
micro-batch's backward on one GPU) from each model's config numbers, written out below.
The activation coefficients were checked against the bytes autograd saves for backward
in one Qwen2 decoder layer of the 0.5B and 8B shapes on CPU (bf16 weights: 57.4 and 184.5 KB
a token a layer, the formula's 57.3 and 184.3); ``benchmarks/memory.py`` measures whole
steps.

    python benchmarks/memory_table.py                      # micro-batch 8192 tokens, 3/8 trained
    python benchmarks/memory_table.py --tokens 16384 --trained 0.5
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

GB = 1e9
LORA_RANK = 16  # on q, k, v, o, gate, up, down: the trainer's DEFAULT_LORA_TARGETS


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int  # h
    mlp: int  # I
    query: int  # h_q = attention heads × head size
    kv: int  # h_kv = KV heads × head size
    vocab: int
    tied: bool
    extra_norms: int = 0  # RMSNorms a layer beyond the usual two (Gemma 3: two more)

    @property
    def decoder_params(self) -> int:
        h = self.hidden
        attention = h * self.query * 2 + h * self.kv * 2
        return self.layers * (attention + 3 * h * self.mlp)

    @property
    def params(self) -> int:
        heads = 1 if self.tied else 2
        return self.decoder_params + heads * self.vocab * self.hidden

    @property
    def lora_params(self) -> int:
        h = self.hidden
        return self.layers * LORA_RANK * (7 * h + 2 * self.query + 2 * self.kv + 3 * self.mlp)

    def activation_bytes(self, fp32_residual: bool) -> int:
        """Kept for backward, a token a layer: the MLP's four I-wide bf16 tensors, the
        attention's inputs and outputs, and the two RMSNorms' fp32 working copies."""
        h = self.hidden
        per_norm = 6 * h + (5 * h if fp32_residual else 0)
        return (
            8 * self.mlp + 2 * h + 6 * self.query + 4 * self.kv + (2 + self.extra_norms) * per_norm
        )


SHAPES = [
    Shape("Qwen2.5-0.5B", 24, 896, 4864, 896, 128, 151936, tied=True),
    Shape("Qwen3-4B", 36, 2560, 9728, 4096, 1024, 151936, tied=True),
    Shape("Qwen3-8B", 36, 4096, 12288, 4096, 1024, 151936, tied=False),
    Shape("Gemma-3-27B", 62, 5376, 21504, 4096, 2048, 262208, tied=True, extra_norms=2),
]


@dataclass(frozen=True)
class Setting:
    lora: bool
    bf16: bool
    checkpointing: bool
    chunk: int | None


def peak_bytes(shape: Shape, setting: Setting, tokens: int, trained: int) -> dict[str, float]:
    """Bytes at the start of a micro-batch's backward, by term (see docs/models.md)."""
    p, p_train = shape.params, (shape.lora_params if setting.lora else shape.params)
    weights = (2 if setting.bf16 else 4) * p
    gradients = (2 if setting.bf16 else 4) * p_train
    optimizer = (12 if setting.bf16 else 8) * p_train
    per_token_layer = shape.activation_bytes(fp32_residual=not setting.bf16)
    if setting.checkpointing:
        kept = (2 if setting.bf16 else 4) * shape.hidden
        activations = tokens * (shape.layers * kept + per_token_layer)
    else:
        activations = tokens * shape.layers * per_token_layer
        if not setting.bf16:  # autocast's bf16 copies of the weights, kept for backward
            activations += 2 * shape.decoder_params
    positions = trained if setting.chunk is None else min(trained, setting.chunk)
    logits = 12 * shape.vocab * positions
    terms = {
        "weights": weights, "gradients": gradients, "optimizer": optimizer,
        "activations": activations, "logits": logits,
    }  # fmt: skip
    return {k: v / GB for k, v in terms.items()}


COLUMNS = {
    "fp32, no saving": Setting(lora=False, bf16=False, checkpointing=False, chunk=None),
    "+ chunks": Setting(lora=False, bf16=False, checkpointing=False, chunk=1024),
    "+ chunks + ckpt": Setting(lora=False, bf16=False, checkpointing=True, chunk=1024),
    "bf16 + chunks + ckpt": Setting(lora=False, bf16=True, checkpointing=True, chunk=1024),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens in a micro-batch")
    parser.add_argument("--trained", type=float, default=3 / 8, help="share of them trained")
    parser.add_argument("--gpu-gb", type=float, default=80.0)
    args = parser.parse_args()
    trained = int(args.tokens * args.trained)
    print(f"micro-batch {args.tokens} tokens, {trained} trained; GB (1e9 bytes); "
          f"* = over {args.gpu_gb:.0f} GB; computed, not measured\n")  # fmt: skip
    print("| model | params | training | " + " | ".join(COLUMNS) + " |")
    print("|---|---|---|" + "---|" * len(COLUMNS))
    for shape in SHAPES:
        for lora in (True, False):
            cells = []
            for setting in COLUMNS.values():
                terms = peak_bytes(shape, Setting(lora, *_rest(setting)), args.tokens, trained)
                total = sum(terms.values())
                cells.append(f"{total:.1f}{'*' if total > args.gpu_gb else ''}")
            mode = f"LoRA r={LORA_RANK}" if lora else "full"
            print(
                f"| {shape.name} | {shape.params / 1e9:.2f}B | {mode} | " + " | ".join(cells) + " |"
            )
    print("\nBy term, all three savings (weights / gradients / AdamW / activations / logits):")
    for shape in SHAPES:
        for lora in (True, False):
            setting = Setting(lora, bf16=True, checkpointing=True, chunk=1024)
            terms = peak_bytes(shape, setting, args.tokens, trained)
            parts = " / ".join(f"{v:.1f}" for v in terms.values())
            print(f"- {shape.name}, {'LoRA' if lora else 'full'}: {parts}")


def _rest(setting: Setting) -> tuple[bool, bool, int | None]:
    return setting.bf16, setting.checkpointing, setting.chunk


if __name__ == "__main__":
    main()
