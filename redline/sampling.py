"""Sampling parameters and token selection on the device without host synchronisation.

Random draws come from a counter-based hash of (request seed, stream, position, token id), not from a
generator with state: a request gets the same tokens whether it runs alone or batched with others,
and nothing in a step depends on how many random numbers earlier steps drew.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = whole vocabulary
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability; 0 = off
    seed: int | None = None  # None: a fresh random seed per request
    stop: list[str] | str | None = None
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop_strings = tuple(stops)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (lowbias32) on int64 tensors; both multipliers are < 2**31 so no
    product of a 32-bit value overflows int64."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _MASK32
    return x ^ (x >> 16)


def uniform(
    seed: torch.Tensor, position: torch.Tensor, stream: int, width: int | None = None
) -> torch.Tensor:
    """Deterministic U(0, 1) draws in fp32.

    seed [B] int64 (32-bit values), position [B, T] int64 -> [B, T] or, with width, [B, T, width]
    (one draw per token id). `stream` separates independent uses at the same position.
    """
    key = _hash32(_hash32(seed ^ (stream * 0x9E3779B9))[:, None] ^ position)  # [B, T]
    if width is not None:
        ids = torch.arange(width, device=seed.device, dtype=torch.int64)
        key = _hash32(key[..., None] + ids * 0x61C88647)  # [B, T, width]
    # top 24 bits, centred: never exactly 0 or 1
    return ((key >> 8).float() + 0.5) * (1.0 / (1 << 24))


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the device."""

    temperature: torch.Tensor  # [B] fp32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] fp32
    seed: torch.Tensor  # [B] int64
    min_p: torch.Tensor  # [B] fp32, 0 = off

    def rows(self, start: int, stop: int) -> SamplingTensors:
        """Views of rows start .. stop - 1 (a batch bucket, or one slot for prefill)."""
        w = slice(start, stop)
        return SamplingTensors(self.temperature[w], self.top_k[w], self.top_p[w], self.seed[w], self.min_p[w])

    def take(self, slots: torch.Tensor) -> SamplingTensors:
        """The rows of `slots` [B] (a batched prefill's), in that order."""
        t = self
        return SamplingTensors(
            t.temperature[slots], t.top_k[slots], t.top_p[slots], t.seed[slots], t.min_p[slots]
        )


def filtered_probs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Temperature, then top-k, then top-p, then min-p (HF's order), as one distribution per row. The
    draft's proposals and the target's verification filter alike, so speculation samples exactly the
    filtered target distribution.

    logits [B, T, V] fp32 -> probs [B, T, V] fp32. Greedy rows (temperature 0) get a one-hot on the argmax.
    """
    vocab = logits.shape[-1]
    temp = t.temperature[:, None, None]
    scaled = logits / temp.clamp_min(1e-6)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    k = torch.where(t.top_k > 0, t.top_k, vocab)[:, None, None]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= t.top_p[:, None, None], 0.0)
    # min-p: keep what reaches min_p x the largest probability (sorted: column 0), e.g. 0.1 of 0.6 -> 0.06
    sorted_probs = sorted_probs.masked_fill(
        sorted_probs < t.min_p[:, None, None] * sorted_probs[..., :1], 0.0
    )
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    probs = torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)
    one_hot = torch.nn.functional.one_hot(logits.argmax(dim=-1), vocab).float()
    return torch.where(temp > 0, probs, one_hot)


def sample_from(probs: torch.Tensor, seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """One token per row by the exponential race: argmax(p / E), E ~ Exp(1), picks i with probability p_i.

    probs [B, T, V], seed [B], position [B, T] -> tokens [B, T] int64
    """
    noise = -torch.log(uniform(seed, position, stream, probs.shape[-1]))
    return (probs / noise).argmax(dim=-1)


def select_tokens(
    logits: torch.Tensor, t: SamplingTensors, position: torch.Tensor, any_sampling: bool
) -> torch.Tensor:
    """logits [B, T, V] fp32, position [B, T] (the position each token will occupy) -> tokens [B, T].

    `any_sampling` is known on the host from the requests; when False the step is a plain argmax.
    """
    greedy = logits.argmax(dim=-1)
    if not any_sampling:
        return greedy
    sampled = sample_from(filtered_probs(logits, t), t.seed, position, stream=0)
    return torch.where(t.temperature[:, None] > 0, sampled, greedy)
