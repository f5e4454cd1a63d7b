"""The trainer's memory savings give the plain path's numbers, and really save.

Chunked log-probabilities, gradient checkpointing and bf16 weights with fp32 optimizer state
are each compared with the plain fp32 path on the same tiny model and batch: loss, metrics
and gradients within the tolerances stated at each test. Each runs on every device present
(CUDA cases are skipped without one).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from devices import DEVICES
from test_trainer import (
    GRPO,
    VOCAB,
    ScaledLogitsQwen2,
    grads,
    make_samples,
    make_trainer,
    optimizer_tensors,
    reference_logprobs,
    tiny_model,
    train_steps,
    weights,
)
from torch.utils._python_dispatch import TorchDispatchMode

from post_training_cookbook.trainer import logprobs as logprobs_module
from post_training_cookbook.trainer import memory_plan
from post_training_cookbook.trainer.frozen_head import (
    chosen_and_entropy_frozen_head,
    frozen_fp32_head,
)
from post_training_cookbook.trainer.logprobs import _chunked_chosen_and_entropy, _Fp32Linear
from post_training_cookbook.trainer.memory_plan import (
    LOGPROB_CHUNK_BYTES,
    auto_logprob_chunk_tokens,
)
from post_training_cookbook.trainer.precision import MasterWeightAdamW
from post_training_cookbook.trainer.trainer import Trainer
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings, TrainingSample

HIDDEN = 64  # tiny_model's hidden size
LOSS = LossConfig(loss_type="grpo", kl_beta=0.05, tis_cap=2.0)


class TokenScaledLogitsQwen2(transformers.Qwen2ForCausalLM):
    """Scales each position's logits by a factor of its input token: its logits depend on
    more than the decoder's hidden states, so only the full forward reproduces them."""

    def forward(
        self, *args: object, **kwargs: object
    ) -> transformers.modeling_outputs.CausalLMOutputWithPast:
        output = super().forward(*args, **kwargs)
        ids = kwargs["input_ids"]
        assert isinstance(ids, torch.Tensor)
        output.logits = output.logits * (1.0 + (ids[..., None] % 3).to(output.logits.dtype))
        return output


ROUTE_MODELS: dict[str, Callable[[], transformers.PreTrainedModel]] = {
    "head": tiny_model,
    "forward_on_hidden": lambda: ScaledLogitsQwen2(tiny_model().config),
    "full_forward": lambda: TokenScaledLogitsQwen2(tiny_model().config),
}


def step_results(
    trainer: Trainer, samples: list[TrainingSample], loss: LossConfig = LOSS, seed: int = 0
) -> tuple[float, dict[str, float], dict[str, torch.Tensor]]:
    torch.manual_seed(seed)  # the same LoRA dropout masks in every trainer compared
    result = trainer.forward_backward(samples, loss)
    return result.loss, result.metrics, {n: g.cpu() for n, g in grads(trainer).items()}


def assert_same_step(
    a: tuple[float, dict[str, float], dict[str, torch.Tensor]],
    b: tuple[float, dict[str, float], dict[str, torch.Tensor]],
    atol: float,
    rtol: float,
) -> None:
    (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = a, b
    assert loss_b == pytest.approx(loss_a, abs=atol)
    assert metrics_a.keys() == metrics_b.keys()
    for key, value in metrics_a.items():
        assert metrics_b[key] == pytest.approx(value, abs=atol, rel=rtol), key
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, atol=atol, rtol=rtol, msg=name)


def warmed_lora(model: transformers.PreTrainedModel, device: str) -> dict[str, torch.Tensor]:
    """A trained adapter: at init B = 0 gives A no gradient, which would hide differences."""
    warm = make_trainer(True, copy.deepcopy(model), device=device)
    warm.forward_backward(make_samples(6), GRPO)
    warm.optim_step(1e-2)
    return {n: p.detach().clone() for n, p in warm.trainable_parameters().items()}


def load_adapter(trainer: Trainer, adapter: dict[str, torch.Tensor]) -> Trainer:
    """The trainer with ``adapter``'s weights (full weight: none to load)."""
    if not adapter:
        return trainer
    with torch.no_grad():
        for name, p in trainer.trainable_parameters().items():
            p.copy_(adapter[name].to(p.dtype))
    return trainer


