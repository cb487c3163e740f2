"""A corpus of malformed checkpoints, generated (never committed as binaries).

Each *kind* is a function ``kind(root) -> Case`` that writes its input under ``root/<kind>/``
and says what must happen: the :mod:`kda_tp.errors` class expected, and substrings the message
must contain (the file's path and, where there is one, the tensor's name). One kind
(``misaligned_offset``) is valid and must load correctly.

Usage as a script, to dump the corpus for manual fuzzing or as a libFuzzer seed corpus::

    python tests/malformed.py OUTDIR        # one directory per kind, plus valid seed files

``Case.action`` tells how the input is fed to kda_tp:

``open``
    ``SafetensorsSource(path, backend)`` on both backends, then every tensor read.
``shard``
    ``shard_checkpoint(path, out, tp_size=2)`` (the whole ``kda-tp shard`` path: config, plan,
    per-tensor checks, then writing).

Geometry of the base checkpoint: Kimi-Linear style, hidden 64, 4 heads of 64, conv kernel 4,
gate rank 16, two KDA layers; at tp_size 2 the local q|k width is 256, so the default plan
rule holds.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from kda_tp import synth
from kda_tp.errors import (
    CheckpointError,
    DtypeMismatchError,
    KdaTpError,
    ShapeMismatchError,
)

__all__ = ["CLI_KINDS", "CliCase", "KINDS", "Case", "build", "build_all", "base_checkpoint", "pack", "write_raw"]

INDEX = "model.safetensors.index.json"
GEOMETRY = dict(
    hidden=64, heads=4, head_dim=64, conv_kernel=4, gate_rank=16, num_layers=2, kda_layers=[0, 1]
)
ATTN = "model.layers.{}.self_attn."
_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


@dataclass(frozen=True)
class Case:
    """One malformed input and what kda_tp must do with it.

    Attributes:
        kind: the kind's name (a function of this module).
        path: the input: a ``.safetensors`` file or a checkpoint directory.
        error: the exception class expected, or None when the input must load correctly.
        contains: substrings the message must contain (the file, and the tensor if any).
        action: ``"open"`` or ``"shard"`` (see the module docstring).
        blocking: the input could block a naive reader forever (a FIFO); test it in a
            subprocess with a timeout.
        expected: for a valid input, tensor name -> numpy array it must read back as.
    """

    kind: str
    path: Path
    error: type[KdaTpError] | None
    contains: tuple[str, ...]
    action: str = "open"
    blocking: bool = False
    expected: dict[str, np.ndarray] = field(default_factory=dict, compare=False)


# ----------------------------------------------------------------------------------------------
# writers


def write_raw(
    path: Path, header: dict | bytes, data: bytes = b"", header_len: int | None = None
) -> Path:
    """Write ``[u64 header_len][header][data]``; ``header`` is a dict (JSON-encoded) or raw bytes;
    ``header_len`` overrides the length field (default: the header's real length)."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    length = len(raw) if header_len is None else header_len
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", length) + raw + data)
    return path


def pack(
    tensors: list[tuple[str, str, list[int], bytes]], metadata: dict | None = None
) -> tuple[dict, bytes]:
    """(header dict, data) of tensors laid back to back in the order given."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    chunks = []
    for name, dtype, shape, data in tensors:
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
        chunks.append(data)
    return header, b"".join(chunks)


def _pattern(n: int, seed: int = 0) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(n))


def _small_file(path: Path) -> Path:
    """A valid two-tensor file (F32 [2, 3] and BF16 [4])."""
    header, data = pack([("w", "F32", [2, 3], _pattern(24)), ("b", "BF16", [4], _pattern(8, 3))])
    return write_raw(path, header, data)


_BASE_CACHE: dict[Path, Path] = {}


def base_checkpoint(root: Path) -> Path:
    """The valid small checkpoint every directory kind starts from (written once per root)."""
    base = root / "_base"
    if root not in _BASE_CACHE or not (base / INDEX).exists():
        synth.write_small_checkpoint(base, **GEOMETRY)
        _BASE_CACHE[root] = base
    return base


def _copy_base(root: Path, kind: str) -> Path:
    target = root / kind
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(base_checkpoint(root), target)
    return target


def read_tensors(directory: Path) -> list[tuple[str, str, list[int], bytes]]:
    """Every tensor of a checkpoint directory, file by file in data order (a stdlib parser)."""
    index = json.loads((directory / INDEX).read_text())
    out = []
    for file_name in sorted(set(index["weight_map"].values())):
        raw = (directory / file_name).read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + length])
        header.pop("__metadata__", None)
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
            b, e = info["data_offsets"]
            out.append((name, info["dtype"], info["shape"], raw[8 + length + b : 8 + length + e]))
    return out


def _rewritten(
    root: Path, kind: str, edit: Callable[[list[tuple[str, str, list[int], bytes]]], list]
) -> Path:
    """The base checkpoint with its tensors passed through ``edit`` and written back as one
    ``model.safetensors`` (no index), beside the base's ``config.json``."""
    target = root / kind
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    base = base_checkpoint(root)
    shutil.copy(base / "config.json", target / "config.json")
    header, data = pack(edit(read_tensors(base)), {"format": "pt"})
    write_raw(target / "model.safetensors", header, data)
    return target


def _edit_config(root: Path, kind: str, edit: Callable[[dict], object]) -> Path:
    target = _copy_base(root, kind)
    config = json.loads((target / "config.json").read_text())
    edit(config)
    (target / "config.json").write_text(json.dumps(config))
    return target


def _edit_index(root: Path, kind: str, edit: Callable[[dict], object]) -> tuple[Path, dict]:
    target = _copy_base(root, kind)
    index = json.loads((target / INDEX).read_text())
    edit(index)
    (target / INDEX).write_text(json.dumps(index))
    return target, index


def _file(root: Path, kind: str) -> Path:
    return root / kind / "model.safetensors"


# ----------------------------------------------------------------------------------------------
# one safetensors file: layout


def empty_file(root: Path) -> Case:
    path = _file(root, "empty_file")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return Case("empty_file", path, CheckpointError, (str(path), "the file is 0 bytes"))


def short_file(root: Path) -> Case:
    path = _file(root, "short_file")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x02\x00\x00\x00\x00")
    return Case("short_file", path, CheckpointError, (str(path), "the file is 5 bytes"))


def header_len_past_eof(root: Path) -> Case:
    path = write_raw(_file(root, "header_len_past_eof"), b"{}", header_len=1000)
    return Case("header_len_past_eof", path, CheckpointError, (str(path), "runs past the end"))


def header_len_huge(root: Path) -> Case:
    path = write_raw(_file(root, "header_len_huge"), b"{}", header_len=2**63)
    return Case("header_len_huge", path, CheckpointError, (str(path), str(2**63), "exceeds"))


def header_len_max_u64(root: Path) -> Case:
    path = write_raw(_file(root, "header_len_max_u64"), b"{}", header_len=2**64 - 1)
    return Case("header_len_max_u64", path, CheckpointError, (str(path), str(2**64 - 1)))


def header_not_utf8(root: Path) -> Case:
    path = write_raw(_file(root, "header_not_utf8"), b'{"\xff\xfe": 1}')
    return Case("header_not_utf8", path, CheckpointError, (str(path), "not UTF-8"))


def header_not_json(root: Path) -> Case:
    path = write_raw(_file(root, "header_not_json"), b"hello, world")
    return Case("header_not_json", path, CheckpointError, (str(path), "not a JSON object"))


def header_json_array(root: Path) -> Case:
    path = write_raw(_file(root, "header_json_array"), b'[{"dtype": "F32"}]')
    return Case("header_json_array", path, CheckpointError, (str(path), "not a JSON object"))


def header_entry_not_object(root: Path) -> Case:
    path = write_raw(_file(root, "header_entry_not_object"), {"weight": 5})
    return Case("header_entry_not_object", path, CheckpointError, (str(path), '"weight"'))


def header_entry_missing_field(root: Path) -> Case:
    path = write_raw(
        _file(root, "header_entry_missing_field"),
        {"weight": {"dtype": "F32", "shape": [2]}},
        b"\0" * 8,
    )
    return Case(
        "header_entry_missing_field", path, CheckpointError, (str(path), '"weight"', "data_offsets")
    )


def header_metadata_not_strings(root: Path) -> Case:
    path = write_raw(_file(root, "header_metadata_not_strings"), {"__metadata__": {"step": 3}})
    return Case("header_metadata_not_strings", path, CheckpointError, (str(path), "__metadata__"))


def unknown_dtype(root: Path) -> Case:
    header, data = pack([("ok", "F32", [2], _pattern(8)), ("odd", "F128", [2], _pattern(32))])
    path = write_raw(_file(root, "unknown_dtype"), header, data)
    return Case("unknown_dtype", path, CheckpointError, (str(path), '"odd"', "F128"))


def shape_bytes_disagree(root: Path) -> Case:
    header = {"w": {"dtype": "F32", "shape": [3, 3], "data_offsets": [0, 32]}}
    path = write_raw(_file(root, "shape_bytes_disagree"), header, _pattern(32))
    return Case("shape_bytes_disagree", path, CheckpointError, (str(path), '"w"', "36 bytes"))


def shape_overflow(root: Path) -> Case:
    header = {"w": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 8]}}
    path = write_raw(_file(root, "shape_overflow"), header, _pattern(8))
    return Case("shape_overflow", path, CheckpointError, (str(path), '"w"', "overflows"))


