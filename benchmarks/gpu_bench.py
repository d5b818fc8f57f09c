"""Batch-1 decode step on a Llama-3.1-8B-shaped random-weight model: BF16 and FP8 against the memory
bandwidth roofline, the EAGLE-3 K=3 step against the plain step, CUDA graph against eager; and prefill
attention at 4,000 tokens (the Triton kernel against SDPA over the cache slice), a 4,000-token prefill
through the whole model, and the int4 / int8 weight-only kernel against bf16 on the 8B's gate/up product.

    python benchmarks/gpu_bench.py --out OUTDIR [--shape 8b|tiny] [--device cuda] [--peak-gbps 4800]

Weights are random (N(0, 0.02)), built directly on the device: no checkpoint is read. The roofline
time of a plain step is (weight bytes read per token) / (peak bandwidth): every linear weight plus
one embedding row; KV-cache reads are left out (a few MB at this length). `--shape tiny --device cpu`
runs the same code on CPU in seconds (tests/test_gpu_check.py), the Triton kernel left out.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from redline.config import ModelConfig
from redline.draft_tree import TreeShape
from redline.kernels import HAS_TRITON
from redline.kernels.attention_core import sdpa_attention
from redline.kernels.paged_kv import BLOCK
from redline.layers.backends import Backends, prefill_tiles
from redline.models.eagle3 import Eagle3Draft, default_aux_layers, draft_config_for
from redline.models.llama import LlamaForCausalLM
from redline.models.quantize import HIGH_PRECISION, to_fp8
from redline.quant.fp8 import scaled_mm_available
from redline.quant.scheme import Fp8Scheme
from redline.runner.model_runner import ModelRunner
from redline.runner.one_slot import fill_slot, release_slot
from redline.runner.plan import Shapes
from redline.train.random_init import llama3_config, normal_init

SHAPES = {
    "8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "tiny": dict(vocab_size=512, tie_word_embeddings=False),  # llama3_config's tiny defaults otherwise
}
PROMPT = 128
LONG_PROMPT = 4000


def weight_bytes(model: LlamaForCausalLM) -> int:
    embed = model.model.embed_tokens.weight
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return total - embed.numel() * embed.element_size() + embed[0].numel() * embed.element_size()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def random_pair(
    config: ModelConfig, device: torch.device, pdl: bool = False, fp8: bool = False
) -> tuple[LlamaForCausalLM, Eagle3Draft]:
    """Target and EAGLE-3 draft with N(0, 0.02) weights, built on the device with the kernels the engine
    would choose there (with pdl: programmatic dependent launch; fp8: FP8 decoder linears)."""
    backends = Backends.choose(device, torch.bfloat16, compiled=False, pdl=pdl, fp8_weights=fp8)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config, backends=backends, aux_layers=default_aux_layers(config.num_layers))
        model = model.to(torch.bfloat16)
        embedding = model.model.embed_tokens
        draft = Eagle3Draft(draft_config_for(config), backends=backends, target_embedding=embedding)
        draft = draft.to(torch.bfloat16)
    normal_init(model)
    normal_init(draft)
    if fp8:
        with torch.no_grad():
            to_fp8(model, Fp8Scheme(tuple(HIGH_PRECISION)), scaled_mm_available(device))
    model.finish_loading()
    draft.midlayer.mlp.fuse_gate_up()
    model.model.rotary.materialize(device)
    draft.rotary.materialize(device)
    return model.eval().requires_grad_(False), draft.eval().requires_grad_(False)


@torch.inference_mode()
def time_step(runner: ModelRunner, graphed: bool, steps: int) -> float:
    """Seconds per decode step of slot 0 (prefilled with PROMPT tokens), the graph or the eager step."""
    fill_slot(runner, list(range(5, 5 + PROMPT)))
    kv_len = runner.shapes.kv_len_for(PROMPT + steps * (runner.shapes.k + 1))
    run = runner.run_step if graphed else runner.step
    for _ in range(3):
        run(1, kv_len, False)
    sync(runner.device)
    start = time.perf_counter()
    for _ in range(steps):
        run(1, kv_len, False)
    sync(runner.device)
    release_slot(runner)
    return (time.perf_counter() - start) / steps


def seconds_per_call(run: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    run()  # compiles the Triton kernel on its first call
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    sync(device)
    return (time.perf_counter() - start) / repeats


def prefill_attention_bench(config: ModelConfig, device: torch.device) -> dict:
    """One layer's attention over a 4,000-token prompt in a 4,096-position cache bucket, bf16: the Triton
    prefill kernel (on CUDA) and SDPA over the cache slice with the boolean mask (the torch path), with
    causal FLOP/s (4 * D * Hq * T(T+1)/2) and SDPA's peak memory beyond its inputs."""
    t, kv_len, d = LONG_PROMPT, 4096, config.head_dim
    q = torch.randn(1, t, config.num_heads, d, device=device, dtype=torch.bfloat16)
    k_cache, v_cache = (
        torch.randn(2, 1, config.num_kv_heads, kv_len + BLOCK, d, device=device).bfloat16().unbind(0)
    )
    # the same keys and values in blocks of 16 (kernels/paged_kv.py) for the kernel: block j holds
    # positions 16 j .. 16 j + 15, the table lists them in order
    blocks = [c[0].unflatten(1, (-1, BLOCK)).transpose(0, 1).contiguous() for c in (k_cache, v_cache)]
    tables = torch.arange(blocks[0].shape[0], device=device, dtype=torch.int32)[None]
    positions = torch.arange(t, device=device)[None]
    mask = (torch.arange(kv_len, device=device)[None, :] <= positions[0, :, None])[None, None]
    flops = 4 * d * config.num_heads * t * (t + 1) / 2

    def sdpa() -> torch.Tensor:
        return sdpa_attention(q, k_cache[:, :, :kv_len], v_cache[:, :, :kv_len], mask)

    result: dict = {"tokens": t, "kv_len": kv_len}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    sdpa_s = seconds_per_call(sdpa, device)
    result["sdpa_ms"], result["sdpa_tflops"] = sdpa_s * 1e3, flops / sdpa_s / 1e12
    if device.type == "cuda":
        result["sdpa_peak_extra_gb"] = (torch.cuda.max_memory_allocated() - base) / 1e9
    if device.type == "cuda" and HAS_TRITON:
        from redline.kernels.prefill_attention import prefill_attention

        tiles = prefill_tiles(torch.bfloat16)
        triton_s = seconds_per_call(
            lambda: prefill_attention(q, *blocks, positions, tables, kv_len, **tiles), device
        )
        result["triton_ms"], result["triton_tflops"] = triton_s * 1e3, flops / triton_s / 1e12
        got = prefill_attention(q, *blocks, positions, tables, kv_len, **tiles)
        result["triton_max_abs_diff_vs_sdpa"] = (got.float() - sdpa().float()).abs().max().item()
    print(f"prefill attention {t} tokens: {json.dumps(result)}")
    return result


