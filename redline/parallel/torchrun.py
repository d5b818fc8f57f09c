"""Tensor parallelism across machines, launched by torchrun:

    torchrun --nnodes M --nproc-per-node G --rdzv-endpoint HOST:PORT ... -m redline serve --tp M*G ...

Every process runs the same command line. Rank 0 runs it (the scheduler, the HTTP server); every other
rank, seeing RANK > 0, follows instead (cli.main -> follow): it joins the process group, receives rank
0's RunnerSpec, builds its shard on its LOCAL_RANK device, then makes rank 0's runner calls as they
come. Calls travel as one small broadcast per call on a gloo group of their own, with a timeout long
enough for a server to sit idle; the model's collectives use the default group (NCCL on CUDA).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from redline.parallel.group import TensorParallel
from redline.parallel.workers import (
    JOIN_TIMEOUT,
    Message,
    ParallelRunner,
    RunnerSpec,
    build_runner,
    serve_calls,
)

IDLE_TIMEOUT = timedelta(days=365)  # a follower waits this long for rank 0's next call


def launched() -> bool:
    """Whether this process is one of several that torchrun started."""
    return "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def is_follower() -> bool:
    return launched() and int(os.environ["RANK"]) > 0


def _join() -> dist.ProcessGroup:
    """The default group from torchrun's environment, and the gloo group calls travel on."""
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=JOIN_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def _on_this_machine(spec: RunnerSpec) -> RunnerSpec:
    return spec.on_rank(int(os.environ.get("LOCAL_RANK", "0")))


def _sender(calls: dist.ProcessGroup) -> Callable[[Message], None]:
    return lambda message: dist.broadcast_object_list([message], src=0, group=calls)


def _receiver(calls: dist.ProcessGroup) -> Callable[[], Message]:
    def receive() -> Message:
        box: list[Message | None] = [None]
        dist.broadcast_object_list(box, src=0, group=calls)
        assert box[0] is not None
        return box[0]

    return receive


def lead(spec: RunnerSpec, size: int) -> ParallelRunner:
    """Rank 0: joins, sends every rank the spec, builds its own shard."""
    world = int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ValueError(f"--tensor-parallel-size {size}, but torchrun started {world} processes")
    calls = _join()
    send = _sender(calls)
    send(("spec", (spec,)))
    runner = build_runner(_on_this_machine(spec), TensorParallel.current(spec.expert_parallel))
    return ParallelRunner(runner, send, [])


def follow() -> int:
    """Ranks > 0: build this rank's shard from rank 0's spec and make rank 0's calls until it stops."""
    calls = _join()
    receive = _receiver(calls)
    _, (spec,) = receive()
    runner = build_runner(_on_this_machine(spec), TensorParallel.current(spec.expert_parallel))
    serve_calls(runner, receive)
    dist.destroy_process_group()
    return 0
