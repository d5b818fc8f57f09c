"""Sampling parameters and token selection on the device without host synchronisation.

Random draws come from a counter-based hash of (request seed, stream, position, token id), not from a
generator with state: a request gets the same tokens whether it runs alone or batched with others,
and nothing in a step depends on how many random numbers earlier steps drew.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from redline.structured_spec import StructuredOutputs

_MASK32 = 0xFFFFFFFF
MAX_LOGPROBS = 20  # top log-probabilities a token can report (OpenAI's top_logprobs limit)
MAX_REPETITION_PENALTY = 10.0
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)
MAX_TOP_K = 2**31 - 1  # top_k is an int64 tensor entry; anything past the vocabulary keeps it all
MAX_LOGIT_BIAS = 100.0  # logit_bias values lie in [-100, 100] (OpenAI's range)


class ParamError(ValueError):
    """A request that its parameters cannot serve, naming the parameter (the server's 400 `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass
class SamplingParams:
    max_tokens: int = 256  # 0: prefill only (the prompt's logprobs)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = whole vocabulary
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability; 0 = off
    seed: int | None = None  # None: a fresh random seed per request
    stop: list[str] | str | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated so far
    frequency_penalty: float = 0.0  # subtracted once per time a token was generated so far
    repetition_penalty: float = 1.0  # divides logits > 0, multiplies those < 0, of prompt and output tokens
    logprobs: int | None = None  # per generated token its log-probability and the top N (0: none); None = off
    prompt_logprobs: int | None = None  # the same for every prompt token after the first; None = off
    structured: StructuredOutputs | None = None  # the output must match it (structured_spec.py)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (-100 bans, 100 forces)
    allowed_token_ids: list[int] | None = None  # only these tokens may be generated (vLLM's)
    bad_words: list[str] | None = None  # never generated, as vLLM bans them (structured/token_controls.py)
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def check(name: str, ok: bool, bound: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {bound}, got {getattr(self, name)!r}")

        int_in = lambda value, low, high: isinstance(value, int) and low <= value <= high
        check("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 0, "an integer >= 0")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens 0 (prefill only) needs prompt_logprobs")
        check("temperature", self.temperature >= 0, ">= 0")
        check("top_p", 0 < self.top_p <= 1, "in (0, 1]")
        check("min_p", 0 <= self.min_p <= 1, "in [0, 1]")
        check("top_k", int_in(self.top_k, 0, MAX_TOP_K), f"an integer in [0, {MAX_TOP_K}]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            check(name, -MAX_PENALTY <= v <= MAX_PENALTY, f"in [-{MAX_PENALTY}, {MAX_PENALTY}]")
        rep = self.repetition_penalty
        check("repetition_penalty", 0 < rep <= MAX_REPETITION_PENALTY, f"in (0, {MAX_REPETITION_PENALTY}]")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            check(name, v is None or int_in(v, 0, MAX_LOGPROBS), f"None or an integer in [0, {MAX_LOGPROBS}]")
        check("seed", self.seed is None or isinstance(self.seed, int), "an integer")
        check("structured", self.structured is None or isinstance(self.structured, StructuredOutputs),
              "None or a StructuredOutputs")  # fmt: skip
        self._check_token_controls()
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        check("stop", all(isinstance(s, str) and s for s in stops), "a non-empty string or a list of them")
        self.stop_strings = tuple(stops)

    def _check_token_controls(self) -> None:
        bias, allowed, bad = self.logit_bias, self.allowed_token_ids, self.bad_words
        is_id = lambda token: isinstance(token, int) and not isinstance(token, bool) and token >= 0
        in_range = lambda v: isinstance(v, int | float) and abs(v) <= MAX_LOGIT_BIAS
        if bias is not None and not (isinstance(bias, dict) and all(is_id(t) and in_range(v)
                                                                    for t, v in bias.items())):  # fmt: skip
            raise ValueError(f"logit_bias must map token ids to numbers in [-{MAX_LOGIT_BIAS:g}, "
                             f"{MAX_LOGIT_BIAS:g}]")  # fmt: skip
        ids = isinstance(allowed, list | tuple) and allowed and all(map(is_id, allowed))
        if allowed is not None and not ids:
            raise ValueError("allowed_token_ids must be a non-empty list of token ids")
        words = isinstance(bad, list | tuple) and all(isinstance(w, str) and w.strip() for w in bad)
        if bad is not None and not words:
            raise ValueError("bad_words must be a list of non-blank strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty, self.frequency_penalty, self.repetition_penalty) != (0, 0, 1)

    @property
    def needs_logits(self) -> bool:
        """Whether the step must compute this request's logits (the sampling path): it samples, has
        penalties, asks for logprobs, or allows only some tokens (allowed_token_ids: where a grammar's mask
        leaves none of them, the logits path keeps the mask alone, penalties.with_bias). Otherwise an argmax
        suffices, grammars' masks and logit biases applied to it."""
        return not self.greedy or self.penalized or self.logprobs is not None or bool(self.allowed_token_ids)


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
    return open_unit(key)


def open_unit(key: torch.Tensor) -> torch.Tensor:  # [...] int64 32-bit values -> [...] fp32
    """32-bit keys (int64 tensor) -> fp32 in (0, 1), never 0 or 1: the top 23 bits, centred. Keys 0 and
    2**32 - 1 give 2**-24 and 1 - 2**-24, both exact in fp32. The top 24 bits did not fit: their largest
    value, 2**24 - 0.5, rounds to 2**24, so that one draw in 2**24 (the largest 256 of 2**32 keys) gave
    u = 1, noise -log(u) = 0, and a greedy row's race (one-hot / noise, sample_from) a 0/0 NaN that argmax
    took: a random token in one greedy step of 340 on the logits path (logprobs, penalties) with SmolLM2's
    49,152 tokens, and a slight bias when sampling."""
    return ((key >> 9).float() + 0.5) * (1.0 / (1 << 23))


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the device."""

    temperature: torch.Tensor  # [B] fp32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] fp32
    seed: torch.Tensor  # [B] int64
    min_p: torch.Tensor  # [B] fp32, 0 = off
    presence: torch.Tensor  # [B] fp32 presence penalty, 0 = off
    frequency: torch.Tensor  # [B] fp32 frequency penalty, 0 = off
    repetition: torch.Tensor  # [B] fp32 repetition penalty, 1 = off
    # [B, R, W] int32: token bitmasks of a step's R rows (structured/bitmask.py), -1 (all bits) = all allowed
    allowed: torch.Tensor
    bias: torch.Tensor  # [B, V] fp32 added to the logits: logit_bias, -inf off allowed_token_ids, 0 = none

    @classmethod
    def zeros(cls, rows: int, device: torch.device, mask_rows: int = 1, vocab: int = 32) -> SamplingTensors:
        """Greedy, unfiltered, unpenalized and unconstrained rows; masks for steps of up to mask_rows rows
        over `vocab` tokens (the defaults serve tests of the filters alone: a step needs the model's)."""
        zero = lambda dtype=torch.float32: torch.zeros(rows, dtype=dtype, device=device)
        one = torch.ones(rows, device=device)
        allowed = torch.full((rows, mask_rows, -(-vocab // 32)), -1, dtype=torch.int32, device=device)
        bias = torch.zeros(rows, vocab, device=device)
        return cls(zero(), zero(torch.int64), one, zero(torch.int64), zero(), zero(), zero(), one.clone(),
                   allowed, bias)  # fmt: skip

    def rows(self, start: int, stop: int) -> SamplingTensors:
        """Views of rows start .. stop - 1 (a batch bucket, or one slot for prefill)."""
        return self.take(slice(start, stop))

    def take(self, slots: torch.Tensor | slice) -> SamplingTensors:
        """The rows of `slots` [B] (a batched prefill's), in that order."""
        t, s = self, slots
        return SamplingTensors(t.temperature[s], t.top_k[s], t.top_p[s], t.seed[s], t.min_p[s], t.presence[s],
                               t.frequency[s], t.repetition[s], t.allowed[s], t.bias[s])  # fmt: skip


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
    # u < 1 (open_unit), and u - 1 is exact: log1p keeps the smallest noise, -log(1 - 2^-24) = 6e-8, above 0
    noise = -torch.log1p(uniform(seed, position, stream, probs.shape[-1]) - 1.0)
    return (probs / noise).argmax(dim=-1)
