"""Engines measured in turns: all loaded at once, then each prompt, repeat after repeat, completed by every
engine in a row, so that the machine's drift (a VM's bandwidth moved 33 -> 66 GB/s within minutes on the
2-core machine of BENCHMARKS.md) falls on all of them alike. Example, 2 prompts, 2 repeats, engines A and
B: A p0, B p0, A p1, B p1, then the second round starting from B: B p0, A p0, B p1, A p1. Each engine's
runs come out repeat after repeat, prompt after prompt, so runs[i] of A and of B are the same prompt in
the same round.

Apart (together=False), each engine is loaded, completes all its prompts and is closed before the next:
one engine's memory at a time."""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from redline.benchmark.contenders import Contender, LlamaCppContender, Timed
from redline.benchmark.llamacpp import LlamaCppFailed

SHARE_OF_MEMORY = 0.7  # the engines load together only while their weights take at most this much


@dataclass(eq=False)  # identity: a failed one is removed from the live list
class Measured:
    contender: Contender
    runs: list[Timed] = field(default_factory=list)  # repeat after repeat, prompt after prompt
    row: dict = field(default_factory=dict)  # what only this engine measures (Contender.row)


def in_turns(
    contenders: list[Contender], prompts: list[list[int]], max_tokens: int, repeats: int, together: bool
) -> tuple[list[Measured], list[str]]:
    """Every contender's runs, in the contenders' order, and the failures of those that failed (llama.cpp
    only: a crash there costs its row, not the benchmark). Every contender opened is closed, whatever
    happens."""
    measured: list[Measured] = []
    failures: list[str] = []
    for group in [contenders] if together else [[c] for c in contenders]:
        live: list[Measured] = []
        with contextlib.ExitStack() as closing:  # each closed, even when another's close raises
            for c in group:
                closing.callback(c.close)
                m = _opened(c, prompts[0], max_tokens, failures)
                live += [m] if m is not None else []
            _rounds(live, prompts, max_tokens, repeats, "engines in turns" if together else group[0].engine,
                    failures)  # fmt: skip
            for m in live:
                m.row = m.contender.row(m.runs, prompts)
            measured += live
    return measured, failures


def _rounds(
    live: list[Measured],
    prompts: list[list[int]],
    max_tokens: int,
    repeats: int,
    label: str,
    failures: list[str],
) -> None:
    """The completions, repeat after repeat, prompt after prompt, each by every live engine in a row; the
    engine that goes first moves on by one each round (A B C, then B C A, ...), so that going first, right
    after the previous prompt's last engine, falls on each in turn (with as many repeats as engines; the
    order within a row stays cyclic). An engine that fails leaves `live`."""
    with tqdm(total=repeats * len(prompts) * len(live), desc=label, unit="completion") as bar:
        for r in range(repeats):
            for prompt in prompts:
                turn = r % len(live) if live else 0
                for m in live[turn:] + live[:turn]:
                    try:
                        m.runs.append(m.contender.complete(prompt, max_tokens))
                    except LlamaCppFailed as e:
                        _failed(e, failures)
                        live.remove(m)
                    bar.update()


def _opened(c: Contender, prompt: list[int], max_tokens: int, failures: list[str]) -> Measured | None:
    """The contender loaded and warmed up by one completion (its time added to warmup_s); None if it
    failed (said, and counted in failures)."""
    try:
        c.open()
        start = time.perf_counter()
        c.complete(prompt, max_tokens)
    except LlamaCppFailed as e:
        _failed(e, failures)
        return None
    c.warmup_s += time.perf_counter() - start
    return Measured(c)


def _failed(e: LlamaCppFailed, failures: list[str]) -> None:
    print(f"[redline] {e}", file=sys.stderr)
    failures.append(str(e))


def fit_together(contenders: list[Contender], model_bytes: int) -> bool:
    """Whether every contender's weights fit in SHARE_OF_MEMORY of the memory available now (redline and HF
    hold every parameter of the model, a redline draft, KV cache and compile workspace ~10% more; llama.cpp
    its file); if not, says so."""
    needed = sum(
        Path(c.path).stat().st_size if isinstance(c, LlamaCppContender) else 1.1 * model_bytes
        for c in contenders
    )
    available = available_memory()
    if available is None or needed <= SHARE_OF_MEMORY * available:
        return True
    print(
        f"[redline] {len(contenders)} engines need about {needed / 2**30:.1f} GiB together and "
        f"{available / 2**30:.1f} GiB are available: running them one after another (the machine's drift "
        "then enters their ratios; fewer --num-draft-tokens or --tree rows let them run in turns)",
        file=sys.stderr,
    )
    return False


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
