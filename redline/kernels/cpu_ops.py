"""redline's C++ CPU kernels for bf16 decode steps on CPUs with AVX-512 BF16 (csrc/*.cpp), built once
per machine and torch version with torch's own extension builder and registered as torch ops
(torch.ops.redline_cpu.*), which eager code and compiled graphs both call:

- `few_rows_bf16` (csrc/few_rows_bf16.cpp): x[M, K] @ W[N, K]^T for decode steps (layers/linear.product),
  each weight row streamed once with vdpbf16ps on torch's thread pool. On SmolLM2's decoder weights it
  read 25-40 GB/s against 11-13 for F.linear in bf16 (BENCHMARKS.md "C++ decode kernels on AVX-512 BF16").
  A packed weight (packed_layout.py) goes to csrc/packed_rows_bf16.cpp, for any number of rows: decode
  steps, verify steps and prompts (BENCHMARKS.md "Packed weights"), and a quantized one
  (quantized_layout.py) to csrc/quantized_rows_bf16.cpp (int4) or csrc/int8_rows_vnni.cpp (int8: integer
  products by AVX-512 VNNI, x carried in int16);
- `decode_attention_bf16` (csrc/decode_attention_bf16.cpp): a decode step's few queries over the paged
  cache through the block tables, as kernels/decode_attention.py on CUDA (same arguments, same
  definition: decode_attention_reference), with no gathered keys and no mask tensors: scores 16 keys at
  a time, its own vector e^x (BENCHMARKS.md "Leaner decode kernels and no guard lookup");
- `dense_layer_bf16` (csrc/dense_layer_bf16.cpp): a whole dense decoder layer of a decode step (norms,
  products, rotary, the cache write, attention, SwiGLU, residuals) as one call, composed of the two kernels
  above (csrc/kernels.h) and row-wise vector code: a compiled step made about 12 calls from its Python per
  layer (BENCHMARKS.md "One call a decoder layer").

They share csrc/avx512_bf16.h (bf16 loads, the sum of 16 registers' lanes, e^x), csrc/kernels.h and, with
the AVX2 attention op below, csrc/paged_keys.h (which cache entries each query sees). Every build's name
hashes every header of csrc/ and csrc_avx2/: a change to any of them is a new build.

Where they cannot run (no AVX-512 BF16 and VNNI, no C++ compiler or ninja, REDLINE_CPU_KERNELS=0, a failed
build), `load()` is False and layers/backends.py keeps torch's and inductor's paths. On CPUs with AVX2,
`load_avx2()` builds two more ops for the fp32 and bf16 models those kernels do not take (both dtypes on
CPUs without AVX-512 BF16, fp32 on those with it), sharing csrc_avx2/avx2.h; an fp32 or bf16 model's
first start on a machine builds them (about 30 s):

- `quantized_rows` (csrc_avx2/quantized_rows_avx2.cpp): int4 and int8 weights in the same layout times
  rows, in integer products as the VNNI kernel's (layers/linear.quantized_product), so that quantized
  weights are read as codes there too;
- `decode_attention` (csrc_avx2/decode_attention_avx2.cpp): decode_attention_bf16's function, 8 keys at a
  time, for head_dim a multiple of 8 up to 256 (BENCHMARKS.md "Decode attention on AVX2").
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from redline.kernels.attention_core import attention_by_reductions, step_mask, tree_visible
from redline.kernels.packed_layout import is_packed, out_features
from redline.kernels.paged_kv import gather_blocks
from redline.kernels.quantized_layout import dequantize, is_quantized

CSRC, CSRC_AVX2 = Path(__file__).parent / "csrc", Path(__file__).parent / "csrc_avx2"
SOURCES = sorted(CSRC.glob("*.cpp"))
AVX2_SOURCES = sorted(CSRC_AVX2.glob("*.cpp"))  # include csrc/*.h too
HEADERS = sorted([*CSRC.glob("*.h"), *CSRC_AVX2.glob("*.h")])  # part of every build's name
# -ffp-contract=off: a * b + c rounds twice, as torch and inductor round it (g++ fuses it into one FMA by
# default, which moved the one-call layer's rotary off torch's)
BASE_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
FLAGS = [*BASE_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni"]
AVX2_FLAGS = [*BASE_FLAGS, "-mavx2", "-mfma", "-mf16c"]
STALE_LOCK_S = 600  # a build takes well under a minute: an older lock was left by a killed process
_avx2_loaded = False  # load_avx2() built and loaded the AVX2 ops: read by quantized_rows_loaded()


def extension_name(
    sources: list[Path] = SOURCES, flags: list[str] = FLAGS, stem: str = "redline_cpu_ops"
) -> str:
    """One build per torch version and source: a build against another torch's headers may not load, and
    two checkouts with different sources must not rebuild over each other."""
    files = b"".join(s.read_bytes() for s in sources + HEADERS)
    digest = hashlib.sha256(files + " ".join(flags).encode()).hexdigest()
    version = re.sub(r"\W", "_", torch.__version__)
    return f"{stem}_{version}_{digest[:10]}"


def _ninja_beside_python() -> None:
    """pip's ninja sits beside the interpreter, which need not be on PATH (.venv/bin/python run directly)."""
    here = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if here not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([path, here]) if path else here