# ------------------------------------------------------------------ chunked log-probabilities


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route", list(ROUTE_MODELS))
def test_chunked_logprobs_give_the_whole_micro_batch_loss_metrics_and_gradients(
    route: str, device: str
) -> None:
    """fp32, tolerance 1e-6 absolute, 1e-5 relative: the chunks compute the same sums in
    another order."""
    model, samples = ROUTE_MODELS[route](), make_samples(8)
    results, logprobs = [], []
    for chunk in (None, 5):  # a micro-batch's ~30-60 trained positions at once, or 5
        trainer = make_trainer(
            False, copy.deepcopy(model), reference_model=True, device=device,
            logprob_chunk_tokens=chunk, micro_batch_tokens=200,
        )  # fmt: skip
        assert trainer._scorer.route == route
        logprobs.append(trainer.forward(samples))
        results.append(step_results(trainer, samples))
    assert_same_step(*results, atol=1e-6, rtol=1e-5)
    for whole, chunked, sample in zip(*logprobs, samples, strict=True):
        assert chunked == pytest.approx(whole, abs=1e-6)
        assert whole == pytest.approx(reference_logprobs(model.eval(), sample), abs=1e-5)


def rows_of_one_length(count: int, length: int) -> list[TrainingSample]:
    """``make_samples``' rows, cut to one ``length`` (so that they form one micro-batch)."""
    rows = [s for s in make_samples(10 * count, seed=1) if len(s.tokens) >= length][:count]
    assert len(rows) == count
    return [
        TrainingSample(s.tokens[:length], s.mask[:length], s.sampler_logprobs[:length],
                       s.advantages[:length])
        for s in rows
    ]  # fmt: skip


def kept_for_backward(trainer: Trainer, samples: list[TrainingSample]) -> list[torch.Size]:
    """Shapes of the distinct non-parameter tensors autograd keeps for backward during
    ``forward_backward`` (a checkpointed region keeps its own to itself, and frees them)."""
    parameters = {p.untyped_storage().data_ptr() for p in trainer._model.parameters()}
    saved: dict[int, torch.Size] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in parameters:
            saved[pointer] = tensor.shape
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        trainer.forward_backward(samples, GRPO)
    return list(saved.values())


def elements(shapes: list[torch.Size]) -> int:
    return sum(shape.numel() for shape in shapes)


def is_vocabulary_rows(shape: torch.Size) -> bool:
    """[..., vocab], except the head weight's transpose and its gradient ([hidden, vocab])."""
    return len(shape) >= 2 and shape[-1] == VOCAB and tuple(shape) != (HIDDEN, VOCAB)


