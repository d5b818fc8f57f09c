"""Serving eagerly while the compiled graphs build in a background thread (runner/background_compile.py):
a request started eagerly continues on the compiled runner, the switch compiles nothing more, and a
failed compile leaves the eager runner serving."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils
from conftest import build_hf_model, greedy_divergence_is_a_near_tie, llama3_hf_config, save_hf_model

from redline import LLM, SamplingParams
from redline.engine_config import EngineConfig
from redline.runner import background_compile
from redline.train.random_init import write_random_draft

TOKENS = 120  # the first test's completion
LONG_CONTEXT = 2200


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("background")
    config = llama3_hf_config(max_position_embeddings=LONG_CONTEXT)
    target = save_hf_model(build_hf_model(config, seed=11), root / "t", tokenizer_dir)
    return target, write_random_draft(target, root / "d")


@pytest.fixture
def gate(monkeypatch):
    """The background compile starts only once the test sets this (and at teardown, so that a failed test
    leaves no compile thread waiting)."""
    opened, warm_up = threading.Event(), background_compile.warm_up

    def gated(*args, **kwargs) -> bool:
        opened.wait()
        return warm_up(*args, **kwargs)

    monkeypatch.setattr(background_compile, "warm_up", gated)
    yield opened
    opened.set()


def options(draft) -> dict:
    """Every step drafting and greedy: one step to compile (test_compile covers steps that draft nothing and
    the logits path). One configuration for every test, the 2,000-token prompt's: the tests after the first
    find its graphs in inductor's cache (about 20 s against 150 s cold)."""
    return dict(dtype="float32", max_num_seqs=1, max_model_len=LONG_CONTEXT, max_num_batched_tokens=512,
                draft=draft, num_speculative_tokens=2, adaptive_draft_length=False, compile_sampling=False,
                progress=False)  # fmt: skip


def test_a_request_started_eagerly_finishes_on_the_compiled_runner(pair, gate):
    target, draft = pair
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    llm = LLM(target, compile=True, compile_in_background=True, **options(draft))
    assert not llm.executor.compiled and llm.runner.compiled_step is None  # answering eagerly at once
    prompt = torch.randint(5, 384, (30,)).tolist()
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    stream = llm.stream(prompt, params)
    pieces = iter(stream)
    for _ in range(3):
        next(pieces)  # prefill and a few steps on the eager runner
    assert not llm.executor.compiled
    gate.set()
    assert llm.wait_compiled(timeout=900)
    rest = list(pieces)  # the switch happens at the next step, the request still in its slot
    assert rest and llm.executor.compiled and llm.runner.compiled_step is not None
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a prefill shape the warm-up missed would run eagerly, warning
        again = llm.generate([prompt], params)[0]  # wholly compiled
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # every shape was compiled
    eager = LLM(target, compile=False, **options(draft))
    [want] = eager.generate([prompt], params)
    for got in (stream.completion, again):
        assert len(got.token_ids) == TOKENS
        assert greedy_divergence_is_a_near_tie(eager.model, prompt, got.token_ids, want.token_ids)


def test_a_chunked_2000_token_prefill_switches_between_its_chunks(pair, gate):
    """A 2,000-token prompt in chunks of 512: the first chunk is prefilled eagerly, the compile finishes,
    and the other chunks and the decode run on the compiled runner over the keys the eager one wrote."""
    target, draft = pair
    kw = options(draft)
    llm = LLM(target, compile=True, compile_in_background=True, **kw)
    prompt = torch.randint(5, 384, (2000,)).tolist()
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    request = llm.make_request(prompt, params)
    llm.engine.add(request)
    llm.engine.step()  # the first chunk, eagerly
    assert not llm.executor.compiled and not request.output_ids
    assert 0 < request.computed < len(prompt)  # part of the prompt's keys written eagerly
    gate.set()
    assert llm.wait_compiled(timeout=900)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a chunk shape the warm-up missed would run eagerly, warning
        while not request.finished:
            llm.engine.step()
    assert llm.executor.compiled
    got = request.completion()
    eager = LLM(target, compile=False, **kw)
    [want] = eager.generate([prompt], params)
    assert len(got.token_ids) == 48
    assert greedy_divergence_is_a_near_tie(eager.model, prompt, got.token_ids, want.token_ids)