def offsets_reversed(root: Path) -> Case:
    header = {"w": {"dtype": "U8", "shape": [0], "data_offsets": [8, 0]}}
    path = write_raw(_file(root, "offsets_reversed"), header, _pattern(8))
    return Case("offsets_reversed", path, CheckpointError, (str(path), '"w"', "end before"))


def overlapping_tensors(root: Path) -> Case:
    header = {
        "a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
        "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]},
    }
    path = write_raw(_file(root, "overlapping_tensors"), header, _pattern(12))
    return Case("overlapping_tensors", path, CheckpointError, (str(path), '"a"', '"b"', "overlaps"))


def gap_between_tensors(root: Path) -> Case:
    header = {
        "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
        "b": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]},
    }
    path = write_raw(_file(root, "gap_between_tensors"), header, _pattern(12))
    return Case(
        "gap_between_tensors", path, CheckpointError, (str(path), '"a"', '"b"', "gap of 4 bytes")
    )


def offsets_past_eof(root: Path) -> Case:
    header, data = pack([("a", "F32", [4], _pattern(16)), ("b", "F32", [4], _pattern(16))])
    path = write_raw(_file(root, "offsets_past_eof"), header, data[:20])
    return Case("offsets_past_eof", path, CheckpointError, (str(path), '"b"', "truncated"))


