"""Build a target model (and its EAGLE-3 draft) from Hugging Face checkpoint directories."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from redline.config import ModelConfig
from redline.engine_config import WEIGHT_ONLY
from redline.kernels import cpu_ops
from redline.layers.backends import TORCH, Backends
from redline.models.eagle3 import Eagle3Draft, aux_layers_of, load_draft
from redline.models.expert_layout import per_expert_part, rank_part
from redline.models.huge_pages import trim_heap
from redline.models.int_checkpoint import IntCheckpointLoad, int_skeleton
from redline.models.int_shards import int_shard_of
from redline.models.llama import LlamaForCausalLM
from redline.models.loader import Part, load_weights
from redline.models.quantize import (
    HIGH_PRECISION,
    QuantizeOnLoad,
    WeightOnly,
    WeightSource,
    fp8_skeleton,
    quantize_head,
)
from redline.models.tensor_files import checkpoint_files
from redline.parallel import sharding
from redline.parallel.group import SINGLE, TensorParallel
from redline.parallel.sharding import Shard
from redline.quant.fp8 import scaled_mm_available
from redline.quant.int_scheme import IntScheme, int_scheme
from redline.quant.scheme import Fp8Scheme, fp8_scheme

# Multimodal Llama 4 checkpoints hold the vision tower and projector beside the language model.
_SKIPPED_PREFIXES = ("vision_model.", "multi_modal_projector.")


def checkpoint_key_to_module_key(config: ModelConfig, tp: TensorParallel = SINGLE):
    """language_model.model.layers.1.feed_forward.router.weight -> model.layers.1.mlp.router.weight;
    per-expert Llama 4 keys map to a Part of the fused expert tensors (models/expert_layout.py): rank
    tp.rank's Part, or None for another rank's expert. config: the whole model's (not a rank's)."""
    prefix = config.weight_prefix

    def rename(key: str) -> str | Part | None:
        if key.startswith(_SKIPPED_PREFIXES):
            return None
        if prefix:
            if not key.startswith(prefix):
                return key  # reported as unexpected by the loader
            key = key[len(prefix) :]
        key = key.replace(".feed_forward.", ".mlp.")
        inter = config.expert_intermediate_size
        if config.num_experts and (part := per_expert_part(key, inter)) is not None:
            return rank_part(part, inter, config.num_experts, tp)
        return key

    return rename


def module_key_to_checkpoint_key(config: ModelConfig, key: str) -> str:
    """The inverse of checkpoint_key_to_module_key for whole tensors and module names (for writing
    checkpoints and matching a quantization config's `ignore` list)."""
    if config.family == "llama4":
        key = key.replace(".mlp.", ".feed_forward.")
    return config.weight_prefix + key


def _config_and_scheme(
    model_dir: str | Path, quantization: str | None = None
) -> tuple[ModelConfig, Fp8Scheme | None]:
    """The whole model's config and the FP8 scheme of its checkpoint (None: high precision)."""
    if quantization not in (None, "fp8", *WEIGHT_ONLY):
        raise ValueError(f"unknown quantization {quantization!r}; choose fp8, int4, int8 or gguf")
    config = ModelConfig.from_dir(model_dir)
    return config, fp8_scheme(config.raw, str(Path(model_dir) / "config.json"))


def fp8_weights(model_dir: str | Path, quantization: str | None) -> bool:
    """Whether the decoder's linears will hold FP8 weights: an FP8 checkpoint, or quantization on load."""
    return _config_and_scheme(model_dir, quantization)[1] is not None or quantization == "fp8"


def skeleton(
    model_dir: str | Path,
    tp: TensorParallel = SINGLE,
    scaled_mm: bool = False,
    backends: Backends = TORCH,
    aux_layers: tuple[int, ...] = (),
) -> LlamaForCausalLM:
    """Rank tp.rank's model on the meta device, without weights: its shard's shapes, and FP8 modules
    where the checkpoint's quantization_config puts them (int4 / int8 ones: models/int_checkpoint.py)."""
    config, scheme = _config_and_scheme(model_dir)
    ints = int_scheme(config.raw, str(Path(model_dir) / "config.json"))
    if ints is not None and ints.act_order and ints.group is not None and tp.size > 1:  # models/int_shards.py
        why = "act order scatters a group's inputs, which o_proj and down_proj split over the ranks"
        raise ValueError(f"{model_dir}: a {ints} checkpoint runs in one process (no tensor parallel): {why}")
    if tp.size > 1:
        config = sharding.local_config(config, tp.size, tp.expert_parallel)
    named = functools.partial(module_key_to_checkpoint_key, config)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp, backends, aux_layers)
        if scheme is not None:
            fp8_skeleton(model, scheme, scaled_mm, named)
        if ints is not None:
            int_skeleton(model, ints, named, tp)
    return model


