"""Published checkpoint layouts that are not plain safetensors of a bf16 model, each written with the
writers the real releases come from (torch.save, safetensors, huggingface_hub's shard splitter) and
configs shaped like the real ones, loaded, and checked against what the checkpoint describes:

- EAGLE-3 drafts as `pytorch_model.bin` (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B) and targets as sharded
  `pytorch_model-*.bin` + `pytorch_model.bin.index.json`;
- Llama 4 FP8 with one projection per expert (RedHatAI/Llama-4-Scout-17B-16E-Instruct-FP8-dynamic);
- compressed-tensors FP8 with per-tensor weight scales and static input scales (neuralmagic /
  RedHatAI Meta-Llama-3.1-8B-Instruct-FP8);
- `redline quantize` streaming into shards, and quantization on load, within the memory they claim.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import build_hf_model, llama3_hf_config, llama4_hf_config, save_hf_model
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import load_file, save_file

from redline.config import ModelConfig
from redline.layers.linear import Linear
from redline.models.build import load_target, module_key_to_checkpoint_key
from redline.models.eagle3 import aux_layers_of, default_aux_layers, load_draft
from redline.models.kv_cache import KVCache
from redline.models.loader import CheckpointError, checkpoint_files
from redline.models.quantized_checkpoint import quantize_checkpoint
from redline.quant.fp8 import FP8, FP8_MAX, Fp8Linear
from redline.quant.fp8_experts import Fp8Experts
from redline.quant.scheme import Fp8Scheme
from redline.sampling import SamplingTensors
from redline.speculative.propose import DraftInputs, propose
from redline.train.random_init import write_random_draft

BF16 = torch.bfloat16


def logits_of(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        hidden, _ = model(tokens, torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1))
        return model.logits(hidden)


def tokens_for(vocab: int, shape: tuple[int, int] = (2, 40), seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def fp8_with_bf16_scale(w: torch.Tensor, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """What llm-compressor stores for a bf16 model: scale = absmax / 448 in bf16 (the weight's dtype),
    values e4m3 of w / scale. dim None: one scale per tensor, shape [1]; else per `dim` slice, kept."""
    absmax = w.abs().amax().reshape(1) if dim is None else w.abs().amax(dim=dim, keepdim=True)
    scale = (absmax / FP8_MAX).to(BF16)
    return (w / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def bf16_exact(model: torch.nn.Module) -> torch.nn.Module:
    """Rounds a fp32 model's weights to bf16 values, so bf16 files hold them exactly."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(BF16).float())
    return model


# EAGLE-3 drafts in pytorch_model.bin

# yuhuili/EAGLE3-LLaMA3.1-Instruct-8B/config.json, with the tiny target's sizes: no target_hidden_size,
# no eagle_config (the default aux layers 2, L/2, L-3), no rope_theta (10000), fp16 weights. Its
# pytorch_model.bin holds fc, midlayer.*, norm, lm_head [draft_vocab, H], d2t and t2d (no embed_tokens).
EAGLE3_RELEASE_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "bos_token_id": 0,
    "eos_token_id": 1,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 112,
    "max_position_embeddings": 2048,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 1,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.28.1",
    "use_cache": True,
    "vocab_size": 384,
    "draft_vocab_size": 100,
}


@pytest.fixture(scope="module")
def llama3_target(tmp_path_factory, tokenizer_dir):
    hf = build_hf_model(llama3_hf_config(num_hidden_layers=6, tie_word_embeddings=False), seed=0)
    return save_hf_model(hf, tmp_path_factory.mktemp("target") / "t", tokenizer_dir), hf


