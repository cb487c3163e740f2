"""Checkpoints as plain data, written and read with the stdlib: tensors as
``{name: (dtype, shape, bytes)}`` in safetensors files and checkpoint folders, and ``config.json``
dicts in the Kimi-Linear and Qwen3-Next styles. Independent of kda_tp's readers, for the oracle's
and the fuzz tests."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path


def read_file(path: Path) -> tuple[dict, int, bytes]:
    """(header dict, data start offset, data section bytes) of a safetensors file."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), 8 + length, raw[8 + length :]


def write_safetensors(path: Path, tensors: dict, metadata: dict | None = None) -> None:
    """Write ``{name: (dtype, shape, bytes)}`` as a safetensors file."""
    header = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(t[2] for t in tensors.values()))


def read_safetensors(path: Path) -> dict:
    """``{name: (dtype, shape tuple, bytes)}`` of a safetensors file, plus nothing else."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    header.pop("__metadata__", None)
    return {
        name: (
            e["dtype"],
            tuple(e["shape"]),
            blob[8 + n + e["data_offsets"][0] : 8 + n + e["data_offsets"][1]],
        )
        for name, e in header.items()
    }


def read_checkpoint_tensors(directory: Path):
    """(name, (dtype, shape, bytes)) for every tensor of every safetensors file in a dir."""
    for path in sorted(directory.glob("*.safetensors")):
        yield from read_safetensors(path).items()


def write_checkpoint(directory: Path, config: dict, tensors: dict, metadata=None, files=1) -> None:
    """A checkpoint dir: config.json, the tensors spread over ``files`` safetensors files, and
    model.safetensors.index.json."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    names = list(tensors)
    weight_map = {}
    for i in range(files):
        file_name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::files]}
        write_safetensors(directory / file_name, part, metadata)
        weight_map.update(dict.fromkeys(part, file_name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def kimi_config(*, hidden, head_dim, heads, conv, kda_layers):
    """A Kimi-Linear-style ``config.json`` (``linear_attn_config``; ``kda_layers`` 1-based)."""
    return {
        "hidden_size": hidden,
        "linear_attn_config": {
            "head_dim": head_dim,
            "num_heads": heads,
            "short_conv_kernel_size": conv,
            "kda_layers": kda_layers,
        },
    }


def qwen3_next_config(*, hidden, head_dim, heads, conv, layer_types):
    """A Qwen3-Next-style ``config.json`` (flat ``linear_*`` keys, ``layer_types`` per layer)."""
    return {
        "hidden_size": hidden,
        "linear_key_head_dim": head_dim,
        "linear_num_key_heads": heads,
        "linear_conv_kernel_dim": conv,
        "layer_types": layer_types,
    }


def narrow(data: bytes, shape, elem_bytes: int, dim: int, start: int, stop: int) -> bytes:
    """``torch.narrow(tensor, dim, start, stop - start)`` on raw row-major bytes."""
    inner = math.prod(shape[dim + 1 :]) * elem_bytes
    block = shape[dim] * inner
    return b"".join(
        data[o * block + start * inner : o * block + stop * inner]
        for o in range(math.prod(shape[:dim]))
    )