def load_target(
    model_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    quantization: str | None = None,
    tp: TensorParallel = SINGLE,
    backends: Backends = TORCH,
    aux_layers: tuple[int, ...] = (),
    group_size: int = 32,  # int4's and int8's
) -> LlamaForCausalLM:
    """With tp.size > 1 this process builds and reads only rank tp.rank's shard (parallel/sharding.py).
    quantization "fp8" quantizes a high-precision checkpoint while loading (each decoder linear and
    expert module as soon as its weights are read, so the high-precision model never sits in memory whole),
    "int4" / "int8" the decoder's linears to weight-only codes in groups of group_size (CPU: the C++
    kernels' layout where one runs, _kernel_path, kernels/quantized_layout.py, and the head int8; else
    quant/int4.py for int4; CUDA: quant/weight_only_gpu.py), "gguf" a .gguf import's decoder and head as
    the file holds them (models/gguf_blocks.py);
    FP8 checkpoints load as FP8 whatever it says, and GPTQ / AWQ / compressed-tensors int4 and int8
    checkpoints as their codes (models/int_checkpoint.py).
    backends: what runs in the layers (layers/backends.py);
    aux_layers: the hidden states an EAGLE-3 draft reads (models/eagle3.aux_layers_of)."""
    whole, scheme = _config_and_scheme(model_dir, quantization)
    ints = int_scheme(whole.raw, str(Path(model_dir) / "config.json"))
    if ints is not None and quantization is not None:
        raise ValueError(f"{model_dir} holds {ints} weights: --quantization takes a high-precision one")
    scaled_mm = scaled_mm_available(torch.device(device))
    model = skeleton(model_dir, tp, scaled_mm, backends, aux_layers)
    hook, weight_only = None, None
    optional = ["lm_head.weight"] if whole.tie_word_embeddings else []
    rename = checkpoint_key_to_module_key(whole, tp)
    if ints is not None:
        hook = _int_checkpoint_hook(model, model_dir, whole, ints.bits, dtype, torch.device(device))
        optional += hook.optional
        rename = _skipping(rename, hook.extra_bias)
    elif scheme is None and quantization in ("fp8", *WEIGHT_ONLY):
        if quantization in WEIGHT_ONLY:
            options = (quantization, group_size, dtype, tp, torch.device(device))
            weight_only = _weight_source(model_dir, whole, *options)
        hook = QuantizeOnLoad(model, Fp8Scheme(tuple(HIGH_PRECISION)), scaled_mm, weight_only)
        rename, optional = _skipping(rename, hook.supplied.__contains__), optional + sorted(hook.supplied)
    elif scheme is not None and quantization in WEIGHT_ONLY:
        raise ValueError(
            f"{model_dir} holds FP8 weights: {quantization} quantization takes a high-precision checkpoint"
        )
    load_weights(
        model,
        model_dir,
        dtype=dtype,
        device=device,
        rename=rename,
        optional=optional,
        hook=hook,
        shard_of=_shard_of(whole, ints, tp),
    )
    if weight_only is not None:  # before finish_loading packs a bf16 head
        quantize_head(model, weight_only.head)
        weight_only.report()
    model.finish_loading()
    if isinstance(hook, IntCheckpointLoad):
        hook.report()
    model.model.rotary.materialize(torch.device(device))
    trim_heap()  # the freed high-precision copies of a quantized load
    return model.eval()


def _shard_of(
    whole: ModelConfig, ints: IntScheme | None, tp: TensorParallel
) -> Callable[[str], Shard | None]:
    """What rank tp.rank reads of each checkpoint tensor: an int checkpoint's codes, scales and zeros by
    their packing (models/int_shards.py), every other tensor as parallel/sharding.py says."""
    if ints is not None:
        return lambda key: int_shard_of(ints, whole, key, tp.rank, tp.size, tp.expert_parallel)
    return lambda key: sharding.shard_of(whole, key, tp.rank, tp.size, tp.expert_parallel)


