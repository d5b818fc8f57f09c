"""Prefill through torch.compile with a dynamic, padded prompt length: the same hidden states, aux
states and cache entries as the eager forward, for any slot and length, from one graph."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils
from conftest import llama4_hf_config

from redline.config import ModelConfig
from redline.engine.compiled_prefill import CompiledPrefill, padded_prompt_len, warm_up_lengths
from redline.engine.kv_cache import KVCache, gather_blocks
from redline.models.llama import LlamaForCausalLM
from redline.models.random_init import normal_init


def test_prompt_lengths_pad_to_multiples_of_16_capped_by_the_cache():
    assert [padded_prompt_len(n, 1024) for n in (1, 16, 17, 20, 33, 64, 65)] == [16, 16, 32, 32, 48, 64, 80]
    assert padded_prompt_len(90, 100) == 96 and padded_prompt_len(99, 100) == 100
    assert warm_up_lengths(4097) == [16, 32] and warm_up_lengths(20) == [16, 20]
    assert warm_up_lengths(16) == [16]


def test_warm_up_visits_both_sides_of_every_token_count_branch():
    assert warm_up_lengths(4097, {128}) == [16, 32, 128, 144]  # Maverick: 128 experts, top-1
    assert warm_up_lengths(4097, {40, 8}) == [16, 32, 48]  # 40 -> 32 and 48; nothing pads to <= 8
    assert warm_up_lengths(130, {128}) == [16, 32, 128, 130]


@torch.inference_mode()
def test_a_length_the_warm_up_did_not_compile_runs_eagerly_with_the_same_result():
    """32 experts, top-1: prompts of up to 32 tokens take the MoE's few-token path. Compiled at 16 only
    and frozen, a 40-token prompt (padded to 48: the grouped path) would need a second graph: it warns
    and runs eagerly, equal to the eager forward."""
    raw = llama4_hf_config(num_local_experts=32).to_dict()
    config = ModelConfig.from_dict({**raw, "architectures": ["Llama4ForCausalLM"]})
    model = LlamaForCausalLM(config).eval()
    normal_init(model, std=0.1)
    assert model.token_count_branches() == {32}
    torch._dynamo.reset()
    cache = KVCache(config, 1, 64, torch.float32, torch.device("cpu"))
    eager_cache = KVCache(config, 1, 64, torch.float32, torch.device("cpu"))
    prefill = CompiledPrefill(model, cache)
    prefill(torch.randint(0, config.vocab_size, (1, 16)), 0)
    prefill.freeze()
    tokens = torch.randint(0, config.vocab_size, (1, 40))
    with pytest.warns(UserWarning, match="48-token prefill needs a graph the warm-up did not compile"):
        hidden, _ = prefill(tokens, 0)
    tables = eager_cache.tables(0, 1)
    want, _ = model(tokens, torch.arange(40)[None], eager_cache.layers, tables, eager_cache.kv_len_for(40))
    torch.testing.assert_close(hidden, want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def llama4_model() -> LlamaForCausalLM:
    """Llama 4 layers (MoE, chunked attention of 24, NoPE + temperature tuning) with EAGLE-3 aux states."""
    raw = llama4_hf_config(num_local_experts=8).to_dict()
    config = ModelConfig.from_dict({**raw, "architectures": ["Llama4ForCausalLM"]})
    model = LlamaForCausalLM(config).eval()
    normal_init(model, std=0.1)
    model.aux_layers = (1, 2, 4)
    return model


@torch.inference_mode()
def test_compiled_prefill_equals_eager_in_every_slot_and_length_from_one_graph(llama4_model):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, config = llama4_model, llama4_model.config
    slots, cache_len = 3, 4200
    compiled_cache = KVCache(config, slots, cache_len, torch.float32, torch.device("cpu"))
    eager_cache = KVCache(config, slots, cache_len, torch.float32, torch.device("cpu"))
    prefill = CompiledPrefill(model, compiled_cache)
    # 20 compiles; 29 and 40 (crossing a chunk of 24) and a 4,150-token prompt (173 chunks; past
    # the 4,096 elements at which inductor once split a backed dimension's reductions) reuse it
    for slot, n in ((1, 20), (2, 29), (0, 40), (1, 4150)):
        tokens = torch.randint(0, config.vocab_size, (1, n))
        others = compiled_cache.table[[s for s in range(slots) if s != slot]].flatten().long()  # blocks
        untouched = [(k[others].clone(), v[others].clone()) for k, v in compiled_cache.layers]
        with torch._dynamo.config.patch(error_on_recompile=(n != 20)):
            hidden, aux = prefill(tokens, slot)
        positions = torch.arange(n)[None]
        tables = eager_cache.tables(slot, 1)
        kv_len = eager_cache.kv_len_for(n)
        want_hidden, want_aux = model(tokens, positions, eager_cache.layers, tables, kv_len)
        # fp32 sums in another order: a few ulp per op, grown over 4 layers
        torch.testing.assert_close(hidden, want_hidden, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(aux, want_aux, atol=1e-4, rtol=1e-4)
        layers = zip(compiled_cache.layers, eager_cache.layers, untouched, strict=True)
        for (k, v), (want_k, want_v), (other_k, other_v) in layers:
            for got, want in ((k, want_k), (v, want_v)):
                got, want = gather_blocks(got, tables, n), gather_blocks(want, tables, n)
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            assert torch.equal(k[others], other_k) and torch.equal(v[others], other_v)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # every length, every slot
