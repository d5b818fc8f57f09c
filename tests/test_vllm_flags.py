"""A `vllm serve` command line works with `redline serve`: vLLM's spellings of the flags mean what
redline's own do, and --speculative-config names the EAGLE-3 draft."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_hf_model, llama3_hf_config, save_hf_model

from redline import LLM
from redline.cli import build_parser
from redline.models.random_init import write_random_draft
from redline.server.serve import engine_options, speculative_config


def test_vllm_and_redline_spellings_give_the_same_engine(tmp_path, tokenizer_dir):
    target = save_hf_model(build_hf_model(llama3_hf_config(), seed=1), tmp_path / "t", tokenizer_dir)
    draft = str(write_random_draft(target, tmp_path / "d"))
    spec = json.dumps({"method": "eagle3", "model": draft, "num_speculative_tokens": 2})
    vllm = ["serve", str(target), "--max-model-len", "512", "--max-num-seqs", "3", "--dtype", "auto",
            "--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.8", "--speculative-config", spec,
            "--max-num-batched-tokens", "64", "--no-enable-prefix-caching",
            "--served-model-name", "x"]  # fmt: skip
    ours = ["serve", "--model", str(target), "--max-seq-len", "512", "--max-batch", "3", "--dtype", "auto",
            "--tp", "1", "--gpu-memory-utilization", "0.8", "--draft", draft, "--num-draft-tokens", "2",
            "--max-prefill-tokens", "64", "--no-prefix-caching", "--served-model-name", "x"]  # fmt: skip
    parser = build_parser()
    options = engine_options(parser.parse_args(vllm))
    assert options == engine_options(parser.parse_args(ours))
    llm = LLM(**options, progress=False)
    assert (llm.runner.slots, llm.max_seq_len, llm.num_draft_tokens) == (3, 512, 2)
    assert llm.runner.prefix_caching is False and llm.scheduler.max_prefill_tokens == 64
    raw = json.loads((target / "config.json").read_text())
    want = raw.get("torch_dtype") or raw["dtype"]  # transformers 5 writes "dtype"
    assert want == "float32" and next(llm.model.parameters()).dtype == torch.float32  # --dtype auto
    assert engine_options(parser.parse_args(["serve", str(target), "--enable-prefix-caching"]))[
        "prefix_caching"
    ]


def test_a_speculative_config_redline_cannot_honour_is_refused():
    assert speculative_config('{"method": "eagle3", "model": "d", "num_speculative_tokens": 4}') == ("d", 4)
    assert speculative_config('{"model": "d"}') == ("d", 3)
    for text, message in [
        ("{nope", "is not JSON"),
        ('{"method": "ngram", "model": "d"}', 'only "method": "eagle3"'),
        ('{"method": "eagle3"}', 'needs "model"'),
        ('{"model": "d", "num_speculative_tokens": "3"}', "must be an integer"),
    ]:
        with pytest.raises(ValueError, match=message):
            speculative_config(text)
    parser = build_parser()
    args = parser.parse_args(["serve", "m", "--draft", "d", "--speculative-config", '{"model": "d"}'])
    with pytest.raises(ValueError, match="give the draft once"):
        engine_options(args)
