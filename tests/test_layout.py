"""The package's shape, kept as the review left it: imports run downward through the layers of the
architecture (README "Architecture"), no file over 450 lines, no function over 80 lines but Triton
kernels."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "redline"
# Lowest first: a part may import only the parts before it (and itself).
LAYERS = [
    "config", "dtypes", "draft_tree", "engine_config", "engine_flags", "structured_spec", "sampling",
    "logprobs", "penalties", "failures", "tokenizer", "structured", "tool_calls", "data", "kernels",
    "parallel", "quant", "layers", "models", "speculative",
    "runner", "engine", "train", "evaluate", "benchmark", "server", "demo", "cli", "__init__", "__main__",
]  # fmt: skip


def part_of(module: str) -> str:
    """redline.layers.attention -> "layers"; redline.config -> "config"; redline -> "__init__"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def reexports() -> dict[str, str]:
    """What `from redline import X` reads: {"LLM": "redline.engine.llm", ...} (redline/__init__.py)."""
    tree = ast.parse((ROOT / "__init__.py").read_text())
    found = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module]
    return {a.name: n.module for n in found for a in n.names}


def imported(path: Path) -> set[str]:
    """The redline modules a file imports: `from redline import logprobs` is redline.logprobs, `from
    redline import LLM` redline.engine.llm."""
    out, names = set(), reexports()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "redline":  # __version__: a constant there
            out |= {names.get(a.name, f"redline.{a.name}") for a in node.names if a.name != "__version__"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("redline."):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("redline.")}
    return out


def files() -> list[tuple[str, Path]]:
    name = lambda p: ".".join(("redline", *p.relative_to(ROOT).with_suffix("").parts))
    return [(name(p), p) for p in ROOT.rglob("*.py")]


def test_imports_run_downward():
    upward = []
    for module, path in files():
        mine = LAYERS.index(part_of(module))
        for target in imported(path):
            if LAYERS.index(part_of(target)) > mine:
                upward.append(f"{module} imports {target}")
    assert not upward, "\n".join(upward)


def test_every_part_has_a_layer():
    assert {part_of(m) for m, _ in files()} <= set(LAYERS)


def test_files_and_functions_stay_short():
    long_files = [f"{m}: {n}" for m, p in files() if (n := len(p.read_text().splitlines())) > 450]
    long_functions = []
    for module, path in files():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            triton = any("triton.jit" in ast.unparse(d) for d in node.decorator_list)
            if node.end_lineno - node.lineno + 1 > 80 and not triton:
                long_functions.append(f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long_files and not long_functions, long_files + long_functions