def avx512_bf16_and_vnni() -> bool:
    """Both, as every CPU with AVX-512 BF16 has (Cooper Lake, Sapphire Rapids, Zen 4): int8 products are
    VNNI's."""
    return torch.cpu._is_avx512_bf16_supported() and torch.cpu._is_vnni_supported()


def avx2() -> bool:
    """AVX2 and FMA (torch's AVX2 capability; every such CPU has F16C) or AVX-512."""
    return torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512"))


def available(instructions: bool | None = None) -> bool:
    """Whether the kernels can be built here: the instructions (default: AVX-512 BF16 and VNNI's), a C++
    compiler and ninja, and REDLINE_CPU_KERNELS not 0."""
    from torch.utils.cpp_extension import is_ninja_available

    instructions = avx512_bf16_and_vnni() if instructions is None else instructions
    if os.environ.get("REDLINE_CPU_KERNELS", "1") == "0" or not instructions:
        return False
    _ninja_beside_python()
    return shutil.which(os.environ.get("CXX", "c++")) is not None and is_ninja_available()


def _wait_for_lock(lock: Path) -> None:
    """torch's builder holds `lock` while it builds (every process takes it, for ninja's check) and waits
    for it with no time limit: wait up to STALE_LOCK_S from its last change, then take it as left by a
    process that was killed, and remove it."""
    if lock.exists():
        print(f"redline: waiting for {lock} (another process building the CPU kernels)", file=sys.stderr)
    while lock.exists():
        try:
            if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
                warnings.warn(f"redline: removing {lock}, left by a build that did not finish", stacklevel=3)
                lock.unlink(missing_ok=True)
        except FileNotFoundError:
            return
        time.sleep(0.5)


