"""How much memory the pool of KV blocks gets when the user names no size.

CUDA (as vLLM's --gpu-memory-utilization): a share of the device's memory, less what is in use once the
weights are loaded (this process's, and any other process's on the device) and less the activations of
a prefill forward of PROFILED_TOKENS tokens (or a whole context, if shorter), measured by running one.
Example, an H200 (140 GB), utilization 0.9, 16 GB of weights, a 3 GB activation peak:
0.9 x 140 - 16 - 3 = 107 GB of KV blocks.

CPU: every slot's whole context, up to CPU_DEFAULT_BYTES (as vLLM's 4 GiB VLLM_CPU_KVCACHE_SPACE), but
never less than one whole context: 256 slots of 4,096 SmolLM2 positions in bf16 would be 24 GB.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CPU_DEFAULT_BYTES = 4 * 2**30
PROFILED_TOKENS = 8192  # as vLLM's default max_num_batched_tokens; longer prompts: --max-prefill-tokens


def cuda_kv_bytes(free: int, total: int, utilization: float, activations: int) -> int:
    """Bytes for KV blocks: utilization x total, less the memory in use (total - free) and the
    activation peak. Raises when nothing is left, naming the numbers."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(utilization * total) - (total - free) - activations
    if budget <= 0:
        gib = lambda n: f"{n / 2**30:.1f} GiB"
        raise ValueError(
            f"no device memory left for the KV cache: {utilization:.0%} of {gib(total)} is "
            f"{gib(int(utilization * total))}, {gib(total - free)} is in use (weights, other processes) "
            f"and a prefill needs {gib(activations)}; raise gpu_memory_utilization or shorten max_seq_len"
        )
    return budget


def measured_cuda_kv_bytes(
    device: torch.device, utilization: float, largest_prefill: Callable[[], object]
) -> int:
    """cuda_kv_bytes on `device`, its activation peak measured by running `largest_prefill` (no cache)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    largest_prefill()
    torch.cuda.synchronize(device)
    activations = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return cuda_kv_bytes(free, total, utilization, activations)


def cpu_kv_blocks(whole_contexts: int, one_context: int, block_bytes: int) -> int:
    """Blocks for every slot's whole context (`whole_contexts` blocks), capped at CPU_DEFAULT_BYTES but
    not below one context (`one_context` blocks)."""
    return min(whole_contexts, max(CPU_DEFAULT_BYTES // block_bytes, one_context))
