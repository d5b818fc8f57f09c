"""One engine over N processes on this machine: rank 0 (the caller's process) runs the scheduler, and
ranks 1 .. N - 1 are workers it starts (spawn) that make the same runner calls.

Each call rank 0's scheduler makes (admit, reserve, prefill_batch, decode, release, warm_up; eval's
log_probs) first goes to every worker as one small message on its own queue, then runs locally; the
ranks meet in the step's all-reduces. The queues are pipes, so an idle worker waits for the next
request without a collective's timeout. Workers never tokenize: messages carry token ids and sampling
parameters. On CUDA rank r uses cuda:r; on CPU the caller's threads are split evenly over the ranks.

Start-up: every worker reports on a status queue once it has joined the process group, and again once
its shard and runner are built; a worker that fails (out of memory, a missing shard) or dies surfaces
on rank 0 as an error naming its rank, and the other workers are stopped. A worker that dies later
makes every call fail with RankLostError (checked before each call, and after a call that raised: a
collective with a dead peer fails), which the engine counts as a lost device (engine/failures.py).

Shutdown: rank 0 stops the workers ("stop"); they ignore Ctrl-C (it reaches the whole process group, and
rank 0 handles it), and a worker whose rank 0 has died (killed, say) exits by itself within a second
instead of waiting for calls forever. A worker's tqdm bars take a thread lock instead of tqdm's default
multiprocessing one: a semaphore a killed worker never unregisters, which the resource tracker would
report as "leaked" at exit.
"""

from __future__ import annotations

import multiprocessing
import signal
import socket
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.context import SpawnProcess
from queue import Empty
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from redline.engine.failures import RankLostError
from redline.engine.prefill import PrefillChunk, PrefillResult
from redline.engine.runner import ModelRunner, StepOutput
from redline.models.build import load_target
from redline.models.eagle3 import load_draft
from redline.parallel.group import TensorParallel

JOIN_TIMEOUT = timedelta(minutes=10)  # init_process_group: every rank reaching the rendezvous


@dataclass(frozen=True)
class RunnerSpec:
    """What every rank builds its runner from (picklable: it travels to the workers)."""

    model_dir: str
    dtype: torch.dtype
    device: str
    max_batch: int
    max_seq_len: int
    draft: str | None
    num_draft_tokens: int
    compile: bool | None
    pdl: bool
    kv_cache_dtype: torch.dtype | None
    quantization: str | None
    expert_parallel: bool = False
    kv_cache_memory: int | None = None
    prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9

    def on_rank(self, rank: int) -> RunnerSpec:
        return replace(self, device=f"cuda:{rank}") if self.device.startswith("cuda") else self


