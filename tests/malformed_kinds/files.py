"""One safetensors file whose layout is wrong (``action="open"``: the file opened on both
backends, every tensor read), and one valid file whose tensors stand at odd addresses."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
from kda_tp.errors import CheckpointError

from .core import Case, Kinds, file_path, framed, pack, pattern, write_raw

KINDS = Kinds()

_W = '{"dtype":"U8","shape":[4],"data_offsets":[0,4]}'

#: kind -> (the file's bytes, what the message says besides the file's path)
LAYOUT: dict[str, tuple[bytes, tuple[str, ...]]] = {
    "empty_file": (b"", ("the file is 0 bytes",)),
    "short_file": (b"\x02\x00\x00\x00\x00", ("the file is 5 bytes",)),
    "header_len_past_eof": (framed(b"{}", header_len=1000), ("runs past the end",)),
    "header_len_huge": (framed(b"{}", header_len=2**63), (str(2**63), "exceeds")),
    "header_len_max_u64": (framed(b"{}", header_len=2**64 - 1), (str(2**64 - 1),)),
    "header_not_utf8": (framed(b'{"\xff\xfe": 1}'), ("not UTF-8",)),
    "header_not_json": (framed(b"hello, world"), ("not a JSON object",)),
    "header_json_array": (framed(b'[{"dtype": "F32"}]'), ("not a JSON object",)),
    "header_entry_not_object": (framed({"weight": 5}), ('"weight"',)),
    "header_entry_missing_field": (
        framed({"weight": {"dtype": "F32", "shape": [2]}}, b"\0" * 8),
        ('"weight"', "data_offsets"),
    ),
    "header_metadata_not_strings": (framed({"__metadata__": {"step": 3}}), ("__metadata__",)),
    "unknown_dtype": (
        framed(*pack([("ok", "F32", [2], pattern(8)), ("odd", "F128", [2], pattern(32))])),
        ('"odd"', "F128"),
    ),
    "shape_bytes_disagree": (
        framed({"w": {"dtype": "F32", "shape": [3, 3], "data_offsets": [0, 32]}}, pattern(32)),
        ('"w"', "36 bytes"),
    ),
    "shape_overflow": (
        framed({"w": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 8]}},
               pattern(8)),
        ('"w"', "overflows"),
    ),
    "offsets_reversed": (
        framed({"w": {"dtype": "U8", "shape": [0], "data_offsets": [8, 0]}}, pattern(8)),
        ('"w"', "end before"),
    ),
    "overlapping_tensors": (
        framed({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
                "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]}}, pattern(12)),
        ('"a"', '"b"', "overlaps"),
    ),
    "gap_between_tensors": (
        framed({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                "b": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]}}, pattern(12)),
        ('"a"', '"b"', "gap of 4 bytes"),
    ),
    "offsets_past_eof": (
        framed(*pack([("a", "F32", [4], pattern(16)), ("b", "F32", [4], pattern(16))]))[:-12],
        ('"b"', "truncated"),
    ),
    "trailing_bytes": (
        framed(*pack([("a", "F32", [4], pattern(16))])) + b"junk",
        ("4 trailing bytes",),
    ),
    "duplicate_names": (framed(f'{{"w":{_W},"w":{_W}}}'.encode(), pattern(4)), ('"w"', "twice")),
}


def _writer(content: bytes) -> Callable[[Path, str], Path]:
    """A writer: ``content`` as the kind's one file."""

    def write(root: Path, kind: str) -> Path:
        path = file_path(root, kind)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        return path

    return write


for _kind, (_content, _contains) in LAYOUT.items():
    KINDS.add(_kind, _writer(_content), CheckpointError, _contains)


@KINDS.kind(CheckpointError, "not a regular file", blocking=True)
def not_a_regular_file(root: Path, kind: str) -> Path:
    """A FIFO named like a checkpoint file: opening it naively blocks forever."""
    path = file_path(root, kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    os.mkfifo(path)
    return path


def misaligned_offset(root: Path) -> Case:
    """Valid, but the data section and the F32/F64 tensors start at odd addresses: they must be
    read correctly (copied into aligned memory), on both backends."""
    values = {
        "u8": np.arange(3, dtype=np.uint8),
        "f32": np.array([[1.5, -2.0], [3.25, 1e-3]], dtype=np.float32),
        "f64": np.array([np.pi, -np.e, 7.0], dtype=np.float64),
        "i16": np.array([-1, 2, -3], dtype=np.int16),
    }
    tensors = [
        ("u8", "U8", [3], values["u8"].tobytes()),
        ("f32", "F32", [2, 2], values["f32"].tobytes()),
        ("f64", "F64", [3], values["f64"].tobytes()),
        ("i16", "I16", [3], values["i16"].tobytes()),
    ]
    header, data = pack(tensors)
    raw = json.dumps(header).encode()
    raw += b" " * ((3 - (8 + len(raw))) % 8)  # data section starts at 3 mod 8
    path = write_raw(file_path(root, "misaligned_offset"), raw, data)
    assert (8 + len(raw)) % 8 == 3
    return Case("misaligned_offset", path, None, (), expected=values)


KINDS["misaligned_offset"] = misaligned_offset
