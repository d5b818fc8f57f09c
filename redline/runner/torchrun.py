"""Tensor parallelism across machines, launched by torchrun:

    torchrun --nnodes M --nproc-per-node G --rdzv-endpoint HOST:PORT ... -m redline serve --tp M*G ...

Every process runs the same command line. Rank 0 runs it (the scheduler, the HTTP server); every other
rank, seeing RANK > 0, follows instead (cli.main -> follow): it joins the process group, receives rank
0's EngineConfig, builds its shard on its LOCAL_RANK device, then executes rank 0's plans as they come
(runner/ranks.py). Messages travel as one broadcast per step on a gloo group of their own, with a timeout
long enough for a server to sit idle; the model's collectives use the default group (NCCL on CUDA).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from redline.engine_config import EngineConfig
from redline.parallel.group import TensorParallel
from redline.runner.build import build_runner
from redline.runner.model_runner import ModelRunner
from redline.runner.ranks import JOIN_TIMEOUT, Message, RankGroup, follow

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


def _runner(config: EngineConfig) -> ModelRunner:
    """This process's shard, on its LOCAL_RANK GPU on CUDA."""
    local = os.environ.get("LOCAL_RANK", "0")
    device = f"cuda:{local}" if config.load.device.startswith("cuda") else config.load.device
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    return build_runner(config, TensorParallel.current(config.parallel.enable_expert_parallel), device)


def _sender(calls: dist.ProcessGroup) -> Callable[[Message], None]:
    return lambda message: dist.broadcast_object_list([message], src=0, group=calls)


def _receiver(calls: dist.ProcessGroup) -> Callable[[], Message]:
    def receive() -> Message:
        box: list[Message | None] = [None]
        dist.broadcast_object_list(box, src=0, group=calls)
        assert box[0] is not None
        return box[0]

    return receive


def lead(config: EngineConfig, size: int) -> RankGroup:
    """Rank 0: joins, sends every rank the config, builds its own shard."""
    world = int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ValueError(f"--tensor-parallel-size {size}, but torchrun started {world} processes")
    calls = _join()
    send = _sender(calls)
    send(("config", (config,)))
    return RankGroup(_runner(config), send, [])


def follow_rank_0() -> int:
    """Ranks > 0: build this rank's shard from rank 0's config and execute rank 0's plans until it stops."""
    calls = _join()
    receive = _receiver(calls)
    _, (config,) = receive()
    follow(_runner(config), receive)
    dist.destroy_process_group()
    return 0