def build_runner(spec: RunnerSpec, tp: TensorParallel) -> ModelRunner:
    model = load_target(spec.model_dir, spec.dtype, spec.device, spec.quantization, tp=tp)
    draft = None if spec.draft is None else load_draft(spec.draft, model, spec.dtype, spec.device)
    return ModelRunner(model, spec.max_batch, spec.max_seq_len, draft, spec.num_draft_tokens, spec.compile,
                       spec.pdl, spec.kv_cache_dtype, kv_cache_memory=spec.kv_cache_memory,
                       prefix_caching=spec.prefix_caching,
                       gpu_memory_utilization=spec.gpu_memory_utilization)  # fmt: skip


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _worker(rank: int, size: int, init: str, spec: RunnerSpec, calls: Any, status: Any, threads: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: rank 0 stops the workers
    tqdm.set_lock(threading.RLock())  # not tqdm's multiprocessing lock (a semaphore a killed worker leaks)
    try:
        torch.set_num_threads(threads)
        spec = spec.on_rank(rank)
        if spec.device.startswith("cuda"):
            torch.cuda.set_device(spec.device)
        status.put((rank, "joining", None))
        dist.init_process_group(_backend(spec.device), init_method=init, rank=rank, world_size=size,
                                timeout=JOIN_TIMEOUT)  # fmt: skip
        runner = build_runner(spec, TensorParallel.current(spec.expert_parallel))
    except BaseException:
        status.put((rank, "failed", traceback.format_exc()))
        return
    status.put((rank, "ready", None))
    serve_calls(runner, lambda: _receive(calls, rank))
    dist.destroy_process_group()


def _receive(calls: Any, rank: int) -> Message:
    """A worker's next call from rank 0; exits once rank 0 has died, which would never send "stop"."""
    while True:
        try:
            return calls.get(timeout=1.0)
        except Empty:
            parent = multiprocessing.parent_process()
            if parent is not None and not parent.is_alive():
                raise SystemExit(f"tensor-parallel rank {rank}: rank 0 exited; stopping") from None


Message = tuple[str, tuple[Any, ...]]  # (runner method, its arguments); ("stop", ()) ends a worker


class ParallelRunner:
    """Rank 0's runner: the scheduler's calls go to every worker (`send`), then run here; anything else
    is read from the local runner. `workers`: the processes started here (none under torchrun)."""

    def __init__(self, runner: ModelRunner, send: Callable[[Message], None], workers: list[SpawnProcess]):
        self.runner, self._send, self.workers = runner, send, workers
        self.closed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def lost(self) -> str | None:
        """Which worker died, if one did: "rank 1 (exit code -9)"."""
        for rank, worker in enumerate(self.workers, start=1):
            if not worker.is_alive():
                return f"rank {rank} (exit code {worker.exitcode})"
        return None

    def _call(self, name: str, *args: Any, here: tuple[Any, ...] | None = None) -> Any:
        """Sends the call to every worker, then makes it here (with `here` for arguments, if given)."""
        if (dead := self.lost()) is not None:
            raise RankLostError(f"tensor-parallel {dead} died")
        self._send((name, args))
        try:
            return getattr(self.runner, name)(*(args if here is None else here))
        except Exception as error:
            if (dead := self.lost()) is not None:
                raise RankLostError(f"tensor-parallel {dead} died: {error}") from error
            raise

    def prefill(self, *args: Any) -> int:
        return self._call("prefill", *args)

    def admit(self, *args: Any) -> int | None:
        return self._call("admit", *args)

    def prefill_batch(self, chunks: list[PrefillChunk]) -> list[PrefillResult]:
        return self._call("prefill_batch", chunks)

    def decode(self, rows: int, last_position: int) -> StepOutput:
        return self._call("decode", rows, last_position)

    def release(self, slot: int) -> None:
        self._call("release", slot)

    def reserve(self, slot: int, positions: int) -> bool:
        """Every rank's pool takes the same decisions from the same calls: the same answer everywhere. A
        slot that already holds the blocks (15 steps in 16 without a draft) sends no message: rank 0's
        pool, which answers it, is every rank's."""
        if self.runner.holds(slot, positions):
            return True
        return self._call("reserve", slot, positions)

    def log_probs(self, tokens: list[int]) -> torch.Tensor:
        return self._call("log_probs", tokens)

    def warm_up(self, progress: bool = True) -> None:
        self._call("warm_up", False, here=(progress,))  # one progress bar: rank 0's

    def close(self) -> None:
        """Stops the workers and leaves the process group (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self.lost() is None:
            self._send(("stop", ()))
        for worker in self.workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.terminate()
        dist.destroy_process_group()


def serve_calls(runner: ModelRunner, receive: Callable[[], Message]) -> None:
    """A worker's life after start-up: rank 0's calls, in order, until "stop"."""
    while True:
        name, args = receive()
        if name == "stop":
            return
        getattr(runner, name)(*args)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_workers(status: Any, workers: list[SpawnProcess], stage: str) -> None:
    """Waits until every worker has reported `stage`; raises naming the first rank that failed or died."""
    pending = set(range(1, len(workers) + 1))
    while pending:
        try:
            rank, reported, error = status.get(timeout=0.5)
        except Empty:
            for rank in sorted(pending):
                code = workers[rank - 1].exitcode
                if code is not None:
                    message = f"tensor-parallel rank {rank} exited with code {code} while starting"
                    raise RuntimeError(message) from None
            continue
        if reported == "failed":
            raise RuntimeError(f"tensor-parallel rank {rank} failed to start:\n{error}")
        if reported == stage:
            pending.discard(rank)


def start(spec: RunnerSpec, size: int) -> ParallelRunner:
    """Starts ranks 1 .. size - 1 and builds rank 0's shard here, joined in one process group."""
    if spec.device.startswith("cuda") and torch.cuda.device_count() < size:
        visible = torch.cuda.device_count()
        raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; {visible} visible")
    context = mp.get_context("spawn")
    init = f"tcp://127.0.0.1:{_free_port()}"
    threads = max(1, torch.get_num_threads() // size)
    status = context.Queue()
    calls = [context.Queue() for _ in range(size - 1)]
    args = [(r, size, init, spec, calls[r - 1], status, threads) for r in range(1, size)]
    workers = [context.Process(target=_worker, args=a, daemon=True) for a in args]
    for worker in workers:
        worker.start()
    try:
        wait_for_workers(status, workers, "joining")
        torch.set_num_threads(threads)
        spec = spec.on_rank(0)
        dist.init_process_group(_backend(spec.device), init_method=init, rank=0, world_size=size,
                                timeout=JOIN_TIMEOUT)  # fmt: skip
        runner = build_runner(spec, TensorParallel.current(spec.expert_parallel))
        wait_for_workers(status, workers, "ready")
    except BaseException:
        for worker in workers:
            worker.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    return ParallelRunner(runner, lambda message: [queue.put(message) for queue in calls], workers)