def draft_tokens(target, draft, tokens: torch.Tensor, k: int = 3) -> torch.Tensor:
    """The draft's K greedy proposals after `tokens` ([1, T] -> [1, K])."""
    positions = torch.arange(tokens.shape[1])[None]
    kv = KVCache(draft.config.layer, 1, 64, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        _, aux = target(tokens, positions)
        row = torch.tensor([tokens.shape[1] - 2])
        first_row = torch.zeros_like(row)
        inputs = DraftInputs(aux[:, :-1], tokens[:, 1:], positions[:, :-1], first_row, kv.layers[0],
                             kv.tables(0, 1), 64)  # fmt: skip
        greedy = SamplingTensors.zeros(1, torch.device("cpu"), vocab=target.config.vocab_size)
        proposed, _ = propose(draft, inputs, tokens[:, 1:], row, k, greedy, any_sampling=False)
    return proposed


def test_bin_draft_proposes_what_the_safetensors_draft_does(llama3_target, tmp_path):
    model_dir, _ = llama3_target
    src = write_random_draft(model_dir, tmp_path / "random", draft_vocab=100, std=0.3)
    state = {
        k: v.half() if v.is_floating_point() else v for k, v in load_file(src / "model.safetensors").items()
    }
    assert not any(k.startswith("embed_tokens") for k in state)
    dirs = {"bin": tmp_path / "bin", "safetensors": tmp_path / "safetensors"}
    for path in dirs.values():
        path.mkdir()
        (path / "config.json").write_text(json.dumps(EAGLE3_RELEASE_CONFIG, indent=2))
    torch.save(state, dirs["bin"] / "pytorch_model.bin")
    save_file(state, dirs["safetensors"] / "model.safetensors")

    target = load_target(model_dir, torch.float32, aux_layers=aux_layers_of(dirs["bin"], 6))
    drafts = {name: load_draft(path, target, torch.float32) for name, path in dirs.items()}
    assert target.aux_layers == default_aux_layers(6)
    a, b = drafts["bin"].state_dict(), drafts["safetensors"].state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(drafts["bin"].d2t, state["d2t"]) and drafts["bin"].fc.weight.dtype == torch.float32
    proposals = {name: [] for name in dirs}
    for seed in range(4):
        tokens = tokens_for(384, (1, 12 + seed), seed)
        for name, draft in drafts.items():
            proposals[name].append(draft_tokens(target, draft, tokens))
    assert all(torch.equal(x, y) for x, y in zip(proposals["bin"], proposals["safetensors"], strict=True))
    assert len({tuple(p[0].tolist()) for p in proposals["bin"]}) > 1  # real proposals, not a constant


# Targets as sharded pytorch_model-*.bin


def save_sharded_bin(state: dict[str, torch.Tensor], out: Path, max_shard_size: str) -> None:
    """What transformers 4.x save_pretrained(safe_serialization=False) wrote: huggingface_hub's split, one
    torch.save per shard, pytorch_model.bin.index.json."""
    split = split_torch_state_dict_into_shards(
        state, filename_pattern="pytorch_model{suffix}.bin", max_shard_size=max_shard_size
    )
    for filename, keys in split.filename_to_tensors.items():
        torch.save({k: state[k].contiguous() for k in keys}, out / filename)
    index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    (out / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2))


def test_sharded_bin_target(llama3_target, tmp_path):
    model_dir, hf = llama3_target
    out = tmp_path / "bin"
    out.mkdir()
    (out / "config.json").write_text((model_dir / "config.json").read_text())
    save_sharded_bin(hf.state_dict(), out, "60KB")
    assert len(set(checkpoint_files(out).values())) > 3
    tokens = tokens_for(384)
    with torch.no_grad():
        torch.testing.assert_close(logits_of(load_target(out, torch.float32), tokens), hf(tokens).logits)
    path = (
        out / json.loads((out / "pytorch_model.bin.index.json").read_text())["weight_map"]["lm_head.weight"]
    )
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(CheckpointError, match=rf"{path.name}: not a readable PyTorch checkpoint"):
        load_target(out)


# Llama 4 FP8, one projection per expert


def split_experts(state: dict[str, torch.Tensor], inter: int) -> dict[str, torch.Tensor]:
    """Fused Llama 4 expert tensors (x @ W) and their FP8 scales -> one nn.Linear weight [out, in] and
    scale [out, 1] per expert and projection, as llm-compressor's SequentialLlama4TextExperts writes them:
    gate_proj = gate_up[n][:, :I].T, up_proj = gate_up[n][:, I:].T, down_proj = down[n].T."""
    out = {}
    for key, t in state.items():
        match = re.fullmatch(r"(.*\.experts)\.(gate_up_proj|down_proj)(_scale)?", key)
        if match is None:
            out[key] = t
            continue
        prefix, name, scale = match.groups()
        suffix = "weight_scale" if scale else "weight"
        for n in range(t.shape[0]):
            if name == "down_proj":  # weight [I, H] -> [H, I]; scale [H, 1] stays
                out[f"{prefix}.{n}.down_proj.{suffix}"] = (t[n] if scale else t[n].t()).contiguous()
            else:  # weight [H, 2I] -> 2 x [I, H]; scale [1, 2I] -> 2 x [I, 1]
                out[f"{prefix}.{n}.gate_proj.{suffix}"] = t[n][:, :inter].t().contiguous()
                out[f"{prefix}.{n}.up_proj.{suffix}"] = t[n][:, inter:].t().contiguous()
    return out


