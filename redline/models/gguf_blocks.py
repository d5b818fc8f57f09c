"""A GGUF file's quantized tensors in the CPU kernel's layout (kernels/quantized_layout.py), for
`quantization="gguf"`: the file's own weights, read from its blocks, never as a bf16 copy.

| GGUF type                      | layout     | from the block                      |
|--------------------------------|------------|-------------------------------------|
| Q4_0 (d, 32 nibbles)           | int4 g32   | scale d, zero -8 d: exact           |
| Q4_1 (d, m, 32 nibbles)        | int4 g32   | scale d, zero m: exact              |
| Q8_0 (d, 32 int8)              | int8 g32   | codes + 128, zero -128 d: exact     |
| any other quantized type       | int4 g32 up to 5 bits a weight, else int8 g32: re-quantized from the    |
|                                | dequantized values (quantized_layout.quantize), its error reported    |
| F32, F16, BF16                 | not quantized: loaded as the model's dtype                            |

A block of 32 weights of one row is one group, fp16 d and m are the layout's fp16 scale and zero, and the
nibbles of Q4_0 / Q4_1 are in ggml's order: byte j holds weight j in its low nibble and weight j + 16 in
its high one. Example, Q4_1 block bytes [d, m, 0x21, ...]: weight 0 is 1 * d + m, weight 16 is 2 * d + m.
"""

from __future__ import annotations

import functools
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

from redline.config import ModelConfig
from redline.kernels import quantized_layout
from redline.models.gguf_reader import GGUFFile
from redline.models.gguf_tensors import dequantized, hf_name, hf_shape, unpermute_qk
from redline.parallel import sharding
from redline.parallel.group import SINGLE, TensorParallel
from redline.parallel.sharding import Shard

Q = gguf.GGMLQuantizationType
GROUP = 32  # weights a block: Q4_0's, Q4_1's, Q8_0's
HIGH_PRECISION = (Q.F32, Q.F16, Q.BF16)


@dataclass
class Requantized:
    """What re-quantizing a tensor cost, against the GGUF's own dequantized values."""

    name: str
    kind: str  # "Q6_K -> int8 g32"
    rms_error: float  # of the weights, relative to their rms

    def __str__(self) -> str:
        return f"{self.name}: {self.kind}, rms error {100 * self.rms_error:.2f}% of the weights' rms"


def fp16(blocks: np.ndarray, offset: int) -> torch.Tensor:  # [rows, blocks, bytes] -> [rows, blocks] fp32
    values = np.array(blocks[..., offset : offset + 2]).view(np.float16)[..., 0]
    return torch.from_numpy(values).float()


