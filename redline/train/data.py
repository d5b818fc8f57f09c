"""Training text: the Python standard library's source on this machine, and user data for drafts.

The demo corpus is the top-level `*.py` files of the standard library. The files in HELD_OUT never
enter training: evaluation and the demo's prompts come from them.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import torch

HELD_OUT = (
    "bisect.py", "calendar.py", "difflib.py", "fnmatch.py", "heapq.py", "shlex.py", "textwrap.py", "uuid.py",
)  # fmt: skip


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no Python standard library source under {root}")
    return files


def stdlib_texts(max_files: int = 40, max_chars: int = 20_000) -> list[str]:
    """The first `max_files` standard-library files, each cut to `max_chars` (tokenizers for tests)."""
    return [read_text(p)[:max_chars] for p in stdlib_files()[:max_files]]


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def split_stdlib() -> tuple[list[str], list[str]]:
    """(training texts, held-out texts) of the demo corpus."""
    train, held_out = [], []
    for path in stdlib_files():
        (held_out if path.name in HELD_OUT else train).append(read_text(path))
    return train, held_out


def token_stream(encoded: list[list[int]], separator: int) -> torch.Tensor:
    """Documents joined into one 1-D stream: [a0 a1] [b0] -> [a0 a1 sep b0 sep]."""
    return torch.tensor([token for doc in encoded for token in [*doc, separator]], dtype=torch.int64)


def step_generator(seed: int, step: int) -> torch.Generator:
    """The random source of one training step: batches depend on (seed, step) only, so resuming is exact."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def stream_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` random windows of `length` tokens from a 1-D stream: [batch, length]."""
    starts = torch.randint(0, len(stream) - length + 1, (batch,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def load_texts(data: Path) -> list[str]:
    """Texts from a JSONL file (one object per line with "text" or "prompt", or "messages" whose contents
    are joined), a text file, or a directory of text files (read recursively, sorted)."""
    if data.is_dir():
        texts = [read_text(p) for p in sorted(data.rglob("*")) if p.is_file()]
    elif data.suffix == ".jsonl":
        texts = [_jsonl_text(line, data, n) for n, line in enumerate(read_text(data).splitlines(), 1) if line]
    elif data.is_file():
        texts = [read_text(data)]
    else:
        raise FileNotFoundError(f"training data {data} does not exist")
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError(f"no text found in {data}")
    return texts


def _jsonl_text(line: str, path: Path, number: int) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{number}: not valid JSON ({e})") from e
    if isinstance(record, dict):
        for key in ("text", "prompt"):
            if isinstance(record.get(key), str):
                return record[key]
        if isinstance(record.get("messages"), list):
            return "\n".join(str(m.get("content", "")) for m in record["messages"] if isinstance(m, dict))
    raise ValueError(f'{path}:{number}: expected an object with "text", "prompt" or "messages"')


def prompt_windows(encoded: list[list[int]], count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` tokens cut from random places in the documents (longer ones first pick)."""
    gen = torch.Generator().manual_seed(seed)
    usable = [doc for doc in encoded if len(doc) > length]
    if not usable:
        return [doc for doc in encoded if doc][:count]
    prompts = []
    for i in range(count):
        doc = usable[i % len(usable)]
        start = int(torch.randint(0, len(doc) - length + 1, (1,), generator=gen))
        prompts.append(doc[start : start + length])
    return prompts