def fp8_dynamic_config(ignore: list[str]) -> dict:
    """The FP8-dynamic releases' quantization_config (RedHatAI/Llama-4-Scout-17B-16E-Instruct-FP8-dynamic)"""
    float8 = {"num_bits": 8, "symmetric": True, "type": "float"}
    return {
        "config_groups": {
            "group_0": {
                "input_activations": {**float8, "dynamic": True, "strategy": "token"},
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {**float8, "dynamic": False, "observer": "minmax", "strategy": "channel"},
            }
        },
        "format": "float-quantized",
        "ignore": ignore,
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def write_multimodal_llama4(
    out: Path, text_state: dict, text_config, quantization_config: dict | None
) -> Path:
    """A Llama4ForConditionalGeneration checkpoint: text under language_model., a vision tower beside it,
    safetensors shards split by huggingface_hub as save_pretrained splits them."""
    state = {f"language_model.{k}": v for k, v in text_state.items()}
    state["vision_model.patch_embedding.linear.weight"] = torch.randn(8, 4).to(BF16)
    state["multi_modal_projector.linear_1.weight"] = torch.randn(64, 8).to(BF16)
    out.mkdir(parents=True)
    split = split_torch_state_dict_into_shards(state, max_shard_size="100KB")
    for filename, keys in split.filename_to_tensors.items():
        save_file({k: state[k] for k in keys}, out / filename, metadata={"format": "pt"})
    index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {
        "architectures": ["Llama4ForConditionalGeneration"],
        "model_type": "llama4",
        "text_config": json.loads(text_config.to_json_string()),
        "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 8},
    }
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config))
    return out


def llama4_fp8_checkpoints(hf, root: Path) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """The same FP8 Llama 4 (self_attn kept in bf16, as the Scout FP8-dynamic recipe does) written twice:
    experts fused (gate_up_proj [E, H, 2I] + gate_up_proj_scale [E, 1, 2I], down_proj [E, I, H] +
    down_proj_scale [E, H, 1]) and per expert. Returns both directories and the dequantized state dict."""
    fp8, dequantized = {}, {}
    for key, w in hf.state_dict().items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            q, scale = fp8_with_bf16_scale(w, dim=1)  # per expert and output column: [E, 1, N]
            down = key.endswith("down_proj")
            fp8[key], fp8[f"{key}_scale"] = q, scale.transpose(1, 2).contiguous() if down else scale
        elif key.startswith("model.layers.") and key.endswith("_proj.weight") and ".self_attn." not in key:
            q, scale = fp8_with_bf16_scale(w, dim=-1)  # shared expert and dense MLPs: [N, 1]
            fp8[key], fp8[key.replace(".weight", ".weight_scale")] = q, scale
        else:
            fp8[key], dequantized[key] = w.to(BF16), w
            continue
        dequantized[key] = q.float() * scale.float()
    # compressed-tensors lists the linears it left alone by their checkpoint names; releases add patterns
    n_layers = hf.config.num_hidden_layers
    ignore = [f"language_model.model.layers.{i}.self_attn.{p}_proj" for i in range(n_layers) for p in "qkvo"]
    ignore += ["re:.*router", "language_model.lm_head", "re:vision_model.*", "multi_modal_projector.linear_1"]
    quantization = fp8_dynamic_config(ignore)
    inter = hf.config.intermediate_size
    fused = write_multimodal_llama4(root / "fused", fp8, hf.config, quantization)
    per_expert = write_multimodal_llama4(
        root / "per-expert", split_experts(fp8, inter), hf.config, quantization
    )
    return fused, per_expert, dequantized


