"""GPTQ, AWQ and compressed-tensors checkpoints over tensor-parallel ranks (models/int_shards.py): each
rank reads its rows or inputs in the checkpoint's own packing, holds one process's codes of its part bit
for bit, and the ranks' logits are one process's; `redline info --tp` counts the packed codes as stored."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import build_hf_model, llama3_hf_config, save_hf_model
from int_checkpoints import write_int_checkpoint
from test_int_checkpoints import effective_weight, source  # noqa: F401 (fixture)

from redline.cli import main
from redline.config import ModelConfig
from redline.kernels import cpu_ops
from redline.models.build import load_target
from redline.models.int_shards import int_shard_of
from redline.parallel.group import TensorParallel
from redline.parallel.sharding import Shard, shard_of
from redline.quant.int_scheme import IntScheme

VARIANTS = {  # every packing and layout: int4 / int8, groups / per channel, zeros / symmetric
    "gptq-sym": dict(method="gptq", bits=4, group=32, sym=True),
    "gptq-int8": dict(method="gptq", bits=8, group=32, sym=False),
    "gptq-v2-channel": dict(method="gptq", bits=4, group=None, sym=False, v2=True),
    "awq": dict(method="awq", bits=4, group=32),
    "awq-channel": dict(method="awq", bits=4, group=None),
    "gptq-channel-act-order": dict(method="gptq", bits=4, group=None, act_order=True),  # g_idx all 0
    "ct-int4": dict(method="compressed-tensors", bits=4, group=32, sym=False),
    "ct-int8-channel": dict(method="compressed-tensors", bits=8, group=None, sym=True),
}


@pytest.fixture(scope="module")
def biased(tmp_path_factory, tokenizer_dir):
    """The source model's shape (hidden 128, 4 heads of 32, 2 KV heads, MLP 256) with q/k/v, o and MLP
    biases: over 4 ranks each holds 1 query head, a KV head two ranks share, o_proj's 32 inputs (1 group
    of 32) and a rank's MLP rows and inputs, 64 (2 groups)."""
    config = llama3_hf_config(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                              attention_bias=True, mlp_bias=True)  # fmt: skip
    model = build_hf_model(config, seed=17).to(torch.bfloat16)
    return save_hf_model(model, tmp_path_factory.mktemp("int_tp") / "src", tokenizer_dir)


def test_each_tensor_is_cut_along_its_packing(source):  # noqa: F811
    """The source model (hidden 128, 4 heads of 32, 2 KV heads, MLP 256) over 2 ranks, rank 1: o_proj's
    inputs [64, 128) are GPTQ int4 qweight rows [8, 16) (8 codes a word) and groups [2, 4) of 32; k_proj's
    outputs [32, 64) are AWQ qweight words [4, 8) and scales columns [32, 64); compressed-tensors int8
    down_proj inputs [128, 256) are weight_packed words [32, 64) (4 codes a word) and scale groups [2, 4)
    of 64. A per-channel scale and a column-parallel g_idx are read whole; a rank's part that splits a
    group is refused by name."""
    config = ModelConfig.from_dir(source)
    attn, mlp, all_ = "model.layers.0.self_attn", "model.layers.0.mlp", slice(None)
    gptq = IntScheme("gptq", 4, 32, False, False)
    assert int_shard_of(gptq, config, f"{attn}.o_proj.qweight", 1, 2) == Shard((slice(8, 16),))
    assert int_shard_of(gptq, config, f"{attn}.o_proj.scales", 1, 2) == Shard((slice(2, 4),))
    assert int_shard_of(gptq, config, f"{attn}.o_proj.qzeros", 1, 2) == Shard((slice(2, 4),))
    assert int_shard_of(gptq, config, f"{attn}.o_proj.g_idx", 1, 2) == Shard((slice(64, 128),))
    assert int_shard_of(gptq, config, f"{attn}.k_proj.qzeros", 1, 2) == Shard((all_, slice(4, 8)))
    assert int_shard_of(gptq, config, f"{attn}.k_proj.g_idx", 1, 2) is None
    assert int_shard_of(gptq, config, f"{attn}.o_proj.bias", 1, 2) == Shard((), zeroed=True)
    awq = IntScheme("awq", 4, 64, False, False)
    assert int_shard_of(awq, config, f"{attn}.k_proj.qweight", 1, 2) == Shard((all_, slice(4, 8)))
    assert int_shard_of(awq, config, f"{attn}.k_proj.scales", 1, 2) == Shard((all_, slice(32, 64)))
    ct = IntScheme("compressed-tensors", 8, 64, False, False)
    assert int_shard_of(ct, config, f"{mlp}.down_proj.weight_packed", 1, 2) == Shard((all_, slice(32, 64)))
    assert int_shard_of(ct, config, f"{mlp}.down_proj.weight_scale", 1, 2) == Shard((all_, slice(2, 4)))
    assert int_shard_of(ct, config, f"{mlp}.up_proj.weight_zero_point", 1, 2) == Shard((slice(32, 64),))
    assert int_shard_of(ct, config, f"{mlp}.up_proj.weight_shape", 1, 2) is None
    channel = IntScheme("gptq", 4, None, False, False)
    assert int_shard_of(channel, config, f"{mlp}.down_proj.scales", 1, 2) is None
    wide = IntScheme("gptq", 8, 128, False, False)
    with pytest.raises(ValueError, match=r"rank 1's inputs \[64, 128\) of 2 ranks split groups of 128"):
        int_shard_of(wide, config, f"{attn}.o_proj.qzeros", 1, 2)


