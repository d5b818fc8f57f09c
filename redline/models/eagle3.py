"""The EAGLE-3 draft head: fc over three fused target hidden states, one decoder layer over
concat(norm(embedding), norm(hidden)), final norm and an lm_head over a reduced draft vocabulary.

Row convention (shared by inference and training): the draft row at position p reads the target's
hidden state at p and the embedding of the token at p + 1, and predicts the token at p + 2.

Under tensor parallelism the draft is split like the target (parallel/sharding.py): its layer's heads
and MLP width, its lm_head by draft vocabulary, its own embeddings by vocabulary; fc, the norms and
d2t / t2d are replicated (as vLLM does). A replicated draft would read all of itself on every rank:
BENCHMARKS.md "Tensor parallelism" measures and projects both.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from redline.config import ConfigError, ModelConfig, llama_layer_config
from redline.layers.attention import Attention, AttentionBatch, TreeMask
from redline.layers.backends import TORCH, Backends
from redline.layers.linear import Linear
from redline.layers.mlp import MLP
from redline.layers.norm import RMSNorm
from redline.layers.packed import pack_weights
from redline.layers.rotary import Rotary
from redline.models.llama import KVLayer, LlamaForCausalLM
from redline.models.loader import CheckpointError, checkpoint_files, load_weights, save_weights
from redline.models.quantize import WeightOnly, quantize_draft
from redline.parallel.group import SINGLE, TensorParallel
from redline.parallel.sharding import Shard, local_config, shard_of, vocab_shard
from redline.parallel.vocab import (
    BlockShaping,
    VocabParallelEmbedding,
    gather_vocab,
    vocab_block,
    vocab_parallel_argmax,
)

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """Inputs of layers 2, L/2 and L-3, i.e. the outputs of layers 1, L/2-1 and L-4 (32 layers: 2, 16, 29)."""
    return (min(2, num_layers), num_layers // 2, max(num_layers - 3, 0))


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the draft's decoder layer (Llama 3 style)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...] | None  # None: default_aux_layers of the target
    norm_before_residual: bool
    raw: dict[str, Any]

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "draft config") -> Eagle3Config:
        archs = raw.get("architectures") or []
        if not any("Eagle3" in a or "eagle3" in a.lower() for a in archs):
            raise ConfigError(
                f"{source}: not an EAGLE-3 draft (architectures {archs}); expected {ARCHITECTURE}"
            )
        layer = llama_layer_config({**raw, "num_hidden_layers": 1}, ARCHITECTURE)
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return cls(
            layer=layer,
            draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
            target_hidden_size=int(raw.get("target_hidden_size") or layer.hidden_size),
            aux_layers=tuple(int(i) for i in ids) if ids else None,
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            raw=raw,
        )

    def local(self, size: int) -> Eagle3Config:
        """One of `size` tensor-parallel ranks' configs: its heads and MLP width (ConfigError if the
        layer does not split)."""
        return dataclasses.replace(self, layer=local_config(self.layer, size))

    @classmethod
    def from_dir(cls, draft_dir: str | Path) -> Eagle3Config:
        path = Path(draft_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json in draft directory {draft_dir}")
        try:
            return cls.from_dict(json.loads(path.read_text()), source=str(path))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e


class Eagle3Layer(nn.Module):
    def __init__(
        self, config: Eagle3Config, rotary: Rotary, tp: TensorParallel = SINGLE, backends: Backends = TORCH
    ):
        super().__init__()
        c = config.layer
        self.tp = tp  # attention and the MLP each return a partial sum over ranks: all-reduced in finish
        self.norm_before_residual = config.norm_before_residual
        self.self_attn = Attention(c, 0, rotary, 2 * c.hidden_size, backends)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, c.mlp_bias, backends)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(
        self,
        embeds: torch.Tensor,  # [B, T, H] embeddings of the tokens at p + 1
        hidden: torch.Tensor,  # [B, T, H] fused target hidden (or the draft's own) at p
        batch: AttentionBatch,
        cache: KVLayer | None,
    ) -> torch.Tensor:
        x, residual = self.attention_input(embeds, hidden)
        return self.finish(residual, self.self_attn(x, batch, cache))

    def attention_input(
        self, embeds: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([B, T, 2H] attention input, [B, T, H] residual)
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return torch.cat((self.input_layernorm(embeds), normed), dim=-1), residual

    def finish(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:  # [B, T, H] each
        x = residual + self.tp.all_reduce(attended)
        return x + self.tp.all_reduce(self.mlp(self.post_attention_layernorm(x)))


class Eagle3Draft(nn.Module):
    def __init__(
        self,
        config: Eagle3Config,
        tp: TensorParallel = SINGLE,
        backends: Backends = TORCH,
        target_embedding: nn.Module | None = None,
    ):
        """With tp.size > 1, config.layer is this rank's shard of the layer (`Eagle3Config.local`).
        target_embedding: the target's embeddings, which the draft reads unless it gets its own
        (`embed_tokens`, from a checkpoint that ships them)."""
        super().__init__()
        c = config.layer
        self.config, self.tp = config, tp
        self.rotary = Rotary(c.rope, c.head_dim, interleaved=False)
        fc_in = len(config.aux_layers or (0, 0, 0)) * config.target_hidden_size
        self.fc = Linear(fc_in, c.hidden_size, False, backends.few_rows)
        self.midlayer = Eagle3Layer(config, self.rotary, tp, backends)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(
            c.hidden_size, vocab_block(config.draft_vocab_size, tp.size), False, backends.few_rows
        )
        # d2t[i]: draft id i is target id i + d2t[i]; t2d[j]: target id j is in the draft vocabulary
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))
        self.embed_tokens: nn.Embedding | None = None  # own embeddings if the checkpoint has them
        # else the target's (a list keeps it out of state_dict)
        self._target_embed = [] if target_embedding is None else [target_embedding]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if self.embed_tokens is not None else self._target_embed[0]
        return table(tokens)

    @property
    def dtype(self) -> torch.dtype:
        """What it computes in: its norm's dtype (its linears may hold quantized codes)."""
        return self.norm.weight.dtype

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:  # [..., 3 * target_hidden] -> [..., H]
        return self.fc(aux.to(self.dtype))

    def forward(
        self,
        next_tokens: torch.Tensor,  # [B, T] the token at p + 1 for each row
        hidden: torch.Tensor,  # [B, T, H]
        positions: torch.Tensor,  # [B, T] p
        cache: KVLayer | None,  # [blocks, kv_heads, BLOCK, head_dim] each
        tables: torch.Tensor | None = None,  # [B, blocks per sequence] int32
        kv_len: int | None = None,
        tree: TreeMask | None = None,  # the rows are nodes of a draft tree (speculative/tree.py)
    ) -> torch.Tensor:  # [B, T, H] the draft's hidden state (before the final norm)
        key_positions = positions if cache is None else torch.arange(kv_len, device=positions.device)[None]
        batch = AttentionBatch.build(self.config.layer, self.rotary, positions, key_positions, tables, tree)
        return self.midlayer(self.embed(next_tokens), hidden, batch, cache)

    def write_keys(
        self,
        next_tokens: torch.Tensor,  # [B, T]
        hidden: torch.Tensor,  # [B, T, H]
        positions: torch.Tensor,  # [B, T]
        cache: KVLayer,
        tables: torch.Tensor,  # [B, blocks per sequence] int32
    ) -> None:
        """The draft's keys and values at the rows' positions, as `forward` writes them, without attending,
        the MLP or the head: a step that proposes nothing keeps the draft's cache whole at ~1/3 of its
        layer's weights (fc, q/k/v)."""
        batch = AttentionBatch.build(self.config.layer, self.rotary, positions, positions, tables)
        x, _ = self.midlayer.attention_input(self.embed(next_tokens), hidden)
        self.midlayer.self_attn.write_keys(x, batch, cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., draft_vocab] fp32
        return gather_vocab(self.lm_head(self.norm(hidden)).float(), self.tp, self.config.draft_vocab_size)

    def greedy_tokens(self, hidden: torch.Tensor, shape: BlockShaping | None = None) -> torch.Tensor:
        """logits(hidden).argmax(-1) ([..., H] -> [...] draft ids), without gathering the logits under
        tensor parallelism; `shape` changes each rank's block first (a bias: speculative/propose.py)."""
        local = self.lm_head(self.norm(hidden)).float()
        if shape is not None:
            local = shape(local, self.tp.rank * local.shape[-1])
        return vocab_parallel_argmax(local, self.tp, self.config.draft_vocab_size)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids -> target ids. d2t = [0, 0, 3, ...]: draft id 2 is target id 5."""
        return draft_ids + self.d2t[draft_ids]


def _rename_draft_key(key: str) -> str:
    """Other exports name the layer `model.layers.0.*` or `layers.0.*`; we use EAGLE's `midlayer.*`."""
    for prefix in ("model.layers.0.", "layers.0."):
        if key.startswith(prefix):
            return "midlayer." + key[len(prefix) :]
    return key.removeprefix("model.")


