import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from redline.models.loader import CheckpointError, checkpoint_files, load_weights, save_weights

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


def test_float8_keeps_dtype(tmp_path: Path) -> None:
    weights = random_weights()
    weights["proj.weight"] = weights["proj.weight"].to(torch.float8_e4m3fn)
    save_weights(weights, tmp_path)
    model = meta_model()
    load_weights(model, tmp_path, dtype=torch.bfloat16, progress=False)
    assert model.proj.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(model.proj.weight.view(torch.uint8), weights["proj.weight"].view(torch.uint8))


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


def test_no_safetensors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors in"):
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