def test_per_expert_fp8_llama4_equals_fused_and_the_dequantized_model(tmp_path):
    hf = bf16_exact(build_hf_model(llama4_hf_config(), seed=3))
    fused_dir, per_expert_dir, dequantized = llama4_fp8_checkpoints(hf, tmp_path)
    assert "language_model.model.layers.3.feed_forward.experts.2.down_proj.weight_scale" in checkpoint_files(
        per_expert_dir
    )
    fused, per_expert = load_target(fused_dir, torch.float32), load_target(per_expert_dir, torch.float32)

    moe = per_expert.model.layers[1].mlp
    assert isinstance(moe.experts, Fp8Experts) and isinstance(moe.shared_expert.gate_proj, Fp8Linear)
    assert type(moe.router) is Linear and type(per_expert.model.layers[0].self_attn.q_proj) is Linear
    assert isinstance(per_expert.model.layers[0].mlp.down_proj, Fp8Linear)  # a dense layer
    a, b = fused.state_dict(), per_expert.state_dict()
    assert a.keys() == b.keys()
    for key in a:  # the same FP8 bits and scales, assembled expert by expert
        assert a[key].dtype == b[key].dtype and torch.equal(
            a[key].view(torch.uint8), b[key].view(torch.uint8)
        ), key

    tokens = tokens_for(hf.config.vocab_size, (2, 50))
    assert torch.equal(logits_of(fused, tokens), logits_of(per_expert, tokens))
    hf.load_state_dict(dequantized)  # what the checkpoint describes (weights dequantized, x unquantized)
    with torch.no_grad():
        torch.testing.assert_close(logits_of(per_expert, tokens), hf(tokens).logits, atol=1e-4, rtol=0)


def test_per_expert_high_precision_llama4(tmp_path, tokenizer_dir):
    """Per-expert keys without quantization fill `Experts` the same way (a text-only Llama4ForCausalLM)."""
    hf = bf16_exact(build_hf_model(llama4_hf_config(), seed=4))
    out = save_hf_model(hf, tmp_path / "hf", tokenizer_dir)
    for path in out.glob("*.safetensors"):
        path.unlink()
    state = split_experts({k: v.to(BF16) for k, v in hf.state_dict().items()}, hf.config.intermediate_size)
    assert "model.layers.1.feed_forward.experts.3.up_proj.weight" in state
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    tokens = tokens_for(hf.config.vocab_size)
    with torch.no_grad():
        expected = hf(tokens).logits
    torch.testing.assert_close(
        logits_of(load_target(out, torch.float32), tokens), expected, atol=1e-4, rtol=0
    )


def test_ignore_entries_match_checkpoint_names():
    """compressed-tensors and fbgemm_fp8 name modules as the checkpoint does; redline drops `language_model.`
    and calls `feed_forward` `mlp`: an entry matches either name, on whole name parts."""
    text = json.loads(llama4_hf_config().to_json_string())
    config = ModelConfig.from_dict({"architectures": ["Llama4ForConditionalGeneration"], "text_config": text})
    scheme = Fp8Scheme(
        ("language_model.lm_head", "re:.*router", "language_model.model.layers.1.self_attn", "vision_model")
    )

    def kept(name: str) -> bool:
        return scheme.keeps_high_precision(name, module_key_to_checkpoint_key(config, name))

    assert kept("lm_head") and kept("model.layers.3.mlp.router") and kept("model.layers.1.self_attn.k_proj")
    assert not kept("model.layers.10.self_attn.k_proj") and not kept(
        "model.layers.3.mlp.shared_expert.up_proj"
    )


def test_missing_expert_is_named(tmp_path):
    hf = bf16_exact(build_hf_model(llama4_hf_config(), seed=5))
    _, per_expert_dir, _ = llama4_fp8_checkpoints(hf, tmp_path)
    index_path = per_expert_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["language_model.model.layers.3.feed_forward.experts.2.up_proj.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match=r"'model\.layers\.3\.mlp\.experts\.gate_up_proj' is assembled from 7"
    ):
        load_target(per_expert_dir)


# compressed-tensors FP8, per-tensor weight scales and static input scales

