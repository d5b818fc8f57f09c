"""One EngineConfig behind every entry point: LLM(...)'s options and every command's flags come from its
fields, with the same names and defaults; vLLM's spellings mean what redline's do, so a `vllm serve`
command line works with `redline serve`, and --speculative-config names the EAGLE-3 draft."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_hf_model, llama3_hf_config, save_hf_model

from redline import LLM
from redline.cli import ONE_SLOT, build_parser
from redline.engine_config import EngineConfig, SpeculativeConfig, options
from redline.engine_flags import config_from_args, flags_of
from redline.server.serve import engine_config
from redline.train.random_init import write_random_draft

# command -> the argv that gives its defaults, and the options it declares a default of its own for
COMMANDS = {
    "generate": (["generate", "--model", "m", "--prompt", "x"], ONE_SLOT),
    "serve": (["serve", "m"], {}),
    "bench": (["bench", "--model", "m"], {"quantization": []}),  # bench's: quantized rows beside the others
    "eval": (["eval", "--model", "m", "--data", "humaneval"], {}),
    "info": (["info", "--model", "m"], {}),
}


def test_every_commands_engine_flags_are_the_fields_with_their_defaults():
    """Each command's flags for an option have the option's names and default (or the command's declared
    one), so the engine a command builds by default is EngineConfig's default; serve and generate take
    every option."""
    parser = build_parser()
    for name, (argv, own) in COMMANDS.items():
        args = parser.parse_args(argv)
        given = {o.flat for o in options().values() if hasattr(args, o.flat)}
        assert {"model", "dtype", "tensor_parallel_size"} <= given, name
        for flat in given - {"model"}:
            assert getattr(args, flat) == own.get(flat, options()[flat].default), (name, flat)
        if name in ("generate", "serve"):
            assert given == set(options()), name
    generate = config_from_args(parser.parse_args(COMMANDS["generate"][0]))
    assert generate == EngineConfig.create("m", **ONE_SLOT)
    served = engine_config(parser.parse_args(COMMANDS["serve"][0]))
    assert served == EngineConfig.create("m").answering_at_once()  # answers while it compiles
    assert served.compilation.compile_in_background
    for o in options().values():  # redline's older names are aliases of vLLM's, on the command line too
        assert flags_of(o)[0] == "--" + o.flat.replace("_", "-")
        assert all(f"--{alias.replace('_', '-')}" in flags_of(o) for alias in o.aliases)


def test_python_options_take_vllms_names_and_redlines_and_refuse_others():
    vllm = EngineConfig.create("m", max_num_seqs=3, max_model_len=512, enable_prefix_caching=False,
                               kv_cache_memory_bytes=4096, max_num_batched_tokens=64)  # fmt: skip
    ours = EngineConfig.create("m", max_batch=3, max_seq_len=512, prefix_caching=False, kv_cache_memory=4096,
                               max_prefill_tokens=64)  # fmt: skip
    assert vllm == ours and vllm.scheduler.slots == 3 and vllm.cache.kv_cache_memory_bytes == 4096
    with pytest.raises(TypeError, match="unknown engine option 'max_batches'"):
        EngineConfig.create("m", max_batches=3)
    with pytest.raises(ValueError, match="given twice"):
        EngineConfig.create("m", max_batch=3, max_num_seqs=3)
    for bad, message in [
        (dict(max_num_seqs=0), "max_num_seqs must be at least 1"),
        (dict(tensor_parallel_size=1, expert_parallel=True), "expert_parallel needs tensor_parallel_size"),
        (dict(draft="d", num_draft_tokens=9), "num_speculative_tokens must be an integer in 1..8"),
        (dict(dtype="int3"), "unknown dtype 'int3'"),
        (dict(mode="fast"), "unknown mode 'fast'"),
        (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\]"),
        (dict(max_num_batched_tokens=8), "at least 16"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig.create("m", **bad)
    for bad, message in [  # what Python can pass and a flag cannot
        (dict(max_num_seqs=1.5), "max_num_seqs must be int or None, got 1.5"),
        (dict(max_num_seqs="8"), "max_num_seqs must be int or None, got '8'"),
        (dict(enable_prefix_caching="no"), "enable_prefix_caching must be bool, got 'no'"),
        (dict(num_speculative_tokens=True), "num_speculative_tokens must be int, got True"),
    ]:
        with pytest.raises(TypeError, match=message):
            EngineConfig.create("m", **bad)
    for bad, message in [  # options that need another
        (dict(device="cuda:x"), "unknown device 'cuda:x'"),
        (dict(cuda_graphs=True), "cuda_graphs needs a CUDA device"),
        (dict(pdl=True), "pdl needs a CUDA device"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig.create("m", **bad)
    python = EngineConfig.create("m", dtype=torch.float16, kv_cache_memory="2GiB", gpu_memory_utilization=1)
    assert (python.load.dtype, python.cache.kv_cache_memory_bytes) == ("float16", 2**31)
    throughput = EngineConfig.create("m", mode="max-throughput").scheduler
    assert (throughput.slots, throughput.prefill_tokens) == (256, 2048)
    latency = EngineConfig.create("m", max_num_seqs=16).scheduler
    assert (latency.slots, latency.prefill_tokens) == (16, None)


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
    config = engine_config(parser.parse_args(vllm))
    assert config == engine_config(parser.parse_args(ours))
    llm = LLM(config=config, progress=False)
    assert (llm.config.scheduler.slots, llm.max_seq_len, llm.num_draft_tokens) == (3, 512, 2)
    scheduler = llm.engine.scheduler
    assert scheduler.prefix_caching is False and scheduler.max_prefill_tokens == 64
    raw = json.loads((target / "config.json").read_text())
    want = raw.get("torch_dtype") or raw["dtype"]  # transformers 5 writes "dtype"
    assert want == "float32" and next(llm.model.parameters()).dtype == torch.float32  # --dtype auto
    assert llm.config.load.dtype == "float32"  # resolved
    enabled = engine_config(parser.parse_args(["serve", str(target), "--enable-prefix-caching"]))
    assert enabled.cache.enable_prefix_caching
    without = engine_config(parser.parse_args(["serve", str(target), "--draft", draft, "--no-speculation"]))
    assert not without.speculation


def test_a_speculative_config_redline_cannot_honour_is_refused():
    got = SpeculativeConfig.from_json('{"method": "eagle3", "model": "d", "num_speculative_tokens": 4}')
    assert (got.model, got.num_speculative_tokens) == ("d", 4)
    assert SpeculativeConfig.from_json('{"model": "d"}').num_speculative_tokens == 3
    for text, message in [
        ("{nope", "is not JSON"),
        ('{"method": "ngram", "model": "d"}', 'method "ngram" takes no draft model'),
        ('{"method": "medusa", "model": "d"}', "unknown speculative method"),
        ("[1]", "must be a JSON object"),
        ('{"method": "eagle3"}', 'needs "model"'),
        ('{"model": "d", "num_speculative_tokens": "3"}', "num_speculative_tokens must be int, got '3'"),
        ('{"model": "d", "draft_tensor_parallel_size": 2}', "unknown keys"),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_json(text)
    parser = build_parser()
    args = parser.parse_args(["serve", "m", "--draft", "d", "--speculative-config", '{"model": "d"}'])
    with pytest.raises(ValueError, match="give the draft once"):
        engine_config(args)
    with pytest.raises(ValueError, match="give the draft once"):
        EngineConfig.create("m", draft="d", speculative_config={"model": "d"})
