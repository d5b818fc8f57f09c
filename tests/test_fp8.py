"""FP8 weights: quantization error bounds, both kernels, `redline quantize` round trip, loading the
published layouts, and FP8 models close to their high-precision originals."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_hf_model, llama3_hf_config, llama4_hf_config, save_hf_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from redline import LLM, SamplingParams
from redline.config import ConfigError
from redline.models.build import load_target
from redline.models.quantized_checkpoint import quantize_checkpoint
from redline.quant.fp8 import FP8, Fp8Linear, dequantize, quantize
from redline.quant.fp8_experts import Fp8Experts
from redline.quant.scheme import Fp8Scheme

# e4m3 keeps 3 mantissa bits: rounding moves a normal value by at most 2^-4 of itself, and a value
# in the subnormal range (below 2^-6 x scale) by at most half its step, 2^-10 x scale.
REL, SUBNORMAL = 2.0**-4, 2.0**-10


def test_quantize_error_bound():
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 96)  # columns over four decades
    q, scale = quantize(w)
    assert q.dtype == FP8 and scale.shape == (64, 1)
    err = (dequantize(q, scale, torch.float32) - w).abs()
    assert bool((err <= w.abs() * REL + scale * SUBNORMAL + 1e-12).all())
    assert torch.equal(quantize(torch.zeros(3, 5))[0].float(), torch.zeros(3, 5))  # no 0/0


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_kernels(bias):
    linear = torch.nn.Linear(128, 48, bias=bias)
    x = torch.randn(5, 3, 128)
    dequantized = Fp8Linear.from_linear(linear, scaled_mm=False)
    reference = torch.nn.functional.linear(
        x, dequantize(dequantized.weight, dequantized.weight_scale, torch.float32), linear.bias
    )
    # the dequantize kernel computes exactly that product (fp32 rounding only)
    torch.testing.assert_close(dequantized(x), reference, atol=1e-5, rtol=1e-5)
    # _scaled_mm also quantizes x per token: each product term moves by <= ~2 x 2^-4, errors average
    # over K = 128 terms, so the output's relative L2 error stays well under 2^-4
    scaled = Fp8Linear.from_linear(linear, scaled_mm=True)(x)
    assert ((scaled - reference).norm() / reference.norm()).item() < REL
    full = linear(x)
    assert ((dequantized(x) - full).norm() / full.norm()).item() < REL


def test_fp8_experts_match_dequantized_reference():
    from redline.layers.moe import Experts

    experts = Experts(4, 32, 24)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.1)
        experts.down_proj.normal_(0, 0.1)
    fp8 = Fp8Experts.from_experts(experts)
    x, which = torch.randn(6, 32), torch.tensor([0, 3, 3, 1, 2, 0])
    exact = experts.forward_selected(x, which)
    got = fp8.forward_selected(x, which)
    assert ((got - exact).norm() / exact.norm()).item() < 2 * REL
    # prefill: rows sorted by expert, order [0, 5, 3, 4, 1, 2] (experts [0, 0, 1, 2, 3, 3]), group ends
    # [2, 3, 4, 6]; each expert dequantized once: the same function as the decode path
    order = torch.argsort(which, stable=True)
    grouped = fp8.forward_grouped(x[order], torch.tensor([2, 3, 4, 6], dtype=torch.int32))
    torch.testing.assert_close(grouped, got[order], atol=1e-5, rtol=1e-5)


class LargestFp32(TorchDispatchMode):
    """The most elements any op's fp32 output holds."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [
            t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.dtype == torch.float32
        ]
        self.largest = max([self.largest, *sizes])
        return out