class VocabularyTensors(TorchDispatchMode):
    """Records the rows of every [rows, vocab] tensor an op creates, forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else [out]:
            if isinstance(tensor, torch.Tensor) and is_vocabulary_rows(tensor.shape):
                self.rows.append(tensor.numel() // VOCAB)
        return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route", ["head", "forward_on_hidden"])
def test_chunking_leaves_no_vocabulary_sized_tensor_of_a_whole_micro_batch(
    route: str, device: str
) -> None:
    """Neither made at once (the largest such tensor of any op, forward or backward) nor
    piled up for backward (chunk after chunk, each keeping its log-softmax)."""
    samples = rows_of_one_length(12, length=20)  # one micro-batch, 12 × 9 trained tokens
    most_rows, kept_rows = {}, {}
    for chunk in (None, 16):
        trainer = make_trainer(
            False, ROUTE_MODELS[route](), logprob_chunk_tokens=chunk, device=device
        )
        with VocabularyTensors() as recorder:
            trainer.forward_backward(samples, GRPO)
        most_rows[chunk] = max(recorder.rows)
        kept = kept_for_backward(trainer, samples)
        kept_rows[chunk] = elements([s for s in kept if is_vocabulary_rows(s)]) // VOCAB
    assert len(list(trainer._micro_batches(samples))) == 1
    trained = sum(s.num_trained_tokens for s in samples)
    assert most_rows[None] == kept_rows[None] == trained  # whole: one tensor holds them all
    assert most_rows[16] == 16
    assert kept_rows[16] == 0


@pytest.mark.parametrize(
    ("vocab_size", "chunk"),
    [(49152, 256), (151936, 64), (128256, 128), (32000, 512), (VOCAB, 1024), (10**7, 64)],
)
def test_the_auto_chunk_holds_64_mib_of_fp32_logits(vocab_size: int, chunk: int) -> None:
    """SmolLM2's, Qwen's, Llama 3's, Llama 2's vocabularies; the bounds at both ends."""
    assert auto_logprob_chunk_tokens(vocab_size) == chunk
    assert chunk * vocab_size * 4 <= LOGPROB_CHUNK_BYTES or chunk == 64


def test_the_default_trainer_chunks_by_the_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    """``"auto"`` is the default and is resolved once; given values are kept."""
    samples = rows_of_one_length(12, length=20)  # one micro-batch, 12 × 9 trained tokens
    monkeypatch.setattr(memory_plan, "LOGPROB_CHUNK_BYTES", 4 * VOCAB * 64)
    trainer = make_trainer(False)
    assert trainer.logprob_chunk_tokens == 64
    with VocabularyTensors() as recorder:
        trainer.forward_backward(samples, GRPO)
    trained = sum(s.num_trained_tokens for s in samples)
    assert max(recorder.rows) <= 64 < trained
    assert make_trainer(False, logprob_chunk_tokens=16).logprob_chunk_tokens == 16
    assert make_trainer(False, logprob_chunk_tokens=None).logprob_chunk_tokens is None


@pytest.mark.parametrize("chunk", [None, 7])
@pytest.mark.parametrize("bias", [False, True])
def test_the_frozen_head_gives_the_generic_values_and_gradients(
    chunk: int | None, bias: bool
) -> None:
    """Log-probabilities, entropy and the rows' gradient (under an uneven upstream
    gradient) equal the generic chunked path's, fp32 to 1e-6 absolute."""
    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=bias).requires_grad_(False)
    rows, targets = torch.randn(20, HIDDEN), torch.randint(0, VOCAB, (20,))
    upstream = torch.randn(20)
    results = []
    for frozen in (False, True):
        inputs = rows.clone().requires_grad_(True)
        if frozen:
            chosen, entropy = chosen_and_entropy_frozen_head(head, inputs, targets, chunk)
        else:
            chosen, entropy = _chunked_chosen_and_entropy(head, inputs, targets, chunk)
        (chosen * upstream).sum().backward()
        results.append((chosen.detach(), entropy.detach(), inputs.grad))
    for generic, frozen_head in zip(*results, strict=True):
        torch.testing.assert_close(frozen_head, generic, atol=1e-6, rtol=1e-5)
    none = torch.zeros((0, HIDDEN), requires_grad=True)
    chosen, entropy = chosen_and_entropy_frozen_head(head, none, targets[:0], chunk)
    chosen.sum().backward()
    assert chosen.shape == (0,) and float(entropy) == 0.0 and none.grad is not None


