"""MoE prefill by sorting (token, choice) pairs by expert and one grouped GEMM: equal to the dense sum
over experts, for top_k 1 and 2, fp32 and bf16, FP8 experts, empty groups and a single busy expert, and
under torch.compile(fullgraph=True) with a dynamic token dimension."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils
import torch.nn.functional as F
from torch.profiler import profile

from redline.kernels.grouped_mm import grouped_mm, grouped_mm_loop, masked_grouped_mm, native_grouped_mm
from redline.layers.moe import Experts, MoE, routed_sorted, sort_by_expert
from redline.parallel.group import TensorParallel
from redline.quant.fp8 import FP8, dequantize
from redline.quant.fp8_experts import Fp8Experts

# Norm-relative error bounds against a float64 reference.
# fp32: unit roundoff 2^-24 ~ 6e-8; a K <= 64 term sum moves by at most K x that (4e-6) per product.
# bf16: the chain rounds six times (weighted input, gate, up, silu, silu * up, down), each by at most
# 2^-9 of the value: 6 x 2^-9 ~ 0.012 (measured ~0.005). A token sent to a wrong expert costs O(1).
BOUND = {torch.float32: 1e-5, torch.bfloat16: 6 * 2.0**-9}


def random_experts(e: int, h: int, i: int, dtype: torch.dtype, seed: int) -> Experts:
    generator = torch.Generator().manual_seed(seed)
    experts = Experts(e, h, i)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(e, h, 2 * i, generator=generator) * h**-0.5)
        experts.down_proj.copy_(torch.randn(e, i, h, generator=generator) * i**-0.5)
    return experts.to(dtype)


def random_moe(e: int, h: int, i: int, top_k: int, dtype: torch.dtype, seed: int) -> MoE:
    moe = MoE(h, i, e, top_k)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():  # Linear [out, in]; experts [E, in, out]
            fan_in = p.shape[-1] if p.dim() == 2 else p.shape[-2]
            p.copy_(torch.randn(p.shape, generator=generator) * fan_in**-0.5)
    return moe.to(dtype)


def dense_routed(
    experts: Experts,
    x: torch.Tensor,  # [N, H]
    top_expert: torch.Tensor,  # [N, k]
    weight: torch.Tensor,  # [N, k]
) -> torch.Tensor:  # [N, H] float64
    """The definition: sum over all experts e of expert_e(w_e * x), w_e = 0 where e was not chosen."""
    gate_up, down = experts.gate_up_proj.double(), experts.down_proj.double()
    dense_weight = torch.zeros(x.shape[0], gate_up.shape[0], dtype=torch.float64)
    dense_weight.scatter_(1, top_expert, weight.double())
    out = torch.zeros(x.shape[0], down.shape[-1], dtype=torch.float64)
    for e in range(gate_up.shape[0]):
        gate, up = ((x.double() * dense_weight[:, e : e + 1]) @ gate_up[e]).chunk(2, dim=-1)
        out += (F.silu(gate) * up) @ down[e]
    return out


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def test_sort_by_expert_groups_pairs_stably():
    order, offs = sort_by_expert(torch.tensor([2, 0, 2, 0, 3]), 4)
    assert order.tolist() == [1, 3, 0, 2, 4] and offs.tolist() == [2, 2, 4, 5] and offs.dtype == torch.int32
    expert = torch.randint(0, 16, (3000,), generator=torch.Generator().manual_seed(0))
    order, offs = sort_by_expert(expert, 16)
    assert torch.equal(offs.long(), torch.bincount(expert, minlength=16).cumsum(0))
    start = 0
    for e, end in enumerate(offs.tolist()):
        group = order[start:end]
        assert bool((expert[group] == e).all()) and bool((group.diff() > 0).all())  # stable
        start = end


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_equals_product_per_group(dtype):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(300, 64, generator=generator).to(dtype)
    w = torch.randn(6, 64, 48, generator=generator).to(dtype)
    ends = [0, 100, 100, 180, 299, 300]  # groups 0 and 2 empty
    starts = [0, *ends[:-1]]
    want = torch.cat(
        [x[s:t].double() @ w[g].double() for g, (s, t) in enumerate(zip(starts, ends, strict=True))]
    )
    offs = torch.tensor(ends, dtype=torch.int32)
    product = lambda g, rows, out: torch.mm(rows, w[g], out=out)
    masked = masked_grouped_mm(x, offs, 48, product)  # the path taken while a CUDA graph captures
    for got in (grouped_mm(x, w, offs), grouped_mm_loop(x, w, offs), masked):
        assert got.dtype == dtype and relative_error(got, want) < BOUND[dtype] / 6  # one rounding
    assert native_grouped_mm(x, w) == (dtype == torch.bfloat16)  # fp32 does not trace through it
    assert not native_grouped_mm(x[:, :60].contiguous(), w[:, :60])  # rows not 16-byte multiples


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_prefill_equals_dense_reference_at_2048_tokens(dtype, top_k):
    moe = random_moe(16, 64, 32, top_k, dtype, seed=top_k)
    x = torch.randn(2048, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        got = moe(x)
        top_logit, top_expert = torch.topk(moe.router(x), top_k, dim=-1)
        weight = torch.sigmoid(top_logit.float()).to(dtype)
        want = moe.shared_expert(x).double() + dense_routed(moe.experts, x, top_expert, weight)
    assert relative_error(got, want) < BOUND[dtype]
    # every expert got tokens here; the grouped path is what ran (2048 * k pairs > 16 experts)
    assert torch.bincount(top_expert.reshape(-1), minlength=16).min() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "route",
    ["all_to_expert_5", "two_experts_of_16", "top2_over_three_experts"],
)
def test_empty_groups_and_one_busy_expert(dtype, route):
    n, generator = 700, torch.Generator().manual_seed(3)
    experts = random_experts(16, 64, 32, dtype, seed=4)
    x = torch.randn(n, 64, generator=generator).to(dtype)
    if route == "all_to_expert_5":
        top_expert = torch.full((n, 1), 5)
    elif route == "two_experts_of_16":
        top_expert = torch.randint(0, 2, (n, 1), generator=generator) * 15  # experts 0 and 15 only
    else:
        top_expert = torch.stack([torch.randperm(3, generator=generator)[:2] + 7 for _ in range(n)])
    weight = torch.rand(top_expert.shape, generator=generator).to(dtype)
    with torch.no_grad():
        got = routed_sorted(x, top_expert, weight, experts, 16)
    assert relative_error(got, dense_routed(experts, x, top_expert, weight)) < BOUND[dtype]


def test_sorted_path_equals_decode_path():
    experts = random_experts(8, 64, 32, torch.float32, seed=5)
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(40, 64, generator=generator)
    top_expert = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(40)])
    weight = torch.rand(40, 2, generator=generator)
    with torch.no_grad():
        grouped = routed_sorted(x, top_expert, weight, experts, 8)
        selected = experts.forward_selected(
            (x[:, None] * weight[..., None]).reshape(80, 64), top_expert.reshape(-1)
        )
    torch.testing.assert_close(grouped, selected.view(40, 2, 64).sum(1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("top_k", [1, 2])
def test_fp8_experts_equal_their_dequantized_bf16_counterpart(top_k):
    moe = random_moe(16, 64, 32, top_k, torch.bfloat16, seed=7)
    fp8 = Fp8Experts.from_experts(moe.experts)
    exact, rounded = Experts(16, 64, 32), Experts(16, 64, 32).to(torch.bfloat16)  # q * s in fp32, bf16
    with torch.no_grad():
        for experts in (exact, rounded):
            dtype = experts.gate_up_proj.dtype
            experts.gate_up_proj.copy_(dequantize(fp8.gate_up_proj, fp8.gate_up_proj_scale, dtype))
            experts.down_proj.copy_(dequantize(fp8.down_proj, fp8.down_proj_scale.transpose(1, 2), dtype))
    x = torch.randn(2048, 64, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    with torch.no_grad():
        moe.experts = rounded
        bf16_counterpart = moe(x)
        moe.experts = fp8
        got = moe(x)
        top_logit, top_expert = torch.topk(moe.router(x), top_k, dim=-1)
        weight = torch.sigmoid(top_logit.float()).to(torch.bfloat16)
        want = moe.shared_expert(x).double() + dense_routed(exact, x, top_expert, weight)
    # FP8 casts its weight exactly and scales the product; the counterpart rounds q * s to bf16 first:
    # both are bf16 chains of the same function, each within the bf16 bound of the exact one
    assert relative_error(got, want) < BOUND[torch.bfloat16]
    assert relative_error(bf16_counterpart, want) < BOUND[torch.bfloat16]
    assert relative_error(got, bf16_counterpart) < BOUND[torch.bfloat16]


def test_fp8_prefill_casts_only_experts_with_tokens_one_at_a_time():
    moe = random_moe(16, 64, 32, 1, torch.bfloat16, seed=9)
    moe.experts = Fp8Experts.from_experts(moe.experts)
    with torch.no_grad():  # the router sends every token to expert 3, 8 or 12 (by sign pattern of x)
        moe.router.weight.zero_()
        moe.router.weight[3, 0], moe.router.weight[8, 1], moe.router.weight[12, 2] = 1.0, 1.0, 1.0
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    x[:, :3] = x[:, :3].abs()
    with torch.no_grad(), profile(record_shapes=True) as prof:
        moe(x)
    casts = [
        e.input_shapes[0]
        for e in prof.events()
        if e.name == "aten::_to_copy" and "Float8" in e.input_dtypes[0]
    ]
    used = torch.topk(moe.router(x), 1).indices.unique().numel()
    assert used == 3 and sorted(casts) == sorted([[64, 64]] * used + [[32, 64]] * used)
    assert moe.experts.gate_up_proj.dtype == FP8


@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8"])
def test_compiled_prefill_with_dynamic_tokens_equals_eager(kind):
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    moe = random_moe(16, 64, 32, 2, dtype, seed=11)
    if kind == "fp8":
        moe.experts = Fp8Experts.from_experts(moe.experts)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(moe, fullgraph=True)
    for n in (256, 2048):
        x = torch.randn(n, 64, generator=torch.Generator().manual_seed(n)).to(dtype)
        torch._dynamo.mark_dynamic(x, 0)
        with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=n != 256):
            got = compiled(x)
            want = moe(x)
        # inductor fuses silu * up without the bf16 roundings between them: within the bf16 bound
        assert relative_error(got, want) < BOUND[dtype]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def expert_parallel_rank(whole: MoE, rank: int, rows: list[int]) -> MoE:
    """Rank `rank` of 2 of `whole` under expert parallelism (its half of the experts, its half of the
    shared expert's width); appends the rows its grouped GEMM computes (offs[E - 1]) to `rows`."""
    e, (i, h), k = whole.num_experts, whole.experts.down_proj.shape[1:], whole.top_k
    part = MoE(h, i, e, k, TensorParallel(rank, 2, expert_parallel=True))
    mine, width = slice(rank * e // 2, (rank + 1) * e // 2), slice(rank * i // 2, (rank + 1) * i // 2)
    shared, whole_shared = part.shared_expert, whole.shared_expert
    with torch.no_grad():
        part.router.weight.copy_(whole.router.weight)
        part.experts.gate_up_proj.copy_(whole.experts.gate_up_proj[mine])
        part.experts.down_proj.copy_(whole.experts.down_proj[mine])
        shared.gate_proj.weight.copy_(whole_shared.gate_proj.weight[width])
        shared.up_proj.weight.copy_(whole_shared.up_proj.weight[width])
        shared.down_proj.weight.copy_(whole_shared.down_proj.weight[:, width])
    grouped = part.experts.forward_grouped
    part.experts.forward_grouped = lambda x, offs: rows.append(offs[-1].item()) or grouped(x, offs)
    return part


@pytest.mark.parametrize("tokens", [300, 2], ids=["grouped", "few-tokens"])
def test_expert_parallel_ranks_sum_to_the_whole_moe_and_prefill_runs_only_their_pairs(tokens):
    """8 experts, top 2, over 2 expert-parallel ranks (experts 0-3 and 4-7, the shared expert split by
    width): the ranks' outputs add up to the one-process MoE (what the MLP's all-reduce computes), and in
    the grouped (prefill) path each rank's grouped GEMM gets exactly the pairs that chose its experts."""
    whole = random_moe(8, 32, 24, 2, torch.float32, seed=int(torch.randint(0, 2**31, ())))
    x = torch.randn(tokens, 32)
    chosen = torch.topk(whole.router(x), 2, dim=-1).indices
    total = torch.zeros(tokens, 32)
    for rank in range(2):
        rows: list[int] = []
        with torch.no_grad():
            total += expert_parallel_rank(whole, rank, rows)(x)
        if tokens * 2 > 8:
            assert rows == [((chosen >= rank * 4) & (chosen < rank * 4 + 4)).sum().item()]
    with torch.no_grad():
        # fp32, the same products summed in another order (two partial sums per token): a few ulp
        torch.testing.assert_close(total, whole(x), atol=1e-5, rtol=1e-5)
