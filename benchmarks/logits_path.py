"""What logprobs and penalties cost in the decode step, on the real SmolLM2 pair (eager, fp32, CPU).

A step takes the argmax path when every row is greedy without penalties or logprobs, else the logits
path (speculative/step.py): logits, penalties (penalties.py), filters, rejection sampling and the packed
log-probabilities (logprobs.py). Every sampled request pays for the penalty and log-probability work
whether it asks for them or not (one graph per (rows, path), not four). This script measures:

- whole steps of 8 busy slots (K = 3, 300-token prompts) in four configurations, interleaved so that
  other load hits all alike: greedy; sampled (temperature 0.8); sampled + logprobs 5; sampled +
  presence / frequency / repetition penalties;
- the added pieces alone on the step's shapes [8, K + 1, 49,152]: the draft-aware counts and the
  penalties, and the log-probability packing (log-softmax, top 20), next to the filters they join
  (temperature / top-k / top-p / min-p, a sort of the vocabulary).

    .venv/bin/python benchmarks/logits_path.py [--steps 30] [--threads 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from redline.benchmark.machine import cpu_model
from redline.demo import demo_pair
from redline.engine.llm import LLM
from redline.logprobs import pack
from redline.penalties import counts_after_drafts, penalize
from redline.sampling import SamplingParams, SamplingTensors, filtered_probs

SLOTS, K, PROMPT = 8, 3, 300
GREEDY = SamplingParams(max_tokens=3_000, ignore_eos=True)
SAMPLED = dataclasses.replace(GREEDY, temperature=0.8, seed=1)
CONFIGS = {
    "greedy": GREEDY,
    "sampled": SAMPLED,
    "sampled + logprobs 5": dataclasses.replace(SAMPLED, logprobs=5),
    "sampled + penalties": dataclasses.replace(
        SAMPLED, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2
    ),
}


def ms(fn, repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def step_times(steps: int) -> dict[str, float]:
    """Median ms per decode step, 8 slots busy, for each configuration (interleaved)."""
    engines = {}
    target, draft = demo_pair()
    prompt = torch.randint(100, 40_000, (PROMPT,)).tolist()
    for name, params in CONFIGS.items():
        llm = LLM(target, dtype="float32", draft=draft, num_draft_tokens=K, adaptive_draft_length=False,
                  max_batch=SLOTS, max_seq_len=4096,
                  compile=False, progress=False)  # fmt: skip
        requests = [llm.make_request(prompt, params) for _ in range(SLOTS)]
        for request in requests:
            llm.engine.add(request)
        while not all(r.output_ids for r in requests):  # every prompt prefilled: all slots decode
            llm.engine.step()
        engines[name] = llm
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(steps):
        for name, llm in engines.items():
            start = time.perf_counter()
            llm.engine.step()
            times[name].append(1000 * (time.perf_counter() - start))
    return {name: statistics.median(t) for name, t in times.items()}


def piece_times() -> dict[str, float]:
    vocab = 49_152
    logits = torch.randn(SLOTS, K + 1, vocab)
    t = SamplingTensors.zeros(SLOTS, torch.device("cpu"))
    t.temperature.fill_(0.8)
    t.top_p.fill_(0.95)
    counts = torch.randint(0, 3, (SLOTS, vocab), dtype=torch.int32)
    seen = torch.rand(SLOTS, vocab) < 0.01
    drafts = torch.randint(0, vocab, (SLOTS, K))
    tokens = torch.randint(0, vocab, (SLOTS, K + 1))
    return {
        "filters (existing)": ms(lambda: filtered_probs(logits, t)),
        "counts after drafts + penalties": ms(
            lambda: penalize(logits, t, counts_after_drafts(counts, drafts), seen)
        ),
        "logprobs pack": ms(lambda: pack(logits, tokens)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = {"cpu": cpu_model(), "threads": args.threads, "slots": SLOTS, "k": K, "prompt": PROMPT}
    result["pieces_ms"] = piece_times()
    result["step_ms"] = step_times(args.steps)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
