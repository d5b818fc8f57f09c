"""A dense decoder layer's decode step in one C++ call (kernels/cpu_ops.dense_layer_bf16): what the layer's
ops compute, each row as its one-token step, inside a compiled graph with the cache written in place, and
only for the layers it computes."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from redline.config import ModelConfig
from redline.kernels import cpu_ops
from redline.kernels.paged_kv import BLOCK
from redline.layers.attention import AttentionBatch
from redline.layers.backends import Backends
from redline.models.llama import DecoderLayer, LlamaForCausalLM
from redline.models.quantize import QUANTIZED, WeightOnly

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="needs AVX-512 BF16 and VNNI, C++ and ninja")

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
# Llama 4 text layers without MoE, q/k norm or query temperature, every layer rotary, chunks of 64 positions
LLAMA4_DENSE = dict(
    architectures=["Llama4ForCausalLM"],
    intermediate_size_mlp=1536,
    interleave_moe_layer_step=0,
    no_rope_layers=[1] * 4,
    use_qk_norm=False,
    attn_temperature_tuning=False,
    attention_chunk_size=64,
)


def bf16_model(
    dtype: torch.dtype = torch.bfloat16,
    layers: int = 1,
    compiled: bool = False,
    weight_only: WeightOnly | None = None,
    **fields,
) -> LlamaForCausalLM:
    """A random Llama 3 model built as the engine builds it on this CPU for bf16 (norm weights near 1,
    products of unit-scale activations), its weights in `dtype`, the decoder's linears quantized as
    `weight_only` says before loading finishes (as QuantizeOnLoad does)."""
    raw = dict(architectures=["LlamaForCausalLM"], vocab_size=512, num_hidden_layers=layers)
    config = ModelConfig.from_dict({**raw, **SMOLLM2, **fields})
    model = LlamaForCausalLM(config, backends=Backends.choose("cpu", torch.bfloat16, compiled=compiled))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, p.shape[-1] ** -0.5)
    model = model.to(dtype)
    for name, module in model.named_modules():
        if weight_only is not None and name.rpartition(".")[2] in QUANTIZED:
            weight_only.quantized(module, name)
    model.finish_loading()
    return model


def step_case(model: LlamaForCausalLM, b: int, t: int, kv_len: int):
    """x [B, T, H], bf16 caches of shuffled blocks, and the batch of B rows whose T new tokens end at random
    positions below kv_len."""
    c = model.config
    per_row = -(-kv_len // BLOCK)
    caches = torch.randn(2, b * per_row + 2, c.num_kv_heads, BLOCK, c.head_dim).bfloat16().unbind(0)
    tables = torch.randperm(b * per_row + 2)[: b * per_row].view(b, per_row).int()
    positions = torch.randint(t - 1, kv_len, (b, 1)) - torch.arange(t - 1, -1, -1)  # [B, T]
    return torch.randn(b, t, c.hidden_size).bfloat16(), caches, step_batch(model, positions, tables, kv_len)


def step_batch(model: LlamaForCausalLM, positions: torch.Tensor, tables: torch.Tensor, kv_len: int):
    return AttentionBatch.build(
        model.config, model.model.rotary, positions, torch.arange(kv_len)[None], tables
    )


def model_caches(model: LlamaForCausalLM) -> tuple[list, torch.Tensor]:
    """Random bf16 caches of 12 blocks per layer (k and v tensors of their own, as KVCache's), and one row's
    table of 8 of them (128 positions)."""
    c = model.config
    shape = (12, c.num_kv_heads, BLOCK, c.head_dim)
    caches = [(torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()) for _ in range(c.num_layers)]
    return caches, torch.randperm(12)[:8].int()[None]


def by_ops(layer: DecoderLayer, x: torch.Tensor, batch: AttentionBatch, cache) -> torch.Tensor:
    one_call, layer.one_call = layer.one_call, None
    try:
        return layer(x, batch, cache)
    finally:
        layer.one_call = one_call


def mostly_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-equal but for rare elements one bf16 step apart (2^-8 relative, and what follows from such an
    element): the norms' fp32 sums of squares add in another order than torch's, and their scale may
    round to the next float, which moves a product across a bf16 rounding boundary."""
    assert (got == want).float().mean() > 0.99
    torch.testing.assert_close(got, want, rtol=2**-6, atol=2**-6)


TAILS = dict(hidden_size=200, intermediate_size=72, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
CASES = [
    {},  # SmolLM2's widths, Llama 3's rotary halves
    LLAMA4_DENSE,  # Llama 4's rotary (adjacent pairs) and chunked attention
    TAILS,  # widths that are not multiples of 16 lanes
]


@pytest.mark.parametrize("b, t", [(1, 1), (2, 4), (8, 9)])
@pytest.mark.parametrize("fields", CASES)
def test_one_call_computes_what_the_layers_ops_compute(b, t, fields):
    """The layer's output and both caches, against the layer's own ops, which round to bf16 at the same
    points (the norm, then its weight; the rotary in fp32; silu, then the product with up)."""
    model = bf16_model(**fields)
    layer = model.model.layers[0]
    assert layer.one_call is cpu_ops.dense_layer_bf16
    x, caches, batch = step_case(model, b, t, kv_len=300)
    with torch.no_grad():
        one_cache, ops_cache = [c.clone() for c in caches], [c.clone() for c in caches]
        got = layer(x, batch, tuple(one_cache))
        want = by_ops(layer, x, batch, tuple(ops_cache))
    mostly_equal(got, want)
    for one, ops, before in zip(one_cache, ops_cache, caches, strict=True):
        mostly_equal(one, ops)
        assert not torch.equal(one, before)  # the new keys and values were written


@pytest.mark.parametrize("fields", CASES)
def test_a_verify_step_equals_its_one_token_steps_bit_for_bit(fields):
    """An [8, 9] step (K = 8 at batch 8: 72 rows) against its 72 tokens one at a time, in order, on a copy
    of the caches: the same outputs and caches, bit for bit (speculative tokens can equal plain ones)."""
    model = bf16_model(**fields)
    layer = model.model.layers[0]
    x, caches, batch = step_case(model, 8, 9, kv_len=200)
    with torch.no_grad():
        whole_cache, alone_cache = [c.clone() for c in caches], tuple(c.clone() for c in caches)
        whole = layer(x, batch, tuple(whole_cache))
        for j in range(9):
            for i in range(8):
                one = step_batch(model, batch.positions[i : i + 1, j : j + 1], batch.tables[i : i + 1], 200)
                alone = layer(x[i : i + 1, j : j + 1], one, alone_cache)
                assert torch.equal(alone[0, 0], whole[i, j])
    assert all(torch.equal(a, w) for a, w in zip(alone_cache, whole_cache, strict=True))


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 32), (4, 64)])
def test_quantized_weights_take_one_call_which_computes_the_layers_ops(bits, group):
    """SmolLM2's widths with int4 / int8 weights (kernels/quantized_layout.py): one call, whose output and
    caches are the layer's ops' (each product the same kernel), and a verify step's rows bit for bit its
    one-token steps'."""
    model = bf16_model(weight_only=WeightOnly(bits, group, True, torch.bfloat16))
    layer = model.model.layers[0]
    assert layer.one_call is cpu_ops.dense_layer_bf16
    assert layer.self_attn.qkv_weight.dtype == (torch.uint8 if bits == 4 else torch.int8)
    x, caches, batch = step_case(model, 2, 4, kv_len=300)
    with torch.no_grad():
        one_cache, ops_cache = [c.clone() for c in caches], [c.clone() for c in caches]
        got = layer(x, batch, tuple(one_cache))
        mostly_equal(got, by_ops(layer, x, batch, tuple(ops_cache)))
        alone_cache = tuple(c.clone() for c in caches)
        for j in range(4):  # row 1's tokens one at a time, in order
            one = step_batch(model, batch.positions[1:, j : j + 1], batch.tables[1:], 300)
            assert torch.equal(layer(x[1:, j : j + 1], one, alone_cache)[0, 0], got[1, j])
    for one, ops in zip(one_cache, ops_cache, strict=True):
        mostly_equal(one, ops)


