"""An F16 GGUF written from a quantized one: the same model, metadata and tokenizer, every matrix
dequantized (gguf.quants) and stored as F16, vectors (norms) as F32, as llama.cpp's own converter stores
an F16 model. It lets llama.cpp run the very weights redline imports (`redline bench`'s llama.cpp rows),
in the layout llama.cpp expects: tensor names and the Q/K row order are kept as they are in the source.
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


def _copy_metadata(source: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    """Every key but the file type, which becomes F16."""
    for field in source.fields.values():
        if field.name.startswith(SKIPPED_KEYS) or field.name == FILE_TYPE:
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)


def write_f16_gguf(source_path: Path, out_path: Path, progress: bool = True) -> Path:
    """Writes `out_path`; returns it. Each tensor is dequantized once (about 2 bytes per parameter held
    until the file is written)."""
    source = GGUFFile(Path(source_path))
    writer = gguf.GGUFWriter(out_path, source.architecture)
    _copy_metadata(source.reader, writer)
    tensors = source.reader.tensors
    for tensor in tqdm(tensors, desc=f"writing {Path(out_path).name}", unit="tensor", disable=not progress):
        values = dequantized(tensor).numpy()  # [rows, columns] in GGUF's row order (numpy: dims reversed)
        writer.add_tensor(tensor.name, values.astype(np.float16 if values.ndim > 1 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out_path)
