"""The draft's pass over a prefill's rows: every row's keys written alone and the layer run over the one row
the proposals continue from (DraftInputs.one_row) gives the hidden state and the KV cache of the layer run
over every row."""

from __future__ import annotations

import torch
from conftest import build_hf_model, llama3_hf_config, save_hf_model

from redline.models.build import load_target
from redline.models.eagle3 import aux_layers_of, load_draft
from redline.models.kv_cache import KVCache
from redline.speculative.propose import DraftInputs, draft_root
from redline.train.random_init import write_random_draft


@torch.inference_mode()
def test_one_row_pass_equals_the_pass_over_every_row(tmp_path, tokenizer_dir):
    """Two chunks of 37 padded rows each, at positions 0.. and 20.. (a later chunk, whose earlier keys are
    in the cache), continuing from rows 36 and 11: fp32, so equal up to the sums' order. One row and 37
    take different kernels (a GEMV, a blocked GEMM) whose sums differ by a few ulps (1.2e-7 each), grown
    by the norms and the layer to 1.6e-5 at worst on an AVX2 CPU; a wrong row or key would differ by
    O(1), so 1e-4."""
    hf = build_hf_model(llama3_hf_config(num_hidden_layers=4), seed=0)
    target_dir = save_hf_model(hf, tmp_path / "t", tokenizer_dir)
    draft_dir = write_random_draft(target_dir, tmp_path / "d", draft_vocab=100, std=0.3)
    target = load_target(target_dir, torch.float32, aux_layers=aux_layers_of(draft_dir, 4))
    draft = load_draft(draft_dir, target, torch.float32)
    length, kv_len = 37, 64
    tokens = torch.randint(5, 384, (2, length + 1))
    positions = torch.stack((torch.arange(length), torch.arange(20, 20 + length)))
    _, aux = target(tokens[:, :-1], positions)
    row = torch.tensor([length - 1, 11])
    layer = draft.config.layer
    caches = [KVCache(layer, 2, kv_len, torch.float32, torch.device("cpu")) for _ in range(2)]
    for held, same in zip(caches[0].layers[0], caches[1].layers[0], strict=True):
        same.copy_(held.normal_())  # the keys of positions < 20, and garbage past them as a pool holds
    results = []
    for one_row, cache in zip((False, True), caches, strict=True):
        first_row = torch.zeros(2, dtype=torch.int64)
        inputs = DraftInputs(aux, tokens[:, 1:], positions, first_row, cache.layers[0], cache.tables(0, 2),
                             kv_len, one_row=one_row)  # fmt: skip
        h, position = draft_root(draft, inputs, tokens[:, 1:], row)
        results.append((h, position, [t.clone() for t in cache.layers[0]]))
    (h_all, pos_all, kv_all), (h_one, pos_one, kv_one) = results
    assert h_one.shape == (2, 1, layer.hidden_size)
    assert torch.equal(pos_one, pos_all) and torch.equal(pos_one, positions.gather(1, row[:, None]))
    torch.testing.assert_close(h_one, h_all, atol=1e-4, rtol=1e-4)
    for one, every in zip(kv_one, kv_all, strict=True):
        torch.testing.assert_close(one, every, atol=1e-4, rtol=1e-4)
