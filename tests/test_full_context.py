"""Requests that fill their slot to exactly the context window, with a draft that is always accepted.

Every step then emits K + 1 tokens, so a request ends with its slot's position up to K past the window,
and the slot, now free, is still computed while it lies inside the batch bucket of the others. Its writes
must stay inside the cache whatever state it holds, and every request must run to its last token.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_hf_model, llama3_hf_config, save_hf_model
from safetensors.torch import load_file, save_file

from redline import LLM, SamplingParams
from redline.train.random_init import write_random_draft

CONTEXT = 160


@pytest.fixture(scope="module")
def zero_logit_pair(tmp_path_factory, tokenizer_dir):
    """A target and a draft whose final norm weights are zero: every logit is 0, so both always choose
    token 0 (argmax takes the first of equal values), and the target accepts every draft."""
    root = tmp_path_factory.mktemp("zero_logits")
    model = build_hf_model(llama3_hf_config(max_position_embeddings=CONTEXT))
    with torch.no_grad():
        model.model.norm.weight.zero_()
    target = save_hf_model(model, root / "target", tokenizer_dir)
    draft = write_random_draft(target, root / "draft")  # full vocabulary: draft id 0 is target id 0
    weights = load_file(draft / "model.safetensors")
    weights["norm.weight"].zero_()
    save_file(weights, draft / "model.safetensors")
    return target, draft


GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_requests_run_to_the_context_limit_with_every_draft_accepted(zero_logit_pair, k, batch, device):
    """On CUDA through the Triton kernels and a CUDA graph per step shape, captured at start-up."""
    run_to_the_limit(*zero_logit_pair, k, batch, device=device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_cuda_runs_to_the_context_limit(zero_logit_pair):
    """The CUDA graphs capture the compiled step (kv_len unbacked) with PDL launches on Hopper and newer;
    the prompt goes through the compiled prefill."""
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    run_to_the_limit(*zero_logit_pair, k=3, batch=4, device="cuda", compile=True, pdl=hopper)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("k", [1, 5])
def test_ngram_lookup_runs_to_the_context_limit(zero_logit_pair, k, batch):
    """N-gram lookup alone over prompts of token 0: every proposal (0 again) is accepted, up to the last
    position of the context, the slots' histories filled to their ends."""
    run_to_the_limit(zero_logit_pair[0], None, k, batch, speculative_method="ngram", zeros=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize(("k", "topk", "nodes"), [(1, 2, 3), (3, 2, 11), (4, 2, 15)])
def test_draft_trees_run_to_the_context_limit(zero_logit_pair, k, topk, nodes, batch, device):
    """A draft tree writes further past its root than a chain (its rows, the draft's frontier slots):
    every write stays inside the cache, and every request runs to its last token. Every draft scores the
    same here, so the tree keeps whole levels: with all it drafts (nodes = its pool + 1) it holds the
    all-zero path (CPU's topk gives the first of equal values first; CUDA's order among them is unspecified,
    so there the acceptance is not asserted), and each step accepts K. On CUDA the 3-row trees take the
    Triton decode kernel under the tree's mask, the larger ones the gathered cache, in CUDA graphs."""
    tree = dict(speculative_eagle_topk=topk, speculative_num_draft_tokens=nodes)
    run_to_the_limit(*zero_logit_pair, k, batch, device=device, every_draft=device == "cpu", **tree)


def run_to_the_limit(
    target, draft, k: int, batch: int, zeros: bool = False, every_draft: bool = True, **engine
) -> None:
    # every step drafts: adaptive draft length, timing the steps, may find drafting does not pay (a K = 1 step
    # costing twice one without drafts under load) and then skip it for a whole request
    kw = dict(
        max_batch=batch, max_seq_len=CONTEXT, num_draft_tokens=k, progress=False, adaptive_draft_length=False
    )
    llm = LLM(target, dtype="float32", **kw, **({"draft": draft} if draft else {}), **engine)
    # Staggered prompt lengths, so requests end at different steps and slots are reused after ending.
    # After the first token, m steps of K + 1 leave 1 token for the last step, which still advances the
    # slot by K + 1: it ends at CONTEXT + K - 1, the furthest a slot can go (n = CONTEXT - 2 - m (K + 1)).
    steps = torch.randperm((CONTEXT - 3) // (k + 1))[: 3 * batch] + 1
    lengths = (CONTEXT - 2 - steps * (k + 1)).tolist()
    prompts = [[0] * n if zeros else torch.randint(5, 384, (n,)).tolist() for n in lengths]
    params = [SamplingParams(max_tokens=CONTEXT - n, ignore_eos=True) for n in lengths]
    for n, params_i, c in zip(lengths, params, llm.generate(prompts, params), strict=True):
        assert c.token_ids == [0] * params_i.max_tokens and c.finish_reason == "length"
        assert n + len(c.token_ids) == CONTEXT
        assert c.acceptance_length == k + 1 or not every_draft  # every step accepted all K drafts
    stats = llm.stats()  # every slot and block given back
    assert stats.running == stats.waiting == 0 and stats.kv_blocks_free == stats.kv_blocks