def trailing_bytes(root: Path) -> Case:
    header, data = pack([("a", "F32", [4], _pattern(16))])
    path = write_raw(_file(root, "trailing_bytes"), header, data + b"junk")
    return Case("trailing_bytes", path, CheckpointError, (str(path), "4 trailing bytes"))


def duplicate_names(root: Path) -> Case:
    entry = '{"dtype":"U8","shape":[4],"data_offsets":[0,4]}'
    path = write_raw(
        _file(root, "duplicate_names"), f'{{"w":{entry},"w":{entry}}}'.encode(), _pattern(4)
    )
    return Case("duplicate_names", path, CheckpointError, (str(path), '"w"', "twice"))


def not_a_regular_file(root: Path) -> Case:
    """A FIFO named like a checkpoint file: opening it naively blocks forever."""
    path = _file(root, "not_a_regular_file")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    os.mkfifo(path)
    return Case(
        "not_a_regular_file",
        path,
        CheckpointError,
        (str(path), "not a regular file"),
        blocking=True,
    )


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
    path = write_raw(_file(root, "misaligned_offset"), raw, data)
    assert (8 + len(raw)) % 8 == 3
    return Case("misaligned_offset", path, None, (), expected=values)


# ----------------------------------------------------------------------------------------------
# model.safetensors.index.json


def index_not_json(root: Path) -> Case:
    target = _copy_base(root, "index_not_json")
    (target / INDEX).write_text('{"weight_map": {')
    return Case(
        "index_not_json", target, CheckpointError, (str(target / INDEX), "not JSON"), "shard"
    )


def index_no_weight_map(root: Path) -> Case:
    target, _ = _edit_index(root, "index_no_weight_map", lambda ix: ix.update(weight_map=["a"]))
    return Case(
        "index_no_weight_map", target, CheckpointError, (str(target / INDEX), "weight_map"), "shard"
    )


def index_missing_file(root: Path) -> Case:
    name = ATTN.format(1) + "q_proj.weight"
    target, _ = _edit_index(
        root,
        "index_missing_file",
        lambda ix: ix["weight_map"].update({name: "model-00009-of-00009.safetensors"}),
    )
    return Case(
        "index_missing_file",
        target,
        CheckpointError,
        (str(target / INDEX), "model-00009-of-00009.safetensors", name),
        "shard",
    )


def index_tensor_not_in_file(root: Path) -> Case:
    name = ATTN.format(0) + "q_proj.weight"

    def edit(ix: dict) -> None:
        files = sorted(set(ix["weight_map"].values()))
        other = next(f for f in files if f != ix["weight_map"][name])
        ix["weight_map"][name] = other

    target, _ = _edit_index(root, "index_tensor_not_in_file", edit)
    return Case(
        "index_tensor_not_in_file",
        target,
        CheckpointError,
        (str(target / INDEX), name, "no such tensor"),
        "shard",
    )