def test_in_a_compiled_graph_it_writes_the_cache_in_place():
    """Two layers in a compiled forward: the same op and the eager result, the live caches written, and no
    copy of a cache in the graph's code."""
    torch._dynamo.reset()
    model = bf16_model(layers=2)
    x, caches, batch = step_case(model, 2, 4, kv_len=100)
    layers = model.model.layers
    eager_caches = [[c.clone() for c in caches] for _ in layers]
    graph_caches = [[c.clone() for c in caches] for _ in layers]

    def forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list) -> torch.Tensor:
        step = AttentionBatch(**{**batch.__dict__, "cos": cos, "sin": sin})
        for layer, cache in zip(layers, caches, strict=True):
            x = layer(x, step, tuple(cache))
        return x

    with torch.no_grad():
        want = forward(x, batch.cos, batch.sin, eager_caches)
        compiled = torch.compile(forward, fullgraph=True, dynamic=False)
        got, [code] = run_and_get_code(compiled, x, batch.cos, batch.sin, graph_caches)
    assert torch.equal(got, want)
    for graph, eager in zip(graph_caches, eager_caches, strict=True):
        assert all(torch.equal(g, e) for g, e in zip(graph, eager, strict=True))
    assert code.count("redline_cpu.dense_layer_bf16.default(") == 2
    assert "copy_" not in code and "clone" not in code


