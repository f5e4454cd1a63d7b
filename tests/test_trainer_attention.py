"""The trainer's CPU attention gives the numbers of transformers' own attention, values and
gradients, on padded batches, and leaves long rows and other implementations alone."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from post_training_cookbook.trainer import attention


def tiny_llama(seed: int = 0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def padded_batch(lengths: list[int], vocab: int = 96) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and mask, rows of ``lengths`` tokens."""
    generator = torch.Generator().manual_seed(1)
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width), generator=generator)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


def logits_and_grads(
    model: transformers.PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    # A loss over real tokens only: padding positions have no meaning to compare.
    logits[valid].logsumexp(-1).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach()[valid], grads


LONG = attention.MATH_MAX_KEYS + 20  # rows past the math path: SDPA


@pytest.mark.parametrize("lengths", [[40, 17, 33], [25], [60, 60], [LONG, 90], [LONG]])
def test_matches_eager_attention_values_and_gradients(lengths: list[int]) -> None:
    eager = tiny_llama()
    eager.set_attn_implementation("eager")
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation(attention.TRAINER_ATTENTION)
    ids, mask = padded_batch(lengths)
    want_logits, want_grads = logits_and_grads(eager, ids, mask)
    got_logits, got_grads = logits_and_grads(ours, ids, mask)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    assert want_grads.keys() == got_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_matches_sdpa_under_bf16_autocast_and_beyond_the_math_limit() -> None:
    sdpa = tiny_llama()
    ours = copy.deepcopy(sdpa)
    attention.use_for(ours)
    assert ours.config._attn_implementation == attention.TRAINER_ATTENTION
    for lengths in ([50, 31], [attention.MATH_MAX_KEYS + 20, 90]):  # math path, then SDPA
        ids, mask = padded_batch(lengths)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want, _ = logits_and_grads(sdpa, ids, mask)
            got, _ = logits_and_grads(ours, ids, mask)
        assert (got.float() - want.float()).abs().mean() < 2e-2


def test_fewer_queries_than_keys_attend_causally_from_the_bottom_right() -> None:
    """Queries that are the last of their keys (a continuation after a shared prefix), with
    no mask given: each sees the keys up to its own position, as eager's explicit mask."""
    model = tiny_llama()
    module = model.model.layers[0].self_attn
    generator = torch.Generator().manual_seed(2)
    for keys in (40, LONG):
        query = torch.randn(2, 4, 12, 16, generator=generator)
        key, value = torch.randn(2, 2, keys, 16, generator=generator).unbind(0)
        key, value = key[None].expand(2, -1, -1, -1), value[None].expand(2, -1, -1, -1)
        got, _ = attention.trainer_attention(module, query, key, value, None, scaling=0.25)
        allowed = torch.arange(keys)[None, :] <= torch.arange(keys - 12, keys)[:, None]
        grouped_key = key.repeat_interleave(2, dim=1)
        grouped_value = value.repeat_interleave(2, dim=1)
        scores = (query @ grouped_key.transpose(-1, -2) * 0.25).masked_fill(~allowed, -torch.inf)
        want = (scores.softmax(-1) @ grouped_value).transpose(1, 2)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_long_rows_honour_is_causal_false_as_sdpa_does() -> None:
    """A caller's ``is_causal=False`` (no mask) lets every query see every key, as in
    transformers' SDPA attention."""
    module = tiny_llama().model.layers[0].self_attn
    generator = torch.Generator().manual_seed(4)
    query = torch.randn(1, 4, LONG, 16, generator=generator)
    key = torch.randn(1, 2, LONG, 16, generator=generator)
    value = torch.randn(1, 2, LONG, 16, generator=generator)
    got, _ = attention.trainer_attention(module, query, key, value, None, is_causal=False)
    want, _ = sdpa_attention_forward(module, query, key, value, None, is_causal=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_long_rows_keep_the_grouped_keys_and_values_themselves_for_backward() -> None:
    """Past the math path a query head reads its KV head in place: backward keeps the keys
    and values as given (2 KV heads), not copies repeated to the 4 query heads."""
    module = tiny_llama().model.layers[0].self_attn
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(2, 4, LONG, 16, generator=generator, requires_grad=True)
    key = torch.randn(2, 2, LONG, 16, generator=generator, requires_grad=True)
    value = torch.randn(2, 2, LONG, 16, generator=generator, requires_grad=True)
    _, mask = padded_batch([LONG, 90])
    allowed = mask.bool()[:, None, None, :] & torch.ones(LONG, LONG).tril().bool()
    kept: list[int] = []

    def pack(saved: torch.Tensor) -> torch.Tensor:
        kept.append(saved.data_ptr())
        return saved

    for given in (allowed, None):
        kept.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved):
            attention.trainer_attention(module, query, key, value, given)
        assert key.data_ptr() in kept and value.data_ptr() in kept


def test_math_path_reads_only_keys_a_query_may_see() -> None:
    """Changing a later token must not change an earlier position's output (causal), and a
    padded row's real positions must not see its padding."""
    model = tiny_llama()
    model.set_attn_implementation(attention.TRAINER_ATTENTION)
    ids, mask = padded_batch([30, 20])
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        changed = ids.clone()
        changed[0, 25] = (changed[0, 25] + 1) % 96  # a later token of row 0
        changed[1, 25] = 7  # padding of row 1
        after = model(input_ids=changed, attention_mask=mask).logits
    torch.testing.assert_close(after[0, :25], before[0, :25])
    torch.testing.assert_close(after[1, :20], before[1, :20])


def test_use_for_leaves_other_choices_alone() -> None:
    model = tiny_llama()
    model.set_attn_implementation("eager")
    attention.use_for(model)
    assert model.config._attn_implementation == "eager"


def test_saved_config_does_not_name_it(tmp_path: pytest.TempPathFactory) -> None:
    model = tiny_llama()
    attention.use_for(model)
    model.save_pretrained(str(tmp_path))
    assert attention.TRAINER_ATTENTION not in (tmp_path / "config.json").read_text()  # type: ignore[operator]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert loaded.config._attn_implementation == "sdpa"
