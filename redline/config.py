"""Model configuration read from a Hugging Face config.json, validated once."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LLAMA3_ARCHS = ("LlamaForCausalLM",)
LLAMA4_ARCHS = ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")
SUPPORTED_ARCHS = LLAMA3_ARCHS + LLAMA4_ARCHS


class ConfigError(ValueError):
    """A config.json that redline cannot run."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    scaling: str  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 1.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str  # "llama3" | "llama4"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (Llama 4: intermediate_size_mlp)
    rms_norm_eps: float
    max_position: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Llama 4 text
    rope_interleaved: bool = False  # Llama 4 rotates adjacent pairs; Llama 3 rotates halves
    rope_layers: tuple[bool, ...] = ()  # per layer: True = RoPE (+ chunked attention), False = NoPE
    attention_chunk_size: int | None = None
    use_qk_norm: bool = False
    attn_temperature_tuning: bool = False
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 1
    expert_intermediate_size: int = 0  # routed and shared expert width
    weight_prefix: str = ""  # "language_model." for multimodal Llama 4 checkpoints
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_params_estimate(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = h * self.num_heads * self.head_dim * 2 + h * kv * 2
        dense = 3 * h * self.intermediate_size
        moe = 3 * h * self.expert_intermediate_size * (self.num_experts + 1) + h * self.num_experts
        per_layer = [attn + (moe if i in self.moe_layers else dense) for i in range(self.num_layers)]
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return sum(per_layer) + self.vocab_size * h + head

    def is_rope_layer(self, layer: int) -> bool:
        return self.rope_layers[layer]

    def is_chunked_layer(self, layer: int) -> bool:
        return self.attention_chunk_size is not None and self.rope_layers[layer]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json in {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHS), None)
        if arch is None:
            raise ConfigError(
                f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"redline supports {', '.join(SUPPORTED_ARCHS)}"
            )
        try:
            return _llama3(raw, arch) if arch in LLAMA3_ARCHS else _llama4(raw, arch)
        except KeyError as e:
            raise ConfigError(f"{source}: missing required field {e.args[0]!r} for {arch}") from e


def _eos_ids(*sources: dict[str, Any]) -> tuple[int, ...]:
    found = [src.get("eos_token_id") for src in sources]
    ids = [i for eos in found for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int)]
    return tuple(dict.fromkeys(ids))  # in order of appearance, without repeats


def _rope(cfg: dict[str, Any], default_theta: float) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older configs `rope_theta` + `rope_scaling`.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", default_theta)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise ConfigError(f"unsupported rope scaling {kind!r}; redline supports 'default' and 'llama3'")
    if kind == "default":
        return RopeConfig(theta=theta, scaling="default")
    return RopeConfig(
        theta=theta,
        scaling="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


def _common(cfg: dict[str, Any]) -> dict[str, Any]:
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    if head_dim % 2:
        raise ConfigError(f"head_dim={head_dim} must be even for rotary embeddings")
    return dict(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_position=int(cfg.get("max_position_embeddings", 8192)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
    )


def llama_layer_config(cfg: dict[str, Any], arch: str) -> ModelConfig:
    """A Llama 3 style layer config from any config.json with Llama fields (used for EAGLE-3 drafts)."""
    try:
        return _llama3(cfg, arch)
    except KeyError as e:
        raise ConfigError(f"missing required field {e.args[0]!r} for {arch}") from e


def _llama3(cfg: dict[str, Any], arch: str) -> ModelConfig:
    common = _common(cfg)
    return ModelConfig(
        architecture=arch,
        family="llama3",
        intermediate_size=int(cfg["intermediate_size"]),
        rope=_rope(cfg, 10000.0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        eos_token_ids=_eos_ids(cfg),
        rope_layers=(True,) * common["num_layers"],
        raw=cfg,
        **common,
    )


def _llama4(outer: dict[str, Any], arch: str) -> ModelConfig:
    text = outer.get("text_config", outer)
    common = _common(text)
    n = common["num_layers"]
    interval = int(text.get("no_rope_layer_interval", 4))
    no_rope_layers = text.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    if len(no_rope_layers) < n:
        raise ConfigError(f"no_rope_layers has {len(no_rope_layers)} entries for {n} layers")
    step = int(text.get("interleave_moe_layer_step", 1))
    moe_layers = text.get("moe_layers")
    if moe_layers is None:
        moe_layers = list(range(step - 1, n, step)) if step > 0 else []
    chunk = text.get("attention_chunk_size")
    return ModelConfig(
        architecture=arch,
        family="llama4",
        intermediate_size=int(text.get("intermediate_size_mlp", text.get("intermediate_size"))),
        rope=_rope(text, 500000.0),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", outer.get("tie_word_embeddings", False))),
        eos_token_ids=_eos_ids(text, outer),
        rope_interleaved=True,
        rope_layers=tuple(bool(x) for x in no_rope_layers[:n]),
        attention_chunk_size=int(chunk) if chunk else None,
        use_qk_norm=bool(text.get("use_qk_norm", True)),
        # Real configs store attn_temperature_tuning as an int (4): it is a switch.
        attn_temperature_tuning=bool(text.get("attn_temperature_tuning", True)),
        floor_scale=float(text.get("floor_scale", 8192)),
        attn_scale=float(text.get("attn_scale", 0.1)),
        moe_layers=tuple(int(i) for i in moe_layers),
        num_experts=int(text.get("num_local_experts", 16)),
        num_experts_per_tok=int(text.get("num_experts_per_tok", 1)),
        expert_intermediate_size=int(text["intermediate_size"]),
        weight_prefix="language_model." if arch == "Llama4ForConditionalGeneration" else "",
        raw=outer,
        **common,
    )
