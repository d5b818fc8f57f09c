"""llama.cpp on the same weights, through `llama-cpp-python` (optional: `pip install -e ".[llamacpp]"`, which
builds llama.cpp from source): batch 1, greedy, the same prompt token ids, the same thread count as torch,
fixed-length completions timed token by token like the other engines.

Two files per GGUF model: the file itself (e.g. the shipped Q4_1) and an F16 copy written from its
dequantized tensors (models/gguf_f16.py): the weights redline runs, in llama.cpp's best unquantized form.

Each file runs in a child process (`python -m redline.benchmark.llamacpp`, JSON in and out): a crash
inside llama.cpp (a build whose AMX kernels fault on this CPU, say) costs that row, not the benchmark.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

Complete = Callable[[list[int], int], tuple[list[int], float, float]]  # (prompt, n) -> tokens, ttft_s, rate


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def file_kind(path: Path) -> str:
    """'Q4_1', 'F16', ...: the file type the GGUF metadata names (general.file_type), else the type most
    of its matrices have."""
    from collections import Counter

    import gguf

    from redline.models.gguf_reader import GGUFFile

    file = GGUFFile(path)
    kind = file.value("general.file_type", None)
    if kind is not None:
        return gguf.LlamaFileType(kind).name.removeprefix("MOSTLY_")
    types = Counter(t.tensor_type.name for t in file.tensors.values() if len(t.shape) > 1)
    return types.most_common(1)[0][0] if types else "?"


def weight_bytes(path: Path) -> int:
    """Bytes of the file's tensors: what a decode step reads in the file's own quantization (a tied
    embedding is one tensor, read by the output product)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


def complete(model, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    """One greedy completion of n tokens (eos ignored); returns (tokens, ttft_s, decode tokens/s)."""
    model.reset()  # no prefix reuse between runs: every prompt is prefilled, as in the other engines
    tokens, times = [], []
    start = time.perf_counter()
    for token in model.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        times.append(time.perf_counter())
        tokens.append(int(token))
        if len(tokens) == n:
            break
    return tokens, times[0] - start, (n - 1) / (times[-1] - times[0])


def timed_runs(complete: Complete, prompts: list[list[int]], max_tokens: int, repeats: int) -> dict:
    """One warm-up completion, then every prompt `repeats` times (the HF baseline's loop too): warmup_s,
    rates and ttfts of every run, outputs of the last repeat."""
    start = time.perf_counter()
    complete(prompts[0], max_tokens)
    result = {"warmup_s": time.perf_counter() - start, "rates": [], "ttfts": [], "outputs": []}
    for _ in range(repeats):
        result["outputs"] = []
        for prompt in prompts:
            tokens, ttft, rate = complete(prompt, max_tokens)
            result["rates"].append(rate)
            result["ttfts"].append(ttft)
            result["outputs"].append(tokens)
    return result


def bench_file(path: Path, prompts: list[list[int]], max_tokens: int, repeats: int, threads: int) -> dict:
    """timed_runs of the file, in this process."""
    from llama_cpp import Llama

    context = max(map(len, prompts)) + max_tokens + 16
    model = Llama(str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads, verbose=False)
    return timed_runs(lambda prompt, n: complete(model, prompt, n), prompts, max_tokens, repeats)


def bench_in_child(path: Path, prompts: list[list[int]], max_tokens: int, repeats: int, threads: int) -> dict:
    """bench_file in a child process; raises RuntimeError naming the file if it fails or crashes."""
    request = {"path": str(path), "prompts": prompts, "max_tokens": max_tokens, "repeats": repeats,
               "threads": threads}  # fmt: skip
    child = subprocess.run(
        [sys.executable, "-m", "redline.benchmark.llamacpp"], input=json.dumps(request), capture_output=True,
        text=True,
    )  # fmt: skip
    if child.returncode != 0:
        how = f"signal {-child.returncode}" if child.returncode < 0 else f"exit status {child.returncode}"
        tail = child.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"llama.cpp failed on {path} ({how}): {tail[0]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    a = json.loads(sys.stdin.read())
    print(json.dumps(bench_file(Path(a["path"]), a["prompts"], a["max_tokens"], a["repeats"], a["threads"])))
