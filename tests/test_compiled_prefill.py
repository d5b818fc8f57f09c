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
from redline.engine.kv_cache import KVCache
from redline.models.llama import LlamaForCausalLM
from redline.models.random_init import normal_init


def test_prompt_lengths_pad_to_multiples_of_16_capped_by_the_cache():
    assert [padded_prompt_len(n, 1024) for n in (1, 16, 17, 20, 33, 64, 65)] == [16, 16, 32, 32, 48, 64, 80]
    assert padded_prompt_len(90, 100) == 96 and padded_prompt_len(99, 100) == 100
    assert warm_up_lengths(100) == [16, 32, 100] and warm_up_lengths(128) == [16, 32, 64, 128]
    assert warm_up_lengths(4097)[-3:] == [1024, 2048, 4097] and warm_up_lengths(16) == [16]


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
    slots, cache_len = 3, 2100
    compiled_cache = KVCache(config, slots, cache_len, torch.float32, torch.device("cpu"))
    eager_cache = KVCache(config, slots, cache_len, torch.float32, torch.device("cpu"))
    prefill = CompiledPrefill(model, compiled_cache)
    # 20 compiles; 29 and 40 (crossing a chunk of 24) and a 2,000-token prompt (83 chunks) reuse it
    for slot, n in ((1, 20), (2, 29), (0, 40), (1, 2000)):
        tokens = torch.randint(0, config.vocab_size, (1, n))
        others = [s for s in range(slots) if s != slot]
        untouched = [(k[others].clone(), v[others].clone()) for k, v in compiled_cache.layers]
        with torch._dynamo.config.patch(error_on_recompile=(n != 20)):
            hidden, aux = prefill(tokens, slot)
        positions = torch.arange(n)[None]
        want_hidden, want_aux = model(tokens, positions, eager_cache.layers, slot, eager_cache.kv_len_for(n))
        # fp32 sums in another order: a few ulp per op, grown over 4 layers
        torch.testing.assert_close(hidden, want_hidden, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(aux, want_aux, atol=1e-4, rtol=1e-4)
        layers = zip(compiled_cache.layers, eager_cache.layers, untouched, strict=True)
        for (k, v), (want_k, want_v), (other_k, other_v) in layers:
            torch.testing.assert_close(k[slot, :, :n], want_k[slot, :, :n], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v[slot, :, :n], want_v[slot, :, :n], atol=1e-4, rtol=1e-4)
            assert torch.equal(k[others], other_k) and torch.equal(v[others], other_v)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # every length, every slot
