"""The CUDA-graph runner replays the decode step exactly (GPU only)."""

from __future__ import annotations

import pytest
import torch

from redline import LLM, SamplingParams
from redline.train.random_init import write_random_draft, write_random_model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cuda_graph_step_equals_eager_step(tmp_path, temperature):
    target = write_random_model(tmp_path / "t")
    draft = write_random_draft(target, tmp_path / "d")
    prompts = [list(range(5, 30)), list(range(40, 47)), list(range(9, 20))]
    params = SamplingParams(max_tokens=40, temperature=temperature, seed=3, ignore_eos=True)
    llm = LLM(target, dtype="float32", device="cuda", max_batch=4, max_seq_len=128, draft=draft)
    graphed = [c.token_ids for c in llm.generate(prompts, params)]
    assert llm.runner._run_step.graphs  # the graphs were captured and replayed
    llm.runner._run_step = llm.runner.step  # the same step, eager
    assert [c.token_ids for c in llm.generate(prompts, params)] == graphed
