"""The compiled engine: every prefill and step shape compiles at start-up, and none while serving (Llama 3;
Llama 4's in test_compile_llama4.py)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils
from conftest import build_hf_model, llama3_hf_config, save_hf_model
from every_bucket import run_through_every_bucket, unique_graphs

from redline.runner import compiled_step
from redline.train.random_init import write_random_draft


@pytest.fixture(scope="module")
def llama3_pair(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("compile")
    target = save_hf_model(build_hf_model(llama3_hf_config(), seed=7), root / "t", tokenizer_dir)
    return target, write_random_draft(target, root / "d")


@pytest.mark.parametrize("drafting", ["eagle3", "eagle3+ngram"])
def test_a_run_through_every_bucket_compiles_nothing(llama3_pair, drafting):
    """EAGLE-3 alone: two slots (rows 1 and 2: slot 1 busy keeps rows at 2), every step drafting: 2 x 2
    step graphs (rows, sampling) and 2 of prefill (one row, several). Beside it n-gram lookup (its history
    sliced to the unbacked kv_len; lookup alone runs the same code without the draft): one slot, adaptive,
    1 x 2 x 2 step graphs (rows, sampling, k) and 1 of prefill."""
    target, draft = llama3_pair
    if drafting == "eagle3":
        run_through_every_bucket(target, dict(draft=draft, max_batch=2, adaptive_draft_length=False), 4 + 2)
    else:
        run_through_every_bucket(target, dict(draft=draft, prompt_lookup_max=3, max_batch=1), 4 + 1)


def test_a_compiled_step_compiles_each_pair_once_then_runs_its_bytecode_directly():
    """A (rows, sampling, k) key compiles on its first call; later calls, at any kv_len, run the bytecode
    dynamo made for it with no guard lookup (and the same results); a new key raises after freeze()."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    state, weight = torch.randn(4, 8), torch.randn(8, 8)

    def step(rows: int, kv_len: int, sampling: bool, k: int) -> torch.Tensor:  # -> [rows, 8]
        out = state[:rows] @ weight * kv_len - k
        return out + 1 if sampling else out

    compiled = compiled_step.CompiledStep(step, cache_len=64, device=torch.device("cpu"), graphs=3)
    keys = [(1, 10, False, 3), (2, 20, True, 3), (1, 33, False, 3), (2, 64, True, 3), (1, 17, False, 0)]
    for rows, kv_len, sampling, k in keys:
        torch.testing.assert_close(compiled(rows, kv_len, sampling, k), step(rows, kv_len, sampling, k))
    assert unique_graphs() == 3 and set(compiled.direct) == {(1, False, 3), (2, True, 3), (1, False, 0)}
    compiled.freeze()
    with pytest.raises(RuntimeError, match="not compiled at warm-up"):
        compiled(4, 10, False, 3)
    compiled.compiled = None  # dynamo's entry point gone: the keys run without it
    torch.testing.assert_close(compiled(2, 5, True, 3), step(2, 5, True, 3))
    torch.testing.assert_close(compiled(1, 64, False, 0), step(1, 64, False, 0))
