"""A GGUF file opened with the `gguf` library: typed metadata look-ups whose errors name the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

_MISSING = object()


class GGUFError(ValueError):
    """A GGUF file that redline cannot import; the message names the file and the problem."""


class GGUFFile:
    """Metadata and tensors of one GGUF file (memory-mapped: tensor data is read when touched)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {self.path} does not exist")
        try:
            self.reader = gguf.GGUFReader(self.path)
        except (ValueError, OSError, EOFError) as e:  # bad magic, unsupported version, truncated file
            raise GGUFError(f"{self.path}: not a readable GGUF file: {e}") from e
        self.tensors: dict[str, gguf.ReaderTensor] = {t.name: t for t in self.reader.tensors}
        self.architecture = str(self.value("general.architecture"))

    def value(self, key: str, default: Any = _MISSING) -> Any:
        """The metadata value under `key` (a str, int, float, bool or list), or `default` if absent."""
        field = self.reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
            return default
        value = field.contents()
        return value.item() if isinstance(value, np.generic) else value

    def arch_value(self, key: str, default: Any = _MISSING) -> Any:
        """A per-architecture key: arch_value("block_count") reads "llama.block_count"."""
        return self.value(f"{self.architecture}.{key}", default)

    def token_id(self, name: str) -> int | None:
        """A special token's id: token_id("eos") reads "tokenizer.ggml.eos_token_id"; None if absent."""
        value = self.value(f"tokenizer.ggml.{name}_token_id", None)
        return None if value is None else int(value)

    def error(self, problem: str) -> GGUFError:
        return GGUFError(f"{self.path}: {problem}")