LLAMA31_FP8_QUANTIZATION_CONFIG = {  # neuralmagic/Meta-Llama-3.1-8B-Instruct-FP8
    "config_groups": {
        "group_0": {
            "input_activations": {
                "block_structure": None,
                "dynamic": False,
                "group_size": None,
                "num_bits": 8,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "tensor",
                "symmetric": True,
                "type": "float",
            },
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "block_structure": None,
                "dynamic": False,
                "group_size": None,
                "num_bits": 8,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "tensor",
                "symmetric": True,
                "type": "float",
            },
        }
    },
    "format": "naive-quantized",
    "global_compression_ratio": 1.24,
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "frozen",
}


def decoder_linears(hf) -> dict[str, torch.nn.Linear]:
    return {
        name: m for name, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in name
    }


@pytest.fixture(scope="module")
def static_fp8(tmp_path_factory, tokenizer_dir):
    """A tensor-strategy FP8 Llama 3 with input scales calibrated as llm-compressor's minmax observer does
    (absmax of the inputs each linear saw on calibration text / 448), and the HF model whose weights are
    the checkpoint's dequantized ones."""
    hf = bf16_exact(build_hf_model(llama3_hf_config(tie_word_embeddings=False), seed=6))
    absmax: dict[str, float] = {}
    hooks = [
        m.register_forward_pre_hook(
            lambda m, args, name=name: absmax.__setitem__(
                name, max(absmax.get(name, 0.0), args[0].abs().max().item())
            )
        )
        for name, m in decoder_linears(hf).items()
    ]
    with torch.no_grad():
        hf(tokens_for(384, (4, 32), seed=100))
    for hook in hooks:
        hook.remove()
    state, input_scales = {}, {}
    for key, w in hf.state_dict().items():
        name = key.removesuffix(".weight")
        if name in absmax:
            q, scale = fp8_with_bf16_scale(w, dim=None)
            state[key], state[f"{name}.weight_scale"] = q, scale
            input_scales[name] = torch.tensor([absmax[name] / FP8_MAX]).to(BF16)
            state[f"{name}.input_scale"] = input_scales[name]
            with torch.no_grad():
                hf.get_submodule(name).weight.copy_(q.float() * scale.float())
        else:
            state[key] = w.to(BF16)
    out = save_hf_model(hf, tmp_path_factory.mktemp("fp8") / "static", tokenizer_dir)
    for path in out.glob("*.safetensors"):
        path.unlink()
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = LLAMA31_FP8_QUANTIZATION_CONFIG
    (out / "config.json").write_text(json.dumps(config))
    return out, hf, {name: s.float() for name, s in input_scales.items()}


def rounded_inputs(hf, scale_of) -> list:
    """Pre-hooks that round each decoder linear's input to e4m3 as x ~= clamp(x / s, +-448) * s, with
    s = scale_of(linear name, x): the function a checkpoint with FP8 activations describes."""

    def hook(args, scale):
        return ((args[0] / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale,)

    return [
        m.register_forward_pre_hook(lambda m, args, name=name: hook(args, scale_of(name, args[0])))
        for name, m in decoder_linears(hf).items()
    ]


def logits_with_rounded_inputs(hf, tokens: torch.Tensor, scale_of) -> torch.Tensor:
    hooks = rounded_inputs(hf, scale_of)
    with torch.no_grad():
        logits = hf(tokens).logits
    for hook in hooks:
        hook.remove()
    return logits


def mean_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


def test_tensor_strategy_static_fp8_loads_per_tensor_scales(static_fp8):
    out, _, input_scales = static_fp8
    model = load_target(out, torch.float32)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, Fp8Linear) and q_proj.tensorwise
    assert q_proj.weight_scale.shape == (1,) and q_proj.weight_scale.dtype == torch.float32
    assert torch.equal(
        q_proj.input_scale, input_scales["model.layers.0.self_attn.q_proj"]
    )  # bf16 -> fp32 exact
    assert type(model.lm_head) is Linear