def index_unlisted_tensor(root: Path) -> Case:
    name = ATTN.format(1) + "o_norm.weight"
    target, _ = _edit_index(root, "index_unlisted_tensor", lambda ix: ix["weight_map"].pop(name))
    return Case(
        "index_unlisted_tensor",
        target,
        CheckpointError,
        (str(target / INDEX), name, "no file"),
        "shard",
    )


def index_parent_path(root: Path) -> Case:
    name = ATTN.format(0) + "A_log"

    def edit(ix: dict) -> None:
        ix["weight_map"][name] = "../_base/" + ix["weight_map"][name]

    target, _ = _edit_index(root, "index_parent_path", edit)
    return Case(
        "index_parent_path",
        target,
        CheckpointError,
        (str(target / INDEX), name, "not a plain relative path"),
        "shard",
    )


def index_absolute_path(root: Path) -> Case:
    name = ATTN.format(0) + "A_log"
    base = base_checkpoint(root)

    def edit(ix: dict) -> None:
        ix["weight_map"][name] = str((base / ix["weight_map"][name]).resolve())

    target, _ = _edit_index(root, "index_absolute_path", edit)
    return Case(
        "index_absolute_path",
        target,
        CheckpointError,
        (str(target / INDEX), name, "not a plain relative path"),
        "shard",
    )


# ----------------------------------------------------------------------------------------------
# config.json


def config_missing(root: Path) -> Case:
    target = _copy_base(root, "config_missing")
    (target / "config.json").unlink()
    return Case("config_missing", target, CheckpointError, (str(target), "config.json"), "shard")


def config_not_json(root: Path) -> Case:
    target = _copy_base(root, "config_not_json")
    (target / "config.json").write_text('{"hidden_size": 64,')
    return Case(
        "config_not_json", target, CheckpointError, (str(target / "config.json"), "JSON"), "shard"
    )


def config_not_object(root: Path) -> Case:
    target = _copy_base(root, "config_not_object")
    (target / "config.json").write_text("[64, 4, 64]")
    return Case(
        "config_not_object",
        target,
        CheckpointError,
        (str(target / "config.json"), "not a JSON object"),
        "shard",
    )


def config_not_regular(root: Path) -> Case:
    """config.json is a FIFO: reading it naively blocks forever."""
    target = _copy_base(root, "config_not_regular")
    (target / "config.json").unlink()
    os.mkfifo(target / "config.json")
    return Case(
        "config_not_regular",
        target,
        CheckpointError,
        (str(target / "config.json"), "not a regular file"),
        "shard",
        blocking=True,
    )


def config_negative(root: Path) -> Case:
    target = _edit_config(
        root, "config_negative", lambda c: c["linear_attn_config"].update(num_heads=-4)
    )
    return Case(
        "config_negative",
        target,
        CheckpointError,
        (str(target / "config.json"), "linear_attn_config.num_heads", "-4"),
        "shard",
    )


def config_zero(root: Path) -> Case:
    target = _edit_config(root, "config_zero", lambda c: c["linear_attn_config"].update(head_dim=0))
    return Case(
        "config_zero",
        target,
        CheckpointError,
        (str(target / "config.json"), "linear_attn_config.head_dim"),
        "shard",
    )


def config_absurd(root: Path) -> Case:
    target = _edit_config(root, "config_absurd", lambda c: c.update(hidden_size=2**40))
    return Case(
        "config_absurd",
        target,
        CheckpointError,
        (str(target / "config.json"), "hidden_size", str(2**40)),
        "shard",
    )


def config_not_an_int(root: Path) -> Case:
    target = _edit_config(root, "config_not_an_int", lambda c: c.update(hidden_size="64"))
    return Case(
        "config_not_an_int",
        target,
        CheckpointError,
        (str(target / "config.json"), "hidden_size"),
        "shard",
    )


def config_disagrees_with_weights(root: Path) -> Case:
    """A config in range but not the weights' geometry: the first KDA tensor checked is refused."""
    target = _edit_config(
        root, "config_disagrees_with_weights", lambda c: c.update(hidden_size=2**31 - 1)
    )
    return Case(
        "config_disagrees_with_weights",
        target,
        ShapeMismatchError,
        (str(target), ATTN.format(0) + "q_proj.weight"),
        "shard",
    )


