"""Llama 3 rope scaling recovered from the `rope_freqs.weight` tensor llama.cpp stores in its place.

convert_hf_to_gguf does not write a Llama 3.x config's `rope_scaling` as metadata: it precomputes one factor
per rotary frequency (inverse frequencies are divided by it) and stores them as a tensor. This module finds
the `llama3` parameters that reproduce those factors, so the imported config.json says what the original did.
"""

from __future__ import annotations

import numpy as np

# The band's edges fix only the ratios original_max_position / low_freq_factor and / high_freq_factor;
# every Llama 3.x release has low_freq_factor 1, so that is the one we pick.
_LOW_FREQ_FACTOR = 1.0
# What llama.cpp's converter assumes when a config does not say; used for what the factors leave
# undetermined (fewer than two frequencies inside the band).
_FALLBACK = {"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama3_factors(theta: float, head_dim: int, scaling: dict[str, float]) -> np.ndarray:
    """The per-frequency factors convert_hf_to_gguf writes for a `llama3` rope_scaling: [head_dim // 2].

    1 for wavelengths below original / high_freq_factor, `factor` above original / low_freq_factor, and
    between them 1 / ((1 - s) / factor + s) with s = (original / wavelength - low) / (high - low)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = (original / wavelen - low) / (high - low)
    band = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, band))


def shortest_float32(x: float) -> float:
    """The shortest decimal that rounds to the same float32: 8.000000476837158 -> 8.0."""
    return float(str(np.float32(x)))


def llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, float | str] | None:
    """The `llama3` rope_scaling whose factors equal `factors` ([head_dim // 2], fp32 in the file), or None
    when every factor is 1. Raises ValueError when no llama3 scaling reproduces them.

    In the band, 1 / f = (1 - s) / factor + s gives s per frequency, and s is linear in 1 / wavelength:
    s = (original / (high - low)) / wavelength - low / (high - low). A line through the band's points gives
    the two coefficients; with low = 1 they fix original and high. Example (Llama 3.1: theta 500000,
    head_dim 128, factor 8, low 1, high 4, original 8192): the band holds wavelengths 2048..8192, i.e.
    6 frequencies, and the fit returns original 8192, high 4."""
    factors = np.asarray(factors, dtype=np.float64)
    if factors.shape != (head_dim // 2,):
        raise ValueError(f"has {factors.shape} rope factors for head_dim {head_dim}")
    if np.all(factors == 1.0):
        return None
    factor = shortest_float32(factors.max())
    no_match = ValueError(f"rope factors {factors.tolist()} match no llama3 rope scaling")
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    inside = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    s = (1 / factors[inside] - 1 / factor) / (1 - 1 / factor)
    if inside.sum() >= 2:
        slope, intercept = np.polyfit(1 / wavelen[inside], s, 1)  # orig / (high - low), -low / (high - low)
        if intercept >= 0:
            raise no_match
        width = _LOW_FREQ_FACTOR / -intercept  # high - low
        original, high = slope * width, _LOW_FREQ_FACTOR + width
    elif inside.sum() == 1:  # one point fixes original once high is chosen: take the usual 4
        high = _FALLBACK["high_freq_factor"]
        original = float(wavelen[inside][0] * (_LOW_FREQ_FACTOR + s[0] * (high - _LOW_FREQ_FACTOR)))
    else:
        original, high = _FALLBACK["original_max_position_embeddings"], _FALLBACK["high_freq_factor"]
    rounded = (round(float(original)), float(round(high, 4)))  # what a config would say: tried first
    for original_max, high_freq in (rounded, (float(original), float(high))):
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": _LOW_FREQ_FACTOR}
        scaling |= {"original_max_position_embeddings": original_max, "high_freq_factor": high_freq}
        if np.allclose(llama3_factors(theta, head_dim, scaling), factors, rtol=1e-5, atol=0):
            return scaling
    raise no_match