def test_tensor_strategy_static_fp8_computes_the_checkpoint(static_fp8):
    out, hf, input_scales = static_fp8
    model = load_target(out, torch.float32)
    tokens = tokens_for(384, (2, 40), seed=7)  # not the calibration text: some inputs exceed the range
    with torch.no_grad():
        dequantized_reference = hf(tokens).logits
        # the dequantize kernel: the dequantized weights times the unquantized input, exactly
        torch.testing.assert_close(logits_of(model, tokens), dequantized_reference, atol=1e-4, rtol=0)
        for module in model.modules():
            if isinstance(module, Fp8Linear):
                module.scaled_mm = True
        scaled = logits_of(model, tokens)
    # the _scaled_mm kernel rounds the input with the static scale: the checkpoint's own function, up to
    # fp32 summation order
    static_reference = logits_with_rounded_inputs(hf, tokens, lambda name, x: input_scales[name])
    torch.testing.assert_close(scaled, static_reference, atol=1e-4, rtol=0)
    # Against the unquantized input: e4m3 rounds each input element by <= 2^-4 of itself with a static
    # scale as with the per-token scales of the FP8-dynamic releases (only the few inputs beyond the
    # calibrated range are clamped), so static rounding moves the next-token distributions about as much as
    # per-token rounding: within 2x of its mean KL, and under the 1e-2 the FP8 tests allow.
    per_token = logits_with_rounded_inputs(
        hf, tokens, lambda name, x: x.abs().amax(-1, keepdim=True) / FP8_MAX
    )
    kl_static, kl_per_token = (
        mean_kl(dequantized_reference, scaled),
        mean_kl(dequantized_reference, per_token),
    )
    assert 0 < kl_static < min(1e-2, 2 * kl_per_token), (kl_static, kl_per_token)


@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("static_input", [False, True])
def test_fp8_linear_scaled_mm_scale_layouts(per_tensor: bool, static_input: bool):
    """_scaled_mm's tensor-wise form (both scales single values) and row-wise form (otherwise) equal the
    product of the dequantized weight with the input rounded as the scheme says."""
    torch.manual_seed(0)
    w, x = torch.randn(24, 64), torch.randn(5, 64) * 3
    layer = Fp8Linear(64, 24, per_tensor=per_tensor, scaled_mm=True, static_input=static_input)
    q, scale = fp8_with_bf16_scale(w, dim=None if per_tensor else -1)
    layer.weight.data, layer.weight_scale.data = q, scale.float()
    if static_input:
        layer.input_scale.data = torch.tensor([2.0 / FP8_MAX])  # clamps the inputs above 2
        x_scale = layer.input_scale
    else:
        x_scale = x.abs().amax(-1, keepdim=True) / FP8_MAX
    x_rounded = (x / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * x_scale
    expected = x_rounded @ (q.float() * scale.float()).t()
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-5)


# `redline quantize` streaming, and quantization on load


