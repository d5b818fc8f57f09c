"""Triton kernels, each beside the torch function it must equal (`*_reference`), each registered as a
torch.library.triton_op (launch.py), so torch.compile traces them and fake tensors run through them.

The GPU path runs them compiled; on CPU the tests run them under TRITON_INTERPRET=1. Triton is
optional: without it (or without a GPU) `select.select_kernels` leaves the torch paths in place.
"""

from __future__ import annotations

import importlib.util

HAS_TRITON = importlib.util.find_spec("triton") is not None
