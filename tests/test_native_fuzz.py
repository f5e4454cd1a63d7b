"""Hostile calls of the native decode kernels (engine/native), from tests/native_fuzz.py's
random cases: every bad argument is refused with a ValueError or TypeError that names it
before any native code runs, and every valid call runs and computes what a reference does.

The default suite runs ``DEFAULT_CASES`` cases per kernel (a few seconds);
``POST_TRAINING_COOKBOOK_NATIVE_FUZZ_CASES`` sets the count, and scripts/native_sanitize.sh
runs thousands per kernel against the ASan and UBSan build, where a read or write outside a
tensor, or undefined behaviour, stops the process with a report. Each test prints its counts
(run pytest with ``-s`` to see them).
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from native_fuzz import (
    Case,
    attention_case,
    finite,
    gated_delta_case,
    reference_attention,
    reference_gated_delta,
    reference_step,
    scalar_ok,
    step_case,
)

from post_training_cookbook.engine import native
from post_training_cookbook.engine.native import native_kernels
from post_training_cookbook.engine.native.guards import GuardedKernels

CASES_ENV = "POST_TRAINING_COOKBOOK_NATIVE_FUZZ_CASES"
DEFAULT_CASES = 150
# |native - reference| <= tolerance * (1 + the reference's largest magnitude). float32: sums in
# another order. bfloat16: the references compute in float64 (attention, the decode step) or
# round where the kernel does (engine/gated_delta.py's torch step); over up to three random
# layers the decode step's bf16 error against float64 has a long tail (99.9th percentile 0.04,
# largest 0.11 in 1,500 cases), so there this only catches gross errors (a wrong row, column
# or weight): tests/test_native_parity.py holds bf16 to the Python step, which rounds alike.
TOLERANCE = {
    "decode_attention": {torch.float32: 1e-4, torch.bfloat16: 1e-2},
    "decode_step": {torch.float32: 1e-4, torch.bfloat16: 0.25},
    "gated_delta_step": {torch.float32: 1e-4, torch.bfloat16: 1e-2},
}


class EnteredNative(Exception):
    pass


class _Counted:
    """The extension, counting the calls that reach it."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.calls = raw, 0

    def __getattr__(self, name: str) -> Any:
        function = getattr(self.raw, name)

        def call(*args: Any) -> Any:
            self.calls += 1
            return function(*args)

        return call


@pytest.fixture(scope="module")
def counted() -> tuple[GuardedKernels, _Counted]:
    if os.environ.get(native.DISABLE_ENV) == "0":
        pytest.skip(f"native kernels turned off ({native.DISABLE_ENV}=0)")
    built = native_kernels()
    assert isinstance(built, GuardedKernels), "the native kernels did not build here"
    raw = _Counted(built.raw)
    return GuardedKernels(raw), raw


@dataclass
class Tally:
    surface: str
    cases: int = 0
    ran: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    kinds: set[str] = field(default_factory=set)
    compared: int = 0
    worst: dict[str, float] = field(default_factory=dict)  # dtype -> largest relative error
    longest: float = 0.0

    def error(self, dtype: torch.dtype, native_out: torch.Tensor, expected: torch.Tensor) -> None:
        """Compare, keeping the largest error relative to the tolerance's scale."""
        scale = 1.0 + expected.abs().max().item() if expected.numel() else 1.0
        gap = (
            (native_out.double() - expected.double()).abs().max().item()
            if expected.numel()
            else 0.0
        )
        relative = gap / scale
        name = str(dtype).removeprefix("torch.")
        self.worst[name] = max(self.worst.get(name, 0.0), relative)
        assert relative <= TOLERANCE[self.surface][dtype], (self.surface, name, gap, scale)

    def line(self) -> str:
        refused = ", ".join(f"{kind} {n}" for kind, n in sorted(self.refused.items()))
        worst = ", ".join(f"{dtype} {error:.1e}" for dtype, error in sorted(self.worst.items()))
        return (
            f"native fuzz {self.surface}: {self.cases} cases, {self.ran} ran clean "
            f"({self.compared} compared with the reference, worst relative error: {worst}), "
            f"{sum(self.refused.values())} refused before the native call ({refused}) over "
            f"{len(self.kinds)} kinds of hostile input; 0 unhandled, 0 accepted silently; "
            f"longest call {self.longest:.3f} s"
        )


