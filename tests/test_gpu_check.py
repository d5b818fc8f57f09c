"""benchmarks/gpu_check.sh is valid bash, and the GPU benchmark's code runs (tiny shape, on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")], check=True)


def test_gpu_bench_runs_on_cpu(tmp_path):
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_bench.py"),
            "--out",
            str(tmp_path),
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--steps",
            "3",
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    summary = json.loads((tmp_path / "gpu_bench.json").read_text())
    names = [r["name"] for r in summary["results"]]
    assert names == [
        "bf16 plain eager",
        "bf16 eagle3 K=3 step",
        "bf16 eagle3 tree 4x8 step",
        "fp8 plain eager",
    ]
    assert summary["fp8_weight_gb"] < summary["bf16_weight_gb"]
    assert all(r["ms_per_step"] > 0 for r in summary["results"]) and summary["tree_step_over_plain_step"] > 0
