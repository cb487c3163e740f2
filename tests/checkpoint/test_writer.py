"""Tests of the streaming safetensors writer (kda_tp.checkpoint.writer): ``write_safetensors``,
``write_index``, and the atomic ``write_json`` they share (kda_tp.checkpoint.files).

Files are read back two ways: with the ``safetensors`` package (which validates the layout) and
with a small header parser (``checkpoint_files.read_file``), so byte offsets, padding and raw
bytes are checked exactly. Synthetic checkpoints (kda_tp.synth): tests/synth/test_synth.py.
"""

from __future__ import annotations

import errno
import json
import os
import weakref
from pathlib import Path

import ml_dtypes  # registers bfloat16 with numpy so safetensors can return BF16 arrays
import numpy as np
import pytest
from safetensors import safe_open

from kda_tp.checkpoint import files as _files, writer as _io
from kda_tp.errors import DtypeMismatchError, OutputError, ShapeMismatchError

from checkpoint_files import read_file


# ----------------------------------------------------------------------------------------------
# helpers


def spec(name, dtype, shape, data):
    """A TensorSpec whose get_bytes returns ``data``."""
    return (name, dtype, tuple(shape), memoryview(data).nbytes, lambda: data)


def leftovers(directory: Path) -> list[str]:
    """Names of temporary files the writer left behind in ``directory``."""
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".partial"))


# ----------------------------------------------------------------------------------------------
# write_safetensors


