"""Load safetensors checkpoints (single file or Hugging Face shards) into an nn.Module tensor by tensor."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

INDEX_FILE = "model.safetensors.index.json"
_MAX_LISTED = 10


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into the model; the message names the file and tensor."""


@contextmanager
def _open_safetensors(path: Path) -> Iterator[Any]:
    try:
        handle = safe_open(path, framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file: {e}") from e
    with handle:
        yield handle


def _read_index(index_path: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index_path}: unreadable checkpoint index: {e!r}") from e
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to file names")
    files = {name: index_path.parent / name for name in set(weight_map.values())}
    missing = sorted(name for name, path in files.items() if not path.is_file())
    if missing:
        raise CheckpointError(f"{index_path}: shards listed in the index are missing on disk: {missing}")
    return {key: files[name] for key, name in weight_map.items()}


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Map every checkpoint key to the safetensors file holding it."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        return _read_index(index_path)
    paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise CheckpointError(f"no *.safetensors in {model_dir}")
    key_to_file: dict[str, Path] = {}
    for path in paths:
        with _open_safetensors(path) as handle:
            keys = handle.keys()  # the safe_open handle is not iterable
            for key in keys:
                if key in key_to_file:
                    raise CheckpointError(f"tensor {key!r} is in both {key_to_file[key]} and {path}")
                key_to_file[key] = path
    return key_to_file


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


def _target_dtype(on_disk: torch.dtype, dtype: torch.dtype, key: str) -> torch.dtype:
    """Floating tensors are cast to `dtype`; integer, bool and 8-bit float (FP8) tensors, and FP8 scales
    (`*_scale`, fp32 on disk: a bf16 scale would add 0.4% error to every weight), keep their dtype."""
    if on_disk.is_floating_point and on_disk.itemsize > 1 and not key.endswith("_scale"):
        return dtype
    return on_disk


def _listing(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:_MAX_LISTED])
    return f"{len(keys)} keys: {shown}" + (", ..." if len(keys) > _MAX_LISTED else "")


def _plan(
    key_to_file: dict[str, Path],
    rename: Callable[[str], str | None],
    expected: set[str],
    optional: set[str],
    model_dir: Path,
) -> dict[Path, list[tuple[str, str]]]:
    """Group (checkpoint key, module key) pairs by file, rejecting missing, unexpected and duplicate keys."""
    by_file: dict[Path, list[tuple[str, str]]] = {}
    source: dict[str, tuple[Path, str]] = {}
    unexpected: list[str] = []
    for key, path in key_to_file.items():
        module_key = rename(key)
        if module_key is None:
            continue
        if module_key not in expected and module_key not in optional:
            unexpected.append(f"{key!r} -> {module_key!r} in {path.name}")
            continue
        if module_key in source:
            other_path, other_key = source[module_key]
            raise CheckpointError(
                f"{model_dir}: {other_key!r} ({other_path.name}) and {key!r} ({path.name}) "
                f"both load into {module_key!r}"
            )
        source[module_key] = (path, key)
        by_file.setdefault(path, []).append((key, module_key))
    if unexpected:
        raise CheckpointError(f"{model_dir}: unexpected tensors in checkpoint: {'; '.join(unexpected)}")
    missing = expected - optional - source.keys()
    if missing:
        raise CheckpointError(f"{model_dir}: checkpoint lacks {_listing(missing)}")
    return by_file


def _check_shapes(model: torch.nn.Module, by_file: dict[Path, list[tuple[str, str]]]) -> None:
    for path, pairs in by_file.items():
        with _open_safetensors(path) as handle:
            for key, module_key in pairs:
                try:
                    shape = tuple(handle.get_slice(key).get_shape())
                except SafetensorError as e:
                    raise CheckpointError(f"{path}: cannot read header of tensor {key!r}: {e}") from e
                expected_shape = tuple(_module_tensor(model, module_key)[2].shape)
                if shape != expected_shape:
                    raise CheckpointError(
                        f"{path}: tensor {key!r} has shape {list(shape)} but module key {module_key!r} "
                        f"expects {list(expected_shape)}"
                    )


def load_weights(
    model: torch.nn.Module,
    model_dir: str | Path,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    rename: Callable[[str], str | None] = lambda key: key,
    expected: Iterable[str] | None = None,
    optional: Iterable[str] = (),
    progress: bool = True,
) -> set[str]:
    """Replace the model's parameters and buffers with checkpoint tensors; returns the module keys loaded.

    All names and shapes are validated from the safetensors headers before any tensor data is read.
    """
    model_dir = Path(model_dir)
    expected_keys = set(model.state_dict().keys() if expected is None else expected)
    by_file = _plan(checkpoint_files(model_dir), rename, expected_keys, set(optional), model_dir)
    _check_shapes(model, by_file)
    loaded: set[str] = set()
    with tqdm(total=sum(map(len, by_file.values())), desc="loading weights", disable=not progress) as bar:
        for path, pairs in by_file.items():
            with _open_safetensors(path) as handle:
                for key, module_key in pairs:
                    try:
                        tensor = handle.get_tensor(key)
                    except SafetensorError as e:
                        raise CheckpointError(f"{path}: cannot read data of tensor {key!r}: {e}") from e
                    tensor = tensor.to(device=device, dtype=_target_dtype(tensor.dtype, dtype, module_key))
                    _install(model, module_key, tensor)
                    loaded.add(module_key)
                    bar.update()
    return loaded


def _shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for key, tensor in tensors.items():
        if shards[-1] and shard_bytes + tensor.nbytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][key] = tensor
        shard_bytes += tensor.nbytes
    return shards


def save_weights(
    tensors: dict[str, torch.Tensor], model_dir: Path, max_shard_bytes: int | None = None
) -> None:
    """Write model.safetensors, or HF-style shards plus an index when larger than max_shard_bytes."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    to_save: dict[str, torch.Tensor] = {}
    seen_storages: set[int] = set()
    for key, tensor in tensors.items():
        tensor = tensor.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen_storages:  # tied weights: safetensors refuses tensors sharing memory
            tensor = tensor.clone()
        seen_storages.add(tensor.untyped_storage().data_ptr())
        to_save[key] = tensor
    total_size = sum(t.nbytes for t in to_save.values())
    if max_shard_bytes is None or total_size <= max_shard_bytes:
        save_file(to_save, model_dir / "model.safetensors", metadata={"format": "pt"})
        return
    shards = _shards(to_save, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for number, shard in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, model_dir / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (model_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