def config_kda_layer_out_of_range(root: Path) -> Case:
    target = _edit_config(
        root,
        "config_kda_layer_out_of_range",
        lambda c: c["linear_attn_config"].update(kda_layers=[1, 2, 9]),
    )
    return Case(
        "config_kda_layer_out_of_range",
        target,
        CheckpointError,
        (str(target), "'linear_attn_config.kda_layers' = [1, 2, 9]",
         "9 beyond num_hidden_layers = 2"),
        "shard",
    )


# ----------------------------------------------------------------------------------------------
# KDA tensors


def kda_missing_tensor(root: Path) -> Case:
    gone = ATTN.format(1) + "g_b_proj.weight"
    target = _rewritten(root, "kda_missing_tensor", lambda ts: [t for t in ts if t[0] != gone])
    return Case(
        "kda_missing_tensor",
        target,
        CheckpointError,
        (str(target), "KDA layer 1", "self_attn.g_b_proj.weight"),
        "shard",
    )


def kda_missing_tensor_first_layer(root: Path) -> Case:
    gone = ATTN.format(0) + "A_log"
    target = _rewritten(
        root, "kda_missing_tensor_first_layer", lambda ts: [t for t in ts if t[0] != gone]
    )
    return Case(
        "kda_missing_tensor_first_layer",
        target,
        CheckpointError,
        (str(target), "KDA layer 0", "self_attn.A_log"),
        "shard",
    )


def _retype(name: str, dtype: str) -> Callable[[list], list]:
    def edit(ts: list) -> list:
        out = []
        for n, d, shape, data in ts:
            if n == name:
                count = int(np.prod(shape))
                data, d = _pattern(count * _SIZES[dtype]), dtype
            out.append((n, d, shape, data))
        return out

    return edit


def kda_wrong_dtype(root: Path) -> Case:
    """Layer 1's A_log is BF16 while layer 0's (which the plan follows) is F32."""
    name = ATTN.format(1) + "A_log"
    target = _rewritten(root, "kda_wrong_dtype", _retype(name, "BF16"))
    return Case(
        "kda_wrong_dtype",
        target,
        DtypeMismatchError,
        (str(target / "model.safetensors"), name, "BF16", "F32"),
        "shard",
    )


def kda_integer_dtype(root: Path) -> Case:
    """The first KDA layer's q_proj is I16: not a floating-point dtype the plan can take."""
    name = ATTN.format(0) + "q_proj.weight"
    target = _rewritten(root, "kda_integer_dtype", _retype(name, "I16"))
    return Case(
        "kda_integer_dtype",
        target,
        DtypeMismatchError,
        (str(target / "model.safetensors"), name, "I16"),
        "shard",
    )


def _reshape(name: str, shape: list[int]) -> Callable[[list], list]:
    def edit(ts: list) -> list:
        out = []
        for n, d, old, data in ts:
            if n == name:
                assert int(np.prod(old)) == int(np.prod(shape)), (old, shape)
                old = shape
            out.append((n, d, old, data))
        return out

    return edit


def kda_wrong_ndim(root: Path) -> Case:
    """Layer 1's q_proj [256, 64] stored 3-D as [heads, head_dim, hidden] = [4, 64, 64].

    (Extra unit axes, e.g. [256, 64, 1] or [1, 256, 64], hold the same bytes in the same order
    and are accepted by design, like the conv weights' [C, 1, K].)"""
    name = ATTN.format(1) + "q_proj.weight"
    target = _rewritten(root, "kda_wrong_ndim", _reshape(name, [4, 64, 64]))
    return Case(
        "kda_wrong_ndim",
        target,
        ShapeMismatchError,
        (str(target / "model.safetensors"), name, "[4, 64, 64]"),
        "shard",
    )


def kda_flattened(root: Path) -> Case:
    """Layer 1's o_proj [64, 256] stored flat as [16384]."""
    name = ATTN.format(1) + "o_proj.weight"
    target = _rewritten(root, "kda_flattened", _reshape(name, [64 * 256]))
    return Case(
        "kda_flattened",
        target,
        ShapeMismatchError,
        (str(target / "model.safetensors"), name),
        "shard",
    )


def kda_scalar_gate(root: Path) -> Case:
    """The first KDA layer's f_a_proj (read for the gate rank) is a 0-d tensor."""
    name = ATTN.format(0) + "f_a_proj.weight"

    def edit(ts: list) -> list:
        return [
            (n, d, [] if n == name else s, data[:2] if n == name else data) for n, d, s, data in ts
        ]

    target = _rewritten(root, "kda_scalar_gate", edit)
    return Case(
        "kda_scalar_gate",
        target,
        ShapeMismatchError,
        (str(target / "model.safetensors"), name),
        "shard",
    )