def test_round_trip_exact_bytes_header_and_metadata(tmp_path):
    rng = np.random.default_rng(1)
    f32 = rng.standard_normal((3, 5), dtype=np.float32)
    bf16 = rng.integers(0, 2**16, size=(7,), dtype=np.uint16)  # odd byte count shifts the rest
    i64 = np.arange(4, dtype=np.int64).reshape(2, 2)
    u8 = bytes(range(11))
    empty = np.zeros((0, 3), dtype=np.float32)
    specs = [
        spec("w.f32", "F32", f32.shape, f32),
        spec("w.bf16", "BF16", bf16.shape, bf16),
        spec("w.i64", "I64", i64.shape, i64),
        spec("w.u8", "U8", (11,), u8),
        spec("w.empty", "F32", (0, 3), empty),
        spec("w.scalar", "F64", (), np.float64(2.5).tobytes()),
    ]
    path = tmp_path / "a.safetensors"
    written = _io.write_safetensors(path, specs, metadata={"format": "pt", "note": "x y"})

    header, start, data = read_file(path)
    assert written == len(data) == sum(s[3] for s in specs)
    assert start % 8 == 0
    raw_header = path.read_bytes()[8:start]
    assert raw_header.startswith(b"{") and raw_header.rstrip(b" ").endswith(b"}")
    assert set(raw_header[len(raw_header.rstrip(b" ")) :]) <= {ord(" ")}
    assert header["__metadata__"] == {"format": "pt", "note": "x y"}
    assert list(header)[1:] == [s[0] for s in specs]  # header order = given order
    offset = 0
    for name, dtype, shape, nbytes, get_bytes in specs:
        entry = header[name]
        assert entry == {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        assert data[offset : offset + nbytes] == np.asarray(get_bytes()).tobytes()
        offset += nbytes

    with safe_open(str(path), framework="np") as f:
        assert f.metadata() == {"format": "pt", "note": "x y"}
        assert f.keys() == sorted(s[0] for s in specs)
        np.testing.assert_array_equal(f.get_tensor("w.f32"), f32)
        np.testing.assert_array_equal(f.get_tensor("w.i64"), i64)
        assert f.get_tensor("w.bf16").view(np.uint16).tolist() == bf16.tolist()
        assert f.get_tensor("w.u8").tobytes() == u8
        assert f.get_tensor("w.empty").shape == (0, 3)
        assert f.get_tensor("w.scalar") == 2.5
    assert leftovers(tmp_path) == []


def test_no_metadata_and_no_tensors(tmp_path):
    path = tmp_path / "empty.safetensors"
    assert _io.write_safetensors(path, []) == 0
    header, start, data = read_file(path)
    assert header == {} and data == b"" and start == 8 + 8  # "{}" padded to 8 bytes
    with safe_open(str(path), framework="np") as f:
        assert f.keys() == [] and f.metadata() is None


@pytest.mark.parametrize(
    "make",
    [
        lambda a: a.tobytes(),
        lambda a: bytearray(a.tobytes()),
        lambda a: memoryview(a.tobytes()),
        lambda a: memoryview(a),  # 2-D float32 memoryview
        lambda a: a,  # 2-D float32 array
        lambda a: a.view(np.uint8).reshape(-1),
    ],
    ids=["bytes", "bytearray", "memoryview", "memoryview-2d", "array-f32", "array-u8"],
)
def test_accepts_any_contiguous_buffer(tmp_path, make):
    a = np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5
    path = tmp_path / "b.safetensors"
    _io.write_safetensors(path, [("t", "F32", (3, 4), 48, lambda: make(a))])
    _h, _s, data = read_file(path)
    assert data == a.tobytes()


def test_non_contiguous_buffer_is_refused(tmp_path):
    a = np.zeros((4, 4), dtype=np.float32)[:, ::2]
    with pytest.raises(TypeError, match="non-contiguous"):
        _io.write_safetensors(tmp_path / "c.safetensors", [("t", "F32", (4, 2), 32, lambda: a)])
    assert list(tmp_path.iterdir()) == []


def test_get_bytes_called_in_order_one_buffer_alive_at_a_time(tmp_path):
    calls = []
    alive = []

    def producer(i):
        def get_bytes():
            # Every earlier buffer must already be released by the writer.
            assert all(ref() is None for ref in alive), f"buffer of an earlier tensor alive at {i}"
            calls.append(i)
            arr = np.full(1000, i, dtype=np.float32)
            alive.append(weakref.ref(arr))
            return arr

        return get_bytes

    specs = [(f"t{i}", "F32", (1000,), 4000, producer(i)) for i in range(5)]
    _io.write_safetensors(tmp_path / "d.safetensors", specs)
    assert calls == [0, 1, 2, 3, 4]
    assert all(ref() is None for ref in alive)


def test_wrong_buffer_length_is_refused_and_nothing_is_left(tmp_path):
    path = tmp_path / "e.safetensors"
    path.write_bytes(b"old contents")
    specs = [
        spec("good", "F32", (2,), np.ones(2, np.float32)),
        ("model.layers.0.self_attn.q_proj.weight", "BF16", (4, 4), 32, lambda: bytes(30)),
    ]
    with pytest.raises(ShapeMismatchError) as info:
        _io.write_safetensors(path, specs)
    message = str(info.value)
    assert (
        "model.layers.0.self_attn.q_proj.weight" in message and "30" in message and "32" in message
    )
    assert path.read_bytes() == b"old contents"  # the old file is untouched
    assert leftovers(tmp_path) == []


def test_declared_size_must_match_shape_before_any_data_is_pulled(tmp_path):
    def never():
        raise AssertionError("get_bytes must not be called")

    with pytest.raises(
        ShapeMismatchError, match=r"^t: declared 10 bytes, but shape \[2, 3\] of F32 .* 24 bytes$"
    ):
        _io.write_safetensors(tmp_path / "f.safetensors", [("t", "F32", (2, 3), 10, never)])
    with pytest.raises(ShapeMismatchError, match="negative"):
        _io.write_safetensors(tmp_path / "f.safetensors", [("t", "F32", (-1, 3), 0, never)])
    assert list(tmp_path.iterdir()) == []


def test_unknown_dtype_is_refused(tmp_path):
    with pytest.raises(DtypeMismatchError, match="^t: dtype 'FP32' is not a safetensors dtype"):
        _io.write_safetensors(
            tmp_path / "g.safetensors", [("t", "FP32", (1,), 4, lambda: bytes(4))]
        )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("specs", "metadata", "match"),
    [
        (
            [("a", "U8", (1,), 1, lambda: b"x"), ("a", "U8", (1,), 1, lambda: b"y")],
            None,
            "duplicate",
        ),
        ([("__metadata__", "U8", (1,), 1, lambda: b"x")], None, "reserved"),
        ([], {"k": 1}, "str to str"),
    ],
    ids=["duplicate", "reserved", "metadata"],
)
def test_invalid_header_is_refused(tmp_path, specs, metadata, match):
    with pytest.raises(OutputError, match=match):
        _io.write_safetensors(tmp_path / "h.safetensors", specs, metadata)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("exc", [RuntimeError("boom"), OSError(errno.EIO, "input read failed")])
