"""Prompts of thousands of tokens: greedy tokens against HF transformers at 2,100 prompt tokens on both
attention paths (torch's SDPA over the cache slice, and the Triton kernels under the interpreter), and
the CPU path's memory at 4,000 tokens (SDPA's flash kernel, nothing quadratic per head)."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import build_hf_model, llama3_hf_config, llama4_hf_config, save_hf_model
from test_parity import assert_same_greedy, hf_greedy
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from redline import LLM, SamplingParams
from redline.layers.backends import Backends
from redline.models.build import load_target
from redline.runner import build
from redline.runner.model_runner import ModelRunner
from redline.runner.plan import (
    PrefillBatch,
    PrefillChunk,
    Shapes,
    SlotSampling,
    SlotSetup,
    StepPlan,
    TableUpdate,
)

PROMPT = 2100
NEW_TOKENS = 12
CONFIGS = {  # Llama 4: chunks of 512, so the prompt crosses four chunk starts (512 .. 2,048)
    "llama3": lambda: llama3_hf_config(max_position_embeddings=4096),
    "llama4": lambda: llama4_hf_config(attention_chunk_size=512, max_position_embeddings=4096),
}


@pytest.fixture(params=list(CONFIGS))
def long_pair(request, tmp_path, tokenizer_dir):
    hf = build_hf_model(CONFIGS[request.param](), seed=11)
    return hf, save_hf_model(hf, tmp_path / request.param, tokenizer_dir)


def _prompt(vocab_size: int, n: int, seed: int) -> list[int]:
    return torch.randint(5, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy_matches_hf(hf, model_dir, new_tokens: int, triton: bool, monkeypatch) -> None:
    device = "cuda" if triton and torch.cuda.is_available() else "cpu"  # on CUDA the runner picks Triton
    length = 4000 if device == "cuda" else PROMPT  # the interpreter on CPU is slow; a GPU takes 4,000
    if device == "cpu" and triton:  # the attention kernels, larger tiles: the interpreter pays per tile
        from redline.kernels.decode_attention import decode_attention
        from redline.kernels.prefill_attention import prefill_attention

        kernels = Backends(
            decode_attention=functools.partial(decode_attention, block_n=64),
            prefill_attention=functools.partial(prefill_attention, block_m=128, block_n=128),
        )
        monkeypatch.setattr(build, "backends_of", lambda config, device: kernels)
    llm = LLM(model_dir, dtype="float32", device=device, max_batch=1, max_seq_len=length + new_tokens + 4)
    prompt = _prompt(hf.config.vocab_size, length, seed=3)
    expected, hf_logits = hf_greedy(hf, prompt, new_tokens)
    [completion] = llm.generate([prompt], SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    assert_same_greedy(completion.token_ids, expected, hf_logits, length)


def test_long_prompt_greedy_matches_hf(long_pair, monkeypatch):
    hf, model_dir = long_pair
    _greedy_matches_hf(hf, model_dir, NEW_TOKENS, False, monkeypatch)


@pytest.mark.parametrize("long_pair", ["llama4"], indirect=True)
def test_long_prompt_greedy_matches_hf_through_triton_kernels(long_pair, monkeypatch):
    """The CUDA path's attention kernels (flash-attention prefill over 2,100 tokens, then split-KV steps)
    under the interpreter, against HF; 4 new tokens. On a GPU, the whole CUDA path over 4,000 tokens.
    The row-wise kernels (norm, SwiGLU) would launch 2,100 programs per layer, minutes in the
    interpreter; test_kernels.py covers them."""
    pytest.importorskip("triton")
    hf, model_dir = long_pair
    _greedy_matches_hf(hf, model_dir, 4, True, monkeypatch)


class LargestOutput(TorchDispatchMode):
    """Records every op's name and the most elements any op's output tensor holds."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.names.add(func.name())
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.largest = max([self.largest, *sizes])
        return out


def test_cpu_prefill_of_4000_tokens_materializes_nothing_quadratic_per_head(tmp_path, tokenizer_dir):
    """A 4,000-token prompt on the CPU path (torch, SDPA over the cache slice): attention runs in SDPA's
    CPU flash kernel, and no op outputs more than one [T, S] plane (the mask, which that kernel turns
    into an additive fp32 mask: [1, 1, T, S]), where the math kernel's scores would be [1, Hq, T, S]."""
    hf = build_hf_model(llama3_hf_config(max_position_embeddings=4096), seed=5)
    model = load_target(save_hf_model(hf, tmp_path / "m", tokenizer_dir), torch.float32)
    runner, n = ModelRunner(model, Shapes(1, 4096, 0)), 4000
    kv_len = runner.shapes.prefill_len(n)
    blocks = tuple(range(runner.shapes.blocks_for(n + 1)))
    prompt = tuple(_prompt(hf.config.vocab_size, n, seed=4))
    plan = StepPlan(
        tables=(TableUpdate(0, 0, blocks),), admitted=(SlotSetup(0, SlotSampling.of(SamplingParams(), 0)),),
        prefill=PrefillBatch((PrefillChunk(0, prompt, 0, final=True),), logits=False),
    )  # fmt: skip
    runner.slots.apply(plan)
    log = LargestOutput()
    with torch.no_grad(), log:  # not inference_mode, under which the mode sees SDPA whole, not its kernel
        assert plan.prefill is not None
        runner.prefill.run(plan.prefill)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in log.names
    assert log.largest <= n * kv_len < hf.config.num_attention_heads * n * kv_len
