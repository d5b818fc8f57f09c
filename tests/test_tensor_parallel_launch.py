"""Tensor parallelism as users launch it, each command a real subprocess: `redline serve --tp 2` driven by
the official `openai` client (and what it does when a worker dies), and `torchrun` over two "machines"
on loopback."""

from __future__ import annotations

import builtins
import keyword
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from conftest import build_hf_model, llama3_hf_config, save_hf_model

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

USAGE = {"include_usage": True}
WORDS = sorted(set(keyword.kwlist) | {n for n in dir(builtins) if n.islower() and not n.startswith("_")})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(url: str) -> int | None:
    """/health's status code, or None when nothing answers."""
    try:
        return httpx.get(url + "/health", timeout=5).status_code
    except httpx.TransportError:
        return None


class Served:
    def __init__(self, process: subprocess.Popen, url: str, log: Path):
        self.process, self.url, self.log = process, url, log

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def workers(self) -> list[int]:
        """The spawned tensor-parallel workers among the server's children (not the resource tracker)."""
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                cmdline = (stat.parent / "cmdline").read_bytes()
            except (OSError, ValueError, IndexError):  # the process ended meanwhile
                continue
            if ppid == self.process.pid and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                found.append(int(stat.parent.name))
        return found

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"redline serve still running {timeout:.0f} s later:\n{self.stderr()[-3000:]}")


@contextmanager
def _serve(model: Path, tp: int, tmp_path: Path) -> Iterator[Served]:
    """`redline serve --tp TP` on a free port (its own session: signals can reach all its processes)."""
    port = _free_port()
    log = tmp_path / f"serve-{port}.log"
    command = [sys.executable, "-m", "redline", "serve", "--model", str(model), "--tp", str(tp),
               "--dtype", "float32", "--port", str(port)]  # fmt: skip
    with log.open("w") as err:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        yield Served(process, f"http://127.0.0.1:{port}", log)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _until_healthy(served: Served, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while _health(served.url) != 200:
        assert served.process.poll() is None, f"redline serve exited:\n{served.stderr()[-3000:]}"
        assert time.monotonic() < deadline, f"redline serve not healthy:\n{served.stderr()[-3000:]}"
        time.sleep(0.2)


def _answers(url: str, prompt: str, message: str) -> list[tuple[str, str | None, int]]:
    """(text, finish reason, completion tokens) of a completion and a chat, whole and streamed, greedy."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    kw = dict(model="t", max_tokens=16, temperature=0)
    messages = [{"role": "user", "content": message}]
    out = client.completions.create(prompt=prompt, **kw)
    chat = client.chat.completions.create(messages=messages, **kw)
    streams = [
        (client.completions.create(prompt=prompt, stream=True, stream_options=USAGE, **kw), lambda c: c.text),
        (client.chat.completions.create(messages=messages, stream=True, stream_options=USAGE, **kw),
         lambda c: c.delta.content or ""),
    ]  # fmt: skip
    answers = [
        (out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens),
        (chat.choices[0].message.content, chat.choices[0].finish_reason, chat.usage.completion_tokens),
    ]
    for stream, text in streams:
        chunks = list(stream)
        choices = [c.choices[0] for c in chunks if c.choices]
        tokens = chunks[-1].usage.completion_tokens  # the last chunk: usage only
        answers.append(("".join(map(text, choices)), choices[-1].finish_reason, tokens))
    return answers


def test_serve_over_two_processes_answers_like_one_and_exits_when_a_worker_dies(tmp_path, tokenizer_dir):
    """Three `redline serve` processes on one tiny Llama 3: TP = 1 and twice TP = 2. Through the official
    `openai` client, a fresh random prompt's completion and chat, whole and streamed, greedy, give both
    TP = 2 servers the TP = 1 server's text, finish reason and token count. SIGTERM to one TP = 2 server's
    process group (its worker too, as systemd or `docker stop` send it) exits 0 with no "leaked
    semaphore" warning; SIGKILL of the other's worker (rank 1) makes its /health fail and the server
    exit non-zero, naming the lost rank, within 60 s."""
    target = save_hf_model(build_hf_model(llama3_hf_config(), seed=4), tmp_path / "t", tokenizer_dir)
    rng = random.Random()
    prompt, message = " ".join(rng.choices(WORDS, k=6)), " ".join(rng.choices(WORDS, k=4))
    with ExitStack() as stack:
        one, two, doomed = (stack.enter_context(_serve(target, tp, tmp_path)) for tp in (1, 2, 2))
        for served in (one, two, doomed):
            _until_healthy(served)
        want = _answers(one.url, prompt, message)
        assert all(text and tokens for text, _, tokens in want)
        for served in (two, doomed):
            assert _answers(served.url, prompt, message) == want, (prompt, message)

        assert len(two.workers()) == 1
        os.killpg(two.process.pid, signal.SIGTERM)
        assert two.wait() == 0, two.stderr()[-3000:]
        assert "leaked semaphore" not in two.stderr()

        (worker,) = doomed.workers()
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while _health(doomed.url) == 200:
            assert time.monotonic() < deadline, "/health still 200 60 s after the worker died"
            time.sleep(0.1)
        assert doomed.wait() != 0
        assert "tensor-parallel rank 1" in doomed.stderr() and "leaked semaphore" not in doomed.stderr()


def test_torchrun_over_two_machines_on_loopback_generates_like_one_process(tmp_path, tokenizer_dir):
    """Two `torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d` launches, one per "machine",
    meeting at a rendezvous endpoint on 127.0.0.1, run `redline generate --tp 2` on a fresh random prompt
    (--ignore-eos: the random model may end at once, leaving no text to compare): both exit 0, the
    launch that became rank 0 prints one process's text, and the other (a follower) prints nothing."""
    target = save_hf_model(build_hf_model(llama3_hf_config(), seed=4), tmp_path / "t", tokenizer_dir)
    prompt = " ".join(random.choices(WORDS, k=6))
    command = ["-m", "redline", "generate", "--model", str(target), "--prompt", prompt, "--max-tokens", "20",
               "--ignore-eos", "--dtype", "float32", "--no-compile"]  # fmt: skip
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}"]  # fmt: skip
    nodes = [
        subprocess.Popen([*torchrun, *command, "--tp", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
        for _ in range(2)
    ]  # fmt: skip
    one = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=180)
    runs = []
    try:
        for node in nodes:
            out, err = node.communicate(timeout=180)
            runs.append((node.returncode, out, err))
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert one.returncode == 0 and one.stdout.strip(), one.stderr[-2000:]
    for code, _, err in runs:
        assert code == 0, err[-3000:]
    assert sorted(out for _, out, _ in runs) == ["", one.stdout], prompt