def test_lora_takes_the_frozen_head_path_with_the_generic_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A LoRA trainer's head is frozen, so its step goes through ``frozen_head.py``, and
    gives the generic path's loss, metrics and gradients (a full-weight head is trained and
    keeps the generic path)."""
    model, samples = tiny_model(), make_samples(8)
    adapter = warmed_lora(model, "cpu")
    lora = load_adapter(
        make_trainer(True, copy.deepcopy(model), logprob_chunk_tokens=5, reference_model=True),
        adapter,
    )
    assert frozen_fp32_head(lora._model) is not None
    assert frozen_fp32_head(make_trainer(False, copy.deepcopy(model))._model) is None
    frozen_step = step_results(lora, samples)
    monkeypatch.setattr(logprobs_module, "frozen_fp32_head", lambda model: None)
    generic = load_adapter(
        make_trainer(True, copy.deepcopy(model), logprob_chunk_tokens=5, reference_model=True),
        adapter,
    )
    assert_same_step(step_results(generic, samples), frozen_step, atol=1e-6, rtol=1e-5)


def test_the_frozen_head_keeps_no_vocabulary_sized_tensor_of_a_whole_micro_batch() -> None:
    samples = rows_of_one_length(12, length=20)  # one micro-batch, 12 × 9 trained tokens
    trainer = make_trainer(True, logprob_chunk_tokens=16)
    assert frozen_fp32_head(trainer._model) is not None
    with VocabularyTensors() as recorder:
        trainer.forward_backward(samples, GRPO)
    assert max(recorder.rows) == 16
    kept = kept_for_backward(trainer, samples)
    assert not [s for s in kept if is_vocabulary_rows(s)]


def test_full_forward_models_still_chunk_the_log_softmax() -> None:
    """The last-resort route: the model's logits exist whole, but the fp32 log-softmax and
    its gradient do not (the model's own logits here are fp32 too, so this counts tensors
    of more rows than a chunk, and they are the model's: logits, scaled logits, their
    gradients)."""
    samples = make_samples(24, seed=3)
    counts = {}
    for chunk in (None, 16):
        trainer = make_trainer(  # padded rows: micro-batches of a few trained tokens each
            False, ROUTE_MODELS["full_forward"](), logprob_chunk_tokens=chunk, packing=False
        )
        with VocabularyTensors() as recorder:
            trainer.forward_backward(samples, GRPO)
        counts[chunk] = sum(1 for rows in recorder.rows if rows > 16)
    assert 0 < counts[16] < counts[None]


# ------------------------------------------------------------------ gradient checkpointing


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_lora", [False, True])
def test_gradient_checkpointing_gives_the_plain_loss_and_gradients(
    use_lora: bool, device: str
) -> None:
    """fp32, tolerance 1e-6 absolute, 1e-5 relative (on CPU they come out equal). With LoRA,
    dropout 0.1: the recompute must replay the same dropout masks."""
    model, samples = tiny_model(), make_samples(6)
    adapter = warmed_lora(model, device) if use_lora else {}
    results = []
    for checkpointing in (False, True):
        trainer = make_trainer(
            use_lora, copy.deepcopy(model), gradient_checkpointing=checkpointing,
            lora_dropout=0.1 if use_lora else 0.0, reference_model=True, device=device,
        )  # fmt: skip
        load_adapter(trainer, adapter)
        results.append(step_results(trainer, samples))
    assert_same_step(*results, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("use_lora", [False, True])
def test_gradient_checkpointing_keeps_a_fraction_of_the_activations(use_lora: bool) -> None:
    samples = make_samples(12)
    kept = {
        checkpointing: elements(
            kept_for_backward(make_trainer(use_lora, gradient_checkpointing=checkpointing), samples)
        )
        for checkpointing in (False, True)
    }
    assert kept[True] < 0.5 * kept[False]


def test_checkpointing_is_off_in_forward_and_for_the_reference() -> None:
    """No-grad passes keep nothing for backward, so there is nothing to recompute."""
    trainer = make_trainer(False, gradient_checkpointing=True, reference_model=True)
    samples = make_samples(4)
    plain = make_trainer(False)
    for row, plain_row in zip(trainer.forward(samples), plain.forward(samples), strict=True):
        assert row == pytest.approx(plain_row, abs=1e-6)
    assert trainer._reference is not None and not trainer._reference.model.is_gradient_checkpointing


# ------------------------------------------------------------------ precision


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_lora", [False, True])
def test_bf16_weights_give_the_fp32_loss_and_gradients_within_bf16_rounding(
    use_lora: bool, device: str
) -> None:
    """From the same weights (rounded to bf16 for both, so only the arithmetic differs):
    loss and metrics within 2e-3 absolute; the whole gradient within 2% of its fp32 norm,
    each parameter's within 5% and cos > 0.999. bf16 keeps 8 bits of mantissa (relative
    steps of 1/256), and the decoder compounds that over its layers; measured on CPU:
    loss 1e-4 apart, whole gradient 0.6%, worst parameter 3% (a LoRA A), cos ≥ 0.9995."""
    model, samples = tiny_model(), make_samples(6)
    model.to(torch.bfloat16).to(torch.float32)
    adapter = warmed_lora(model, device) if use_lora else {}
    adapter = {n: t.to(torch.bfloat16).float() for n, t in adapter.items()}
    fp32, bf16 = (
        step_results(
            load_adapter(
                make_trainer(use_lora, copy.deepcopy(model), precision=p, device=device,
                             reference_model=True),
                adapter,
            ),
            samples,
        )
        for p in ("fp32", "bf16")
    )  # fmt: skip
    assert bf16[0] == pytest.approx(fp32[0], abs=2e-3)
    for key, value in fp32[1].items():
        assert bf16[1][key] == pytest.approx(value, abs=2e-3), key
    assert fp32[2].keys() == bf16[2].keys() and fp32[2]
    assert all(g.dtype == torch.bfloat16 for g in bf16[2].values())
    for name, grad in fp32[2].items():
        other = bf16[2][name].float()
        assert (other - grad).norm() / grad.norm() < 5e-2, name
        assert torch.nn.functional.cosine_similarity(other.flatten(), grad.flatten(), dim=0) > 0.999
    whole_fp32 = torch.cat([g.flatten() for g in fp32[2].values()])
    whole_bf16 = torch.cat([g.float().flatten() for g in bf16[2].values()])
    assert (whole_bf16 - whole_fp32).norm() / whole_fp32.norm() < 2e-2


@pytest.mark.parametrize("device", DEVICES)
def test_the_fp32_head_of_bf16_weights_is_a_plain_fp32_linear(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks of 100 of 256 vocabulary rows (the last one short): logits and all three
    gradients as ``F.linear`` on fp32 copies gives them, within fp32 rounding (1e-5)."""
    monkeypatch.setattr(_Fp32Linear, "BLOCK", 100)
    generator = torch.Generator().manual_seed(0)
    rows, weight, bias = (
        torch.randn(shape, generator=generator).to(device, torch.bfloat16)
        for shape in ((9, HIDDEN), (VOCAB, HIDDEN), (VOCAB,))
    )
    upstream = torch.randn(9, VOCAB, generator=generator).to(device)
    results = []
    for linear in (_Fp32Linear.apply, plain_fp32_linear):
        leaves = [t.clone().requires_grad_() for t in (rows, weight, bias)]
        logits = linear(*leaves)
        (logits * upstream).sum().backward()
        results.append([logits.detach(), *(leaf.grad for leaf in leaves)])
    ours, theirs = results
    assert ours[0].dtype == torch.float32 and ours[1].dtype == torch.bfloat16
    for got, want in zip(ours, theirs, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def plain_fp32_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(rows.float(), weight.float(), bias.float())


class Fp32HeadCopies(TorchDispatchMode):
    """Counts fp32 tensors of the head weight's shape that ops create."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32:
                self.count += tuple(tensor.shape) == (VOCAB, HIDDEN)
        return out


def test_bf16_lora_never_copies_the_head_to_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_Fp32Linear, "BLOCK", 64)
    samples = make_samples(8)
    for chunk in (None, 16):
        trainer = make_trainer(True, precision="bf16", logprob_chunk_tokens=chunk)
        with Fp32HeadCopies() as copies:
            trainer.forward_backward(samples, GRPO)
        assert copies.count == 0
    monkeypatch.setattr(_Fp32Linear, "BLOCK", VOCAB)  # one block: the whole head, once a pass
    with Fp32HeadCopies() as copies:
        make_trainer(True, precision="bf16").forward_backward(samples, GRPO)
    assert copies.count > 0


def bytes_of(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_lora", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_precision_decides_the_bytes_of_weights_gradients_and_optimizer_state(
    precision: str, use_lora: bool, device: str
) -> None:
    """fp32: 4 bytes a weight, 4 a gradient, 8 of AdamW moments a trainable parameter.
    bf16: 2 a weight, 2 a gradient, 4 + 8 of fp32 master and moments a trainable one."""
    trainer = make_trainer(use_lora, precision=precision, device=device, reference_model=True)
    weight_bytes, grad_bytes, state_bytes = (4, 4, 8) if precision == "fp32" else (2, 2, 12)
    every_parameter = list(trainer._model.parameters())  # tied embeddings counted once
    trainable = list(trainer.trainable_parameters().values())
    count = sum(p.numel() for p in every_parameter)
    trainable_count = sum(p.numel() for p in trainable)
    trainer.forward_backward(make_samples(), GRPO)
    assert bytes_of(every_parameter) == weight_bytes * count
    gradients = [p.grad for p in trainable if p.grad is not None]
    assert bytes_of(gradients) == grad_bytes * trainable_count
    trainer.optim_step(1e-3)
    state = [
        tensor
        for per_parameter in trainer._optimizer.state.values()
        for key, tensor in per_parameter.items()
        if key != "step"  # one scalar a parameter
    ]
    assert bytes_of(state) == state_bytes * trainable_count
    reference = trainer._reference  # the full-weight KL copy: frozen, in the weights' dtype
    if reference is not None:
        assert bytes_of(list(reference.parameters())) == weight_bytes * count


def test_bf16_weights_keep_updates_too_small_for_bf16_in_their_fp32_master() -> None:
    """An update of 1e-5 a step on weights near 0.05 (bf16 steps of 2.4e-4 there): a plain
    bf16 AdamW rounds every one away; the fp32 master adds them up."""
    start = torch.full((64,), 0.05).to(torch.bfloat16)
    plain, mastered = start.clone().requires_grad_(), start.clone().requires_grad_()
    optimizers = [torch.optim.AdamW([plain], lr=1e-5), MasterWeightAdamW([mastered], lr=1e-5)]
    for _ in range(20):
        for param, optimizer in zip((plain, mastered), optimizers, strict=True):
            param.grad = torch.ones_like(param)  # Adam's update is then lr each step
            optimizer.step()
    assert torch.equal(plain.detach(), start)  # every update lost
    master = optimizers[1].state[mastered]["master"]
    expected = start.float() - 20 * 1e-5
    torch.testing.assert_close(master, expected, atol=1e-7, rtol=1e-5)
    assert torch.equal(mastered.detach(), master.to(torch.bfloat16))  # the weight: its rounding
    assert (mastered.detach() < start).all()


@pytest.mark.parametrize("slice_size", [MasterWeightAdamW.SLICE, 8])
def test_master_weight_adamw_is_torch_adamw_on_fp32_parameters(slice_size: int) -> None:
    """Whole, or in slices of 8 of the 35 elements (the last one short)."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(5, 7, generator=generator)
    ours, theirs = start.clone().requires_grad_(), start.clone().requires_grad_()
    settings: dict[str, Any] = {"lr": 1e-2, "betas": (0.8, 0.95), "weight_decay": 0.1}
    mastered = MasterWeightAdamW([ours], **settings)
    mastered.SLICE = slice_size
    pairs = [(ours, mastered), (theirs, torch.optim.AdamW([theirs], foreach=False, **settings))]
    for _ in range(5):
        grad = torch.randn(5, 7, generator=generator)
        for param, optimizer in pairs:
            param.grad = grad.clone()
            optimizer.step()
    torch.testing.assert_close(ours, theirs, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("use_lora", [False, True])
def test_bf16_training_resumes_bit_for_bit_with_its_master_weights(
    use_lora: bool, tmp_path: Path
) -> None:
    tiny_model().save_pretrained(tmp_path / "base")

    def build() -> Trainer:
        return Trainer(
            tmp_path / "base",
            TrainerSettings(use_lora=use_lora, lora_rank=4, precision="bf16", seed=1),
        )

    original = build()
    train_steps(original, 2, seed=0)
    original.save_training_checkpoint(tmp_path / "ckpt")
    train_steps(original, 2, seed=10)
    resumed = build()
    resumed.load_training_checkpoint(tmp_path / "ckpt")
    masters = [s["master"] for s in resumed._optimizer.state.values()]
    assert masters and all(m.dtype == torch.float32 for m in masters)
    train_steps(resumed, 2, seed=10)
    assert resumed.version == original.version == 4
    assert all(p.dtype == torch.bfloat16 for p in weights(resumed).values())
    for got, want in ((weights(resumed), weights(original)),
                      (optimizer_tensors(resumed), optimizer_tensors(original))):  # fmt: skip
        assert got.keys() == want.keys()
        for key in got:
            assert torch.equal(got[key], want[key]), key


def test_a_checkpoint_of_another_precision_loads_its_weights_only(tmp_path: Path) -> None:
    model = tiny_model()
    make_trainer(False, copy.deepcopy(model), precision="bf16").save_training_checkpoint(
        tmp_path / "bf16"
    )
    fp32 = make_trainer(False, model)
    with pytest.raises(ValueError, match="precision"):
        fp32.load_training_checkpoint(tmp_path / "bf16")
    fp32.load_training_checkpoint(tmp_path / "bf16", load_optimizer=False)
    assert all(p.dtype == torch.float32 for p in fp32.trainable_parameters().values())


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"logprob_chunk_tokens": 0}, 'logprob_chunk_tokens must be >= 1, "auto" or None'),
        ({"logprob_chunk_tokens": "big"}, 'logprob_chunk_tokens must be >= 1, "auto" or None'),
        ({"precision": "fp16"}, r"precision must be one of \('fp32', 'bf16'\)"),
        ({"gradient_checkpointing": "yes"}, "gradient_checkpointing must be a bool"),
    ],
)
def test_memory_options_are_validated(option: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_trainer(False, **option)
