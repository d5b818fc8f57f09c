"""Load a checkpoint (safetensors or PyTorch .bin, single file or shards) into an nn.Module tensor by tensor.

Every name, shape and FP8-ness is checked against the model from the file headers before any tensor
data is read; errors name the file and the tensor. A checkpoint tensor fills a whole module tensor, or a
`Part` of one (Llama 4 checkpoints that store each expert's projections apart from the others).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm import tqdm

from redline.models.shards import ShardWriter
from redline.models.tensor_files import CheckpointError, checkpoint_files, open_tensor_file
from redline.parallel.sharding import Shard

_MAX_LISTED = 10


@dataclass(frozen=True)
class Part:
    """A checkpoint tensor that fills module_tensor[index], transposed first when `transpose`.

    Example: experts.3.up_proj.weight [I, H] (nn.Linear, [out, in]) is
    Part("...experts.gate_up_proj", (3, slice(None), slice(I, 2 * I)), transpose=True): gate_up_proj[3, :, I:]
    is [H, I], the x @ W orientation."""

    module_key: str
    index: tuple[int | slice, ...]
    transpose: bool = False
    shard: Shard | None = None  # what a tensor-parallel rank reads of the checkpoint tensor (None: all)


Rename = Callable[[str], str | Part | None]  # checkpoint key -> module key, a Part, or None to skip it
ShardOf = Callable[[str], Shard | None]  # module key -> what this rank reads of it (None: all of it)


class LoadHook(Protocol):
    """Lets a caller transform modules while they load (quantization on load, models/quantize.py)."""

    def dtype(self, module_key: str, on_disk: torch.dtype, default: torch.dtype) -> torch.dtype:
        """The dtype a tensor is installed in; `default` is what the loader would pick."""

    def loaded(self, module_key: str) -> None:
        """Called once the module tensor is complete (every Part of it installed)."""


class PendingModules:
    """The modules a hook replaces once all their tensors are in (models/quantize.QuantizeOnLoad,
    models/int_checkpoint.IntCheckpointLoad), each with the keys it still waits for."""

    def __init__(self) -> None:
        self._pending: dict[str, tuple[torch.nn.Module, str, set[str]]] = {}  # name: parent, attribute, keys

    def add(self, name: str, parent: torch.nn.Module, attribute: str, keys: set[str]) -> None:
        self._pending[name] = (parent, attribute, keys)

    def module(self, name: str) -> torch.nn.Module | None:  # a module still waiting, by name
        return getattr(*self._pending[name][:2]) if name in self._pending else None

    def complete(self, module_key: str) -> tuple[torch.nn.Module, str, str] | None:
        """module_key is in: (parent, attribute, name) of its module when that was its last tensor."""
        name = module_key.rpartition(".")[0]
        if name not in self._pending:
            return None
        parent, attribute, keys = self._pending[name]
        keys.discard(module_key)
        if keys:
            return None
        del self._pending[name]
        return parent, attribute, name


@dataclass(frozen=True)
class _Source:
    path: Path
    key: str
    part: Part


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def _target_dtype(
    on_disk: torch.dtype, dtype: torch.dtype, module_key: str, hook: LoadHook | None
) -> torch.dtype:
    """Floating tensors are cast to `dtype`; FP8 scales (`*_scale`; bf16 in many releases) to fp32, which
    is exact, since a bf16 scale would add 0.4% error to every weight; integer, bool and 8-bit float
    tensors keep their dtype. A hook has the last word."""
    keep = not on_disk.is_floating_point or _is_fp8(on_disk)
    default = on_disk if keep else torch.float32 if module_key.endswith("_scale") else dtype
    return default if hook is None else hook.dtype(module_key, on_disk, default)


def _listing(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:_MAX_LISTED])
    return f"{len(keys)} keys: {shown}" + (", ..." if len(keys) > _MAX_LISTED else "")


def _module_tensor(model: torch.nn.Module, module_key: str) -> tuple[torch.nn.Module, str, torch.Tensor]:
    """The submodule owning `module_key`, the attribute name there, and its current tensor."""
    module_name, _, attr = module_key.rpartition(".")
    module = model.get_submodule(module_name)
    tensor = module._parameters.get(attr, module._buffers.get(attr))
    if tensor is None:
        raise ValueError(f"model has no parameter or buffer {module_key!r}")
    return module, attr, tensor


def _install(model: torch.nn.Module, module_key: str, tensor: torch.Tensor) -> None:
    module, attr, _ = _module_tensor(model, module_key)
    if attr in module._parameters:
        module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[attr] = tensor  # keeps the buffer's persistent flag


def _fits(on_disk: tuple[int, ...], region: tuple[int, ...], part: Part) -> bool:
    """Equal shapes, or shapes that differ only in size-1 dimensions (a per-tensor scale stored as [] for
    [1], a per-channel [I, 1] for [1, I]); one value also fills a Part of a scale tensor (a per-tensor
    scale of one expert's projection broadcast over that expert's per-channel slots)."""
    squeeze = lambda shape: tuple(d for d in shape if d != 1)
    if on_disk == region or squeeze(on_disk) == squeeze(region):
        return True
    broadcast = bool(part.index) and part.module_key.endswith("_scale")
    return broadcast and torch.Size(on_disk).numel() == 1


def _shaped(tensor: torch.Tensor, part: Part, region: tuple[int, ...]) -> torch.Tensor:
    tensor = tensor.t() if part.transpose else tensor
    return tensor.reshape(region) if tensor.numel() == torch.Size(region).numel() else tensor.expand(region)


def _plan(
    key_to_file: dict[str, Path], rename: Rename, expected: set[str], optional: set[str], model_dir: Path
) -> dict[str, list[_Source]]:
    """The checkpoint tensors of each module key; rejects missing, unexpected and doubly loaded keys."""
    sources: dict[str, dict[tuple, _Source]] = {}  # module key -> {index as a hashable tuple: source}
    unexpected: list[str] = []
    for key, path in key_to_file.items():
        target = rename(key)
        if target is None:
            continue
        part = target if isinstance(target, Part) else Part(target, ())
        if part.module_key not in expected and part.module_key not in optional:
            unexpected.append(f"{key!r} -> {part.module_key!r} in {path.name}")
            continue
        group = sources.setdefault(part.module_key, {})
        slot = tuple((i.start, i.stop, i.step) if isinstance(i, slice) else i for i in part.index)
        whole_clash = group and (not slot or () in group)  # a whole tensor and anything else
        clash = group.get(slot) or (next(iter(group.values())) if whole_clash else None)
        if clash is not None:
            raise CheckpointError(
                f"{model_dir}: {clash.key!r} ({clash.path.name}) and {key!r} ({path.name}) "
                f"both load into {part.module_key!r}"
            )
        group[slot] = _Source(path, key, part)
    if unexpected:
        raise CheckpointError(f"{model_dir}: unexpected tensors in checkpoint: {'; '.join(unexpected)}")
    missing = expected - optional - sources.keys()
    if missing:
        raise CheckpointError(f"{model_dir}: checkpoint lacks {_listing(missing)}")
    return {module_key: list(group.values()) for module_key, group in sources.items()}


def _source_shard(source: _Source, shard_of: ShardOf | None, on_disk: tuple[int, ...]) -> Shard | None:
    """What a tensor-parallel rank reads of a checkpoint tensor: a Part's own shard, or shard_of its
    module key. A scale holding one value (per tensor) is the same on every rank: read whole."""
    part = source.part
    if part.module_key.endswith("_scale") and torch.Size(on_disk).numel() == 1:
        return None
    if part.index:
        return part.shard
    return shard_of(part.module_key) if shard_of else None


def _rank_shape(shape: tuple[int, ...], shard: Shard | None, where: str) -> tuple[int, ...]:
    """The shape of what a tensor-parallel rank reads of a tensor of `shape`."""
    if shard is None or shard.zeroed:
        return shape
    if len(shard.index) > len(shape):
        raise CheckpointError(f"{where} has shape {list(shape)}: too few dimensions to split over ranks")
    return tuple(_take(torch.empty(shape, device="meta").__getitem__, shard).shape)


def _check_headers(
    model: torch.nn.Module, by_file: dict[Path, list[_Source]], shard_of: ShardOf | None
) -> None:
    """Shapes (of this rank's shard) and FP8 vs high precision, from the file headers."""
    for path, group in by_file.items():
        with open_tensor_file(path) as file:
            for source in group:
                module_key, part = source.part.module_key, source.part
                target = _module_tensor(model, module_key)[2]
                region = tuple(torch.empty(target.shape, device="meta")[part.index].shape)
                shard = _source_shard(source, shard_of, file.shape(source.key))
                shape = _rank_shape(file.shape(source.key), shard, f"{path}: tensor {source.key!r}")
                shape = shape[::-1] if part.transpose else shape
                if not _fits(shape, region, part):
                    where = f" at [{', '.join(map(_index_text, part.index))}]" if part.index else ""
                    raise CheckpointError(
                        f"{path}: tensor {source.key!r} has shape {list(shape)}"
                        f"{' (transposed)' if part.transpose else ''} but module key {module_key!r}{where} "
                        f"expects {list(region)}"
                    )
                on_disk = file.dtype(source.key)
                if _is_fp8(on_disk) != _is_fp8(target.dtype):
                    raise CheckpointError(
                        f"{path}: tensor {source.key!r} is {on_disk} but module key {module_key!r} is "
                        f"{target.dtype}: the checkpoint's FP8 layers differ from what config.json's "
                        "quantization_config describes"
                    )


def _index_text(i: int | slice) -> str:
    return str(i) if isinstance(i, int) else ":".join("" if v is None else str(v) for v in (i.start, i.stop))


def check_checkpoint(
    model: torch.nn.Module,
    model_dir: str | Path,
    *,
    rename: Rename = lambda key: key,
    optional: Iterable[str] = (),
    shard_of: ShardOf | None = None,
) -> dict[Path, list[_Source]]:
    """What load_weights checks before reading any data (names, shapes, FP8-ness, and complete coverage of
    module tensors assembled from Parts), without loading; returns the tensors to load, by file."""
    model_dir = Path(model_dir)
    sources = _plan(checkpoint_files(model_dir), rename, set(model.state_dict()), set(optional), model_dir)
    by_file: dict[Path, list[_Source]] = {}
    for source in (source for group in sources.values() for source in group):
        by_file.setdefault(source.path, []).append(source)
    _check_headers(model, by_file, shard_of)
    for module_key, group in sources.items():
        if group[0].part.index:
            target = _module_tensor(model, module_key)[2]
            covered = sum(torch.empty(target.shape, device="meta")[s.part.index].numel() for s in group)
            if covered != target.numel():
                raise CheckpointError(
                    f"{model_dir}: {module_key!r} is assembled from {len(group)} checkpoint tensors "
                    f"({_listing(s.key for s in group)}) that cover {covered} of its {target.numel()} values"
                )
    return by_file


def load_weights(
    model: torch.nn.Module,
    model_dir: str | Path,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    rename: Rename = lambda key: key,
    optional: Iterable[str] = (),
    hook: LoadHook | None = None,
    progress: bool = True,
    shard_of: ShardOf | None = None,
) -> set[str]:
    """Replace the model's parameters and buffers with checkpoint tensors; returns the module keys loaded.

    Reads one file at a time and one tensor at a time. A module tensor assembled from Parts is allocated
    when its first Part arrives and filled in place. With `shard_of` (tensor parallelism) a rank reads
    only its shard of each split tensor: safetensors slices read just those bytes."""
    by_file = check_checkpoint(model, model_dir, rename=rename, optional=optional, shard_of=shard_of)
    parts = Counter(source.part.module_key for group in by_file.values() for source in group)
    remaining = parts.copy()  # Parts still to come
    with tqdm(total=parts.total(), desc="loading weights", disable=not progress) as bar:
        for path, group in by_file.items():
            with open_tensor_file(path) as file:
                for source in group:
                    shard = _source_shard(source, shard_of, file.shape(source.key))
                    tensor = file.read(source.key) if shard is None else _read_shard(file, source.key, shard)
                    module_key = source.part.module_key
                    first = remaining[module_key] == parts[module_key]
                    target_dtype = _target_dtype(tensor.dtype, dtype, module_key, hook)
                    _load_one(model, tensor, source.part, target_dtype, device, first)
                    remaining[module_key] -= 1
                    if remaining[module_key] == 0 and hook is not None:
                        hook.loaded(module_key)
                    bar.update()
    return set(parts)


def _take(read: Callable[[tuple[slice, ...]], torch.Tensor], shard: Shard) -> torch.Tensor:
    """read(shard.index), joined along the last dimension with read(shard.also) when there is one, and
    padded with zero rows up to shard.rows."""
    part = read(shard.index) if shard.also is None else torch.cat((read(shard.index), read(shard.also)), -1)
    if shard.rows is not None and part.shape[0] < shard.rows:
        part = torch.cat((part, part.new_zeros(shard.rows - part.shape[0], *part.shape[1:])))
    return part


def _read_shard(file: Any, key: str, shard: Shard) -> torch.Tensor:
    """This rank's shard of tensor `key` of an open file, reading only its bytes."""
    if shard.zeroed:
        return torch.zeros(file.shape(key), dtype=file.dtype(key))
    return _take(lambda index: file.read_slice(key, index), shard)


def _load_one(
    model: torch.nn.Module,
    tensor: torch.Tensor,
    part: Part,
    dtype: torch.dtype,
    device: torch.device | str,
    first: bool,
) -> None:
    """Installs a whole module tensor, or copies a Part into its module tensor (allocated at the first)."""
    current = _module_tensor(model, part.module_key)[2]
    if not part.index:
        # a copy even where dtype and device match: the model must own its memory, not map the file
        # (which would stay mapped, and resident, as long as any of its tensors lives)
        value = _shaped(tensor, part, tuple(current.shape)).to(device, dtype, copy=True)
        return _install(model, part.module_key, value)
    if first:
        current = torch.empty(current.shape, dtype=dtype, device=device)
        _install(model, part.module_key, current)
    region = current[part.index]
    region.copy_(_shaped(tensor, part, tuple(region.shape)))


def save_weights(
    tensors: dict[str, torch.Tensor], model_dir: Path, max_shard_bytes: int | None = None
) -> None:
    """Write model.safetensors, or HF-style shards plus an index when larger than max_shard_bytes."""
    writer = ShardWriter(Path(model_dir), max_shard_bytes)
    for key, tensor in tensors.items():
        writer.add(key, tensor)
    writer.finish()
