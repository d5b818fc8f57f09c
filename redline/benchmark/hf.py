"""HF transformers `generate` (greedy) timed token by token: the reference every speedup is against."""

from __future__ import annotations

import time

import torch


def load_hf(model_dir, dtype: torch.dtype):
    try:
        import transformers
    except ImportError as e:
        raise ValueError(
            "the HF baseline needs transformers (pip install transformers), or pass --no-hf"
        ) from e
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # fixed-length runs, like ignore_eos
    return model


class TokenTimes:
    """A generate() streamer that timestamps each `put`: the first is the prompt, then one per token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_hf(model, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    """One greedy generate of n tokens; returns (tokens, ttft_s, decode tokens/s per user)."""
    streamer = TokenTimes()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=streamer,
            pad_token_id=0,
        )  # fmt: skip
    first, last = streamer.times[1], streamer.times[-1]
    return out[0, len(prompt) :].tolist(), first - start, (n - 1) / (last - first)