def aux_layers_of(draft_dir: str | Path, target_layers: int) -> tuple[int, ...]:
    """The target hidden states a draft reads (its config's, or default_aux_layers): build the target with
    them (LlamaForCausalLM's aux_layers) before load_draft."""
    return Eagle3Config.from_dir(draft_dir).aux_layers or default_aux_layers(target_layers)


def load_draft(
    draft_dir: str | Path,
    target: LlamaForCausalLM,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    backends: Backends = TORCH,
    weight_only: WeightOnly | None = None,
) -> Eagle3Draft:
    """Loads an EAGLE-3 checkpoint for `target` (built with the draft's aux layers, aux_layers_of), reading
    the target's embeddings (and lm_head when the draft ships none): safetensors, or pytorch_model.bin
    (sharded or not) as the original EAGLE-3 releases ship (yuhuili/EAGLE3-*). weight_only: its linears
    quantized once loaded (models/quantize.quantize_draft)."""
    config, tp = Eagle3Config.from_dir(draft_dir), target.tp
    keys = {_rename_draft_key(k) for k in checkpoint_files(Path(draft_dir))}
    own_embeddings, own_head = "embed_tokens.weight" in keys, "lm_head.weight" in keys
    _check_fits(config, target.config, draft_dir, own_embeddings, own_head)
    wanted = config.aux_layers or default_aux_layers(target.config.num_layers)
    if target.aux_layers != wanted:
        raise ConfigError(
            f"draft {draft_dir} reads the target's hidden states {wanted}, but the target was built with "
            f"aux_layers {target.aux_layers}: build it with aux_layers_of(draft_dir, num_layers)"
        )
    with torch.device("meta"):
        draft = Eagle3Draft(config.local(tp.size), tp, backends, target.model.embed_tokens)
        if own_embeddings:
            draft.embed_tokens = VocabParallelEmbedding(config.layer.vocab_size, config.layer.hidden_size, tp)
    optional = ["d2t", "t2d", "lm_head.weight"]
    shard = functools.partial(draft_shard_of, config, rank=tp.rank, size=tp.size) if tp.size > 1 else None
    load_weights(
        draft, draft_dir, dtype=dtype, device=device, rename=_rename_draft_key, optional=optional,
        shard_of=shard,
    )  # fmt: skip
    if weight_only is not None:  # before the target's head is shared: that one is the target's to quantize
        quantize_draft(draft, weight_only)
    if not own_head:  # the target's head (its vocabulary is the draft's: checked), or its block of it
        draft.lm_head.weight = target.lm_head.weight
    if draft.d2t.is_meta:  # absent: the identity vocabulary (draft_vocab_size == vocab_size was checked)
        draft.d2t = torch.zeros(config.draft_vocab_size, dtype=torch.int64, device=device)
    if draft.t2d.is_meta:
        draft.t2d = torch.ones(config.layer.vocab_size, dtype=torch.bool, device=device)
    draft.d2t, draft.t2d = draft.d2t.long(), draft.t2d.bool()
    draft.rotary.materialize(torch.device(device))
    draft.midlayer.mlp.fuse_gate_up()
    draft.midlayer.self_attn.fuse_qkv()
    if backends.packed_weights:
        pack_weights(draft)
    expected = len(target.aux_layers) * target.config.hidden_size
    if draft.fc.in_features != expected:
        raise CheckpointError(
            f"{draft_dir}: fc.weight takes {draft.fc.in_features} inputs, "
            f"the target's aux hidden states have {expected}"
        )
    return draft.eval()