def test_error_from_get_bytes_passes_through_and_temp_is_removed(tmp_path, exc):
    def failing():
        assert len(leftovers(tmp_path)) == 1  # the temporary file exists while writing
        raise exc

    path = tmp_path / "i.safetensors"
    specs = [spec("ok", "U8", (3,), b"abc"), ("bad", "U8", (3,), 3, failing)]
    with pytest.raises(type(exc)) as info:
        _io.write_safetensors(path, specs)
    assert info.value is exc  # not wrapped: it is an input problem, not an output one
    assert list(tmp_path.iterdir()) == []


def test_temporary_file_name_and_permissions(tmp_path, monkeypatch):
    seen = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append((Path(src), Path(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(_io.os, "replace", spy)
    path = tmp_path / "j.safetensors"
    _io.write_safetensors(path, [spec("t", "U8", (1,), b"z")])
    ((src, dst),) = seen
    assert dst == path and src.parent == tmp_path
    assert src.name.startswith(".j.safetensors.") and src.name.endswith(".partial")
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_enospc_at_fsync_becomes_output_error(tmp_path, monkeypatch):
    def full(_fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_io.os, "fsync", full)
    path = tmp_path / "k.safetensors"
    with pytest.raises(OutputError) as info:
        _io.write_safetensors(path, [spec("t", "U8", (4,), b"abcd")])
    assert "k.safetensors" in str(info.value) and os.strerror(errno.ENOSPC) in str(info.value)
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


def test_enospc_during_data_write_becomes_output_error(tmp_path, monkeypatch):
    """A file object that runs out of space after 100 bytes, as a full disk would."""

    class FullDisk:
        def __init__(self, f):
            self._f, self._written = f, 0

        def write(self, data):
            self._written += memoryview(data).nbytes
            if self._written > 100:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self._f.write(data)

        def __getattr__(self, name):
            return getattr(self._f, name)

    real_open = open
    monkeypatch.setattr(_files, "open", lambda fd, mode: FullDisk(real_open(fd, mode)), raising=False)
    path = tmp_path / "l.safetensors"
    with pytest.raises(OutputError, match="l.safetensors.*write failed") as info:
        _io.write_safetensors(path, [spec("t", "U8", (1000,), bytes(1000))])
    assert info.value.__cause__.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


def test_missing_directory_becomes_output_error(tmp_path):
    with pytest.raises(OutputError, match="m.safetensors") as info:
        _io.write_safetensors(tmp_path / "nope" / "m.safetensors", [spec("t", "U8", (1,), b"z")])
    assert isinstance(info.value.__cause__, FileNotFoundError)


@pytest.mark.skipif(
    os.name != "posix" or os.geteuid() == 0, reason="root ignores directory permissions"
)
def test_read_only_directory_becomes_output_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(OutputError, match="n.safetensors") as info:
            _io.write_safetensors(ro / "n.safetensors", [spec("t", "U8", (1,), b"z")])
        assert isinstance(info.value.__cause__, PermissionError)
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


def test_rename_failure_becomes_output_error_and_temp_is_removed(tmp_path):
    target = tmp_path / "o.safetensors"
    target.mkdir()
    (target / "keep").write_text("x")  # os.replace cannot replace a non-empty directory
    with pytest.raises(OutputError, match="o.safetensors") as info:
        _io.write_safetensors(target, [spec("t", "U8", (1,), b"z")])
    assert isinstance(info.value.__cause__, OSError)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.safetensors"]


# ----------------------------------------------------------------------------------------------
# write_index / write_json


def test_write_index(tmp_path):
    path = tmp_path / "model.safetensors.index.json"
    weight_map = {
        "b.weight": "model-00002-of-00002.safetensors",
        "a.weight": "model-00001-of-00002.safetensors",
    }
    _io.write_index(path, weight_map, 1234)
    text = path.read_text()
    assert text.endswith("\n")
    document = json.loads(text)
    assert document == {"metadata": {"total_size": 1234}, "weight_map": weight_map}
    assert list(document["weight_map"]) == ["a.weight", "b.weight"]
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("total", [-1, 1.5, True])
def test_write_index_refuses_bad_total(tmp_path, total):
    with pytest.raises(OutputError, match="total_size"):
        _io.write_index(tmp_path / "x.json", {}, total)
    assert list(tmp_path.iterdir()) == []


def test_write_json_is_atomic_on_unserialisable_input(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{}")
    with pytest.raises(TypeError):
        _files.write_json(path, {"x": object()})
    assert path.read_text() == "{}"
    assert leftovers(tmp_path) == []
