"""The KV pool's size when the user names none: on CUDA a share of the device's memory less what is in use
and a prefill's activations, on CPU every slot's whole context up to 4 GiB; and the flags that set it,
prefix caching and the prefill budget."""

from __future__ import annotations

import pytest
import torch
from conftest import build_hf_model, llama3_hf_config, save_hf_model

from redline import LLM
from redline.cli import main
from redline.runner.kv_budget import CPU_DEFAULT_BYTES, cpu_kv_blocks, cuda_kv_bytes

GIB = 2**30


def test_on_cuda_the_pool_gets_the_share_left_after_weights_and_activations():
    """An H200 (140 GiB), 0.9: 126 GiB, less 16 GiB in use and a 3 GiB activation peak: 107 GiB."""
    assert (
        cuda_kv_bytes(free=124 * GIB, total=140 * GIB, utilization=0.9, activations=3 * GIB)
        == int(0.9 * 140 * GIB) - 19 * GIB
    )
    with pytest.raises(
        ValueError, match=r"no device memory left for the KV cache: 50% of 140.0 GiB is 70.0 GiB"
    ):
        cuda_kv_bytes(free=60 * GIB, total=140 * GIB, utilization=0.5, activations=GIB)
    for wrong in (0.0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            cuda_kv_bytes(free=GIB, total=GIB, utilization=wrong, activations=0)


def test_on_cpu_the_pool_holds_every_context_up_to_4_gib_and_at_least_one():
    block = 2**20
    assert cpu_kv_blocks(whole_contexts=100, one_context=10, block_bytes=block) == 100
    assert (
        cpu_kv_blocks(whole_contexts=10**6, one_context=300, block_bytes=block) == CPU_DEFAULT_BYTES // block
    )
    assert cpu_kv_blocks(whole_contexts=10**6, one_context=5000, block_bytes=block) == 5000


def test_256_slots_on_cpu_take_at_most_4_gib(tmp_path, tokenizer_dir):
    """256 slots of a 4,096-token context of a model with 2 KB of KV per position would want 2.3 GB:
    under the cap, every context is held; a wider model's pool stops at 4 GiB."""
    small = save_hf_model(build_hf_model(llama3_hf_config(), seed=1), tmp_path / "s", tokenizer_dir)
    llm = LLM(small, dtype="float32", max_batch=256, max_seq_len=4096, compile=False, progress=False)
    assert llm.runner.num_blocks == 256 * -(-llm.runner.shapes.cache_len // 16)
    wide = llama3_hf_config(
        num_hidden_layers=8, num_key_value_heads=4, num_attention_heads=4, hidden_size=256
    )
    target = save_hf_model(build_hf_model(wide, seed=2), tmp_path / "w", tokenizer_dir)
    llm = LLM(target, dtype="float32", max_batch=256, max_seq_len=4096, compile=False, progress=False)
    assert llm.runner.num_blocks * llm.runner.block_bytes <= CPU_DEFAULT_BYTES
    assert llm.stats().kv_blocks == llm.runner.num_blocks == CPU_DEFAULT_BYTES // llm.runner.block_bytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_pool_fills_the_share_it_was_given(tmp_path, tokenizer_dir):
    target = save_hf_model(build_hf_model(llama3_hf_config(), seed=3), tmp_path / "t", tokenizer_dir)
    total = torch.cuda.mem_get_info()[1]
    llm = LLM(
        target, dtype="bfloat16", device="cuda", max_seq_len=1024, gpu_memory_utilization=0.3, progress=False
    )
    pool_bytes = llm.runner.num_blocks * llm.runner.block_bytes
    assert 0 < pool_bytes <= 0.3 * total - torch.cuda.memory_allocated() + pool_bytes


def test_prefill_and_prefix_flags(tmp_path, tokenizer_dir, capsys):
    target = save_hf_model(build_hf_model(llama3_hf_config(), seed=6), tmp_path / "t", tokenizer_dir)
    argv = ["generate", "--model", str(target), "--prompt", "x " * 40, "--dtype", "float32", "--no-compile"]
    assert main([*argv, "--max-prefill-tokens", "8"]) != 0
    assert "max_num_batched_tokens must be at least 16 (one block), got 8" in capsys.readouterr().err
    flags = ["--max-prefill-tokens", "16", "--no-prefix-caching", "--gpu-memory-utilization", "0.5"]
    assert main([*argv, *flags, "--max-tokens", "3"]) == 0
