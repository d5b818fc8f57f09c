"""Prefill through torch.compile with a dynamic, padded prompt length: the same hidden states, aux
states and cache entries as the eager forward, for any slot and length, from one graph."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils
import torch.nn.functional as F
from conftest import llama4_hf_config

from redline.config import ModelConfig
from redline.kernels.paged_kv import gather_blocks
from redline.models.kv_cache import KVCache
from redline.models.llama import LlamaForCausalLM
from redline.runner.compiled_prefill import CompiledPrefill, prefill_shapes
from redline.runner.plan import padded_len as padded_prompt_len
from redline.train.random_init import normal_init


def test_prompt_lengths_pad_to_multiples_of_16_capped_by_the_cache():
    assert [padded_prompt_len(n, 1024) for n in (1, 16, 17, 20, 33, 64, 65)] == [16, 16, 32, 32, 48, 64, 80]
    assert padded_prompt_len(90, 100) == 96 and padded_prompt_len(99, 100) == 100
    assert prefill_shapes(4097) == [(1, 16), (1, 32), (2, 16), (2, 32)]
    assert prefill_shapes(20) == [(1, 16), (1, 20), (2, 16), (2, 20)]


def test_warm_up_visits_both_sides_of_every_token_count_branch():
    # Maverick: 128 experts, top-1: one row of 128 and 144 tokens, two rows of 64 and 80
    assert prefill_shapes(4097, {128}) == [
        (1, 16),
        (1, 32),
        (1, 128),
        (1, 144),
        (2, 16),
        (2, 32),
        (2, 64),
        (2, 80),
    ]
    # 40 -> 32 and 48 for one row, 16 and 32 for two; nothing pads to <= 8 tokens
    assert prefill_shapes(4097, {40, 8}) == [(1, 16), (1, 32), (1, 48), (2, 16), (2, 32)]


def _padded(tokens: torch.Tensor) -> torch.Tensor:  # [B, n] -> [B, L], L = n rounded up to 16
    return F.pad(tokens, (0, padded_prompt_len(tokens.shape[1], 10**6) - tokens.shape[1]))


@torch.inference_mode()
def test_a_shape_the_warm_up_did_not_compile_runs_eagerly_with_the_same_result():
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
    prefill = CompiledPrefill(model, cache, graphs=2)
    prefill(torch.zeros(1, 16, dtype=torch.int64), torch.arange(16)[None], cache.tables(0, 1), 16)
    prefill.freeze()
    tokens = _padded(torch.randint(0, config.vocab_size, (1, 40)))
    positions = torch.arange(48)[None]
    with pytest.warns(UserWarning, match="1 x 48-token prefill needs a graph the warm-up did not compile"):
        hidden, _ = prefill(tokens, positions, cache.tables(0, 1), 48)
    want, _ = model(tokens, positions, eager_cache.layers, eager_cache.tables(0, 1), 48)
    torch.testing.assert_close(hidden, want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def llama4_model() -> LlamaForCausalLM:
    """Llama 4 layers (MoE, chunked attention of 24, NoPE + temperature tuning) with EAGLE-3 aux states."""
    raw = llama4_hf_config(num_local_experts=8).to_dict()
    config = ModelConfig.from_dict({**raw, "architectures": ["Llama4ForCausalLM"]})
    model = LlamaForCausalLM(config, aux_layers=(1, 2, 4)).eval()
    normal_init(model, std=0.1)
    return model


@torch.inference_mode()
def test_compiled_prefill_equals_eager_for_every_batch_chunk_and_slot_from_two_graphs(llama4_model):
    """Whole prompts and chunks at offsets, one row and several, in any slots: the hidden and aux states
    and the cache entries of the eager forward, and other slots' blocks untouched. One graph for one
    row, one for several (dynamo specializes a batch of 1)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, config = llama4_model, llama4_model.config
    slots, cache_len = 4, 4200
    compiled_cache = KVCache(config, slots, cache_len, torch.float32, torch.device("cpu"))
    eager_cache = KVCache(config, slots, cache_len, torch.float32, torch.device("cpu"))
    prefill = CompiledPrefill(model, compiled_cache, graphs=2)
    # (slots, start, length): 20 tokens compile one row, two rows compile the other graph; then chunks
    # at offsets (29 crossing a chunk of 24), 3 rows, and a 4,150-token prompt (173 chunks; past the
    # 4,096 elements at which inductor once split a backed dimension's reductions) reuse them
    runs = [((1,), 0, 20), ((0, 2), 0, 32), ((2,), 40, 29), ((3, 0, 1), 64, 40), ((1,), 0, 4150)]
    for i, (rows, start, n) in enumerate(runs):
        tokens = _padded(torch.randint(0, config.vocab_size, (len(rows), n)))
        positions = start + torch.arange(tokens.shape[1]).expand(len(rows), -1)
        kv_len = start + tokens.shape[1]
        index = torch.tensor(rows)
        others = compiled_cache.table[[s for s in range(slots) if s not in rows]].flatten().long()  # blocks
        untouched = [(k[others].clone(), v[others].clone()) for k, v in compiled_cache.layers]
        with torch._dynamo.config.patch(error_on_recompile=i >= 2):
            hidden, aux = prefill(tokens, positions, compiled_cache.table[index], kv_len)
        tables = eager_cache.table[index]
        want_hidden, want_aux = model(tokens, positions, eager_cache.layers, tables, kv_len)
        # fp32 sums in another order: a few ulp per op, grown over 4 layers
        torch.testing.assert_close(hidden[:, :n], want_hidden[:, :n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(aux[:, :n], want_aux[:, :n], atol=1e-4, rtol=1e-4)
        layers = zip(compiled_cache.layers, eager_cache.layers, untouched, strict=True)
        for (k, v), (want_k, want_v), (other_k, other_v) in layers:
            for got, want in ((k, want_k), (v, want_v)):
                got, want = gather_blocks(got, tables, start + n), gather_blocks(want, tables, start + n)
                torch.testing.assert_close(got[:, :, start:], want[:, :, start:], atol=1e-4, rtol=1e-4)
            assert torch.equal(k[others], other_k) and torch.equal(v[others], other_v)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
