"""Triton kernels, each beside the torch function it must equal (`*_reference`).

The GPU path runs them compiled; on CPU the tests run them under TRITON_INTERPRET=1. Triton is
optional: without it (or without a GPU) `kernels_for` picks the torch references.
"""

from __future__ import annotations

import importlib.util

HAS_TRITON = importlib.util.find_spec("triton") is not None
