"""Writing safetensors checkpoints shard by shard, named as transformers' save_pretrained names them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from redline.models.tensor_files import SAFETENSORS_INDEX

DEFAULT_SHARD_BYTES = 5 * 10**9  # save_pretrained's default max_shard_size, "5GB"


class ShardWriter:
    """Tensors go into the current shard as they come; a shard is written once the next tensor would take
    it past max_shard_bytes, so only one shard is ever held. One shard is `model.safetensors`; more are
    `model-00001-of-00003.safetensors`, ... plus `model.safetensors.index.json`."""

    def __init__(self, out_dir: Path, max_shard_bytes: int | None = DEFAULT_SHARD_BYTES) -> None:
        self.out_dir, self.max_shard_bytes = Path(out_dir), max_shard_bytes
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._shard: dict[str, torch.Tensor] = {}
        self._shard_bytes = 0
        self._storages: set[int] = set()  # of the current shard's tensors
        self._written: list[tuple[Path, list[str]]] = []  # shard files under temporary names, their keys
        self.total_bytes = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().to("cpu").contiguous()
        limit = self.max_shard_bytes
        if self._shard and limit is not None and self._shard_bytes + tensor.nbytes > limit:
            self._flush()
        if tensor.untyped_storage().data_ptr() in self._storages:
            tensor = tensor.clone()  # tied weights: safetensors refuses tensors sharing memory
        self._storages.add(tensor.untyped_storage().data_ptr())
        self._shard[key] = tensor
        self._shard_bytes += tensor.nbytes
        self.total_bytes += tensor.nbytes

    def _flush(self) -> None:
        path = self.out_dir / f"shard-{len(self._written) + 1:05d}.safetensors.partial"
        save_file(self._shard, path, metadata={"format": "pt"})
        self._written.append((path, list(self._shard)))
        self._shard, self._shard_bytes, self._storages = {}, 0, set()

    def finish(self) -> None:
        """Writes the last shard and gives every shard its final name (and the index, for several)."""
        if self._shard or not self._written:
            self._flush()
        if len(self._written) == 1:
            self._written[0][0].rename(self.out_dir / "model.safetensors")
            return
        weight_map: dict[str, str] = {}
        for number, (path, keys) in enumerate(self._written, start=1):
            name = f"model-{number:05d}-of-{len(self._written):05d}.safetensors"
            path.rename(self.out_dir / name)
            weight_map.update(dict.fromkeys(keys, name))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out_dir / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