def _rank_logits_of_each(
    rank: int, size: int, init_file: str, dirs: list[str], tokens: torch.Tensor, out: str
):
    """Rank `rank`'s logits of every checkpoint in dirs, saved as {out}/{i}.pt from rank 0."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    try:
        torch.set_num_threads(1)
        for i, model_dir in enumerate(dirs):
            model = load_target(model_dir, torch.float32, tp=TensorParallel.current())
            with torch.inference_mode():
                logits = model.logits(model(tokens, torch.arange(tokens.shape[1])[None])[0])
            if rank == 0:
                torch.save(logits, Path(out) / f"{i}.pt")
        dist.barrier()  # both ranks done with the group before either tears it down
    finally:
        dist.destroy_process_group()


def test_ranks_hold_one_process_codes_and_logits(biased, tmp_path):
    """Every variant over 4 ranks: rank 1's q_proj, k_proj (the KV head rank 0 shares), o_proj and
    down_proj multiply one process's weights of their part bit for bit, and rank 0's logits (column biases
    split, row biases on rank 0 alone) are one process's up to the all-reduce's fp32 order: 1e-4 with fp32
    products; 2e-3 on the AVX2 kernel, where that order's last-bit changes can move an x across a step of
    its int16 grid (as for int4 / int8 on load, tests/test_quantized_weights.py). Groups of 64 split
    o_proj's 32 inputs a rank: refused by name before a weight is read."""
    dirs = [write_int_checkpoint(biased, tmp_path / name, **v)[0] for name, v in VARIANTS.items()]
    config = ModelConfig.from_dir(biased)
    tokens = torch.randint(5, 384, (1, 40))
    args = (4, str(tmp_path / "init"), [str(d) for d in dirs], tokens, str(tmp_path))
    mp.start_processes(_rank_logits_of_each, args=args, nprocs=4, start_method="spawn")
    for i, (name, model_dir) in enumerate(zip(VARIANTS, dirs, strict=True)):
        one = load_target(model_dir, torch.float32)
        with torch.inference_mode():
            want = one.logits(one(tokens, torch.arange(40)[None])[0])
        tolerance = 2e-3 if cpu_ops.quantized_rows_loaded() else 1e-4  # once a model loaded the kernel
        got = torch.load(tmp_path / f"{i}.pt")
        assert torch.allclose(got, want, atol=tolerance, rtol=tolerance), (name, (got - want).abs().max())
        rank1 = load_target(model_dir, torch.float32, tp=TensorParallel(1, 4))
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.down_proj"):
            mine, whole = (effective_weight(m.model.layers[1].get_submodule(part)) for m in (rank1, one))
            cut = shard_of(config, f"model.layers.1.{part}.weight", 1, 4).index
            assert torch.equal(mine, whole[cut]), (name, part)
    awq = write_int_checkpoint(biased, tmp_path / "awq64", method="awq", group=64)[0]
    with pytest.raises(ValueError, match=r"o_proj: rank 1's inputs \[32, 64\) of 4 ranks split groups of 64"):
        load_target(awq, torch.float32, tp=TensorParallel(1, 4))


def test_info_counts_a_ranks_packed_codes_as_stored(source, tmp_path, capsys):  # noqa: F811
    """GPTQ int4 in groups of 32 over 2 ranks. Per layer a rank's linears stand for 73,728 weights (q 64 x
    128, k and v 32 x 128, o 128 x 64, gate, up and down 128 x 128), stored in 37/64 of a byte each
    (qweight 1/2, scales fp16 1/16, qzeros 1/64) plus an int32 g_idx entry per input (832 inputs): 45,952
    bytes; with two bf16 norms of 128, 3 layers, the tied table's block 192 x 128 in bf16 and the final
    norm: 246,656 parameters in 188,800 bytes."""
    path, _ = write_int_checkpoint(source, tmp_path / "q", method="gptq", bits=4, group=32)
    assert main(["info", "--model", str(path), "--tp", "2"]) == 0
    assert "tensor parallel 2: 246,656 parameters per rank, 188,800 bytes each" in capsys.readouterr().out