def exact_codes(
    tensor: gguf.ReaderTensor, rows: slice = slice(None)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(q [R, K] int32, scale, zero [R, K / 32], bits) of `rows` of a Q4_0, Q4_1 or Q8_0 tensor, rows as the
    file's."""
    n, k = hf_shape(tensor)
    blocks = np.asarray(tensor.data).reshape(n, k // GROUP, -1)[rows]  # [rows, blocks, block bytes]
    n = blocks.shape[0]
    scale = fp16(blocks, 0)
    if tensor.tensor_type == Q.Q8_0:  # codes 0 .. 255 in the layout: -128 d a power-of-two multiple, exact
        q = torch.from_numpy(np.array(blocks[..., 2:]).view(np.int8)).to(torch.int32)
        return q.reshape(n, k) + 128, scale, -128 * scale, 8
    start = 2 if tensor.tensor_type == Q.Q4_0 else 4
    nibbles = torch.from_numpy(np.array(blocks[..., start:])).to(torch.int32)  # [N, blocks, 16]
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).reshape(n, k)  # weights j and j + 16 of byte j
    zero = -8 * scale if tensor.tensor_type == Q.Q4_0 else fp16(blocks, 2)
    return q, scale, zero, 4


def natural_bits(kind: Q) -> int:
    """The layout a quantized type loads into: int4 up to 5 bits a weight with its scales (Q4_0 4.5, Q4_1 5,
    Q4_K 4.5, Q3_K, Q2_K, IQ4), else int8 (Q5_0 5.5, Q5_K 5.5, Q6_K 6.56, Q8_0 8.5)."""
    values, size = gguf.GGML_QUANT_SIZES[kind]
    return 4 if 8 * size / values <= 5 else 8


def gguf_weight(
    tensor: gguf.ReaderTensor, heads: int | None = None, bits: int | None = None, part: Shard | None = None
) -> tuple[torch.Tensor | None, Requantized | None]:
    """The tensor in the kernel's layout (its q_proj / k_proj rows back in HF order for `heads` heads) of
    `bits` (default: its natural_bits), and what re-quantizing cost where it was not exact; (None, None)
    for a high-precision tensor, or one whose rows or width the layout cannot take. part: a tensor-parallel
    rank's rows or inputs of it, in HF order (parallel/sharding.py; a vocabulary block padded with zero
    rows): blocks of 32 inputs stay whole where the rank's inputs start and end at multiples of 32."""
    shape, kind = hf_shape(tensor), tensor.tensor_type
    if kind in HIGH_PRECISION or len(shape) != 2:
        return None, None
    rows, cols, n = _span(shape, part)
    if n % quantized_layout.BLOCK_ROWS or cols.start % GROUP or cols.stop % GROUP:
        return None, None
    bits = bits or natural_bits(kind)

    def in_hf_order(t: torch.Tensor) -> torch.Tensor:  # [N, ...] GGUF rows -> HF rows
        return t if heads is None else unpermute_qk(t, heads)

    exact = kind in (Q.Q4_0, Q.Q4_1, Q.Q8_0) and bits == natural_bits(kind)
    if exact and heads is None:  # a head's table among them: its int32 codes a slice at a time
        return _exact_in_slices(tensor, rows, cols, n), None
    if exact:  # q or k: unpermuted whole, then cut
        q, scale, zero, bits = (in_hf_order(t) if torch.is_tensor(t) else t for t in exact_codes(tensor))
        return quantized_layout.to_blocks(*_cut(q, scale, zero, rows, cols, n), bits), None
    if heads is None:  # the part's rows alone: a rank's share of a head's table, not all of it in fp32
        values = _padded(dequantized(tensor, rows)[:, cols], n)
    else:
        values = _padded(in_hf_order(dequantized(tensor))[rows, cols], n)
    weight = quantized_layout.quantize(values, bits, GROUP)
    error = (quantized_layout.dequantize(weight) - values).pow(2).mean().sqrt() / values.pow(2).mean().sqrt()
    return weight, Requantized(tensor.name, f"{kind.name} -> int{bits} g{GROUP}", float(error))


def _span(shape: tuple[int, int], part: Shard | None) -> tuple[slice, slice, int]:
    """(rows, inputs, rows held) of a [N, K] weight that `part` takes (None: all): a column-parallel or
    vocabulary part's rows (its rows held padded to part.rows), a row-parallel part's inputs. Example,
    vocabulary 100 in blocks of 64, rank 1: rows [64, 100), inputs [0, K), 64 rows held."""
    everything = (slice(0, shape[0]), slice(0, shape[1]))
    if part is None:
        return *everything, shape[0]
    if len(part.index) == 1:
        rows = part.index[0]
        return slice(rows.start, min(rows.stop, shape[0])), everything[1], part.rows or rows.stop - rows.start
    return everything[0], part.index[1], shape[0]


def _padded(t: torch.Tensor, n: int) -> torch.Tensor:  # [R, ...] -> [n, ...], zero rows after
    return t if t.shape[0] == n else torch.cat((t, t.new_zeros(n - t.shape[0], *t.shape[1:])))


def _cut(
    q: torch.Tensor,  # [N, K] codes
    scale: torch.Tensor,  # [N, K / 32]
    zero: torch.Tensor,  # [N, K / 32]
    rows: slice,
    cols: slice,  # inputs, in whole blocks of 32
    n: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The codes, scales and zeros of rows x cols, padded to n rows of zero weights."""
    blocks = slice(cols.start // GROUP, cols.stop // GROUP)
    return _padded(q[rows, cols], n), _padded(scale[rows, blocks], n), _padded(zero[rows, blocks], n)


def _exact_in_slices(tensor: gguf.ReaderTensor, rows: slice, cols: slice, n: int) -> torch.Tensor:
    """exact_codes of rows x cols in the layout, padded to n rows, QUANTIZE_ROWS rows at a time into the
    result (SmolLM2's Q8_0 table as int32 codes whole: 113 MB of temporaries)."""
    step, whole = quantized_layout.QUANTIZE_ROWS, None
    for start in range(0, n, step):
        read = slice(rows.start + start, min(rows.start + start + step, rows.stop))
        q, scale, zero, bits = exact_codes(tensor, read)
        span = min(step, n - start)
        part = quantized_layout.to_blocks(*_cut(q, scale, zero, slice(None), cols, span), bits)
        if whole is None:
            whole = part.new_empty((n // quantized_layout.BLOCK_ROWS, *part.shape[1:]))
        whole[start // quantized_layout.BLOCK_ROWS :][: part.shape[0]] = part
    return whole


# multiplied as one weight each: the parts of (module, parts)
FUSED = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


class GgufWeights:
    """quantization "gguf" (models/quantize.QuantizeOnLoad's weight source): each decoder linear's weight is
    the file's own tensor in the kernel's layout (gguf_weight), installed before loading (`ahead`: the
    import's copy is not read) where the layout takes it, and
    on the kernel's path (`blocks`) the head by the file's output (or tied token_embd) tensor; what was
    re-quantized is reported once. The parts of a fused weight take one layout, the widest any needs (a
    Q4_K_M file's Q6_K v_proj makes its q and k int8), so that every layer keeps its one-call step. A
    tensor left as it is (F16, a shape the layout cannot take) is cast to the model's dtype."""

    def __init__(
        self, path: Path, config: ModelConfig, blocks: bool, dtype: torch.dtype, tp: TensorParallel = SINGLE
    ) -> None:
        self.file, self.blocks, self.dtype = GGUFFile(path), blocks, dtype
        self.part = functools.partial(sharding.shard_of, config, rank=tp.rank, size=tp.size,
                                      expert_parallel=tp.expert_parallel)  # fmt: skip
        self.heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
        self.names = {hf_name(name): name for name in self.file.tensors}  # HF name -> GGUF name
        self.bits: dict[str, int] = {}  # HF module name -> the layout its fused weight takes
        for layer, (module, parts) in itertools.product(range(config.num_layers), FUSED):
            names = [f"model.layers.{layer}.{module}.{part}" for part in parts]
            kinds = [self.file.tensors[self.names[f"{n}.weight"]].tensor_type for n in names]
            widest = max((natural_bits(k) for k in kinds if k not in HIGH_PRECISION), default=None)
            self.bits |= {n: widest for n in names if widest is not None}
        self.requantized: list[Requantized] = []
        self.unquantized: set[str] = set()  # quantized in the file, in the model's dtype here (their shape)

    def check(self, linear: nn.Module, name: str) -> None:
        """Nothing to refuse: a tensor the layout cannot take loads as the model's dtype."""

    def _weight(self, hf: str, heads: int | None = None, bits: int | None = None) -> torch.Tensor | None:
        tensor = self.file.tensors[self.names[hf]]
        weight, cost = gguf_weight(tensor, heads, bits, self.part(hf))
        self.requantized += [cost] if cost is not None else []
        if weight is None and tensor.tensor_type not in HIGH_PRECISION:
            self.unquantized.add(hf)
        return weight

    def ahead(self, linear: nn.Module, name: str) -> nn.Module | None:
        """Before loading: the linear with the file's own tensor where the layout takes it (its weight is then
        not read from the import: the bf16 copy never enters memory), else None."""
        if linear.bias is not None:
            return None
        weight = self._weight(f"{name}.weight", self.heads.get(name.rpartition(".")[2]), self.bits.get(name))
        if weight is None:
            return None
        if quantized_layout.shape_of(weight) != (linear.out_features, linear.in_features):
            shape = quantized_layout.shape_of(weight)
            raise ValueError(f"{self.file.path}: {name} is {shape} in the file, the config makes it "
                             f"{(linear.out_features, linear.in_features)}")  # fmt: skip
        linear.weight = nn.Parameter(weight, requires_grad=False)
        return linear

    def quantized(self, linear: nn.Module, name: str) -> nn.Module:
        heads = self.heads.get(name.rpartition(".")[2])
        weight = self._weight(f"{name}.weight", heads, self.bits.get(name))
        kept = linear.weight.detach().to(self.dtype)  # loaded in its on-disk dtype (QuantizeOnLoad.dtype)
        linear.weight = nn.Parameter(kept if weight is None else weight, requires_grad=False)
        return linear

    def head(self, head: torch.Tensor) -> torch.Tensor | None:  # the loaded head (unused: the file's is read)
        if not self.blocks:  # its lookup and product would dequantize the whole table at every call
            return None
        tied = "lm_head.weight" not in self.names
        return self._weight("model.embed_tokens.weight" if tied else "lm_head.weight")

    def report(self) -> None:
        """One line per kind of re-quantization on stderr, with its largest error, and one for the quantized
        tensors left in the model's dtype."""
        worst: dict[str, Requantized] = {}
        for cost in self.requantized:
            if cost.kind not in worst or cost.rms_error > worst[cost.kind].rms_error:
                worst[cost.kind] = cost
        for kind, cost in worst.items():
            count = sum(c.kind == kind for c in self.requantized)
            print(f"redline: {count} GGUF tensors re-quantized {kind}; the worst, {cost}", file=sys.stderr)
        if self.unquantized:  # rows or inputs not in whole blocks of 32 (a rank's part too)
            names = sorted(self.unquantized)
            print(f"redline: {len(names)} quantized GGUF tensors run in {self.dtype} (the layout takes whole "
                  f"blocks of 32 rows and inputs), such as {names[0]}", file=sys.stderr)  # fmt: skip
