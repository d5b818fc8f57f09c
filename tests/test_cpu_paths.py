"""The CPU paths a compiled step takes: streamed few-row products, attention as reductions, and calls
that skip dynamo's guard evaluation once their shape has been compiled."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from redline.engine.guard_skipping import GuardSkippingStep
from redline.layers.linear import FEW_ROWS, Linear, streamed_rows, weight_times_xt
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
    assert fp32.few_rows is weight_times_xt and bf16.few_rows is None
    select_cpu_paths(model, compiled=True)
    assert fp32.few_rows is streamed_rows and bf16.few_rows is streamed_rows


def test_guard_skipping_step_runs_the_graph_of_each_key():
    """Keys revisited in a new order each get their own graph back, not the last one compiled."""
    torch._dynamo.reset()
    state = torch.zeros(8)

    def step(rows: int, kv_len: int, sampling: bool) -> torch.Tensor:
        return state[:rows] + kv_len + (1000 if sampling else 0)

    run = GuardSkippingStep(torch.compile(step, fullgraph=True, dynamic=False))
    keys = [(1, 64, False), (2, 64, False), (1, 128, False), (2, 128, True), (1, 64, True)]
    order = keys + keys[::-1] + [keys[i] for i in torch.randperm(len(keys)).tolist()]
    for rows, kv_len, sampling in order:
        state.normal_()  # the graphs read the live tensor, not a copy from their compile
        want = step(rows, kv_len, sampling)
        torch.testing.assert_close(run(rows, kv_len, sampling), want)
    assert run.seen == set(keys)