def long_prefill_bench(model: LlamaForCausalLM, device: torch.device) -> dict:
    """A 4,000-token prompt through the whole model (eager, the runner's kernels): time to first token."""
    runner = ModelRunner(model, Shapes(1, LONG_PROMPT + 64, 0), cuda_graphs=False)
    prompt = [5 + i % (model.config.vocab_size - 5) for i in range(LONG_PROMPT)]
    seconds = seconds_per_call(lambda: fill_slot(runner, prompt), device, repeats=2)
    result = {"tokens": LONG_PROMPT, "ms": seconds * 1e3, "tokens_per_s": LONG_PROMPT / seconds}
    print(f"prefill {LONG_PROMPT} tokens through the model: {json.dumps(result)}")
    return result


def weight_only_bench(config: ModelConfig, device: torch.device) -> dict:
    """The 8B's fused gate/up product ([2I, H]) at 1, 4 and 16 rows: bf16 F.linear against the int4 and
    int8 weight-only kernel (kernels/weight_only_mm.py, groups of 128), in weight GB/s read."""
    from redline.kernels.weight_only_mm import weight_only_mm
    from redline.quant.weight_only_gpu import GpuWeightOnlyLinear

    linear = torch.nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False, device=device)
    linear = linear.bfloat16()
    result: dict = {"shape": list(linear.weight.shape)}
    quantized = {bits: GpuWeightOnlyLinear.from_linear(linear, bits, 128, torch.bfloat16) for bits in (4, 8)}
    for rows in (1, 4, 16):
        x = torch.randn(rows, config.hidden_size, device=device, dtype=torch.bfloat16)
        product = functools.partial(torch.nn.functional.linear, x, linear.weight)
        seconds = seconds_per_call(product, device, repeats=20)
        result[f"bf16_m{rows}_gbps"] = linear.weight.nbytes / seconds / 1e9
        for bits, q in quantized.items():
            held = q.codes.nbytes + q.scales.nbytes + q.zeros.nbytes
            run = functools.partial(weight_only_mm, x, q.codes, q.scales, q.zeros)
            seconds_q = seconds_per_call(run, device, repeats=20)
            result[f"int{bits}_m{rows}_gbps"] = held / seconds_q / 1e9
            result[f"int{bits}_m{rows}_speedup_vs_bf16"] = seconds / seconds_q
    print(f"weight-only products: {json.dumps(result)}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", choices=list(SHAPES), default="8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--peak-gbps", type=float, default=4800.0, help="H200 HBM3e: 4.8 TB/s")
    args = parser.parse_args()
    device = torch.device(args.device)
    config = ModelConfig.from_dict(llama3_config(**SHAPES[args.shape]))
    model, draft = random_pair(config, device)
    max_len = PROMPT + args.steps * 4 + 64
    graphs = device.type == "cuda"
    results = []

    def record(name: str, runner: ModelRunner, graphed: bool, bytes_per_step: int) -> None:
        seconds = time_step(runner, graphed, args.steps)
        gbps = bytes_per_step / seconds / 1e9
        share = gbps / args.peak_gbps
        results.append({"name": name, "ms_per_step": seconds * 1e3, "weight_gb_per_s": gbps,
                        "roofline_fraction": share})  # fmt: skip
        print(f"{name:<28}{seconds * 1e3:>9.3f} ms/step{gbps:>9.1f} GB/s{share:>8.1%} of roofline")

    bf16_bytes = weight_bytes(model)
    plain = ModelRunner(model, Shapes(1, max_len, 0))
    record("bf16 plain eager", plain, False, bf16_bytes)
    if graphs:
        record("bf16 plain cuda-graph", plain, True, bf16_bytes)
    spec = ModelRunner(model, Shapes(1, max_len, 3), draft)
    record("bf16 eagle3 K=3 step", spec, graphs, bf16_bytes)
    tree = ModelRunner(model, Shapes(1, max_len, 3, tree=TreeShape(topk=4, steps=3, nodes=8)), draft)
    record("bf16 eagle3 tree 4x8 step", tree, graphs, bf16_bytes)  # one CUDA graph, the 8 rows' mask inside
    del plain, spec, tree
    prefill_attention = prefill_attention_bench(config, device)
    weight_only = weight_only_bench(config, device) if device.type == "cuda" and HAS_TRITON else None
    long_prefill = long_prefill_bench(model, device)
    del model, draft
    if graphs and torch.cuda.get_device_capability(device) >= (9, 0):  # PDL: Hopper or newer
        model, _ = random_pair(config, device, pdl=True)
        record("bf16 plain cuda-graph pdl", ModelRunner(model, Shapes(1, max_len, 0)), True, bf16_bytes)
        del model
    model, _ = random_pair(config, device, fp8=True)
    fp8_bytes = weight_bytes(model)
    record("fp8 plain" + (" cuda-graph" if graphs else " eager"), ModelRunner(model, Shapes(1, max_len, 0)),
           graphs, fp8_bytes)  # fmt: skip
    by_name = {r["name"]: r["ms_per_step"] for r in results}
    summary = {
        "device": torch.cuda.get_device_name() if graphs else "cpu",
        "torch": torch.__version__,
        "shape": args.shape,
        "bf16_weight_gb": bf16_bytes / 1e9,
        "fp8_weight_gb": fp8_bytes / 1e9,
        "k3_step_over_plain_step": by_name["bf16 eagle3 K=3 step"]
        / by_name["bf16 plain" + (" cuda-graph" if graphs else " eager")],
        "tree_step_over_plain_step": by_name["bf16 eagle3 tree 4x8 step"]  # issue 27's target: <= 1.3
        / by_name["bf16 plain" + (" cuda-graph" if graphs else " eager")],
        "pdl_over_no_pdl": (
            by_name["bf16 plain cuda-graph pdl"] / by_name["bf16 plain cuda-graph"]
            if "bf16 plain cuda-graph pdl" in by_name
            else None
        ),
        "results": results,
        "prefill_attention": prefill_attention,
        "prefill_bf16_model": long_prefill,
        "weight_only": weight_only,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_bench.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}, indent=2))


if __name__ == "__main__":
    main()