def test_a_compiled_model_step_verifies_as_it_decodes_bit_for_bit():
    """The model's forward compiled (decoder layers as compile regions; one-call layers outside them) for a
    4-token verify step and for one-token steps: each verify row's hidden state and the caches equal the
    one-token steps', bit for bit."""
    torch._dynamo.reset()
    model = bf16_model(layers=2, compiled=True)
    assert model.layer_regions
    forward = torch.compile(model, fullgraph=True, dynamic=False)
    caches, tables = model_caches(model)
    tokens, positions = torch.randint(0, 512, (1, 4)), torch.arange(4)[None] + 70
    with torch.no_grad():
        steps = [tuple(t.clone() for t in layer) for layer in caches]
        verify, _ = forward(tokens, positions, caches, tables, 128)
        for j in range(4):
            one, _ = forward(tokens[:, j : j + 1], positions[:, j : j + 1], steps, tables, 128)
            assert torch.equal(one[0, 0], verify[0, j])
    for step_layer, verify_layer in zip(steps, caches, strict=True):
        assert all(torch.equal(s, v) for s, v in zip(step_layer, verify_layer, strict=True))


def test_a_compiled_llama4_step_mixes_one_call_and_op_by_op_layers():
    """Llama 4 with MoE every 2nd layer: the dense layers' one call and the MoE layers' compile regions in
    one compiled step, which computes what the eager step does (bf16: compiled rounding differs)."""
    torch._dynamo.reset()
    moe = {"interleave_moe_layer_step": 2, "num_local_experts": 4, "intermediate_size": 256}
    model = bf16_model(layers=2, compiled=True, **{**LLAMA4_DENSE, **moe})
    assert [layer.one_call is not None for layer in model.model.layers] == [True, False]
    caches, tables = model_caches(model)
    tokens, positions = torch.randint(0, 512, (1, 3)), torch.arange(3)[None] + 70
    with torch.no_grad():
        eager_caches = [tuple(t.clone() for t in layer) for layer in caches]
        want, _ = model(tokens, positions, eager_caches, tables, 128)
        got, _ = torch.compile(model, fullgraph=True, dynamic=False)(tokens, positions, caches, tables, 128)
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)  # a few bf16 steps of unit-scale values


def test_layers_it_does_not_compute_keep_their_ops():
    """fp32 weights, biases, a head_dim the attention kernel does not take (16), and of Llama 4: the NoPE
    layer (every 4th), the MoE layers (every 2nd here) and layers with q/k norm."""
    assert bf16_model(torch.float32).model.layers[0].one_call is None  # bf16 backends, fp32 weights
    assert bf16_model(attention_bias=True).model.layers[0].one_call is None
    assert bf16_model(mlp_bias=True).model.layers[0].one_call is None
    narrow = bf16_model(head_dim=16, num_attention_heads=4, num_key_value_heads=2)
    assert narrow.model.layers[0].one_call is None
    nope = bf16_model(layers=4, **{**LLAMA4_DENSE, "no_rope_layers": None})
    assert [layer.one_call is not None for layer in nope.model.layers] == [True, True, True, False]
    moe = bf16_model(layers=4, **{**LLAMA4_DENSE, "interleave_moe_layer_step": 2, "num_local_experts": 4})
    assert [layer.one_call is not None for layer in moe.model.layers] == [True, False, True, False]
    qk_norm = bf16_model(layers=1, **{**LLAMA4_DENSE, "use_qk_norm": True})
    assert qk_norm.model.layers[0].one_call is None
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "num_hidden_layers": 1, **SMOLLM2}
    config = ModelConfig.from_dict(raw)
    unloaded = LlamaForCausalLM(config, backends=Backends.choose("cpu", torch.bfloat16, compiled=False))
    assert unloaded.model.layers[0].one_call is None  # until finish_loading


def test_a_position_past_the_table_is_an_error_that_writes_nothing():
    """The op's own check (in the engine AttentionBatch.build's gather raises first): row 1's position 64
    would be block 4 of a 4-block table; row 0, which comes first, is not written either."""
    model = bf16_model()
    layer = model.model.layers[0]
    x, caches, batch = step_case(model, 2, 1, kv_len=64)
    written = [c.clone() for c in caches]
    rotary = (batch.cos, batch.sin, False)
    past = torch.tensor([[10], [64]])
    with pytest.raises(RuntimeError, match="position 64 is past the block table"), torch.no_grad():
        weights, eps = layer._one_call_weights(), layer.input_layernorm.eps
        cpu_ops.dense_layer_bf16(x, *written, past, batch.tables, 64, 0, *rotary, weights, eps, 9)
    assert all(torch.equal(w, c) for w, c in zip(written, caches, strict=True))
