"""The loader the task YAMLs here name (`custom_dataset: !function local_jsonl.load`): a JSONL file next to
this module as the test split, read in memory, so the tasks work from any directory, offline, with no
datasets cache."""

from __future__ import annotations

import json
from pathlib import Path

import datasets


def load(file: str, **metadata) -> dict[str, datasets.Dataset]:
    """`file` comes from the task's dataset_kwargs; lm-eval also passes its metadata (ignored)."""
    lines = (Path(__file__).parent / file).read_text(encoding="utf-8").splitlines()
    return {"test": datasets.Dataset.from_list([json.loads(line) for line in lines if line.strip()])}
