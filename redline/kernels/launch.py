"""Launching Triton kernels so that torch sees them: every kernel here runs inside a
`torch.library.triton_op`, launched through `torch.library.wrap_triton`.

What that buys:
- torch.compile(fullgraph=True) traces the op (dynamo calls it as one op; AOT autograd decomposes it
  into the `triton_kernel_wrapper` higher-order op, which inductor compiles beside its own kernels);
- fake tensors (FakeTensorMode, the meta analysis dynamo runs) go through the op's body with the
  launch recorded, not run, so a CPU-only torch can run the whole CUDA path on fake CUDA tensors
  (tests/test_fake_cuda.py): shapes, devices and the absence of host syncs are checked there;
- eagerly on real tensors, the kernel launches directly (no higher-order op dispatch).

Under TRITON_INTERPRET=1 (CPU tests) `triton.jit` gives an InterpretedFunction, which runs eagerly
only: `traceable` returns it as it is (torch 2.13 does the same inside wrap_triton; older releases
raise). The interpreter also computes `tl.dot` on bf16 inputs wrongly, so kernels multiply in fp32
when INTERPRETED.
"""

from __future__ import annotations

from typing import Any

from torch.library import wrap_triton
from triton.runtime.interpreter import InterpretedFunction


def is_interpreted(kernel: Any) -> bool:
    return isinstance(kernel, InterpretedFunction)


def traceable(kernel: Any) -> Any:
    """`kernel[grid](...)` launches as wrap_triton's traceable launch, or directly when interpreted."""
    return kernel if is_interpreted(kernel) else wrap_triton(kernel)
