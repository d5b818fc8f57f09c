"""One engine over N processes on this machine: rank 0 (the caller's process) runs the scheduler, and
ranks 1 .. N - 1 are workers it starts (spawn) that execute the same plans.

Each step rank 0 sends its StepPlan (runner/plan.py) to every worker as one message on its own queue,
then executes it locally; the ranks meet in the step's all-reduces. Nothing else travels: the workers
hold no scheduler and no block pool, only the device tensors the plans write (the block tables among
them). The messages are ("execute", plan), ("log_probs", tokens) for eval, ("warm_up", ()) and
("stop", ()). The queues are pipes, so an idle worker waits for the next message without a collective's
timeout. Workers never tokenize. On CUDA rank r uses cuda:r; on CPU the caller's threads are split
evenly over the ranks.

Start-up: every worker reports on a status queue once it has joined the process group, and again once
its shard and runner are built; a worker that fails (out of memory, a missing shard) or dies surfaces
on rank 0 as an error naming its rank, and the other workers are stopped. A worker that dies later
makes every call fail with RankLostError (checked before each call, and after a call that raised: a
collective with a dead peer fails), which the engine counts as a lost device (failures.py).

Shutdown: rank 0 stops the workers ("stop"); they ignore Ctrl-C (it reaches the whole process group, and
rank 0 handles it), and a worker whose rank 0 has died (killed, say) exits by itself within a second
instead of waiting for messages forever. A worker's tqdm bars take a thread lock instead of tqdm's
default multiprocessing one: a semaphore a killed worker never unregisters, which the resource tracker
would report as "leaked" at exit.
"""

from __future__ import annotations

import multiprocessing
import signal
import socket
import threading
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.context import SpawnProcess
from queue import Empty
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from redline.engine_config import EngineConfig
from redline.failures import RankLostError
from redline.parallel.group import TensorParallel
from redline.runner.build import build_runner
from redline.runner.model_runner import ModelRunner
from redline.runner.plan import StepPlan, StepResult
from redline.runner.warm_up import warm_up

JOIN_TIMEOUT = timedelta(minutes=10)  # init_process_group: every rank reaching the rendezvous


def device_of(config: EngineConfig, rank: int) -> str:
    """Rank r's device: cuda:r on CUDA (one GPU each), else the config's."""
    return f"cuda:{rank}" if config.load.device.startswith("cuda") else config.load.device


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _worker(
    rank: int, size: int, init: str, config: EngineConfig, calls: Any, status: Any, threads: int
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: rank 0 stops the workers
    tqdm.set_lock(threading.RLock())  # not tqdm's multiprocessing lock (a semaphore a killed worker leaks)
    try:
        torch.set_num_threads(threads)
        device = device_of(config, rank)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        status.put((rank, "joining", None))
        dist.init_process_group(_backend(device), init_method=init, rank=rank, world_size=size,
                                timeout=JOIN_TIMEOUT)  # fmt: skip
        runner = build_runner(config, TensorParallel.current(config.parallel.enable_expert_parallel), device)
    except BaseException:
        status.put((rank, "failed", traceback.format_exc()))
        return
    status.put((rank, "ready", None))
    follow(runner, lambda: _receive(calls, rank))
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


Message = tuple[
    str, tuple[Any, ...]
]  # ("execute", (plan,)), ("log_probs", (tokens,)), ("warm_up", ()), ("stop", ())


class RankGroup:
    """Rank 0's executor: each message goes to every worker (`send`), then runs here. `workers`: the
    processes started here (none under torchrun, which started them)."""

    recovers = False  # the ranks may have left a failed plan at different points

    def __init__(self, runner: ModelRunner, send: Callable[[Message], None], workers: list[SpawnProcess]):
        self.runner, self._send, self.workers = runner, send, workers
        self.closed = False

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def lost(self) -> str | None:
        """Which worker died, if one did: "rank 1 (exit code -9)"."""
        for rank, worker in enumerate(self.workers, start=1):
            if not worker.is_alive():
                return f"rank {rank} (exit code {worker.exitcode})"
        return None

    def _everywhere(self, message: Message, here: Callable[[], Any]) -> Any:
        """Sends the message to every worker, then runs `here` (the same work on rank 0)."""
        if (dead := self.lost()) is not None:
            raise RankLostError(f"tensor-parallel {dead} died")
        self._send(message)
        try:
            return here()
        except Exception as error:
            if (dead := self.lost()) is not None:
                raise RankLostError(f"tensor-parallel {dead} died: {error}") from error
            raise

    def execute(self, plan: StepPlan) -> StepResult:
        return self._everywhere(("execute", (plan,)), lambda: self.runner.execute(plan))

    def log_probs(self, tokens: list[int]) -> torch.Tensor:
        return self._everywhere(("log_probs", (tokens,)), lambda: self.runner.log_probs(tokens))

    def warm_up(self, progress: bool = True) -> None:
        self._everywhere(
            ("warm_up", ()), lambda: warm_up(self.runner, progress)
        )  # one progress bar: rank 0's

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


def follow(runner: ModelRunner, receive: Callable[[], Message]) -> None:
    """A worker's life after start-up: rank 0's messages, in order, until "stop"."""
    while True:
        kind, args = receive()
        if kind == "stop":
            return
        if kind == "execute":
            runner.execute(*args)
        elif kind == "log_probs":
            runner.log_probs(*args)
        elif kind == "warm_up":
            warm_up(runner, progress=False)
        else:
            raise ValueError(f"unknown message {kind!r} from rank 0")


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


def start(config: EngineConfig, size: int) -> RankGroup:
    """Starts ranks 1 .. size - 1 and builds rank 0's shard here, joined in one process group."""
    if config.load.device.startswith("cuda") and torch.cuda.device_count() < size:
        visible = torch.cuda.device_count()
        raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; {visible} visible")
    context = mp.get_context("spawn")
    init = f"tcp://127.0.0.1:{_free_port()}"
    threads = max(1, torch.get_num_threads() // size)
    status = context.Queue()
    calls = [context.Queue() for _ in range(size - 1)]
    args = [(r, size, init, config, calls[r - 1], status, threads) for r in range(1, size)]
    workers = [context.Process(target=_worker, args=a, daemon=True) for a in args]
    for worker in workers:
        worker.start()
    try:
        wait_for_workers(status, workers, "joining")
        torch.set_num_threads(threads)
        device = device_of(config, 0)
        dist.init_process_group(_backend(device), init_method=init, rank=0, world_size=size,
                                timeout=JOIN_TIMEOUT)  # fmt: skip
        runner = build_runner(config, TensorParallel.current(config.parallel.enable_expert_parallel), device)
        wait_for_workers(status, workers, "ready")
    except BaseException:
        for worker in workers:
            worker.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    return RankGroup(runner, lambda message: [queue.put(message) for queue in calls], workers)