def test_quantize_streams_shards_that_load(tmp_path, tokenizer_dir):
    hf = build_hf_model(llama3_hf_config(tie_word_embeddings=False), seed=8).to(BF16)
    src = save_hf_model(hf, tmp_path / "src", tokenizer_dir)
    counts = quantize_checkpoint(src, tmp_path / "fp8", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "fp8" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    largest = max(t.nbytes for t in hf.state_dict().values())
    total = 0
    for name in shards:  # a shard is closed before it passes the limit (one tensor can exceed it alone)
        shard_bytes = sum(t.nbytes for t in load_file(tmp_path / "fp8" / name).values())
        assert shard_bytes <= max(40_000, largest)
        total += shard_bytes
    assert index["metadata"]["total_size"] == total
    assert index["weight_map"]["model.layers.0.mlp.down_proj.weight_scale"]
    assert 0.3 < counts["quantized_parameters"] / counts["parameters"] < 1.0
    on_load = load_target(src, torch.float32, quantization="fp8")
    from_disk = load_target(tmp_path / "fp8", torch.float32)
    a, b = on_load.state_dict(), from_disk.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(
            a[key].view(torch.uint8), b[key].view(torch.uint8)
        ), key
    assert isinstance(from_disk.model.layers[0].self_attn.q_proj, Fp8Linear)


def test_quantize_keeps_the_source_layout(tmp_path):
    """A per-expert multimodal Llama 4 quantizes into per-expert FP8 (the FP8-dynamic releases' layout),
    its vision tower copied unchanged, and loads into the same FP8 experts as its fused twin."""
    hf = bf16_exact(build_hf_model(llama4_hf_config(), seed=9))
    fused_state = {k: v.to(BF16) for k, v in hf.state_dict().items()}
    per_expert_state = split_experts(fused_state, hf.config.intermediate_size)
    outs = {}
    for name, state in (("fused", fused_state), ("per-expert", per_expert_state)):
        src = write_multimodal_llama4(tmp_path / name, state, hf.config, None)
        outs[name] = tmp_path / f"{name}-fp8"
        quantize_checkpoint(src, outs[name], max_shard_bytes=60_000)
    keys = set(checkpoint_files(outs["per-expert"]))
    assert "language_model.model.layers.1.feed_forward.experts.0.gate_proj.weight_scale" in keys
    assert "vision_model.patch_embedding.linear.weight" in keys
    assert "language_model.model.layers.1.feed_forward.experts.gate_up_proj_scale" in checkpoint_files(
        outs["fused"]
    )
    ignore = json.loads((outs["fused"] / "config.json").read_text())["quantization_config"]["ignore"]
    assert "language_model.lm_head" in ignore and "re:vision_model.*" in ignore
    a = load_target(outs["fused"], torch.float32).state_dict()
    b = load_target(outs["per-expert"], torch.float32).state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(
            a[key].view(torch.uint8), b[key].view(torch.uint8)
        ), key


PEAK_MEMORY_SCRIPT = """
import json, sys
import torch
from redline.config import ModelConfig
from redline.models.build import load_target, module_key_to_checkpoint_key
from redline.models.quantized_checkpoint import quantize_checkpoint

def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])

def peak(run):
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    before = kib("VmRSS:")
    result = run()
    return (kib("VmHWM:") - before) * 1024, result

src, out, shard, small = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
# first runs page in code and allocate once-only state: not what is measured
load_target(small, torch.bfloat16, quantization="fp8")
load_target(small, torch.bfloat16)
quantize_checkpoint(small, out + "-small")
on_load, model = peak(lambda: load_target(src, torch.bfloat16, quantization="fp8"))
del model
streamed, _ = peak(lambda: quantize_checkpoint(src, out, max_shard_bytes=shard))
whole, model = peak(lambda: load_target(src, torch.bfloat16))
print(json.dumps({"on_load": on_load, "streamed": streamed, "whole": whole}))
"""


@pytest.mark.slow
def test_fp8_quantization_never_holds_the_bf16_model(tmp_path, tokenizer_dir):
    """Peak resident memory, in a fresh process (malloc returns big blocks to the system at once): quantizing
    on load and `redline quantize` stay near the FP8 size plus a few tensors and shards, far below the bf16
    model, which a plain bf16 load of the same checkpoint does reach (so the measurement would see it)."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak resident size")
    config = llama3_hf_config(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=20,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
    )
    hf = build_hf_model(config, seed=10).to(BF16)
    shard = 24 * 2**20
    src = save_hf_model(hf, tmp_path / "src", tokenizer_dir, max_shard_size=shard)
    bf16_bytes = sum(p.nbytes for p in hf.parameters())
    fp8_bytes = sum(p.numel() if "_proj" in name else p.nbytes for name, p in hf.named_parameters())
    largest_fp32 = max(p.numel() for p in hf.parameters()) * 4
    del hf
    small = save_hf_model(
        build_hf_model(llama3_hf_config(), seed=11).to(BF16), tmp_path / "small", tokenizer_dir
    )
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    result = subprocess.run(
        [sys.executable, "-c", PEAK_MEMORY_SCRIPT, str(src), str(tmp_path / "out"), str(shard), str(small)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=600,
    )
    peaks = json.loads(result.stdout.strip().splitlines()[-1])
    # FP8 weights, plus: the shard being read (mapped) and the one being written, and ~4 fp32 temporaries
    # of the largest tensor while it is quantized
    bound = fp8_bytes + 2 * shard + 4 * largest_fp32
    assert bound < 0.75 * bf16_bytes  # the bound tells the two apart
    assert peaks["on_load"] < bound, (peaks, bound)
    assert peaks["streamed"] < bound, (peaks, bound)
    # the bf16 load is seen (at least 0.9 of it: the heap the earlier runs freed can hold a little of it)
    assert peaks["whole"] > 0.9 * bf16_bytes, (peaks, bf16_bytes)
