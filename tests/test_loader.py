import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from redline.models.loader import CheckpointError, Part, checkpoint_files, load_weights, save_weights
from redline.models.shards import ShardWriter

VOCAB, HIDDEN = 32, 8


class TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.proj = torch.nn.Linear(HIDDEN, 2 * HIDDEN)
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.ones(2 * HIDDEN))
        self.lm_head = torch.nn.Linear(2 * HIDDEN, VOCAB, bias=False)
        self.register_buffer("position_ids", torch.arange(4))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


def meta_model() -> TinyModel:
    with torch.device("meta"):
        return TinyModel()


def random_weights(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {
        "embed.weight": torch.randn(VOCAB, HIDDEN, dtype=dtype),
        "proj.weight": torch.randn(2 * HIDDEN, HIDDEN, dtype=dtype),
        "proj.bias": torch.randn(2 * HIDDEN, dtype=dtype),
        "norm.weight": torch.randn(2 * HIDDEN, dtype=dtype),
        "lm_head.weight": torch.randn(VOCAB, 2 * HIDDEN, dtype=dtype),
        "position_ids": torch.randint(0, 100, (4,)),
    }


def assert_loaded(model: torch.nn.Module, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    state = model.state_dict()
    for key, saved in weights.items():
        expected = saved.to(dtype) if saved.is_floating_point() else saved
        assert state[key].dtype == expected.dtype, key
        assert torch.equal(state[key], expected), key
    for name, param in model.named_parameters():
        assert not param.requires_grad, name
    assert not any(t.is_meta for t in state.values())


def test_single_file(tmp_path: Path) -> None:
    weights = random_weights()
    save_weights(weights, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    model = meta_model()
    loaded = load_weights(model, tmp_path, dtype=torch.float32, progress=False)
    assert loaded == set(weights)
    assert_loaded(model, weights, torch.float32)
    assert model.scratch.is_meta  # non-persistent buffers are not expected and left alone
    assert isinstance(model.proj.weight, torch.nn.Parameter)
    assert "position_ids" in dict(model.named_buffers())


def test_sharded(tmp_path: Path) -> None:
    weights = random_weights()
    save_weights(weights, tmp_path, max_shard_bytes=1200)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard_names = sorted(set(index["weight_map"].values()))
    assert len(shard_names) >= 3
    assert shard_names[0] == f"model-00001-of-{len(shard_names):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in weights.values())
    assert set(checkpoint_files(tmp_path)) == set(weights)
    model = meta_model()
    load_weights(model, tmp_path, dtype=torch.float32, progress=False)
    assert_loaded(model, weights, torch.float32)


@pytest.mark.parametrize(
    ("disk_dtype", "load_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]
)
def test_dtype_cast(tmp_path: Path, disk_dtype: torch.dtype, load_dtype: torch.dtype) -> None:
    weights = random_weights(disk_dtype)
    save_weights(weights, tmp_path)
    model = meta_model()
    load_weights(model, tmp_path, dtype=load_dtype, progress=False)
    assert_loaded(model, weights, load_dtype)
    assert model.position_ids.dtype == torch.int64


def fp8_meta_model() -> TinyModel:
    """proj in FP8 with a per-tensor scale, as an FP8 checkpoint's skeleton has it."""
    model = meta_model()
    with torch.device("meta"):
        model.proj.weight = torch.nn.Parameter(torch.empty(2 * HIDDEN, HIDDEN, dtype=torch.float8_e4m3fn))
        model.proj.weight_scale = torch.nn.Parameter(torch.empty(1))
    return model


def test_float8_keeps_dtype_and_scales_load_as_fp32(tmp_path: Path) -> None:
    weights = random_weights()
    weights["proj.weight"] = weights["proj.weight"].to(torch.float8_e4m3fn)
    weights["proj.weight_scale"] = torch.tensor(0.0123, dtype=torch.bfloat16)  # [] bf16, as some releases
    save_weights(weights, tmp_path)
    model = fp8_meta_model()
    load_weights(model, tmp_path, dtype=torch.bfloat16, progress=False)
    assert model.proj.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(model.proj.weight.view(torch.uint8), weights["proj.weight"].view(torch.uint8))
    assert model.proj.weight_scale.dtype == torch.float32 and model.proj.weight_scale.shape == (1,)
    assert model.proj.weight_scale.item() == weights["proj.weight_scale"].float().item()  # exact
    assert model.embed.weight.dtype == torch.bfloat16


def test_float8_where_the_model_is_high_precision_and_back(tmp_path: Path) -> None:
    weights = random_weights()
    weights["proj.weight"] = weights["proj.weight"].to(torch.float8_e4m3fn)
    save_weights(weights, tmp_path)
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: tensor 'proj\.weight' is torch\.float8_e4m3fn"
    ):
        load_weights(meta_model(), tmp_path, dtype=torch.float32, progress=False)
    weights = {**random_weights(), "proj.weight_scale": torch.ones(1)}
    save_weights(weights, tmp_path)
    with pytest.raises(CheckpointError, match=r"'proj\.weight' is torch\.float32 but .* is torch\.float8"):
        load_weights(fp8_meta_model(), tmp_path, dtype=torch.float32, progress=False)


def test_rename_strips_prefix_and_skips_vision(tmp_path: Path) -> None:
    weights = random_weights()
    on_disk = {f"language_model.{key}": t for key, t in weights.items()}
    on_disk["vision_model.patch.weight"] = torch.randn(3, 3)

    def rename(key: str) -> str | None:
        return None if key.startswith("vision_model.") else key.removeprefix("language_model.")

    save_weights(on_disk, tmp_path)
    model = meta_model()
    loaded = load_weights(model, tmp_path, dtype=torch.float32, rename=rename, progress=False)
    assert loaded == set(weights)
    assert_loaded(model, weights, torch.float32)


def test_optional_key_absent(tmp_path: Path) -> None:
    weights = random_weights()
    del weights["lm_head.weight"]
    save_weights(weights, tmp_path)
    model = meta_model()
    loaded = load_weights(model, tmp_path, dtype=torch.float32, optional=["lm_head.weight"], progress=False)
    assert loaded == set(weights)
    assert model.lm_head.weight.is_meta
    assert torch.equal(model.embed.weight, weights["embed.weight"])


def test_missing_key(tmp_path: Path) -> None:
    weights = random_weights()
    del weights["norm.weight"]
    save_weights(weights, tmp_path)
    with pytest.raises(CheckpointError, match=r"lacks 1 keys: norm\.weight") as error:
        load_weights(meta_model(), tmp_path, dtype=torch.float32, progress=False)
    assert str(tmp_path) in str(error.value)


def test_unexpected_key(tmp_path: Path) -> None:
    weights = random_weights()
    weights["extra.weight"] = torch.randn(2)
    save_weights(weights, tmp_path)
    with pytest.raises(CheckpointError, match=r"unexpected.*'extra\.weight'.*model\.safetensors"):
        load_weights(meta_model(), tmp_path, dtype=torch.float32, progress=False)


def test_shape_mismatch(tmp_path: Path) -> None:
    weights = random_weights()
    weights["proj.weight"] = torch.randn(HIDDEN, HIDDEN)
    save_weights(weights, tmp_path)
    model = meta_model()
    with pytest.raises(CheckpointError) as error:
        load_weights(model, tmp_path, dtype=torch.float32, progress=False)
    message = str(error.value)
    for part in ("model.safetensors", "'proj.weight'", "[8, 8]", "[16, 8]"):
        assert part in message
    assert model.embed.weight.is_meta  # failed before reading any data


def test_truncated_file(tmp_path: Path) -> None:
    save_weights(random_weights(), tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*not fully covered"):
        load_weights(meta_model(), tmp_path, dtype=torch.float32, progress=False)


def test_garbage_file(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"definitely not a safetensors file" * 4)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        load_weights(meta_model(), tmp_path, dtype=torch.float32, progress=False)


def test_no_checkpoint_files(tmp_path: Path) -> None:
    torch.save({"not": "weights"}, tmp_path / "training_args.bin")  # other .bin files are not weights
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors or pytorch_model\*\.bin in"):
        checkpoint_files(tmp_path)


def test_index_points_to_missing_shard(tmp_path: Path) -> None:
    save_weights(random_weights(), tmp_path, max_shard_bytes=1200)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    missing_shard = index["weight_map"]["proj.weight"]
    (tmp_path / missing_shard).unlink()
    with pytest.raises(CheckpointError, match=rf"index\.json.*missing.*{re.escape(missing_shard)}"):
        load_weights(meta_model(), tmp_path, dtype=torch.float32, progress=False)


def test_malformed_index(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: unreadable"):
        checkpoint_files(tmp_path)


def test_key_in_two_files(tmp_path: Path) -> None:
    weights = random_weights()
    save_file(weights, tmp_path / "a.safetensors")
    save_file({"norm.weight": weights["norm.weight"]}, tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match=r"'norm\.weight'.*a\.safetensors.*b\.safetensors"):
        load_weights(meta_model(), tmp_path, dtype=torch.float32, progress=False)


def test_save_tied_weights(tmp_path: Path) -> None:
    embedding = torch.randn(VOCAB, HIDDEN)
    tied = {"embed.weight": embedding, "lm_head.weight": embedding, "first_rows": embedding[:4]}
    save_weights(tied, tmp_path)
    reloaded = load_file(tmp_path / "model.safetensors")
    assert reloaded.keys() == tied.keys()
    for key, tensor in tied.items():
        assert torch.equal(reloaded[key], tensor), key


# PyTorch .bin checkpoints: same key map, validation and errors as safetensors


def test_bin_single_file(tmp_path: Path) -> None:
    weights = random_weights(torch.float16)
    torch.save(weights, tmp_path / "pytorch_model.bin")
    model = meta_model()
    assert load_weights(model, tmp_path, dtype=torch.float32, progress=False) == set(weights)
    assert_loaded(model, weights, torch.float32)


@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin"])
def test_loaded_tensors_own_their_memory(tmp_path: Path, name: str) -> None:
    """Both formats are read through memory maps; uncast tensors are copied out, so the model neither keeps
    the file mapped (resident) nor changes when the file does."""
    weights = random_weights()
    path = tmp_path / name
    if name == "pytorch_model.bin":
        torch.save(weights, path)
    else:
        save_weights(weights, tmp_path)
    model = meta_model()
    load_weights(model, tmp_path, dtype=torch.float32, progress=False)
    with path.open("r+b") as f:
        f.write(bytes(path.stat().st_size))
    assert_loaded(model, weights, torch.float32)


def test_bin_sharded_with_index(tmp_path: Path) -> None:
    weights = random_weights()
    names = list(weights)
    shards = {"pytorch_model-00001-of-00002.bin": names[:3], "pytorch_model-00002-of-00002.bin": names[3:]}
    for file, keys in shards.items():
        torch.save({k: weights[k] for k in keys}, tmp_path / file)
    index = {"weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    assert {p.name for p in checkpoint_files(tmp_path).values()} == set(shards)
    model = meta_model()
    load_weights(model, tmp_path, dtype=torch.float32, progress=False)
    assert_loaded(model, weights, torch.float32)


def test_bin_legacy_format_loads(tmp_path: Path) -> None:
    """Files from torch.save before the zip format (PyTorch < 1.6) cannot be memory-mapped: read whole."""
    weights = random_weights()
    torch.save(weights, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    model = meta_model()
    load_weights(model, tmp_path, dtype=torch.float32, progress=False)
    assert_loaded(model, weights, torch.float32)


def test_safetensors_preferred_over_bin(tmp_path: Path) -> None:
    weights = random_weights()
    save_weights(weights, tmp_path)
    torch.save({k: torch.zeros_like(v) for k, v in weights.items()}, tmp_path / "pytorch_model.bin")
    model = meta_model()
    load_weights(model, tmp_path, dtype=torch.float32, progress=False)
    assert_loaded(model, weights, torch.float32)


def test_bin_validation_names_the_file(tmp_path: Path) -> None:
    weights = random_weights()
    weights["proj.weight"] = torch.randn(HIDDEN, HIDDEN)
    torch.save(weights, tmp_path / "pytorch_model.bin")
    model = meta_model()
    with pytest.raises(
        CheckpointError, match=r"pytorch_model\.bin: tensor 'proj\.weight' has shape \[8, 8\]"
    ):
        load_weights(model, tmp_path, dtype=torch.float32, progress=False)
    assert model.embed.weight.is_meta  # failed before reading any data
    del weights["proj.weight"]
    torch.save(weights, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"lacks 1 keys: proj\.weight"):
        load_weights(meta_model(), tmp_path, dtype=torch.float32, progress=False)


class Payload:
    """A pickle that runs code when unpickled (what weights_only refuses)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_bin_with_code_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    torch.save({**random_weights(), "norm.weight": Payload(marker)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(
        CheckpointError,
        match=r"pytorch_model\.bin: holds pickled objects other than tensors.*Unsupported global",
    ):
        load_weights(meta_model(), tmp_path, dtype=torch.float32, progress=False)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (lambda good: good[: len(good) // 2], r"pytorch_model\.bin: not a readable PyTorch checkpoint.*zip"),
        (lambda good: b"not a checkpoint" * 8, r"pytorch_model\.bin: not a readable PyTorch checkpoint"),
    ],
)
def test_corrupt_bin(tmp_path: Path, content, message: str) -> None:
    torch.save(random_weights(), tmp_path / "pytorch_model.bin")
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(content(path.read_bytes()))
    with pytest.raises(CheckpointError, match=message):
        load_weights(meta_model(), tmp_path, dtype=torch.float32, progress=False)


def test_bin_that_is_not_a_state_dict(tmp_path: Path) -> None:
    torch.save({"model": random_weights()}, tmp_path / "pytorch_model.bin")  # a training checkpoint
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: not a state dict"):
        checkpoint_files(tmp_path)


# Parts: one module tensor assembled from several checkpoint tensors


def stacked_model() -> torch.nn.Module:
    """A module tensor [2, HIDDEN, 2 * VOCAB] in x @ W orientation, like Llama 4's fused experts."""
    with torch.device("meta"):
        model = torch.nn.Module()
        model.fused = torch.nn.Parameter(torch.empty(2, HIDDEN, 2 * VOCAB))
    return model


def split_rename(key: str) -> Part:
    """ "fused.1.b" ([VOCAB, HIDDEN], [out, in]) -> fused[1, :, VOCAB:] transposed."""
    _, n, half = key.split(".")
    columns = slice(0, VOCAB) if half == "a" else slice(VOCAB, 2 * VOCAB)
    return Part("fused", (int(n), slice(None), columns), transpose=True)


def split_weights() -> dict[str, torch.Tensor]:
    return {f"fused.{n}.{half}": torch.randn(VOCAB, HIDDEN) for n in range(2) for half in "ab"}


def test_parts_fill_a_fused_tensor(tmp_path: Path) -> None:
    weights = split_weights()
    save_weights(weights, tmp_path, max_shard_bytes=VOCAB * HIDDEN * 4)  # one part per shard
    model = stacked_model()
    assert load_weights(model, tmp_path, dtype=torch.float64, rename=split_rename, progress=False) == {
        "fused"
    }
    expected = torch.stack(
        [torch.cat((weights[f"fused.{n}.a"].t(), weights[f"fused.{n}.b"].t()), -1) for n in range(2)]
    )
    assert model.fused.dtype == torch.float64
    assert torch.equal(model.fused, expected.double())


def test_parts_missing_or_twice(tmp_path: Path) -> None:
    weights = split_weights()
    del weights["fused.1.b"]
    save_weights(weights, tmp_path)
    with pytest.raises(
        CheckpointError, match=r"'fused' is assembled from 3 checkpoint tensors .* cover 768 of its 1024"
    ):
        load_weights(stacked_model(), tmp_path, dtype=torch.float32, rename=split_rename, progress=False)
    save_weights({**split_weights(), "fused.1.b.copy": torch.randn(VOCAB, HIDDEN)}, tmp_path)
    rename = lambda key: split_rename(key.removesuffix(".copy"))
    with pytest.raises(
        CheckpointError, match=r"'fused\.1\.b' .* and 'fused\.1\.b\.copy' .* both load into 'fused'"
    ):
        load_weights(stacked_model(), tmp_path, dtype=torch.float32, rename=rename, progress=False)


def test_part_shape_error_names_the_region(tmp_path: Path) -> None:
    weights = split_weights()
    weights["fused.0.b"] = torch.randn(VOCAB, HIDDEN + 1)
    save_weights(weights, tmp_path)
    with pytest.raises(
        CheckpointError,
        match=r"'fused\.0\.b' has shape \[9, 32\] \(transposed\) .* at \[0, :, 32:64\] expects \[8, 32\]",
    ):
        load_weights(stacked_model(), tmp_path, dtype=torch.float32, rename=split_rename, progress=False)


class RecordingHook:
    def __init__(self) -> None:
        self.completed: list[str] = []

    def dtype(self, module_key: str, on_disk: torch.dtype, default: torch.dtype) -> torch.dtype:
        return on_disk if module_key == "fused" else default

    def loaded(self, module_key: str) -> None:
        self.completed.append(module_key)


def test_hook_sees_each_module_tensor_once_complete(tmp_path: Path) -> None:
    weights = {k: v.to(torch.bfloat16) for k, v in split_weights().items()}
    save_weights(weights, tmp_path, max_shard_bytes=VOCAB * HIDDEN * 2)
    model, hook = stacked_model(), RecordingHook()
    load_weights(model, tmp_path, dtype=torch.float32, rename=split_rename, hook=hook, progress=False)
    assert hook.completed == ["fused"] and model.fused.dtype == torch.bfloat16  # the hook's dtype


def test_shard_writer_streams(tmp_path: Path) -> None:
    """A shard goes to disk as soon as the next tensor would not fit: the writer holds one shard."""
    writer = ShardWriter(tmp_path, max_shard_bytes=1000)
    writer.add("a", torch.zeros(200))  # 800 bytes
    writer.add("b", torch.zeros(200))
    assert len(list(tmp_path.iterdir())) == 1  # "a"'s shard, under a temporary name
    writer.add("c", torch.zeros(10))
    writer.finish()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {
        "a": "model-00001-of-00002.safetensors",
        "b": "model-00002-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors",
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
