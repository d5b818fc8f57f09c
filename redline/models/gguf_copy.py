"""An F16 (or Q8_0) GGUF written from a quantized one: the same model, metadata and tokenizer, every matrix
dequantized (gguf.quants) and stored as F16, vectors (norms) as F32, as llama.cpp's own converter stores
an F16 model. It lets llama.cpp run the very weights redline imports (`redline bench`'s llama.cpp rows),
in the layout llama.cpp expects: tensor names and the Q/K row order are kept as they are in the source.
A Q8_0 copy (`kind="Q8_0"`) quantizes those values again, as llama.cpp's converter writes Q8_0 (gguf.quants:
blocks of 32 with an fp16 scale), for the bench's int8 rows.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from tqdm import tqdm

from redline.models.gguf_reader import GGUFFile
from redline.models.gguf_tensors import dequantized

SKIPPED_KEYS = ("general.architecture", "GGUF.")  # the writer adds these itself
FILE_TYPE = "general.file_type"


KINDS = {"F16": gguf.LlamaFileType.MOSTLY_F16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}


def _copy_metadata(source: gguf.GGUFReader, writer: gguf.GGUFWriter, kind: str) -> None:
    """Every key but the file type, which becomes `kind`'s."""
    for field in source.fields.values():
        if field.name.startswith(SKIPPED_KEYS) or field.name == FILE_TYPE:
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    writer.add_file_type(KINDS[kind])


def write_gguf_copy(source_path: Path, out_path: Path, progress: bool = True, kind: str = "F16") -> Path:
    """Writes `out_path` with matrices in `kind` (F16, or Q8_0 where a row is whole blocks of 32, else
    F16); returns it. Each tensor is dequantized once (about 2 bytes per parameter held until the file is
    written)."""
    source = GGUFFile(Path(source_path))
    writer = gguf.GGUFWriter(out_path, source.architecture)
    _copy_metadata(source.reader, writer, kind)
    tensors = source.reader.tensors
    for tensor in tqdm(tensors, desc=f"writing {Path(out_path).name}", unit="tensor", disable=not progress):
        values = dequantized(tensor).numpy()  # [rows, columns] in GGUF's row order (numpy: dims reversed)
        if values.ndim > 1 and kind == "Q8_0" and values.shape[-1] % 32 == 0:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, q8), raw_dtype=q8)
            continue
        writer.add_tensor(tensor.name, values.astype(np.float16 if values.ndim > 1 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out_path)
