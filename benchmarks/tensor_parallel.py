"""Tensor parallelism on CPU: TP = 1 (one process, 2 threads) vs TP = 2 (2 processes x 1 thread, gloo).

For the 33.9M-parameter Llama of decode_baseline.py (hidden 512, 8 layers, 8 heads, MLP 1408, vocabulary
~8000) and a Llama 4 of the same widths (MoE with 16 experts of width 512, top 1, on every other
layer, a shared expert), plain and with a random EAGLE-3 draft at K = 3 (a random draft is rejected
almost always: the step time is what it measures, not the speed-up), batch 1, eager:
- the decode step time: acceptance length / tokens per second per user (tokens/s alone for plain);
- the share of rank 0's generate time spent in the all-reduces (TensorParallel.all_reduce wrapped with
  a timer in rank 0's process: waiting for the other rank included), and their count per step;
- the draft's share (its proposals, speculative.propose.propose, timed): what sharding the draft could
  save;
- peak resident memory of rank 0's process and of rank 1's (ru_maxrss, torch's own ~0.3 GB included),
  and the bytes of rank 0's weights;
- an all-reduce alone: 2 processes x 1 thread in a loop of gloo all-reduces of one step's activations
  ([1, 512] and [4, 512] in the run's dtype), the latency without waiting for the other rank's compute.
Each configuration runs in a fresh process, so each peak is its own.

    .venv/bin/python benchmarks/tensor_parallel.py [--dtype bfloat16] [--max-tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def llama4_config(vocab: int) -> dict:
    from transformers import Llama4TextConfig

    config = Llama4TextConfig(
        vocab_size=vocab, hidden_size=512, intermediate_size=512, intermediate_size_mlp=1408,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, head_dim=64,
        num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=2,
        attention_chunk_size=8192, max_position_embeddings=4096, bos_token_id=0, eos_token_id=4,
    )  # fmt: skip
    return {**config.to_dict(), "architectures": ["Llama4ForCausalLM"], "tie_word_embeddings": False}


def build_models(root: Path) -> dict[str, Path]:
    """The two targets (one tokenizer) and a random draft for each."""
    from redline.train.random_init import write_random_checkpoint, write_random_draft, write_random_model

    llama3 = write_random_model(
        root / "llama3", vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False, max_position_embeddings=4096,
    )  # fmt: skip
    vocab = json.loads((llama3 / "config.json").read_text())["vocab_size"]
    llama4 = root / "llama4"
    write_random_checkpoint(llama4, llama4_config(vocab))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (llama3 / name).exists():
            shutil.copy(llama3 / name, llama4 / name)
    targets = {"llama3": llama3, "llama4": llama4}
    drafts = {f"{m}-draft": write_random_draft(d, root / f"{m}-draft") for m, d in targets.items()}
    return {**targets, **drafts}


def child(spec: dict) -> dict:
    """One configuration in this fresh process; returns its measurements."""
    import redline.speculative.emit as emit_module
    from redline import LLM, SamplingParams
    from redline.parallel.group import TensorParallel

    torch.set_num_threads(2)
    timers = {"all_reduce": [0.0, 0], "propose": [0.0, 0]}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            timers[name][0] += time.perf_counter() - start
            timers[name][1] += 1
            return out

        return wrapper

    TensorParallel.all_reduce = timed("all_reduce", TensorParallel.all_reduce)
    emit_module.propose = timed("propose", emit_module.propose)  # as the emitter calls it
    draft = spec["draft"]
    max_len = spec["prompt_len"] + spec["max_tokens"] + 8
    drafting = {"draft": draft, "num_draft_tokens": 3} if draft else {}
    llm = LLM(spec["model"], dtype=spec["dtype"], max_batch=1, max_seq_len=max_len, compile=False,
              tensor_parallel_size=spec["tp"], progress=False, **drafting)  # fmt: skip
    weight_bytes = sum(p.nbytes for p in llm.model.parameters())
    prompt = torch.randint(5, 8000, (spec["prompt_len"],), generator=torch.Generator().manual_seed(1))
    params = SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True)
    prompt = prompt.tolist()
    llm.generate([prompt], params)  # warm-up
    for timer in timers.values():
        timer[:] = [0.0, 0]
    steps, wall, step_times = 0.0, 0.0, []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        [c] = llm.generate([prompt], params)
        wall += time.perf_counter() - start
        al = c.acceptance_length or 1.0
        step_times.append(al / c.tokens_per_s)
        steps += (c.completion_tokens - 1) / al + 1  # decode steps, and the prefill
    llm.close()
    return dict(
        step_ms=statistics.median(step_times) * 1e3,
        all_reduce_share=timers["all_reduce"][0] / wall if spec["tp"] > 1 else 0.0,
        all_reduces_per_step=timers["all_reduce"][1] / steps if spec["tp"] > 1 else 0.0,
        all_reduce_us=1e6 * timers["all_reduce"][0] / max(1, timers["all_reduce"][1]),
        draft_share=timers["propose"][0] / wall if draft else None,
        peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        worker_peak_rss_gb=_children_peak_gb() if spec["tp"] > 1 else None,
        weight_bytes_rank0=weight_bytes,
    )  # fmt: skip


def _all_reduce_loop(rank: int, init: str, dtype: str, out: str) -> None:
    """Rank `rank` of 2: times 2,000 all-reduces of [rows, 512] for 1 and 4 rows; rank 0 writes µs each."""
    from redline.parallel.group import TensorParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    tp, result = TensorParallel.current(), {}
    for rows in (1, 4):
        x = torch.randn(1, rows, 512).to(getattr(torch, dtype))
        for _ in range(200):
            tp.all_reduce(x)
        start = time.perf_counter()
        for _ in range(2000):
            tp.all_reduce(x)
        result[f"{rows}x512"] = (time.perf_counter() - start) / 2000 * 1e6
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def all_reduce_alone(dtype: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "us.json"
        args = (f"{tmp}/init", dtype, str(out))
        mp.start_processes(_all_reduce_loop, args=args, nprocs=2, start_method="spawn")
        return json.loads(out.read_text())


def _children_peak_gb() -> float:
    """The peak resident memory of the largest child process waited for (rank 1 after llm.close())."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    from redline.benchmark.machine import busy_cores, cpu_model, read_bandwidth_gbps

    busy = busy_cores()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = build_models(Path(tmp))
        for model in ("llama3", "llama4"):
            for draft in (None, dirs[f"{model}-draft"]):
                for tp in (1, 2):
                    spec = dict(model=str(dirs[model]), draft=draft and str(draft), tp=tp, dtype=args.dtype,
                                prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                                repeats=args.repeats)  # fmt: skip
                    run = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                                         capture_output=True, text=True, check=False)  # fmt: skip
                    if run.returncode:
                        sys.exit(f"{model} tp={tp} draft={bool(draft)} failed:\n{run.stderr[-3000:]}")
                    row = {"model": model, "eagle3": draft is not None, "tp": tp,
                           **json.loads(run.stdout.strip().splitlines()[-1])}  # fmt: skip
                    rows.append(row)
                    print(_line(row), flush=True)
    alone = all_reduce_alone(args.dtype)
    each = ", ".join(f"{k} {v:.0f} us" for k, v in alone.items())
    print(f"all-reduce alone (2 processes x 1 thread, gloo): {each}")
    machine = (
        f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.dtype}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}, other load at start {busy:.2f} cores, "
        f"read bandwidth {read_bandwidth_gbps():.1f} GB/s"
    )
    print(f"machine: {machine}")
    if args.json:
        report = {"machine": machine, "args": vars(args), "runs": rows, "all_reduce_alone_us": alone}
        args.json.write_text(json.dumps(report, indent=2, default=str))


def _line(row: dict) -> str:
    draft = f", draft {row['draft_share']:.0%} of the time" if row["draft_share"] is not None else ""
    workers = f", rank 1 peak {row['worker_peak_rss_gb']:.2f} GB" if row["worker_peak_rss_gb"] else ""
    collectives = (
        f", all-reduce {row['all_reduce_share']:.0%} of the time "
        f"({row['all_reduces_per_step']:.1f} per step, {row['all_reduce_us']:.0f} us each)"
        if row["tp"] > 1
        else ""
    )
    return (
        f"{row['model']:6} {'eagle3 K=3' if row['eagle3'] else 'plain':10} TP={row['tp']}: step "
        f"{row['step_ms']:.2f} ms{collectives}{draft}; rank 0 peak {row['peak_rss_gb']:.2f} GB{workers}, "
        f"weights {row['weight_bytes_rank0'] / 1e6:.1f} MB"
    )


if __name__ == "__main__":
    main()