def draft_shard_of(config: Eagle3Config, module_key: str, rank: int, size: int) -> Shard | None:
    """What `rank` of `size` loads of a draft tensor (None: all of it). The layer splits as a target layer
    does; lm_head by the draft vocabulary, own embeddings by the target's; fc, norms, d2t, t2d whole."""
    if module_key in ("lm_head.weight", "embed_tokens.weight"):
        vocab = config.draft_vocab_size if module_key == "lm_head.weight" else config.layer.vocab_size
        return vocab_shard(vocab, rank, size)
    if not module_key.startswith("midlayer."):
        return None
    return shard_of(config.layer, module_key, rank, size)


def _check_fits(
    config: Eagle3Config, target: ModelConfig, draft_dir: str | Path, own_embeddings: bool, own_head: bool
) -> None:
    problems = []
    if config.layer.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {config.layer.vocab_size} != target's {target.vocab_size}")
    if config.target_hidden_size != target.hidden_size:
        problems.append(
            f"target_hidden_size {config.target_hidden_size} != target's hidden_size {target.hidden_size}"
        )
    if not own_embeddings and config.layer.hidden_size != target.hidden_size:
        problems.append(
            f"hidden_size {config.layer.hidden_size} != target's {target.hidden_size} "
            "and the draft has no embed_tokens of its own"
        )
    if not own_head and config.draft_vocab_size != target.vocab_size:
        problems.append(
            f"no lm_head in the draft and draft_vocab_size {config.draft_vocab_size} != target "
            f"vocab {target.vocab_size}"
        )
    if config.draft_vocab_size > target.vocab_size:
        problems.append(f"draft_vocab_size {config.draft_vocab_size} > target vocab {target.vocab_size}")
    if any(not 0 <= i <= target.num_layers for i in config.aux_layers or ()):
        problems.append(f"aux layer ids {config.aux_layers} outside 0..{target.num_layers}")
    if problems:
        raise ConfigError(
            f"draft {draft_dir} does not fit target {target.architecture}: " + "; ".join(problems)
        )