def _build(name: str, sources: list[Path], flags: list[str], what: str) -> bool:
    """Builds (10-30 s, the first time on a machine) and loads the extension `name`; False, warned, where
    the build fails."""
    from torch.utils.cpp_extension import _get_build_directory
    from torch.utils.cpp_extension import load as build

    start = time.perf_counter()
    try:
        directory = Path(_get_build_directory(name, verbose=False))
        built = (directory / f"{name}.so").exists()
        if not built:
            print(f"redline: building the {what} (once per machine, ~30 s)", file=sys.stderr)
        _wait_for_lock(directory / "lock")
        build(
            name,
            [str(s) for s in sources],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except (RuntimeError, OSError) as error:  # a compiler that rejects the flags, a read-only cache
        warnings.warn(f"redline: the {what} did not build ({error})", stacklevel=3)
        return False
    if not built:
        print(f"redline: built the {what} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return True


@functools.cache
def load() -> bool:
    """Builds (the first time on a machine) and loads the AVX-512 BF16 ops; False where they cannot."""
    if not available() or not _build(extension_name(), SOURCES, FLAGS, "AVX-512 BF16 decode kernels"):
        return False
    torch.library.register_fake("redline_cpu::few_rows_bf16")(
        lambda x, w: x.new_empty(x.shape[0], out_features(w))  # [M, K], [N, K] or packed -> [M, N]
    )
    torch.library.register_fake("redline_cpu::decode_attention_bf16")(
        lambda q, *_: q.new_empty(q.shape)  # [B, T, Hq, D]
    )
    torch.library.register_fake("redline_cpu::dense_layer_bf16")(lambda x, *_: x.new_empty(x.shape))
    return True


@functools.cache
def load_avx2() -> bool:
    """Builds (the first time on a machine) and loads the AVX2 ops; False where they cannot."""
    global _avx2_loaded
    name = extension_name(AVX2_SOURCES, AVX2_FLAGS, "redline_cpu_avx2")
    if not AVX2_SOURCES or not available(avx2()):  # (an install without csrc_avx2/)
        return False
    if not _build(name, AVX2_SOURCES, AVX2_FLAGS, "AVX2 kernels (quantized weights, decode attention)"):
        return False
    torch.library.register_fake("redline_cpu_avx2::quantized_rows")(
        lambda x, w: x.new_empty(x.shape[0], out_features(w))  # [M, K], quantized -> [M, N]
    )
    torch.library.register_fake("redline_cpu_avx2::decode_attention")(
        lambda q, *_: q.new_empty(q.shape)  # [B, T, Hq, D]
    )
    _avx2_loaded = True
    return True


def quantized_kernel(dtype: torch.dtype) -> bool:
    """Whether a C++ kernel here multiplies quantized weights for a model in dtype: AVX2's (fp32 or bf16,
    linear.quantized_product) or AVX-512 BF16's (bf16, where the backends pack weights); loads them. AVX2's
    is loaded first, so a bf16 model whose backends do not pack weights still has it."""
    avx2 = dtype in (torch.float32, torch.bfloat16) and load_avx2()
    return avx2 or (dtype == torch.bfloat16 and load())


def quantized_rows_loaded() -> bool:
    """Whether load_avx2() has loaded the AVX2 ops (quantized_rows among them): a plain read, which a
    compiled graph traces as a constant."""
    return _avx2_loaded


def quantized_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [M, K] fp32 / bf16 -> [M, N]
    """x @ weight^T for a quantized weight (quantized_layout.py) by the AVX2 op (load_avx2() first)."""
    return torch.ops.redline_cpu_avx2.quantized_rows(x.contiguous(), weight)


def few_rows_bf16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [M, K], weight -> [M, N]
    """x @ weight^T for a weight [N, K], packed (packed_layout.py) or quantized (quantized_layout.py); packed
    and quantized weights take any number of rows."""
    if is_quantized(weight) and x.dtype != torch.bfloat16:  # a model computing in another dtype
        return F.linear(x, dequantize(weight).to(x.dtype))
    if is_packed(weight) and x.dtype != torch.bfloat16:
        raise ValueError(f"a packed bf16 weight multiplies bf16 rows, not {x.dtype}")
    if is_quantized(weight):
        return torch.ops.redline_cpu.few_rows_bf16(x.contiguous(), weight)
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:  # a layer kept in another dtype
        return F.linear(x, weight)
    return torch.ops.redline_cpu.few_rows_bf16(x.contiguous(), weight.contiguous())


def decode_attention_bf16(
    q: torch.Tensor,  # [B, T, Hq, D]
    k_cache: torch.Tensor,  # [blocks, Hkv, BLOCK, D]
    v_cache: torch.Tensor,
    positions: torch.Tensor,  # [B, T] absolute positions of the queries
    tables: torch.Tensor,  # [B, blocks per sequence] int32
    kv_len: int,
    chunk: int = 0,  # attention chunk size (0: none)
    tree_base: torch.Tensor | None = None,  # [B] with tree_bits [B, T]: a token tree's mask (tree_visible)
    tree_bits: torch.Tensor | None = None,
) -> torch.Tensor:  # [B, T, Hq, D]
    """decode_attention_reference's result. An FP8 cache or a head_dim that is not a multiple of 32 up to
    256 takes the path the kernel replaces: the gathered cache through attention_by_reductions (SDPA
    outside a graph)."""
    bf16 = all(t.dtype == torch.bfloat16 for t in (q, k_cache, v_cache))
    if bf16 and q.shape[-1] % 32 == 0 and q.shape[-1] <= 256:
        kernel = torch.ops.redline_cpu.decode_attention_bf16
        return kernel(q, k_cache, v_cache, positions, tables, kv_len, chunk, tree_base, tree_bits)
    return gathered_attention(q, k_cache, v_cache, positions, tables, kv_len, chunk, tree_base, tree_bits)


def decode_attention_avx2(
    q: torch.Tensor,  # [B, T, Hq, D] fp32 or bf16
    k_cache: torch.Tensor,  # [blocks, Hkv, BLOCK, D] in q's dtype
    v_cache: torch.Tensor,
    positions: torch.Tensor,  # [B, T] absolute positions of the queries
    tables: torch.Tensor,  # [B, blocks per sequence] int32
    kv_len: int,
    chunk: int = 0,  # attention chunk size (0: none)
    tree_base: torch.Tensor | None = None,  # [B] with tree_bits [B, T]: a token tree's mask (tree_visible)
    tree_bits: torch.Tensor | None = None,
) -> torch.Tensor:  # [B, T, Hq, D]
    """decode_attention_reference's result by the AVX2 op (load_avx2() first). What it does not take goes
    through the gathered cache: q in neither fp32 nor bf16, a cache in another dtype than q's (FP8), a
    head_dim that is not a multiple of 8 up to 256."""
    d, dtype = q.shape[-1], q.dtype
    same = k_cache.dtype == dtype and v_cache.dtype == dtype
    if dtype in (torch.float32, torch.bfloat16) and same and d % 8 == 0 and d <= 256:
        kernel = torch.ops.redline_cpu_avx2.decode_attention
        return kernel(q, k_cache, v_cache, positions, tables, kv_len, chunk, tree_base, tree_bits)
    return gathered_attention(q, k_cache, v_cache, positions, tables, kv_len, chunk, tree_base, tree_bits)


def gathered_attention(
    q: torch.Tensor,  # [B, T, Hq, D]
    k_cache: torch.Tensor,  # [blocks, Hkv, BLOCK, D]
    v_cache: torch.Tensor,
    positions: torch.Tensor,  # [B, T]
    tables: torch.Tensor,  # [B, blocks per sequence] int32
    kv_len: int,
    chunk: int,
    tree_base: torch.Tensor | None,  # [B] with tree_bits [B, T], or None
    tree_bits: torch.Tensor | None,
) -> torch.Tensor:  # [B, T, Hq, D]
    """What the decode kernels replace: the gathered cache through attention_by_reductions (SDPA outside a
    graph), under the step's or the tree's mask."""
    keys, values = (gather_blocks(c, tables, kv_len).to(q.dtype) for c in (k_cache, v_cache))
    if tree_base is not None and tree_bits is not None:
        key_positions = torch.arange(kv_len, device=q.device)[None, None, None]
        mask = tree_visible(key_positions, tree_base, tree_bits, chunk)
        return attention_by_reductions(q, keys, values, mask)
    return attention_by_reductions(q, keys, values, step_mask(positions, kv_len, chunk))


def dense_layer_bf16(
    x: torch.Tensor,  # [B, T, H]
    k_cache: torch.Tensor,  # [blocks, Hkv, BLOCK, D], written at the positions
    v_cache: torch.Tensor,
    positions: torch.Tensor,  # [B, T]
    tables: torch.Tensor,  # [B, blocks per sequence] int32
    kv_len: int,
    chunk: int,
    cos: torch.Tensor,  # [B, T, 1, D // 2] fp32
    sin: torch.Tensor,
    interleaved: bool,  # rotary pairs (2i, 2i + 1), else (i, i + D / 2)
    weights: tuple[torch.Tensor, ...],  # input norm [H], qkv [(Hq + 2 Hkv) D, H], o [H, Hq D], post norm [H],
    #                                     gate_up [2I, H], down [H, I]
    eps: float,
    heads: int,  # Hq
    tree_base: torch.Tensor | None = None,  # [B] with tree_bits [B, T]: the rows are a token tree, at their
    tree_bits: torch.Tensor | None = None,  # slots (the positions), under its mask
) -> torch.Tensor:  # [B, T, H]
    """models/llama.DecoderLayer's output for a dense rotary layer at a decode step, in one call; the new keys
    and values go to the caches at their positions through the tables."""
    return torch.ops.redline_cpu.dense_layer_bf16(
        x, k_cache, v_cache, positions, tables, kv_len, chunk, cos, sin, interleaved, *weights, eps, heads,
        tree_base, tree_bits,
    )  # fmt: skip
