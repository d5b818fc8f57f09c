"""The CPU paths a compiled step takes: streamed few-row products, attention as reductions, and calls
that skip dynamo's guard evaluation once their shape has been compiled."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils
import torch.nn.functional as F

from redline.kernels import cpu_ops
from redline.kernels.attention_core import attention_by_reductions, sdpa_attention
from redline.layers import backends
from redline.layers.backends import TORCH, Backends
from redline.layers.linear import FEW_ROWS, Linear, streamed_rows, weight_times_xt
from redline.runner.compiled_step import CompiledStep

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


def test_cpu_backends_by_dtype_compile_and_the_cpus_vector_width(monkeypatch, without_cpu_kernels):
    """Without the C++ kernels (kernels/cpu_ops, AVX-512's and AVX2's): compiled, streamed rows for every
    float dtype, attention as reductions over the gathered cache, one compile region per kind of layer;
    eager, F.linear, except fp32 on AMD CPUs and on CPUs without AVX-512 (W @ x^T), and SDPA."""
    for dtype in (torch.float32, torch.bfloat16):
        compiled = Backends.choose("cpu", dtype, compiled=True)
        assert compiled.few_rows is streamed_rows and compiled.attention_core is attention_by_reductions
        assert compiled.layer_regions and compiled.decode_attention is None
    monkeypatch.setattr(backends, "cpu_vendor", lambda: "GenuineIntel")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert Backends.choose("cpu", torch.float32, compiled=False).few_rows is weight_times_xt
    assert Backends.choose("cpu", torch.bfloat16, compiled=False) == TORCH
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert Backends.choose("cpu", torch.float32, compiled=False) == TORCH
    monkeypatch.setattr(backends, "cpu_vendor", lambda: "AuthenticAMD")
    assert Backends.choose("cpu", torch.float32, compiled=False).few_rows is weight_times_xt
    with pytest.raises(ValueError, match="programmatic dependent launch needs Triton"):
        Backends.choose("cpu", torch.float32, compiled=False, pdl=True)


def test_each_linear_gets_its_product_when_built_and_it_computes_the_same():
    fp32 = Linear(40, 96, bias=True, few_rows=weight_times_xt)
    x = torch.randn(FEW_ROWS // 2, 40)
    torch.testing.assert_close(fp32(x), torch.nn.functional.linear(x, fp32.weight, fp32.bias))
    assert "few_rows=weight_times_xt" in repr(fp32) and "few_rows" not in repr(Linear(4, 4))


def test_compiled_step_runs_the_graph_of_each_key_at_every_kv_len():
    """Keys revisited in a new order each get their own graph back, not the last one compiled, with guard
    evaluation skipped; kv_len is dynamic, so its changes compile nothing; after freeze nothing compiles."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    state = torch.zeros(8, 601)  # as KVCache: one position past the longest kv_len

    def step(rows: int, kv_len: int, sampling: bool, k: int) -> torch.Tensor:
        return state[:rows, :kv_len].sum(-1) + (1000 if sampling else 0) + k

    run = CompiledStep(step, cache_len=600, device=torch.device("cpu"), graphs=4)
    keys = [(1, 64, False), (2, 64, False), (1, 128, False), (2, 600, True), (1, 64, True), (2, 256, True)]
    order = keys + keys[::-1] + [keys[i] for i in torch.randperm(len(keys)).tolist()]
    for i, (rows, kv_len, sampling) in enumerate(order):
        if i == len(keys):
            run.freeze()
        state.normal_()  # the graphs read the live tensor, not a copy from their compile
        torch.testing.assert_close(run(rows, kv_len, sampling, 3), step(rows, kv_len, sampling, 3))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 4  # (rows, sampling): kv_len is dynamic
    with pytest.raises(RuntimeError, match="not compiled at warm-up"):
        run(4, 64, False, 3)


@pytest.mark.parametrize("dtype, tiles", [(torch.bfloat16, (128, 64)), (torch.float32, (64, 32))])
def test_every_layer_is_built_with_the_triton_kernels_on_cuda(dtype, tiles):
    """On CUDA with Triton every attention layer gets the split-KV kernel for steps and the prefill kernel
    (its tiles by the model's dtype) for prompts, decoder layers the fused add + norm, dense MLPs the
    SwiGLU kernel, top-1 MoE the dispatch kernel; the model's repr says so. FP8 weights keep torch's MLP
    and experts. (Built on the CPU: the layers only hold the callables.)"""
    pytest.importorskip("triton")
    from redline.config import ModelConfig
    from redline.kernels.decode_attention import decode_attention
    from redline.kernels.prefill_attention import prefill_attention
    from redline.layers.attention import Attention
    from redline.layers.mlp import MLP
    from redline.models.llama import LlamaForCausalLM
    from redline.train.random_init import llama3_config

    backends = Backends.choose(torch.device("cuda"), dtype, compiled=False)
    model = LlamaForCausalLM(ModelConfig.from_dict(llama3_config(64)), backends=backends)
    for layer in (m for m in model.modules() if isinstance(m, Attention)):
        assert layer.step_kernel.func is decode_attention and layer.step_kernel.keywords == {"pdl": False}
        assert layer.prefill_kernel.func is prefill_attention
        assert (layer.prefill_kernel.keywords["block_m"], layer.prefill_kernel.keywords["block_n"]) == tiles
    assert all(m.swiglu is not None for m in model.modules() if isinstance(m, MLP))
    assert "decode=decode_attention(pdl=False)" in repr(model) and "add_norm=fused_add_norm" in repr(model)
    fp8 = Backends.choose(torch.device("cuda"), dtype, compiled=False, fp8_weights=True)
    assert fp8.swiglu is None and fp8.moe_top1 is None and fp8.decode_attention is not None
    plain = LlamaForCausalLM(ModelConfig.from_dict(llama3_config(64)))
    attention = [m for m in plain.modules() if isinstance(m, Attention)]
    assert all(m.step_kernel is None and m.prefill_kernel is None for m in attention)


@pytest.mark.skipif(not cpu_ops.available(), reason="needs AVX-512 BF16 and VNNI, C++ and ninja")
def test_the_cpu_kernels_build_where_they_can():
    """Where they can build, they do: a source that does not compile makes load() warn and return False,
    which would otherwise only skip the kernels' own tests."""
    assert cpu_ops.load()
