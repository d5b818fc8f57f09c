"""The CPU paths a compiled step takes: streamed few-row products, attention as reductions, and calls
that skip dynamo's guard evaluation once their shape has been compiled."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils
import torch.nn.functional as F

from redline.engine.compiled_step import CompiledStep
from redline.layers import linear
from redline.layers.linear import FEW_ROWS, Linear, faster_fp32_product, streamed_rows, weight_times_xt
from redline.layers.reduced_attention import attention_by_reductions, sdpa_attention

# K = 64..512 fp32 products summed in another order differ by a few ulp; bf16 outputs are rounded to an
# 8-bit mantissa (relative 2^-8 ~ 4e-3), so two correct orders may land one bf16 step apart
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, FEW_ROWS])
@pytest.mark.parametrize("n, k", [(40, 64), (96, 512)])
def test_streamed_rows_compiled_equals_linear(dtype, rows, n, k):
    torch._dynamo.reset()
    x, weight = torch.randn(rows, k).to(dtype), (torch.randn(n, k) * k**-0.5).to(dtype)
    want = F.linear(x.double(), weight.double())
    got = torch.compile(streamed_rows, fullgraph=True, dynamic=False)(x, weight)
    assert got.dtype == dtype and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b, t, hq, hkv, s", [(1, 1, 8, 2, 64), (2, 4, 4, 4, 40), (3, 2, 6, 3, 17)])
@pytest.mark.parametrize("chunk", [0, 8])
def test_attention_by_reductions_compiled_equals_sdpa(dtype, b, t, hq, hkv, s, chunk):
    torch._dynamo.reset()
    d = 16
    q = torch.randn(b, t, hq, d).to(dtype)
    keys, values = torch.randn(2, b, hkv, s, d).to(dtype).unbind(0)
    query_pos = torch.randint(t - 1, s, (b, 1))[:, :, None] - torch.arange(t - 1, -1, -1)[None, None]
    key_pos = torch.arange(s)[None, None, None, :]
    mask = key_pos <= query_pos[..., None]  # [B, 1, T, S]: causal by absolute position
    if chunk:
        mask &= key_pos >= query_pos[..., None] - query_pos[..., None] % chunk
    want = sdpa_attention(q.double(), keys.double(), values.double(), mask)
    got = torch.compile(attention_by_reductions, fullgraph=True, dynamic=False)(q, keys, values, mask)
    assert got.dtype == dtype and got.shape == (b, t, hq, d)
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_select_cpu_paths_by_dtype_and_compile():
    from redline.kernels.select import select_cpu_paths

    fp32, bf16 = Linear(8, 8), Linear(8, 8).to(torch.bfloat16)
    model = torch.nn.ModuleList([fp32, bf16])
    select_cpu_paths(model, compiled=False)
    assert fp32.few_rows is faster_fp32_product(fp32.weight) and bf16.few_rows is None
    select_cpu_paths(model, compiled=True)
    assert fp32.few_rows is streamed_rows and bf16.few_rows is streamed_rows


def test_the_fp32_product_is_timed_once_per_shape_and_computes_the_same(monkeypatch):
    monkeypatch.setattr(linear, "_FP32_CHOICE", {})
    weight = torch.randn(96, 40)
    chosen = faster_fp32_product(weight)
    assert chosen in (weight_times_xt, None) and set(linear._FP32_CHOICE) == {(96, 40)}
    linear._FP32_CHOICE[(96, 40)] = not linear._FP32_CHOICE[(96, 40)]  # a second call reads, not times
    assert faster_fp32_product(torch.randn(96, 40)) is not chosen
    x = torch.randn(FEW_ROWS // 2, 40)
    torch.testing.assert_close(weight_times_xt(x, weight), torch.nn.functional.linear(x, weight))


def test_compiled_step_runs_the_graph_of_each_key_at_every_kv_len():
    """Keys revisited in a new order each get their own graph back, not the last one compiled, with guard
    evaluation skipped; kv_len is dynamic, so its changes compile nothing; after freeze nothing compiles."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    state = torch.zeros(8, 601)  # as KVCache: one position past the longest kv_len

    def step(rows: int, kv_len: int, sampling: bool) -> torch.Tensor:
        return state[:rows, :kv_len].sum(-1) + (1000 if sampling else 0)

    run = CompiledStep(step, cache_len=600, device=torch.device("cpu"))
    keys = [(1, 64, False), (2, 64, False), (1, 128, False), (2, 600, True), (1, 64, True), (2, 256, True)]
    order = keys + keys[::-1] + [keys[i] for i in torch.randperm(len(keys)).tolist()]
    for i, (rows, kv_len, sampling) in enumerate(order):
        if i == len(keys):
            run.freeze()
        state.normal_()  # the graphs read the live tensor, not a copy from their compile
        torch.testing.assert_close(run(rows, kv_len, sampling), step(rows, kv_len, sampling))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 4  # (rows, sampling): kv_len is dynamic
    with pytest.raises(RuntimeError, match="not compiled at warm-up"):
        run(4, 64, False)


@pytest.mark.parametrize("dtype, tiles", [(torch.bfloat16, (128, 64)), (torch.float32, (64, 32))])
def test_select_kernels_sets_step_and_prefill_attention(dtype, tiles):
    """With Triton, every attention layer gets the split-KV kernel for steps and the prefill kernel (its
    tiles by the model's dtype) for prompts; without, both are cleared and SDPA serves."""
    pytest.importorskip("triton")
    from redline.config import ModelConfig
    from redline.kernels.decode_attention import decode_attention
    from redline.kernels.prefill_attention import prefill_attention
    from redline.kernels.select import select_kernels
    from redline.layers.attention import Attention
    from redline.models.llama import LlamaForCausalLM
    from redline.models.random_init import llama3_config

    model = LlamaForCausalLM(ModelConfig.from_dict(llama3_config(64))).to(dtype)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    select_kernels(model, True, pdl=True)
    for layer in layers:
        assert layer.step_kernel.func is decode_attention and layer.step_kernel.keywords == {"pdl": True}
        assert layer.prefill_kernel.func is prefill_attention
        assert (layer.prefill_kernel.keywords["block_m"], layer.prefill_kernel.keywords["block_n"]) == tiles
    select_kernels(model, False)
    assert all(layer.step_kernel is None and layer.prefill_kernel is None for layer in layers)
