"""Memory while loading SmolLM2-135M-Instruct's weights (issue 29's target: an int4 load peaks below the bf16
model's size): for each scheme, in a fresh process, the rise of the peak resident set (VmHWM, reset through
/proc/self/clear_refs just before) over the resident set before the load, for what `LLM` does to build its
weights: models/build.load_target with the CPU kernels' backends, then the move onto huge pages. The
process first builds the model's skeleton once (on the meta device), so that the modules it imports
(torch's compiler among them, about 180 MB whatever the model) are in before the count starts.

    .venv/bin/python benchmarks/load_memory.py [--json out.json]

The KV pool, compiled code and step buffers that `LLM()` adds afterwards are not the loader's and are left
out (they are the same for every scheme).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SCHEMES = ["bf16", "int8", "int4", "gguf", "w4a16"]  # w4a16: a `redline quantize --scheme int4` checkpoint


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure(model_dir: str, scheme: str) -> dict:
    """In this process: load once, return MB figures."""
    import torch

    from redline.layers.backends import Backends
    from redline.models.build import load_target, skeleton
    from redline.models.huge_pages import move_to_huge_pages

    backends = Backends.choose("cpu", torch.bfloat16, compiled=False)
    skeleton(model_dir, backends=backends)  # the imports
    quantization = scheme if scheme in ("int8", "int4", "gguf") else None
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status_kb("VmRSS")
    model = load_target(model_dir, torch.bfloat16, "cpu", quantization, backends=backends)
    move_to_huge_pages(model)
    weights = sum(t.nbytes for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values())
    return {"scheme": scheme, "rise_mb": (status_kb("VmHWM") - before) / 1024,
            "held_mb": (status_kb("VmRSS") - before) / 1024, "weights_mb": weights / 2**20}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # model_dir scheme: one measurement
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child)))
        return
    import torch

    from redline.models.gguf import gguf_model_dir, smollm2_gguf
    from redline.models.quantized_checkpoint import quantize_checkpoint

    base = gguf_model_dir(smollm2_gguf(), torch.bfloat16, progress=False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        written = Path(tmp) / "w4a16"
        quantize_checkpoint(base, written, scheme="int4", group=64)
        for scheme in SCHEMES:
            where = written if scheme == "w4a16" else base
            out = subprocess.run([sys.executable, __file__, "--child", str(where), scheme], check=True,
                                 capture_output=True, text=True).stdout  # fmt: skip
            rows.append(json.loads(out.strip().splitlines()[-1]))
    print("| weights | peak rise while loading | held after | the weights |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['scheme']} | {r['rise_mb']:.0f} MB | {r['held_mb']:.0f} MB | {r['weights_mb']:.0f} MB |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
