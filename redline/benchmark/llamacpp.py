"""llama.cpp on the same weights, through `llama-cpp-python` (optional: `pip install -e ".[llamacpp]"`, which
builds llama.cpp from source): batch 1, greedy, the same prompt token ids, the same thread count as torch,
fixed-length completions timed token by token like the other engines.

Two files per GGUF model: the file itself (e.g. the shipped Q4_1) and an F16 copy written from its
dequantized tensors (models/gguf_f16.py): the weights redline runs, in llama.cpp's best unquantized form.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from redline.models.gguf_reader import GGUFFile


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def file_kind(path: Path) -> str:
    """'Q4_1', 'F16', ...: the file type the GGUF metadata names (general.file_type)."""
    import gguf

    kind = GGUFFile(path).value("general.file_type", None)
    return "?" if kind is None else gguf.LlamaFileType(kind).name.removeprefix("MOSTLY_")


class LlamaCpp:
    def __init__(self, path: Path, context: int) -> None:
        from llama_cpp import Llama

        threads = torch.get_num_threads()
        self.model = Llama(
            str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads, verbose=False
        )

    def run(self, prompt: list[int], n: int) -> tuple[list[int], float, float]:
        """One greedy completion of n tokens (eos ignored); returns (tokens, ttft_s, decode tokens/s)."""
        self.model.reset()  # no prefix reuse between runs: every prompt is prefilled, as in the others
        tokens, times = [], []
        start = time.perf_counter()
        for token in self.model.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                         reset=True):  # fmt: skip
            times.append(time.perf_counter())
            tokens.append(int(token))
            if len(tokens) == n:
                break
        return tokens, times[0] - start, (n - 1) / (times[-1] - times[0])