def _draft_fields(layer: ModelConfig, draft_vocab_size: int, target_hidden_size: int) -> dict[str, Any]:
    """The config.json fields that describe a draft's one decoder layer and its vocabularies."""
    return dict(
        architectures=[ARCHITECTURE],
        model_type="llama",
        hidden_size=layer.hidden_size,
        intermediate_size=layer.intermediate_size,
        num_attention_heads=layer.num_heads,
        num_key_value_heads=layer.num_kv_heads,
        head_dim=layer.head_dim,
        num_hidden_layers=1,
        rms_norm_eps=layer.rms_norm_eps,
        vocab_size=layer.vocab_size,
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=target_hidden_size,
        hidden_act="silu",
        tie_word_embeddings=False,
    )


def _with_aux_layers(raw: dict[str, Any], aux_layers: tuple[int, ...] | None) -> dict[str, Any]:
    if aux_layers is not None:
        raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}
    return raw


def save_draft(draft: Eagle3Draft, out_dir: str | Path) -> None:
    """Writes model.safetensors with `midlayer.*` keys (EAGLE / SpecForge layout) and config.json in the
    layout vLLM and SGLang accept for EAGLE-3 drafts."""
    c, out = draft.config, Path(out_dir)
    raw = {k: v for k, v in c.raw.items() if k != "eagle_config"}
    raw.update(_draft_fields(c.layer, c.draft_vocab_size, c.target_hidden_size))
    save_weights(dict(draft.state_dict()), out)
    (out / "config.json").write_text(json.dumps(_with_aux_layers(raw, c.aux_layers), indent=2))


def draft_config_for(
    target: ModelConfig,
    draft_vocab_size: int | None = None,
    intermediate_size: int | None = None,
    aux_layers: tuple[int, ...] | None = None,
) -> Eagle3Config:
    """A fresh draft's config for `target` (for training, and for tests)."""
    fields = _draft_fields(target, draft_vocab_size or target.vocab_size, target.hidden_size)
    raw = fields | dict(
        intermediate_size=intermediate_size or target.intermediate_size,
        max_position_embeddings=target.max_position,
        rope_theta=target.rope.theta,
        bos_token_id=target.bos_token_id,
    )
    if target.rope.scaling == "llama3":
        r = target.rope
        raw["rope_scaling"] = dict(
            rope_type="llama3",
            factor=r.factor,
            low_freq_factor=r.low_freq_factor,
            high_freq_factor=r.high_freq_factor,
            original_max_position_embeddings=r.original_max_position,
        )
    return Eagle3Config.from_dict(_with_aux_layers(raw, aux_layers))