def fuzz(
    counted: tuple[GuardedKernels, _Counted],
    surface: str,
    make: Callable[[random.Random], Case],
    check: Callable[[Tally, Case, Any], None],
    seed: int,
) -> Tally:
    kernels, raw = counted
    cases = int(os.environ.get(CASES_ENV, DEFAULT_CASES))
    rng = random.Random(seed)
    torch.manual_seed(seed)
    tally = Tally(surface)
    call = getattr(kernels, surface)
    for index in range(cases):
        case = make(rng)
        tally.cases += 1
        if "first_heads" in case.extra:  # the same weights checked with the right head count
            call(**{**case.args, "heads": case.extra["first_heads"]})
        before = raw.calls
        started = time.perf_counter()
        try:
            out = call(**case.args)
        except (ValueError, TypeError) as error:
            where = f"case {index} ({case.hostile}): {type(error).__name__}: {error}"
            assert case.hostile is not None, f"a valid call refused: {where}"
            assert raw.calls == before, f"refused inside the native call: {where}"
            assert any(name in str(error) for name in case.named), (
                f"not named {case.named}: {where}"
            )
            tally.refused[type(error).__name__] += 1
            tally.kinds.add(case.hostile)
            continue
        finally:
            tally.longest = max(tally.longest, time.perf_counter() - started)
        assert case.hostile is None, f"case {index}: {case.hostile} was accepted"
        tally.ran += 1
        check(tally, case, out)
    print(tally.line())
    assert tally.ran and tally.refused  # both kinds of case came up
    return tally


def check_attention(tally: Tally, case: Case, out: torch.Tensor) -> None:
    query = case.args["query"]
    assert out.shape == query.shape and out.dtype == query.dtype
    if case.poisoned or not scalar_ok(case.args["scale"]):
        return
    tally.compared += 1
    tally.error(query.dtype, out, reference_attention(case))


def check_step(tally: Tally, case: Case, logits: torch.Tensor) -> None:
    a = case.args
    rows, dtype = a["input_ids"].shape[0], a["embed"].dtype
    assert logits.shape == (rows, case.extra["lm_head"].shape[0])
    assert logits.dtype == torch.float32
    if case.poisoned or not finite(*case.extra["plain"], a["embed"], *a["keys"], *a["values"]):
        return
    tally.compared += 1
    expected, keys, values = reference_step(case)
    tally.error(dtype, logits, expected)
    for layer, (key, value) in enumerate(zip(keys, values, strict=True)):
        tally.error(dtype, a["keys"][layer][:rows, :, a["col"]], key)
        tally.error(dtype, a["values"][layer][:rows, :, a["col"]], value)


def test_decode_attention_refuses_hostile_calls_by_name_and_computes_valid_ones(
    counted: tuple[GuardedKernels, _Counted],
) -> None:
    fuzz(counted, "decode_attention", attention_case, check_attention, seed=1)


def test_decode_step_refuses_hostile_calls_by_name_and_computes_valid_ones(
    counted: tuple[GuardedKernels, _Counted],
) -> None:
    fuzz(counted, "decode_step", step_case, check_step, seed=2)


def gated_delta_with_reference(rng: random.Random) -> Case:
    """A gated-delta case whose reference (output and new states) is computed before the call
    changes the states in place."""
    case = gated_delta_case(rng)
    if case.hostile is None and not case.poisoned and case.args["state"].shape[0]:
        case.extra["reference"] = reference_gated_delta(case)
    return case


def check_gated_delta_states(tally: Tally, case: Case, out: torch.Tensor) -> None:
    a = case.args
    rows, heads, _, head_v = a["state"].shape
    assert out.shape == (rows, heads * head_v) and out.dtype == a["projected"].dtype
    if "reference" not in case.extra:
        return
    expected, conv_state, state = case.extra["reference"]
    tally.compared += 1
    tally.error(a["projected"].dtype, out, expected)
    assert torch.equal(a["conv_state"], conv_state)  # a copy: exact
    tally.error(a["projected"].dtype, a["state"], state)


def test_gated_delta_step_refuses_hostile_calls_by_name_and_computes_valid_ones(
    counted: tuple[GuardedKernels, _Counted],
) -> None:
    fuzz(counted, "gated_delta_step", gated_delta_with_reference, check_gated_delta_states, seed=3)


def test_the_guard_checks_weights_again_when_their_tensors_change(
    counted: tuple[GuardedKernels, _Counted],
) -> None:
    """Weight checks are cached by the tensors' identity: a new tensor in the list (here a
    norm weight one too short, which the library would read past) is checked."""
    kernels, raw = counted
    rng = random.Random(0)
    case = step_case(rng)
    while case.hostile is not None:
        case = step_case(rng)
    kernels.decode_step(**case.args)
    weights = list(case.args["weights"])
    weights[0] = weights[0][:-1].clone() if weights[0].numel() > 1 else weights[0].new_empty(0)
    before = raw.calls
    with pytest.raises(ValueError, match=r"weights\[0\] \(layer 0's input_norm\)"):
        kernels.decode_step(**{**case.args, "weights": weights})
    assert raw.calls == before
