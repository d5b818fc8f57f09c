"""llama.cpp on the same weights, through `llama-cpp-python` (optional: `pip install -e ".[llamacpp]"`, which
builds llama.cpp from source): batch 1, greedy, the same prompt token ids, the same thread count as torch,
fixed-length completions timed token by token like the other engines.

Two files per GGUF model: the file itself (e.g. the shipped Q4_1) and an F16 copy written from its
dequantized tensors (models/gguf_copy.py): the weights redline runs, in llama.cpp's best unquantized form.

Each file runs in a child process (this file as a script, one JSON line per completion, in
and out), alive from loading the file to the bench's last completion, so that it takes turns with the other
engines: a crash inside llama.cpp (a build whose AMX kernels fault on this CPU, say) costs that row, not the
benchmark.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import TextIO

WAIT_S = 30.0  # seconds a child may take to exit once told to before it is killed
ANSWER_S = 600.0  # seconds a child may take to load its file or to complete a prompt before it is killed


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


class LlamaCppFailed(RuntimeError):
    """llama.cpp failed or crashed on a file: that engine's row is lost, not the benchmark."""


class Child:
    """llama.cpp on one file in a child process (`python -m redline.benchmark.llamacpp`, or `command`) that
    serves completions one JSON line at a time until closed; a failure, a crash or an answer that is not
    one raises LlamaCppFailed naming the file and the child's last words, and closes the child."""

    def __init__(self, path: Path, context: int, threads: int, command: list[str] | None = None):
        self.path = path
        # the child's stderr, read back only on failure; open until close()
        self.errors = tempfile.TemporaryFile(mode="w+", errors="replace")  # noqa: SIM115
        try:  # this file as a script: the child imports neither redline nor torch before serve() runs
            self.process = subprocess.Popen(
                command or [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=self.errors, text=True, errors="replace",
            )  # fmt: skip
        except OSError as e:
            self.errors.close()
            raise LlamaCppFailed(f"llama.cpp failed on {path} (no child process: {e})") from e
        self._ask({"path": str(path), "context": context, "threads": threads}, "ready")

    def complete(self, prompt: list[int], n: int) -> tuple[list[int], float, float]:
        answer = self._ask({"prompt": prompt, "n": n}, "tokens", "ttft_s", "rate")
        return answer["tokens"], answer["ttft_s"], answer["rate"]

    def _ask(self, request: dict, *keys: str) -> dict:
        """The child's answer to `request` within ANSWER_S: a JSON object holding `keys`."""
        line, timed_out = "", False
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            # one line per request, so nothing sits read ahead in the stream's buffer: the pipe tells
            if select.select([self.process.stdout], [], [], ANSWER_S)[0]:
                line = self.process.stdout.readline()
            else:
                timed_out = True
        except BrokenPipeError:
            pass
        try:
            answer = json.loads(line) if line else None
        except ValueError:
            answer = None
        if isinstance(answer, dict) and all(key in answer for key in keys):
            return answer
        self._end()  # before its last words are read: it writes no more
        code = self.process.returncode
        if line:
            said = f"answered {line.strip()[:80]!r}"
        elif timed_out:
            said = f"no answer within {ANSWER_S:g} s"
        else:
            said = f"signal {-code}" if code < 0 else f"exit status {code}"
        failure = f"llama.cpp failed on {self.path} ({said}): {self._last_words()}"
        self.errors.close()
        raise LlamaCppFailed(failure)

    def _last_words(self) -> str:
        self.errors.seek(0)
        tail = self.errors.read().strip().splitlines()[-1:] or ["no output"]
        return tail[0]

    def _end(self) -> None:
        """Its stdin closed, the child exits; killed if it has not within WAIT_S."""
        for stream in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(BrokenPipeError):
                stream.close()
        try:
            self.process.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def close(self) -> None:
        self._end()
        self.errors.close()


def median_rate(path: Path, prompts: list[list[int]], max_tokens: int, threads: int) -> float:
    """The median decode tokens/s per user over the prompts, after one warm-up completion."""
    child = Child(path, max(map(len, prompts)) + max_tokens + 16, threads)
    try:
        child.complete(prompts[0], max_tokens)
        return median(child.complete(p, max_tokens)[2] for p in prompts)
    finally:
        child.close()


def serve(lines: TextIO) -> None:
    """The child: the first line names the file (path, context, threads), then one completion per line.
    Answers go to the original stdout alone: file descriptor 1 is pointed at stderr first, so whatever
    llama.cpp (C) or Python print there cannot break a line of the protocol."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from llama_cpp import Llama

    def answer(message: dict) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    a = json.loads(lines.readline())
    model = Llama(a["path"], n_ctx=a["context"], n_threads=a["threads"], n_threads_batch=a["threads"],
                  verbose=False)  # fmt: skip
    answer({"ready": True})
    for line in lines:
        request = json.loads(line)
        tokens, ttft, rate = complete(model, request["prompt"], request["n"])
        answer({"tokens": tokens, "ttft_s": ttft, "rate": rate})


if __name__ == "__main__":  # run as a script: its folder, first on sys.path, holds no package (run.py, ...)
    sys.path.pop(0)
    serve(sys.stdin)