def kda_wrong_size(root: Path) -> Case:
    """Layer 1's v_proj has 2 dimensions but half the rows."""
    name = ATTN.format(1) + "v_proj.weight"

    def edit(ts: list) -> list:
        return [
            (n, d, [128, 64] if n == name else s, data[: 128 * 64 * 2] if n == name else data)
            for n, d, s, data in ts
        ]

    target = _rewritten(root, "kda_wrong_size", edit)
    return Case(
        "kda_wrong_size",
        target,
        ShapeMismatchError,
        (str(target / "model.safetensors"), name, "[128, 64]"),
        "shard",
    )


def kda_sub_byte_dtype(root: Path) -> Case:
    """Layer 1's o_norm is packed F4: a KDA tensor must be BF16/F16/F32/F64 (a tensor outside
    the KDA layers may be F4; it is copied through, see tests/unit/test_file_quirks.py)."""
    name = ATTN.format(1) + "o_norm.weight"

    def edit(ts: list) -> list:
        return [
            (n, "F4", s, _pattern(int(np.prod(s)) // 2)) if n == name else (n, d, s, data)
            for n, d, s, data in ts
        ]

    target = _rewritten(root, "kda_sub_byte_dtype", edit)
    return Case(
        "kda_sub_byte_dtype",
        target,
        DtypeMismatchError,
        (str(target / "model.safetensors"), name, "F4"),
        "shard",
    )


# ----------------------------------------------------------------------------------------------

KINDS: dict[str, Callable[[Path], Case]] = {
    f.__name__: f
    for f in [
        empty_file,
        short_file,
        header_len_past_eof,
        header_len_huge,
        header_len_max_u64,
        header_not_utf8,
        header_not_json,
        header_json_array,
        header_entry_not_object,
        header_entry_missing_field,
        header_metadata_not_strings,
        unknown_dtype,
        shape_bytes_disagree,
        shape_overflow,
        offsets_reversed,
        overlapping_tensors,
        gap_between_tensors,
        offsets_past_eof,
        trailing_bytes,
        duplicate_names,
        not_a_regular_file,
        misaligned_offset,
        index_not_json,
        index_no_weight_map,
        index_missing_file,
        index_tensor_not_in_file,
        index_unlisted_tensor,
        index_parent_path,
        index_absolute_path,
        config_missing,
        config_not_json,
        config_not_object,
        config_not_regular,
        config_negative,
        config_zero,
        config_absurd,
        config_not_an_int,
        config_disagrees_with_weights,
        config_kda_layer_out_of_range,
        kda_missing_tensor,
        kda_missing_tensor_first_layer,
        kda_wrong_dtype,
        kda_integer_dtype,
        kda_wrong_ndim,
        kda_flattened,
        kda_scalar_gate,
        kda_wrong_size,
        kda_sub_byte_dtype,
    ]
}


# ----------------------------------------------------------------------------------------------
# hostile input for the command line (issue 21): each is one `kda-tp` command line, refused with
# exit 2 and one `kda-tp: error:` line, fast and in little memory (tests/unit/test_malformed.py runs
# each in a subprocess under a time and a memory bound).


@dataclass(frozen=True)
class CliCase:
    """One hostile command line: ``argv`` after ``kda-tp``, extra environment ``env``, and a
    substring the error line must contain."""

    kind: str
    argv: tuple[str, ...]
    contains: str
    env: dict[str, str] = field(default_factory=dict, compare=False)


def _config_text(root: Path, kind: str, text: str) -> Path:
    target = _copy_base(root, kind)
    (target / "config.json").write_text(text)
    return target


def _shard(target: Path, *extra: str) -> tuple[str, ...]:
    return ("shard", str(target), "--tp-size", "2", "--out", str(target.parent / f"{target.name}-out"),
            "--quiet", *extra)


def _sharded(root: Path) -> Path:
    """A real 2-rank output of the base checkpoint (written once per root)."""
    out = root / "_base-tp2"
    if not (out / "rank1").is_dir():
        from kda_tp.shard import shard_checkpoint
        shard_checkpoint(base_checkpoint(root), out, 2)
    return out


def _rank_meta(root: Path, kind: str, **meta: str) -> tuple[Path, Path]:
    """The 2-rank output with rank0's first file's metadata updated by ``meta``."""
    out = root / kind
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(_sharded(root), out)
    first = sorted((out / "rank0").glob("*.safetensors"))[0]
    raw = first.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header["__metadata__"].update(meta)
    tensors = sorted(((n, i) for n, i in header.items() if n != "__metadata__"),
                     key=lambda kv: kv[1]["data_offsets"])
    data = raw[8 + length:]
    packed, body = pack([(n, i["dtype"], i["shape"], data[i["data_offsets"][0]:i["data_offsets"][1]])
                         for n, i in tensors], header["__metadata__"])
    write_raw(first, packed, body)
    return base_checkpoint(root), out


def cli_config_deep(root: Path) -> CliCase:
    t = _config_text(root, "cli_config_deep", "[" * 200_000 + "]" * 200_000)
    return CliCase("cli_config_deep", _shard(t), "MAX_JSON_DEPTH")


def cli_config_digits(root: Path) -> CliCase:
    config = json.loads((base_checkpoint(root) / "config.json").read_text())
    text = json.dumps(config).replace('"hidden_size": 64', '"hidden_size": ' + "7" * 5000)
    t = _config_text(root, "cli_config_digits", text)
    return CliCase("cli_config_digits", _shard(t), "MAX_INT_DIGITS")


def cli_config_huge(root: Path) -> CliCase:
    t = _config_text(root, "cli_config_huge", '{"pad": "' + "x" * (17 * 2**20) + '"}')
    return CliCase("cli_config_huge", _shard(t), "MAX_JSON_BYTES")


def cli_quant_config_deep(root: Path) -> CliCase:
    t = _copy_base(root, "cli_quant_config_deep")
    (t / "hf_quant_config.json").write_text('{"quantization": ' + "[" * 100_000 + "]" * 100_000 + "}")
    return CliCase("cli_quant_config_deep", _shard(t), "MAX_JSON_DEPTH")


def cli_kda_layers_repeated(root: Path) -> CliCase:
    """690 KB of kda_layers: checked in linear time."""
    t = _edit_config(root, "cli_kda_layers_repeated",
                     lambda c: c["linear_attn_config"].update(kda_layers=[1, 2] * 80_000))
    return CliCase("cli_kda_layers_repeated", _shard(t), "more than once")


def cli_glm_layers_huge(root: Path) -> CliCase:
    def edit(c: dict) -> None:
        c.clear()
        c.update(model_type="glm5_next", num_hidden_layers=2147483647)

    t = _edit_config(root, "cli_glm_layers_huge", edit)
    return CliCase("cli_glm_layers_huge", _shard(t), "MAX_LAYERS")


def cli_index_many_files(root: Path) -> CliCase:
    """100,000 distinct file names in the index: parsed in linear time, then the first missing
    file named."""
    t, _ = _edit_index(root, "cli_index_many_files", lambda i: i["weight_map"].update(
        {f"extra.{n}": f"missing-{n}.safetensors" for n in range(100_000)}))
    return CliCase("cli_index_many_files", _shard(t), "does not exist")


def cli_arabic_layer_number(root: Path) -> CliCase:
    name = ATTN.format(1) + "q_proj.weight"
    arabic = name.replace(".1.", ".\u0661.")
    t = _rewritten(root, "cli_arabic_layer_number",
                   lambda ts: [(arabic if n == name else n, d, sh, b) for n, d, sh, b in ts])
    return CliCase("cli_arabic_layer_number", _shard(t), "not written in ASCII digits")


def cli_tp_size_2_64(root: Path) -> CliCase:
    return CliCase("cli_tp_size_2_64", _shard(base_checkpoint(root))[:3]
                   + ("18446744073709551616", "--out", str(root / "x")), "more than 2147483647")


def cli_tp_size_2_40(root: Path) -> CliCase:
    return CliCase("cli_tp_size_2_40", ("audit", str(base_checkpoint(root)), str(root / "x"),
                   "--tp-size", "1099511627776"), "more than 2147483647")


def cli_shard_tp_size_1e8(root: Path) -> CliCase:
    return CliCase("cli_shard_tp_size_1e8", ("shard", str(base_checkpoint(root)), "--tp-size",
                   "100000000", "--out", str(root / "x"), "--quiet"), "divisible")


def cli_audit_tp_size_3e7(root: Path) -> CliCase:
    return CliCase("cli_audit_tp_size_3e7", ("audit", str(base_checkpoint(root)),
                   str(_sharded(root) / "rank0"), "--tp-size", "30000000"), "divisible")


def cli_tp_size_zero(root: Path) -> CliCase:
    return CliCase("cli_tp_size_zero", ("plan", str(base_checkpoint(root)), "--tp-size", "0"),
                   "must be a positive integer, got 0")


def cli_rank_out_of_range(root: Path) -> CliCase:
    return CliCase("cli_rank_out_of_range", ("plan", str(base_checkpoint(root)), "--tp-size", "2",
                   "--rank", "2"), "valid ranks are 0..1")


def _verify(root: Path, *extra: str) -> tuple[str, ...]:
    return ("verify", str(base_checkpoint(root)), str(_sharded(root)), *extra)


def cli_seq_len_zero(root: Path) -> CliCase:
    return CliCase("cli_seq_len_zero", _verify(root, "--numeric", "--seq-len", "0"),
                   "--seq-len: must be a positive integer")


def cli_seq_len_negative(root: Path) -> CliCase:
    return CliCase("cli_seq_len_negative", _verify(root, "--numeric", "--seq-len", "-3"),
                   "--seq-len: must be a positive integer")


def cli_seed_negative(root: Path) -> CliCase:
    return CliCase("cli_seed_negative", _verify(root, "--numeric", "--seed", "-1"),
                   "--seed: must be an integer >= 0")


def cli_demo_seq_len_zero(root: Path) -> CliCase:
    return CliCase("cli_demo_seq_len_zero", ("demo", "--seq-len", "0"), "--seq-len")


def cli_backend_bogus(root: Path) -> CliCase:
    return CliCase("cli_backend_bogus", ("plan", str(base_checkpoint(root)), "--tp-size", "2"),
                   "UsageError: KDA_TP_BACKEND='bogus'", env={"KDA_TP_BACKEND": "bogus"})


def cli_header_tp_size_digits(root: Path) -> CliCase:
    checkpoint, out = _rank_meta(root, "cli_header_tp_size_digits", tp_size="7" * 5000)
    return CliCase("cli_header_tp_size_digits", ("verify", str(checkpoint), str(out)),
                   "MAX_INT_DIGITS")


def cli_header_layers_deep(root: Path) -> CliCase:
    checkpoint, out = _rank_meta(root, "cli_header_layers_deep",
                                 kda_tp_layers="[" * 100_000 + "]" * 100_000)
    return CliCase("cli_header_layers_deep", ("verify", str(checkpoint), str(out)),
                   "MAX_JSON_DEPTH")


def cli_misspelt_flag(root: Path) -> CliCase:
    return CliCase("cli_misspelt_flag", ("plan", str(base_checkpoint(root)), "--tp-szie", "4"),
                   "unrecognized argument --tp-szie; did you mean --tp-size?")


CLI_KINDS: dict[str, Callable[[Path], CliCase]] = {
    f.__name__: f
    for f in [
        cli_config_deep, cli_config_digits, cli_config_huge, cli_quant_config_deep,
        cli_kda_layers_repeated, cli_glm_layers_huge, cli_index_many_files,
        cli_arabic_layer_number, cli_tp_size_2_64, cli_tp_size_2_40, cli_shard_tp_size_1e8,
        cli_audit_tp_size_3e7, cli_tp_size_zero, cli_rank_out_of_range, cli_seq_len_zero,
        cli_seq_len_negative, cli_seed_negative, cli_demo_seq_len_zero, cli_backend_bogus,
        cli_header_tp_size_digits, cli_header_layers_deep, cli_misspelt_flag,
    ]
}


def build(kind: str, root: str | os.PathLike[str]) -> Case:
    """Write one kind under ``root`` and return its case."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return KINDS[kind](root)


def build_all(root: str | os.PathLike[str]) -> list[Case]:
    """Write every kind under ``root`` (plus valid seed files under ``root/_valid``)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _small_file(root / "_valid" / "small.safetensors")
    write_raw(root / "_valid" / "empty_header.safetensors", b"{}      ")
    # Tensors of the byte sizes of the fuzz target open_read's tiny KDA plan (hidden 4, head_dim
    # 2, 2 heads, conv 2, gate 2), so that slicing is reached from a seed.
    header, data = pack(
        [
            ("q_proj.weight", "BF16", [4, 4], _pattern(32)),
            ("q_conv1d.weight", "BF16", [4, 1, 2], _pattern(16, 1)),
            ("A_log", "F32", [1, 1, 2, 1], _pattern(8, 2)),
            ("o_norm.weight", "BF16", [2], _pattern(4, 3)),
        ]
    )
    write_raw(root / "_valid" / "kda_tiny.safetensors", header, data)
    return [KINDS[k](root) for k in KINDS]


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print(f"usage: python {Path(__file__).name} OUTDIR", file=sys.stderr)
        return 2
    cases = build_all(argv[0])
    for case in cases:
        expected = case.error.__name__ if case.error else "loads"
        print(f"{case.kind:32} {case.action:6} {expected:20} {case.path}")
    print(f"{len(cases)} kinds written to {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
