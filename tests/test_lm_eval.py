"""lm-evaluation-harness against a live `redline serve`, end to end: its `local-completions` model runs a
multiple-choice task (log-likelihoods from echo + logprobs requests) and a generate-until task (greedy
completions with stop strings), both defined in tests/data/lm_eval over local JSONL files. The scores, and
every per-document answer behind them, must equal what the model gives directly: log-probabilities from a
forward pass, completions from `LLM.generate`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from live_server import live  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from redline import LLM, SamplingParams  # noqa: E402
from redline.server.app import Server  # noqa: E402

TASKS = Path(__file__).parent / "data" / "lm_eval"
MODEL = "tiny"
CONTEXT = 512


def engine(trained: Path) -> LLM:
    return LLM(trained / "target", dtype="float32", max_batch=8, max_seq_len=CONTEXT, draft=trained / "draft")


@pytest.fixture(scope="module")
def reference(trained) -> LLM:
    """A second engine built as the served one: the server's own belongs to its engine thread."""
    return engine(trained)


def run_lm_eval(url: str, trained: Path, tasks: list[str], tokenized_requests: bool) -> dict:
    """lm-eval's Python API, as `lm_eval --model local-completions --model_args ...` would run it: requests
    in arrays of 4 prompts, two at a time; the tokenizer read from the model directory (nothing fetched)."""
    model_args = {
        "base_url": f"{url}/v1/completions",
        "model": MODEL,
        "tokenizer_backend": "huggingface",
        "tokenizer": str(trained / "target"),
        "tokenized_requests": tokenized_requests,
        "batch_size": 4,
        "num_concurrent": 2,
        "max_retries": 1,  # a rejected request fails the run at once
        "max_length": CONTEXT,
    }
    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
        random_seed=None,  # leave the process's random generators alone
        numpy_random_seed=None,
        torch_random_seed=None,
    )


@pytest.fixture(scope="module")
def evaluated(trained) -> dict[str, dict]:
    """Both tasks with token-id prompts, and the generate-until task again with text prompts."""
    with live(Server(engine(trained), MODEL)) as url:
        tokens = run_lm_eval(url, trained, ["redline_multiple_choice", "redline_generate_until"], True)
        text = run_lm_eval(url, trained, ["redline_generate_until"], False)
    return {"tokens": tokens, "text": text}


def samples(out: dict, task: str) -> list[dict]:
    return sorted(out["samples"][task], key=lambda s: s["doc_id"])


def encode_pair(llm: LLM, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a request into tokens: trailing spaces of the context join the continuation; the
    continuation is what encoding the whole adds past the context's own tokens. No BOS (add_bos_token off)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = llm.tokenizer.encode(context, add_special_tokens=False)
    whole = llm.tokenizer.encode(context + continuation, add_special_tokens=False)
    return context_ids, whole[len(context_ids) :]


def log_likelihood(llm: LLM, context: str, continuation: str) -> tuple[float, bool, bool]:
    """The continuation's summed log-probability, whether greedy decoding would produce it, and whether that
    verdict is clear of fp32 near-ties (every token's top-two log-probs more than 1e-3 apart)."""
    context_ids, continuation_ids = encode_pair(llm, context, continuation)
    rows = llm.runner.log_probs(context_ids + continuation_ids)[len(context_ids) - 1 :]
    chosen = rows[range(len(continuation_ids)), continuation_ids]
    top2 = rows.topk(2, dim=-1).values
    greedy = bool((chosen == top2[:, 0]).all())
    return chosen.sum().item(), greedy, bool((top2[:, 0] - top2[:, 1] > 1e-3).all())


def test_multiple_choice_scores_equal_the_models_log_probabilities(evaluated, reference):
    out = evaluated["tokens"]
    acc, acc_norm = [], []
    for sample in samples(out, "redline_multiple_choice"):
        doc = sample["doc"]
        served = [resp[0] for resp in sample["resps"]]  # one (log-likelihood, is_greedy) per choice
        direct = [log_likelihood(reference, doc["context"], choice) for choice in doc["choices"]]
        for (ll, greedy), (expected_ll, expected_greedy, clear) in zip(served, direct, strict=True):
            assert ll == pytest.approx(expected_ll, abs=1e-3)
            if clear:
                assert greedy == expected_greedy
        lls = [ll for ll, _, _ in direct]
        normed = [ll / len(choice) for ll, choice in zip(lls, doc["choices"], strict=True)]
        acc.append(float(lls.index(max(lls)) == doc["label"]))
        acc_norm.append(float(normed.index(max(normed)) == doc["label"]))
    scores = out["results"]["redline_multiple_choice"]
    assert len(acc) == 9
    assert scores["acc,none"] == pytest.approx(sum(acc) / len(acc))
    assert scores["acc_norm,none"] == pytest.approx(sum(acc_norm) / len(acc_norm))


def first_word(text: str) -> str:
    """The task's filter: the first run of word characters, as lm-eval's regex filter takes it."""
    words = re.findall(r"\w+", text)
    return words[0].strip() if words else "[invalid]"


@pytest.mark.parametrize("prompts", ["tokens", "text"])
def test_generate_until_scores_equal_greedy_generation(evaluated, reference, prompts):
    out = evaluated[prompts]
    docs = samples(out, "redline_generate_until")
    stop = ["\n", "  ", reference.tokenizer.eos_token]  # the task's `until`, and the eos string lm-eval adds
    params = SamplingParams(max_tokens=8, stop=stop)
    inputs = [s["doc"]["prompt"] for s in docs]
    if prompts == "tokens":  # lm-eval encodes without BOS; the server encodes text as `LLM.generate` does
        inputs = [reference.tokenizer.encode(p, add_special_tokens=False) for p in inputs]
    expected = [c.text for c in reference.generate(inputs, params)]
    assert [s["resps"][0][0] for s in docs] == expected
    hits = [first_word(text) == s["doc"]["answer"] for text, s in zip(expected, docs, strict=True)]
    assert [s["filtered_resps"][0] == s["doc"]["answer"] for s in docs] == hits
    assert out["results"]["redline_generate_until"]["exact_match,first-word"] == pytest.approx(
        sum(hits) / len(hits)
    )
