"""Structured outputs on the real SmolLM2-135M-Instruct (bf16 compiled, CPU): how often it writes JSON with
the asked fields with and without a json_schema constraint, and what the constraint costs, at batch 1 and
8, plain and with EAGLE-3 (the demo's draft, K = 3, adaptive) (issue 28).

    .venv/bin/python benchmarks/structured_cost.py [--requests 8] [--max-tokens 96] [--rounds 2]

Requests: chat prompts asking for a JSON object describing a book, a city, a person ... with given fields;
the schema requires exactly those fields (strings and integers). Greedy. Per configuration: the median
request's decode tokens/s (its tokens after the first over the time from its first token to its last:
constrained outputs are shorter, so end-to-end rates would mostly compare prefill shares), the mean
acceptance length with the draft, the share of the wall time the host spent in the grammar (the
matchers' masks before each step, the draft's inside it and the commits after: RequestGrammar.masks /
.proposal_masks / .commit), and how many outputs parse as JSON objects with every asked field
(unconstrained: the text, a ``` fence stripped).
"""

from __future__ import annotations

import argparse
import json
import time
from statistics import median

import torch

from redline import LLM, SamplingParams, StructuredOutputs
from redline.benchmark.machine import describe
from redline.demo import SHIPPED_DRAFT
from redline.models.gguf import smollm2_dir
from redline.structured import matcher

SUBJECTS = [("a book", {"title": "string", "author": "string", "year": "integer"}),
            ("a city", {"name": "string", "country": "string", "population": "integer"}),
            ("a person", {"first_name": "string", "last_name": "string", "age": "integer"}),
            ("a film", {"title": "string", "director": "string", "year": "integer"}),
            ("a planet", {"name": "string", "moons": "integer"}),
            ("a car", {"make": "string", "model": "string", "year": "integer"}),
            ("a song", {"title": "string", "artist": "string", "length_seconds": "integer"}),
            ("a river", {"name": "string", "continent": "string", "length_km": "integer"})]  # fmt: skip
GRAMMAR_SECONDS = [0.0]


def timed(method):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            GRAMMAR_SECONDS[0] += time.perf_counter() - start

    return wrapper


def requests(llm: LLM, count: int) -> list[tuple[list[int], dict]]:
    out = []
    for subject, fields in (SUBJECTS * count)[:count]:
        names = ", ".join(f"{k} ({v})" for k, v in fields.items())
        ask = f"Describe {subject} as a JSON object with the fields {names}. Reply with the JSON only."
        schema = {"type": "object", "properties": {k: {"type": v} for k, v in fields.items()},
                  "required": list(fields)}  # fmt: skip
        out.append((llm.tokenizer.encode_chat([{"role": "user", "content": ask}]), schema))
    return out


def valid(text: str, schema: dict) -> bool:
    text = text.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    try:
        value = json.loads(text)
    except ValueError:
        return False
    types = {"string": str, "integer": int}
    return isinstance(value, dict) and all(
        isinstance(value.get(k), types[spec["type"]]) for k, spec in schema["properties"].items()
    )


def run(llm: LLM, work: list[tuple[list[int], dict]], batch: int, constrained: bool,
        max_tokens: int) -> tuple[float, float, float, int]:  # fmt: skip
    """One pass over the requests, `batch` at a time: (the median request's decode tokens/s, the mean
    acceptance length or 1, the grammar's share of the wall time, how many outputs are valid)."""
    GRAMMAR_SECONDS[0] = 0.0
    start, rates, lengths, ok = time.perf_counter(), [], [], 0
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        spec = lambda schema: StructuredOutputs(json=schema, strict=True) if constrained else None
        params = [SamplingParams(max_tokens=max_tokens, structured=spec(schema)) for _, schema in chunk]
        out = llm.generate([ids for ids, _ in chunk], params)
        rates += [c.tokens_per_s for c in out]
        lengths += [c.acceptance_length or 1.0 for c in out]
        ok += sum(valid(c.text, schema) for c, (_, schema) in zip(out, chunk, strict=True))
    wall = time.perf_counter() - start
    return median(rates), sum(lengths) / len(lengths), GRAMMAR_SECONDS[0] / wall, ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    matcher.RequestGrammar.masks = timed(matcher.RequestGrammar.masks)
    matcher.RequestGrammar.commit = timed(matcher.RequestGrammar.commit)
    matcher.RequestGrammar.proposal_masks = timed(matcher.RequestGrammar.proposal_masks)  # in-step
    print(json.dumps(describe()), flush=True)
    target = smollm2_dir(torch.bfloat16)
    common = dict(dtype="bfloat16", compile=True, max_batch=8, max_seq_len=512, progress=False)
    engines = {"plain": LLM(target, **common),
               "EAGLE-3 K=3": LLM(target, draft=SHIPPED_DRAFT, num_draft_tokens=3, **common)}  # fmt: skip
    work = requests(engines["plain"], args.requests)
    rows = []
    for batch in (1, 8):
        for name, llm in engines.items():
            for constrained in (False, True):
                runs = [run(llm, work, batch, constrained, args.max_tokens) for _ in range(args.rounds)]
                rate, length, share = (median(r[i] for r in runs) for i in range(3))
                kind, ok = "json_schema" if constrained else "free", runs[-1][3]
                rows.append((batch, name, kind, rate, length, share, ok))
                print(f"batch {batch} {name} {kind}: {rate:.1f} tok/s per user, AL {length:.2f}, grammar "
                      f"{share:.1%} of the time, {ok}/{len(work)} valid", flush=True)  # fmt: skip
    print("| batch | engine | output | decode tok/s per user | acceptance length | grammar's share of the "
          "time | valid JSON with the fields |")  # fmt: skip
    print("|---:|---|---|---:|---:|---:|---:|")
    for batch, name, kind, rate, length, share, ok in rows:
        print(f"| {batch} | {name} | {kind} | {rate:.1f} | {length:.2f} | {share:.1%} | {ok}/{len(work)} |")


if __name__ == "__main__":
    main()
