"""One decoder for Llama 3.x and Llama 4 text, driven by ModelConfig.

Module names follow the Hugging Face checkpoints (`model.layers.3.self_attn.q_proj.weight`), except that
Llama 4's `feed_forward` is called `mlp` here; the loader maps the names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from redline.config import ModelConfig
from redline.kernels.attention_core import STEP_QUERIES
from redline.kernels.quantized_layout import is_quantized
from redline.layers.attention import Attention, AttentionBatch, TreeMask
from redline.layers.backends import TORCH, Backends, DenseLayer, backend_name
from redline.layers.linear import WHOLE_STEP_ROWS, Linear, stored
from redline.layers.mlp import MLP
from redline.layers.moe import MoE
from redline.layers.norm import RMSNorm
from redline.layers.packed import pack_weights
from redline.layers.rotary import Rotary
from redline.parallel.group import SINGLE, TensorParallel
from redline.parallel.vocab import (
    BlockShaping,
    VocabParallelEmbedding,
    gather_vocab,
    vocab_block,
    vocab_parallel_argmax,
)
from redline.quant.weight_only_gpu import KERNEL_ROWS, GpuWeightOnlyLinear

KVLayer = tuple[torch.Tensor, torch.Tensor]


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer: int, rotary: Rotary, tp: TensorParallel, backends: Backends = TORCH
    ):
        super().__init__()
        self.tp = tp  # with N ranks, attention and the MLP each return a partial sum: all-reduced here
        h = config.hidden_size
        self.self_attn = Attention(config, layer, rotary, backends=backends)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        if layer in config.moe_layers:
            experts = (config.expert_intermediate_size, config.num_experts, config.num_experts_per_tok)
            self.mlp: nn.Module = MoE(h, *experts, tp, backends)
        else:
            self.mlp = MLP(h, config.intermediate_size, config.mlp_bias, backends)
        self.add_norm = backends.add_norm  # None: torch's add, then the norm module
        self._dense_layer = backends.dense_layer
        self.tree_rows = backends.tree_rows
        self.one_call: DenseLayer | None = None  # a decode step's layer in one call, set by keep_one_call

    def keep_one_call(self) -> None:
        """After loading and fusing the projections: the backends' one-call decode step where it computes this
        layer: dense, rotary, no q/k norm or query temperature, unsharded, fused contiguous bf16 or quantized
        weights (kernels/quantized_layout.py), no biases (the MoE and NoPE layers of Llama 4 keep their
        ops). Else (and until then) op by op."""
        attention, mlp = self.self_attn, self.mlp
        kept = (
            self._dense_layer is not None
            and isinstance(mlp, MLP)
            and mlp.gate_up_weight is not None
            and mlp.swiglu is None
            and attention.qkv_weight is not None
            and attention.use_rope
            and attention.head_dim % 32 == 0  # the attention kernel's head_dim: a multiple of 32 up to 256
            and attention.head_dim <= 256
            and attention.qk_norm_eps is None
            and not attention.temperature_tuning
            and self.tp.size == 1
            and self.input_layernorm.eps == self.post_attention_layernorm.eps
            and all(type(p) is Linear and p.bias is None for p in (attention.o_proj, mlp.down_proj))
            # after the checks above, which make these weights tensors
            and all(
                (w.dtype == torch.bfloat16 or is_quantized(w)) and w.is_contiguous()
                for w in self._one_call_weights()
            )
        )
        self.one_call = self._dense_layer if kept else None

    def _one_call_weights(self) -> tuple[torch.Tensor, ...]:
        """input norm [H], qkv [q + 2kv, H], o [H, q], post-attn norm [H], gate_up [2I, H], down [H, I]"""
        attention, mlp = self.self_attn, self.mlp
        return (
            self.input_layernorm.weight,
            attention.qkv_weight,
            attention.o_proj.weight,
            self.post_attention_layernorm.weight,
            mlp.gate_up_weight,
            mlp.down_proj.weight,
        )

    def in_one_call(self, x: torch.Tensor, cache: KVLayer | None, tree: bool) -> bool:  # x [B, T, hidden]
        """Whether forward computes this x in one call: a decode step (static B and T in a compiled step, see
        Attention.forward) of at most WHOLE_STEP_ROWS rows, as linear.product's kernel rows, or a token
        tree of up to Backends.tree_rows rows (the call takes its mask)."""
        b, t, _ = x.shape
        if tree:  # where the plain step of its slots takes one call (b <= WHOLE_STEP_ROWS)
            step = t <= self.tree_rows and b <= WHOLE_STEP_ROWS
        else:
            step = t <= STEP_QUERIES and b * t <= WHOLE_STEP_ROWS
        return self.one_call is not None and cache is not None and step and cache[0].dtype == x.dtype

    def forward(self, x: torch.Tensor, batch: AttentionBatch, cache: KVLayer | None) -> torch.Tensor:
        if self.in_one_call(x, cache, batch.tree):
            assert cache is not None and batch.tables is not None
            attention, (k, v) = self.self_attn, cache
            attended = (batch.positions, batch.tables, batch.kv_len, attention.chunk)
            rotary = (batch.cos, batch.sin, attention.rotary.interleaved)
            weights, eps = self._one_call_weights(), self.input_layernorm.eps
            tree = (batch.tree_base, batch.tree_bits)
            return self.one_call(x, k, v, *attended, *rotary, weights, eps, attention.num_heads, *tree)
        normed, x = self.reduce_add_norm(self.self_attn(self.input_layernorm(x), batch, cache), x)
        return x + self.tp.all_reduce(self.mlp(normed))

    def reduce_add_norm(
        self,
        partial: torch.Tensor,  # [B, T, hidden] this rank's part of the attention output
        residual: torch.Tensor,  # [B, T, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (normed for the MLP, the new residual)
        """The boundary after attention as one op: all-reduce, residual add, RMSNorm (the add + RMSNorm one
        kernel on CUDA: layers/backends.py), where a fused multi-GPU kernel can replace it."""
        attended = self.tp.all_reduce(partial)
        norm = self.post_attention_layernorm
        if self.add_norm is not None:
            return self.add_norm(attended, residual, norm.weight, norm.eps)
        residual = residual + attended
        return norm(residual), residual

    def extra_repr(self) -> str:
        return f"add_norm={backend_name(self.add_norm)}, decode_step={backend_name(self.one_call)}"


@torch.compiler.nested_compile_region
def _layer_region(
    layer: DecoderLayer, x: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, *batch: object
) -> torch.Tensor:
    return layer(x, AttentionBatch.from_leaves(batch), None if k is None else (k, v))


def run_layer(layer: DecoderLayer, x: torch.Tensor, batch: tuple, cache: KVLayer | None) -> torch.Tensor:
    """One decoder layer. Inside torch.compile a nested compile region: compiled once per kind of layer
    and shape, and every layer of that kind calls the same code with its own weights and cache.

    batch: AttentionBatch.leaves(). The region takes only flat tensors, ints, Nones and the module: dynamo
    then matches each call to the traced layer by its arguments directly, where a dataclass or tuple
    argument made it flatten them through pytree for every layer (BENCHMARKS.md "Start-up in seconds")."""
    k, v = cache if cache is not None else (None, None)
    return _layer_region(layer, x, k, v, *batch)


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, backends: Backends):
        super().__init__()
        self.rotary = Rotary(config.rope, config.head_dim, config.rope_interleaved)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        layers = (DecoderLayer(config, i, self.rotary, tp, backends) for i in range(config.num_layers))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallel = SINGLE,
        backends: Backends = TORCH,
        aux_layers: Sequence[int] = (),
    ):
        """With tp.size > 1, config is this rank's shard of the model (parallel/sharding.local_config).
        aux_layers: the hidden states an EAGLE-3 draft reads, by the published configs' convention: id i is
        the input of layer i (the output of layer i - 1; id num_layers is the last layer's output before
        the final norm)."""
        super().__init__()
        self.config, self.tp, self.aux_layers = config, tp, tuple(aux_layers)
        self.model = Decoder(config, tp, backends)
        self.lm_head = Linear(
            config.hidden_size, vocab_block(config.vocab_size, tp.size), False, backends.few_rows
        )
        self.layer_regions = backends.layer_regions  # decoder layers through run_layer: compile regions
        self.packed_weights = backends.packed_weights

    def finish_loading(self) -> None:
        """After the weights are in: a tied lm_head shares the embedding, dense MLPs with a SwiGLU kernel or
        fused projections multiply gate and up as one weight (q, k and v too with fused projections), and
        the layers the backends' one-call decode step computes take it (DecoderLayer.keep_one_call); the
        weights are packed where the backends' product reads them so (layers/packed.py)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for layer in self.model.layers:
            layer.self_attn.fuse_qkv()
            if isinstance(layer.mlp, MLP):
                layer.mlp.fuse_gate_up()
            elif isinstance(layer.mlp, MoE):
                layer.mlp.shared_expert.fuse_gate_up()
        if self.packed_weights:
            pack_weights(self)
        for layer in self.model.layers:
            layer.keep_one_call()

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T] absolute positions
        cache: list[KVLayer] | None = None,  # per layer k, v [blocks, kv_heads, BLOCK, head_dim]
        tables: torch.Tensor | None = None,  # [B, blocks per sequence] int32: each row's blocks
        kv_len: int | None = None,  # cache positions attended (a static bucket), required with a cache
        tree: TreeMask | None = None,  # the rows are a token tree (speculative/tree.py)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the final normed hidden states [B, T, hidden] and, when aux_layers is set, the
        concatenated aux hidden states [B, T, len(aux_layers) * hidden]."""
        if cache is None:
            key_positions = positions
        else:
            assert kv_len is not None and tables is not None, "a cached forward needs tables and a kv_len"
            key_positions = torch.arange(kv_len, device=tokens.device)[None]
        batch = AttentionBatch.build(self.config, self.model.rotary, positions, key_positions, tables, tree)
        leaves = batch.leaves()  # for the layer regions
        if torch.compiler.is_dynamo_compiling() and any(layer.one_call for layer in self.model.layers):
            # one buffer each, read by every one-call layer: else inductor computes them anew for each call
            # (the regions take them as they are: a region given these failed dynamo's aliasing check)
            batch = replace(batch, cos=stored(batch.cos), sin=stored(batch.sin))
        x = self.model.embed_tokens(tokens)
        captured = {}
        for i, layer in enumerate(self.model.layers):
            if i in self.aux_layers:
                captured[i] = x
            kv = None if cache is None else cache[i]
            if self.layer_regions and not layer.in_one_call(x, kv, batch.tree):
                x = run_layer(layer, x, leaves, kv)
            else:  # a one-call layer outside a region: torch cannot functionalize its cache write inside one
                x = layer(x, batch, kv)
        captured[len(self.model.layers)] = x
        aux = torch.cat([captured[i] for i in self.aux_layers], dim=-1) if self.aux_layers else None
        return self.model.norm(x), aux

    def token_count_branches(self) -> set[int]:
        """Token counts t at which the forward takes another path above t tokens than up to t: a MoE
        layer gathers each token's experts while tokens * top_k <= experts (128 experts, top-1: t = 128);
        a GPU weight-only linear takes its kernel up to KERNEL_ROWS rows (quant/weight_only_gpu.py)."""
        branches = {m.num_experts // m.top_k for m in self.modules() if isinstance(m, MoE)}
        if any(isinstance(m, GpuWeightOnlyLinear) for m in self.modules()):
            branches.add(KERNEL_ROWS)
        return branches

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., vocab] fp32
        """Under tensor parallelism every rank's vocabulary block, gathered (parallel/vocab.py)."""
        return gather_vocab(self.lm_head(hidden).float(), self.tp, self.config.vocab_size)

    def greedy_tokens(self, hidden: torch.Tensor, shape: BlockShaping | None = None) -> torch.Tensor:
        """logits(hidden).argmax(-1) ([..., hidden] -> [...] int64), without gathering the logits under
        tensor parallelism; `shape` changes each rank's block first (masks, biases: speculative/emit.py)."""
        local = self.lm_head(hidden).float()
        if shape is not None:
            local = shape(local, self.tp.rank * local.shape[-1])
        return vocab_parallel_argmax(local, self.tp, self.config.vocab_size)