def _kernel_path(dtype: torch.dtype, what: str) -> bool:
    """Whether weight-only weights on the CPU take the C++ kernels' layout (kernels/quantized_layout.py):
    where a kernel multiplies them (cpu_ops.quantized_kernel). Without it int8 and gguf weights are
    multiplied dequantized, a warned slow path (int4 takes torch's int4 kernel)."""
    blocks = cpu_ops.quantized_kernel(dtype)
    if not blocks and what != "int4":
        why = f"redline: {what} weights without the CPU kernels (AVX2 or AVX-512 BF16; or in {dtype}) are "
        warnings.warn(why + "dequantized at every product: slower than unquantized", stacklevel=4)
    return blocks


def _skipping(rename, skipped: Callable[[str], bool]):
    """rename, skipping the module keys `skipped` names: the biases an int checkpoint holds for linears
    without one (IntCheckpointLoad.extra_bias), the weights a GGUF gave before loading (QuantizeOnLoad)."""

    def renamed(key: str) -> str | Part | None:
        target = rename(key)
        return None if isinstance(target, str) and skipped(target) else target

    return renamed


def _int_checkpoint_hook(
    model: LlamaForCausalLM, model_dir: str | Path, config: ModelConfig, bits: int, dtype: torch.dtype,
    device: torch.device,
) -> IntCheckpointLoad:  # fmt: skip
    """On CUDA the GPU kernel's layout (quant/weight_only_gpu.py), on CPU the C++ kernel's where it runs."""
    rename = checkpoint_key_to_module_key(config)
    present = {key for key in map(rename, checkpoint_files(Path(model_dir))) if isinstance(key, str)}
    if device.type == "cuda":
        return IntCheckpointLoad(model, present, False, dtype, gpu=device)
    return IntCheckpointLoad(model, present, _kernel_path(dtype, f"int{bits}"), dtype, gpu=None)


def _weight_source(
    model_dir: str | Path,
    config: ModelConfig,
    quantization: str,
    group_size: int,
    dtype: torch.dtype,
    tp: TensorParallel,
    device: torch.device,
) -> WeightSource:
    """int4 / int8 on load (WeightOnly; on CUDA the Triton kernel's layout), or a .gguf's own tensors
    (models/gguf_blocks.py; rank tp.rank's part of them), on CPU in the C++ kernels' layout where one runs
    (_kernel_path)."""
    bits = 8 if quantization == "int8" else 4
    if device.type == "cuda" and quantization != "gguf":
        return WeightOnly(bits, group_size, False, dtype, gpu=True)
    blocks = _kernel_path(dtype, quantization)
    if quantization != "gguf":
        return WeightOnly(bits, group_size, blocks, dtype)
    from redline.models.gguf import gguf_source
    from redline.models.gguf_blocks import GgufWeights

    return GgufWeights(gguf_source(Path(model_dir)), config, blocks, dtype, tp)


def load_with_draft(
    target_dir: str | Path,
    draft_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    quantization: str | None = None,
    tp: TensorParallel = SINGLE,
    backends: Backends = TORCH,
    group_size: int = 32,  # int4's and int8's
) -> tuple[LlamaForCausalLM, Eagle3Draft]:
    """The target built with the hidden states the draft reads (aux_layers_of), then the draft over it. A
    weight-only target on the C++ kernel's path (int4, int8, gguf, an int4 / int8 checkpoint) gets a draft
    quantized the same way (gguf: int4) in groups of group_size, its own head int8
    (models/quantize.quantize_draft): a bf16 draft's step costs about what an int4 target's does.
    Otherwise the draft stays in high precision."""
    config = ModelConfig.from_dir(target_dir)
    aux = aux_layers_of(draft_dir, config.num_layers)
    target = load_target(target_dir, dtype, device, quantization, tp, backends, aux, group_size)
    ints, draft_weights = int_scheme(config.raw), None
    quantized = quantization in WEIGHT_ONLY or ints is not None
    if quantized and torch.device(device).type == "cpu" and cpu_ops.quantized_kernel(dtype):
        bits = ints.bits if ints is not None else 8 if quantization == "int8" else 4
        draft_weights = WeightOnly(bits, group_size, True, dtype)
    return target, load_draft(draft_dir, target, dtype, device, backends, draft_weights)
