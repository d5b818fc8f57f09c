"""Where a model comes from: a local directory, a `.gguf` file, or a Hugging Face Hub id (`ORG/NAME`).

A hub id resolves through huggingface_hub's own cache (HF_HUB_CACHE, or HF_HOME/hub, default
~/.cache/huggingface/hub): `snapshot_download` fetches only what redline reads (config, tokenizer and
generation files, and the safetensors weights with their index; `pytorch_model*.bin` only for a repository
without safetensors, as the original EAGLE-3 drafts ship), at `revision` (a branch, tag or commit; default
main). HF_TOKEN (or `hf auth login`) authenticates gated and private repositories. With HF_HUB_OFFLINE=1
only the cache is used. Nothing downloads unless the user names a hub id.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

METADATA = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
]
SAFETENSORS = ["*.safetensors", "*.safetensors.index.json"]
PYTORCH_BIN = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # ORG/NAME, as the Hub spells repository ids


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def resolve(model: str | Path, revision: str | None = None) -> Path:
    """The local path of `model`: itself when it exists, else the snapshot of a hub id. Raises
    FileNotFoundError naming what was tried."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    text = str(model)
    if not HUB_ID.fullmatch(text) or text.startswith((".", "/", "~")):
        raise FileNotFoundError(
            f"model {text!r} does not exist: give a checkpoint directory, a .gguf file or a Hugging Face Hub "
            "id (ORG/NAME)"
        )
    return _snapshot(text, revision)


def _snapshot(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import errors, snapshot_download

    kw = dict(revision=revision, cache_dir=os.environ.get("HF_HUB_CACHE"), local_files_only=_offline())
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=METADATA + SAFETENSORS, **kw))
        if not any(folder.glob("*.safetensors")):  # an older checkpoint: PyTorch pickles instead
            folder = Path(snapshot_download(repo_id, allow_patterns=METADATA + PYTORCH_BIN, **kw))
    except errors.LocalEntryNotFoundError as e:
        where = "HF_HUB_OFFLINE is set" if _offline() else "the Hub cannot be reached"
        raise FileNotFoundError(
            f"{repo_id!r}{f' at revision {revision!r}' if revision else ''} is not in the Hugging Face cache "
            f"and {where}: download it once with network access, or give a local directory"
        ) from e
    except errors.GatedRepoError as e:
        raise FileNotFoundError(
            f"{repo_id!r} is gated: accept its license on the Hub and set HF_TOKEN"
        ) from e
    except errors.RevisionNotFoundError as e:
        raise FileNotFoundError(f"{repo_id!r} has no revision {revision!r}") from e
    except errors.RepositoryNotFoundError as e:
        raise FileNotFoundError(f"no Hub repository {repo_id!r} (or it is private: set HF_TOKEN)") from e
    return folder