def test_fp8_experts_quantize_one_expert_at_a_time():
    """Quantizing on load (--dtype fp8) must not hold fp32 copies of a whole fused expert tensor: for
    Maverick's gate_up that would be 86 GB per layer. Every fp32 temporary is one expert's size."""
    from redline.layers.moe import Experts

    experts = Experts(8, 64, 48).to(torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.1)
        experts.down_proj.normal_(0, 0.1)
    log = LargestFp32()
    with log:
        fp8 = Fp8Experts.from_experts(experts)
    assert log.largest == 64 * 96  # one expert's gate_up [H, 2I]
    q, scale = quantize(experts.gate_up_proj.float(), dim=1)  # the whole tensor at once: the same values
    assert torch.equal(fp8.gate_up_proj.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(fp8.gate_up_proj_scale, scale)


def _close_logits(dir_a, dir_b, tokens: torch.Tensor) -> float:
    """Mean KL(a || b) of next-token distributions over all positions."""
    a, b = load_target(dir_a, torch.float32), load_target(dir_b, torch.float32)
    positions = torch.arange(tokens.shape[1])[None]
    with torch.no_grad():
        la = a.logits(a(tokens, positions)[0]).log_softmax(-1)
        lb = b.logits(b(tokens, positions)[0]).log_softmax(-1)
    return (la.exp() * (la - lb)).sum(-1).mean().item()


@pytest.mark.parametrize("family", ["llama3", "llama4"])
def test_quantize_round_trip_and_accuracy(family, tmp_path, tokenizer_dir):
    config = llama3_hf_config() if family == "llama3" else llama4_hf_config()
    src = save_hf_model(build_hf_model(config, seed=0), tmp_path / "src", tokenizer_dir)
    counts = quantize_checkpoint(src, tmp_path / "fp8")
    assert 0.3 < counts["quantized_parameters"] / counts["parameters"] < 1.0
    raw = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert raw["quantization_config"]["quant_method"] == "compressed-tensors"

    loaded = load_target(tmp_path / "fp8", torch.float32)
    reference = load_target(src, torch.float32)
    fp8_modules = [m for m in loaded.modules() if isinstance(m, Fp8Linear | Fp8Experts)]
    assert fp8_modules and not isinstance(loaded.lm_head, Fp8Linear)
    if family == "llama4":
        assert any(isinstance(m, Fp8Experts) for m in fp8_modules)
    # bit-exact: the loaded FP8 weights are the quantization of the original fp32 weights
    q_ref, s_ref = quantize(reference.model.layers[0].self_attn.q_proj.weight)
    layer = loaded.model.layers[0].self_attn.q_proj
    assert torch.equal(layer.weight.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(layer.weight_scale, s_ref)
    assert layer.weight_scale.dtype == torch.float32  # scales are not cast to the activation dtype

    tokens = torch.randint(0, config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    kl = _close_logits(src, tmp_path / "fp8", tokens)
    assert kl < 1e-2, kl  # fp8 weight noise (~2^-5 relative) on logits of a random model: KL ~1e-4..1e-3


def test_quantize_on_load_and_fp8_dtype(tmp_path, tokenizer_dir):
    src = save_hf_model(build_hf_model(llama3_hf_config(), seed=2), tmp_path / "src", tokenizer_dir)
    on_load = load_target(src, torch.float32, quantization="fp8")
    quantize_checkpoint(src, tmp_path / "fp8")
    from_disk = load_target(tmp_path / "fp8", torch.float32)
    for (name, a), b in zip(on_load.state_dict().items(), from_disk.state_dict().values(), strict=True):
        if a.dtype == FP8:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    llm = LLM(src, dtype="fp8", max_batch=1)
    assert isinstance(llm.model.model.layers[0].mlp.gate_proj, Fp8Linear)
    assert llm.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0].completion_tokens == 4


def test_fbgemm_layout_and_unsupported_schemes(tmp_path, tokenizer_dir):
    src = save_hf_model(build_hf_model(llama3_hf_config(), seed=3), tmp_path / "src", tokenizer_dir)
    quantize_checkpoint(src, tmp_path / "fp8")
    config_path = tmp_path / "fp8" / "config.json"
    raw = json.loads(config_path.read_text())
    raw["quantization_config"] = {"quant_method": "fbgemm_fp8", "modules_to_not_convert": ["lm_head"]}
    config_path.write_text(json.dumps(raw))
    assert isinstance(load_target(tmp_path / "fp8").model.layers[1].self_attn.o_proj, Fp8Linear)

    raw["quantization_config"] = {"quant_method": "bitsandbytes"}
    config_path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="'bitsandbytes' is not supported"):
        load_target(tmp_path / "fp8")
    blocks = {"group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}
    raw["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": blocks}
    config_path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="channel-wise"):
        load_target(tmp_path / "fp8")


def test_ignore_patterns():
    scheme = Fp8Scheme(("lm_head", "re:.*layers\\.1\\..*", "model.layers.0.mlp.up_proj"))
    assert scheme.keeps_high_precision("model.layers.1.self_attn.q_proj")
    assert scheme.keeps_high_precision("model.layers.0.mlp.up_proj")
    assert not scheme.keeps_high_precision("model.layers.0.mlp.gate_proj")
    assert scheme.keeps_high_precision("lm_head")


def test_fp8_kv_cache_close_to_full_precision(tmp_path, tokenizer_dir):
    from redline.models.kv_cache import KVCache

    src = save_hf_model(build_hf_model(llama3_hf_config(), seed=5), tmp_path / "src", tokenizer_dir)
    model = load_target(src, torch.float32)
    tokens = torch.randint(0, model.config.vocab_size, (1, 33), generator=torch.Generator().manual_seed(2))
    logits = {}
    for dtype in (torch.float32, FP8):
        cache = KVCache(model.config, 1, 64, dtype, torch.device("cpu"))
        with torch.no_grad():
            tables = cache.tables(0, 1)
            model(tokens[:, :32], torch.arange(32)[None], cache.layers, tables, 64)  # prefill into the cache
            hidden, _ = model(tokens[:, 32:], torch.tensor([[32]]), cache.layers, tables, 64)  # a decode step
        logits[dtype] = model.logits(hidden)[0, -1].log_softmax(-1)
    assert cache.layers[0][0].dtype == FP8
    kl = (logits[torch.float32].exp() * (logits[torch.float32] - logits[FP8])).sum().item()
    assert 0 < kl < 1e-2, kl  # e4m3 keys/values: ~2^-5 relative noise, averaged by attention


def test_llm_fp8_kv_cache_option(tmp_path, tokenizer_dir):
    src = save_hf_model(build_hf_model(llama3_hf_config(), seed=6), tmp_path / "src", tokenizer_dir)
    llm = LLM(src, dtype="float32", max_batch=1, kv_cache_dtype="fp8")
    assert llm.runner.cache.layers[0][0].dtype == FP8
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, ignore_eos=True))[0].completion_tokens == 5
