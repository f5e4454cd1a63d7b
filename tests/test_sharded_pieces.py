"""The pure pieces of the sharded trainer and its weight broadcast, in one process: how a
batch is split across ranks, which modules FSDP shards, the refusal of a sharded trainer
without Ray, and the broadcast's wire format and timeout (two threads over loopback gloo).

The sharded trainer itself runs in ``test_scale_sharded_trainer.py`` (Ray actors)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from post_training_cookbook.batching import length_groups
from post_training_cookbook.models.catalog import resolve_model
from post_training_cookbook.service.factory import ServiceSpec
from post_training_cookbook.service.weight_broadcast import WeightGroup
from post_training_cookbook.trainer.sharded import decoder_layers, split_across_ranks
from post_training_cookbook.trainer.types import TrainerSettings

# ---------------------------------------------------------------- batch splitting


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=40),
    world_size=st.integers(1, 5),
    max_tokens=st.integers(1, 1200),
)
def test_every_rank_gets_as_many_micro_batches_and_every_sample_lands_once(
    lengths: list[int], world_size: int, max_tokens: int
) -> None:
    plans = split_across_ranks(lengths, world_size, max_tokens)
    assert len(plans) == world_size
    assert len({len(plan) for plan in plans}) == 1  # FSDP: the same number of passes
    placed = sorted(i for plan in plans for group in plan for i in group)
    assert placed == list(range(len(lengths)))
    for plan in plans:
        for group in plan:  # a micro-batch stays within the token budget, or holds one row
            assert len(group) <= 1 or len(group) * max(lengths[i] for i in group) <= max_tokens
        padding = [group for group in plan if not group]
        assert plan[len(plan) - len(padding) :] == padding  # zero-weight ones come last


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=2, max_size=40), world_size=st.integers(2, 4))
def test_ranks_get_shares_of_tokens_within_one_sample_of_each_other(
    lengths: list[int], world_size: int
) -> None:
    plans = split_across_ranks(lengths, world_size, max_tokens=10**6)
    loads = [sum(lengths[i] for group in plan for i in group) for plan in plans]
    assert max(loads) - min(loads) <= max(lengths)  # longest first, to the lightest rank


def test_one_rank_micro_batches_as_one_process_does() -> None:
    lengths = [40, 12, 33, 7, 26, 18, 9, 30]
    (plan,) = split_across_ranks(lengths, 1, max_tokens=64)
    assert plan == [sorted(group) for group in length_groups(lengths, max_tokens=64)]


def test_ranks_without_samples_run_zero_weight_micro_batches() -> None:
    assert split_across_ranks([5, 9], 4, max_tokens=100) == [[[1]], [[0]], [[]], [[]]]


def test_the_split_is_deterministic_so_every_rank_computes_every_share() -> None:
    lengths = [17, 17, 3, 99, 42, 42, 8]
    assert split_across_ranks(lengths, 3, 64) == split_across_ranks(list(lengths), 3, 64)


# ---------------------------------------------------------------- what is sharded


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def test_fsdp_shards_each_decoder_layer_also_under_peft() -> None:
    model = tiny_llama()
    layers = list(model.model.layers)
    assert decoder_layers(model) == layers[::-1]  # innermost first; here all siblings
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    assert decoder_layers(model) == layers[::-1]  # peft wraps inside the layers


def test_a_model_that_names_no_decoder_layers_cannot_be_sharded() -> None:
    with pytest.raises(ValueError, match="names no decoder layer class"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_a_sharded_trainer_on_the_local_backend_fails_before_loading() -> None:
    info = resolve_model("post-training-cookbook/tool-use-tiny")
    with pytest.raises(ValueError, match="num_trainer_workers=2 needs backend='ray'"):
        ServiceSpec(model=info, trainer=TrainerSettings(), num_trainer_workers=2)


# ---------------------------------------------------------------- the weight broadcast


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def in_threads(*targets: Any) -> list[Any]:
    """Run each target in its own thread; their results, or the exception each raised."""
    results: list[Any] = [None] * len(targets)

    def run(index: int) -> None:
        try:
            results[index] = targets[index]()
        except Exception as error:
            results[index] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(targets))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def test_a_broadcast_reaches_every_receiver_tensor_by_tensor_in_its_dtype() -> None:
    address = f"127.0.0.1:{free_port()}"
    sent = {
        "model.embed_tokens.weight": torch.randn(7, 3),
        "model.layers.0.mlp.up_proj.weight": torch.randn(5, 3).to(torch.bfloat16),
        "model.norm.weight": torch.ones(3),
    }

    def send() -> int:
        return WeightGroup(address, 0, 3, timeout_s=20).send(sent.items())

    def receiver(rank: int) -> Any:
        return lambda: dict(WeightGroup(address, rank, 3, timeout_s=20).receive())

    count, *received = in_threads(send, receiver(1), receiver(2))
    assert count == sum(t.numel() * t.element_size() for t in sent.values())
    for got in received:
        assert list(got) == list(sent)  # in order
        for name, tensor in sent.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor)


def test_a_receiver_whose_sender_sends_nothing_raises_after_the_timeout() -> None:
    address = f"127.0.0.1:{free_port()}"
    done = threading.Event()

    def silent_sender() -> None:
        group = WeightGroup(address, 0, 2, timeout_s=2)
        done.wait(30)  # holds the group up, sends nothing
        del group

    def receive() -> list[tuple[str, torch.Tensor]]:
        try:
            return list(WeightGroup(address, 1, 2, timeout_s=2).receive())
        finally:
            done.set()

    started = time.perf_counter()
    _, error = in_threads(silent_sender, receive)
    waited = time.perf_counter() - started
    assert isinstance(error, RuntimeError) and "Timed out" in str(error)
    assert waited < 15
