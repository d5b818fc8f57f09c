"""Runs untrusted Python (a model's completion plus its tests) in a fresh interpreter.

Each program runs as `python -I` (no user site, no PYTHON* variables) in its own temporary working
directory, with an empty environment but PATH, no stdin, its output discarded, in a new session
(so a timeout kills it and anything it started), under resource limits set before the program's
first line: address space, CPU seconds, size of written files, no core files. This keeps mistakes
(an endless loop, a huge allocation, stray files) contained; it is not a security boundary against
hostile code.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

MEMORY_BYTES = 2 * 2**30
FILE_BYTES = 16 * 2**20

# Runs before the program: limits first, then the program as __main__ (an exception exits with 1).
_BOOTSTRAP = """
import resource, runpy, sys
memory, cpu_s, file_bytes = (int(v) for v in sys.argv[2:5])
for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu_s),
                     (resource.RLIMIT_FSIZE, file_bytes), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
sys.argv = sys.argv[1:2]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_python(program: str, timeout: float) -> bool:
    """True when `program` exits with status 0 within `timeout` seconds of wall time."""
    with tempfile.TemporaryDirectory(prefix="redline-sandbox-") as tmp:
        script = Path(tmp) / "program.py"
        script.write_text(program, encoding="utf-8")
        limits = [str(MEMORY_BYTES), str(math.ceil(timeout) + 1), str(FILE_BYTES)]
        process = subprocess.Popen(
            [sys.executable, "-I", "-c", _BOOTSTRAP, str(script), *limits], cwd=tmp,
            env={"PATH": os.environ.get("PATH", "")}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            return process.wait(timeout=timeout) == 0
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return False
