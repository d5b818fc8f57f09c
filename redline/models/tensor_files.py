"""Checkpoint files of either format, read one tensor at a time: safetensors (single or sharded) and
PyTorch `.bin` state dicts (single or sharded, the original EAGLE-3 drafts and older Hugging Face
releases). A directory with both uses its safetensors.

`.bin` files are opened with `torch.load(map_location="cpu", weights_only=True, mmap=True)`: the
restricted unpickler refuses anything but tensors and plain containers, so a file that holds code is
an error and never runs; mmap leaves the data on disk until a tensor is read.

A safetensors tensor is read whole into memory of its own (not a view of the mapped file, whose pages
would count in the process's resident set until the file closes: SmolLM2's 270 MB import raised the peak
of an int4 load by as much), a slice through the mapping (only its bytes). A `.bin` tensor may be a view
of the mapped file: copy what must outlive the file.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import SafetensorError, safe_open

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_GLOB = "pytorch_model*.bin"  # not *.bin: training_args.bin and optimizer.bin are pickles of objects
# safetensors header dtype names (safe_open(...).get_slice(key).get_dtype())
_SAFETENSORS_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "BF16": torch.bfloat16,
    "F16": torch.float16, "F32": torch.float32, "F64": torch.float64, "BOOL": torch.bool,
    "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
}  # fmt: skip


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into the model; the message names the file and tensor."""


class SafetensorsFile:
    """The header and slices through safe_open's handle (which checks the header); whole tensors read."""

    def __init__(self, path: Path, handle, file: BinaryIO) -> None:
        self.path, self._handle, self._file = path, handle, file
        size = int.from_bytes(file.read(8), "little")  # the format: u64 header length, JSON header, data
        self._header, self._data = json.loads(file.read(size)), 8 + size

    def names(self) -> list[str]:
        return list(self._handle.keys())  # the safe_open handle is not iterable

    def _checked(self, what: str, key: str, read: Callable[[], Any]) -> Any:
        try:
            return read()
        except SafetensorError as e:
            raise CheckpointError(f"{self.path}: cannot read {what} of tensor {key!r}: {e}") from e

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._checked("header", key, lambda: self._handle.get_slice(key).get_shape()))

    def dtype(self, key: str) -> torch.dtype:
        name = self._handle.get_slice(key).get_dtype()
        if name not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{self.path}: tensor {key!r} has dtype {name}, which redline cannot read")
        return _SAFETENSORS_DTYPES[name]

    def read(self, key: str) -> torch.Tensor:
        tensor = torch.empty(self.shape(key), dtype=self.dtype(key))
        start, end = self._header[key]["data_offsets"]
        buffer = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        if end - start != len(buffer):
            raise CheckpointError(f"{self.path}: tensor {key!r} holds {end - start} bytes, not {len(buffer)}")
        self._file.seek(self._data + start)
        done = 0
        while done < len(buffer):  # a read returns at most ~2 GB
            count = self._file.readinto(buffer[done:])
            if not count:
                raise CheckpointError(f"{self.path}: the file ends inside tensor {key!r} (truncated)")
            done += count
        return tensor

    def read_slice(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        """tensor[index], reading only those bytes from the file."""
        return self._checked("data", key, lambda: self._handle.get_slice(key)[index])


class TorchFile:
    """A `.bin` state dict, its tensors views of the memory-mapped file."""

    def __init__(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        self.path, self._tensors = path, tensors

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].shape)

    def dtype(self, key: str) -> torch.dtype:
        return self._tensors[key].dtype

    def read(self, key: str) -> torch.Tensor:
        return self._tensors[key]

    def read_slice(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self._tensors[key][index]


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    # mmap needs the zip format torch.save has written since 1.6; older files are read whole
    mmap = zipfile.is_zipfile(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        # torch's message ends with "WeightsUnpickler error: Unsupported global: GLOBAL os.system ..."
        reason = str(e).partition("WeightsUnpickler error:")[2].strip().split(". ")[0] or str(e)
        if "Unsupported global" in reason:
            raise CheckpointError(
                f"{path}: holds pickled objects other than tensors (possibly code), which redline refuses "
                f"to unpickle ({reason}); convert it to safetensors where you trust it"
            ) from e
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint: {reason}") from e
    except Exception as e:  # a corrupt file fails anywhere in the unpickler (IndexError, EOFError, ...)
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint: {e!r}") from e
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise CheckpointError(f"{path}: not a state dict (a mapping of tensor names to tensors)")
    return state


@contextmanager
def open_tensor_file(path: Path) -> Iterator[SafetensorsFile | TorchFile]:
    if path.suffix == ".bin":
        yield TorchFile(path, _load_bin(path))
        return
    try:
        handle = safe_open(path, framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file: {e}") from e
    with handle, open(path, "rb", buffering=0) as file:
        yield SafetensorsFile(path, handle, file)


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


def _scan(paths: list[Path]) -> dict[str, Path]:
    key_to_file: dict[str, Path] = {}
    for path in paths:
        with open_tensor_file(path) as file:
            for key in file.names():
                if key in key_to_file:
                    raise CheckpointError(f"tensor {key!r} is in both {key_to_file[key]} and {path}")
                key_to_file[key] = path
    return key_to_file


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Map every checkpoint key to the file holding it: the safetensors index, else *.safetensors, else
    the .bin index, else pytorch_model*.bin."""
    model_dir = Path(model_dir)
    for index, pattern in ((SAFETENSORS_INDEX, "*.safetensors"), (BIN_INDEX, BIN_GLOB)):
        if (model_dir / index).exists():
            return _read_index(model_dir / index)
        if paths := sorted(model_dir.glob(pattern)):
            return _scan(paths)
    raise CheckpointError(f"no *.safetensors or {BIN_GLOB} in {model_dir}")