def test_the_compiled_runner_prefills_eagerly_until_its_prefill_compiles(pair, monkeypatch):
    """Phase 2: once the decode step is compiled the engine switches, and a prompt arriving before the prefill
    graphs are compiled is prefilled eagerly on the compiled runner (compiling nothing); then the prefill
    runs compiled. Both give the eager engine's tokens."""
    target, draft = pair
    prefill_gate, warm_up = threading.Event(), background_compile.warm_up

    def gated(*args, steps: bool = True, **kwargs) -> bool:
        if not steps:  # phase 2: the prefill
            prefill_gate.wait()
        return warm_up(*args, steps=steps, **kwargs)

    monkeypatch.setattr(background_compile, "warm_up", gated)
    llm = LLM(target, compile=True, compile_in_background=True, **options(draft))
    try:
        assert llm.executor.step_ready.wait(timeout=900)
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        first, second = (torch.randint(5, 384, (n,)).tolist() for n in (37, 21))
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        [early] = llm.generate([first], params)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # not compiled here
        runner = llm.runner
        assert llm.executor.compiled and runner.compiled_prefill.deferred and not llm.wait_compiled(timeout=0)
    finally:
        prefill_gate.set()
    assert llm.wait_compiled(timeout=900) and not runner.compiled_prefill.deferred
    assert runner.compiled_prefill.frozen and runner.compiled_step.frozen
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a prefill shape the warm-up missed would run eagerly, warning
        [late] = llm.generate([second], params)
    eager = LLM(target, compile=False, **options(draft))
    for prompt, got in ((first, early), (second, late)):
        [want] = eager.generate([prompt], params)
        assert len(got.token_ids) == 40
        assert greedy_divergence_is_a_near_tie(eager.model, prompt, got.token_ids, want.token_ids)


def test_a_failed_compile_leaves_the_eager_runner_serving(pair, monkeypatch, capsys):
    target, draft = pair

    def broken(*args, **kwargs):
        raise RuntimeError("inductor is out of order")

    monkeypatch.setattr(background_compile, "warm_up", broken)
    llm = LLM(target, compile=True, compile_in_background=True, **{**options(draft), "progress": True})
    assert not llm.wait_compiled(timeout=60)  # finished, failed
    prompt = torch.randint(5, 384, (12,)).tolist()
    [got] = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(got.token_ids) == 8 and not llm.executor.compiled
    assert isinstance(llm.executor.error, RuntimeError)
    assert "background compile failed (RuntimeError: inductor is out of order); running eagerly" in (
        capsys.readouterr().err
    )


def test_a_failed_prefill_compile_leaves_the_compiled_step_serving(pair, monkeypatch, capsys):
    """Phase 2 fails: the compiled step keeps serving, prompts are prefilled eagerly, and the error is kept
    and said."""
    target, draft = pair
    warm_up = background_compile.warm_up

    def prefill_broken(*args, steps: bool = True, **kwargs) -> bool:
        if not steps:
            raise RuntimeError("inductor is out of order")
        return warm_up(*args, steps=steps, **kwargs)

    monkeypatch.setattr(background_compile, "warm_up", prefill_broken)
    llm = LLM(target, compile=True, compile_in_background=True, **{**options(draft), "progress": True})
    assert not llm.wait_compiled(timeout=900)  # finished, failed
    prompt = torch.randint(5, 384, (12,)).tolist()
    [got] = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(got.token_ids) == 8 and llm.executor.compiled and llm.runner.compiled_prefill.deferred
    assert isinstance(llm.executor.error, RuntimeError)
    said = capsys.readouterr().err
    assert "background compile failed (RuntimeError: inductor is out of order); running the prefill" in said


def test_when_the_engine_compiles_in_the_background():
    cpu = EngineConfig.create("M")
    assert not cpu.compiles_in_background(True)  # LLM(): every shape before the first request
    served = cpu.answering_at_once()  # redline generate / serve: at once, compile left to its CPU default
    assert served.compiles_in_background(True)
    assert not served.compiles_in_background(False)  # REDLINE_COMPILE=0, say: nothing to compile
    for kept in (dict(compile=True), dict(compile_in_background=False), dict(tensor_parallel_size=2)):
        config = EngineConfig.create("M", **kept)
        assert config.answering_at_once() == config, kept
    assert EngineConfig.create("M", compile=True, compile_in_background=True).compiles_in_background(True)
    for wrong, message in [
        (dict(tensor_parallel_size=2), "runs on one process"),
        (dict(compile=False), "needs compile"),
        (dict(device="cuda"), "is for CPU compile"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig.create("M", compile_in_background=True, **wrong)


def test_close_stops_the_compile_at_its_next_shape(pair, gate):
    target, draft = pair
    llm = LLM(target, compile=True, compile_in_background=True, **options(draft))
    threading.Timer(2.0, gate.set).start()
    llm.close()  # waits for the shape in progress, then the warm-up stops before the next one
    assert not llm.executor._thread.is_alive() and not llm.wait_compiled(timeout=0)
    [got] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(got.token_ids) == 4 and not llm.executor.compiled  # still serving, eagerly
