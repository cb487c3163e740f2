"""A view never reads a file that changed since it was opened (issue 33.3).

A checkpoint rewritten in place under an open view (the same inode, opened with ``O_TRUNC``, a
header 16 bytes longer, the same tensors) used to be read at the old offsets on both backends:
valid-looking bytes, shifted by 16. Now every read (``view[name]``, ``read_into``, and the
source's ``get``, ``read_range``, ``read_columns``, ``file_range``) refuses it with a
``CheckpointError`` naming the file and what changed, on both backends; a view opened anew reads
the rewritten file. (Truncation and replacement by rename: ``tests/cli/test_shard_hazards.py``;
the Rust side, ctime and link counts included: ``rust/checkpoint/tests/changed.rs``.)
"""

from __future__ import annotations

import struct
from pathlib import Path

import kda_tp
import malformed
import numpy as np
import pytest
from kda_tp import KdaTpPlan, SafetensorsSource
from kda_tp.errors import CheckpointError

Q_PROJ = malformed.ATTN.format(0) + "q_proj.weight"
O_PROJ = malformed.ATTN.format(1) + "o_proj.weight"
EMBED = "model.embed_tokens.weight"
NAMES = (Q_PROJ, O_PROJ, EMBED)  # a row slice, the column gather, a passed-through tensor


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """The small two-KDA-layer checkpoint of ``malformed.py`` as one ``model.safetensors``."""
    return malformed.rewritten(tmp_path, "ckpt", lambda tensors: tensors)


def rewrite_in_place(path: Path, pad: int = 16) -> bytes:
    """Write ``path`` again on its own inode (``open(path, "wb")``: ``O_TRUNC``) with the same
    tensors and the header padded with ``pad`` spaces, so that every tensor lies ``pad`` bytes
    further on. Returns the new file's bytes."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + n] + b" " * pad
    new = struct.pack("<Q", len(header)) + header + raw[8 + n :]
    inode = path.stat().st_ino
    with open(path, "wb") as f:
        f.write(new)
    assert path.stat().st_ino == inode, "rewritten in place, not replaced"
    return new


def assert_changed(info: pytest.ExceptionInfo[CheckpointError], path: Path, size: int) -> None:
    message = str(info.value)
    assert message.startswith(f"{path}: tensor ")
    assert f"the file changed since it was opened (size {size} -> {size + 16} bytes, mtime " in (
        message)
    assert "reopen it" in message


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_view_refuses_a_checkpoint_rewritten_in_place(checkpoint: Path, backend: str) -> None:
    file = checkpoint / "model.safetensors"
    size = file.stat().st_size
    with kda_tp.open_rank(checkpoint, tp_rank=1, tp_size=2, backend=backend) as view:
        before = {name: bytes(np.asarray(view[name].data)) for name in NAMES}
        full = bytes(np.asarray(view.source.get(Q_PROJ).data))
        begin = view.source.file_range(Q_PROJ)[1]
        new = rewrite_in_place(file)
        # The same tensor 16 bytes further on; its old offsets hold other bytes (what a read
        # there would have returned).
        assert new[begin + 16 : begin + 16 + len(full)] == full
        assert new[begin : begin + len(full)] != full
        for name in NAMES:
            with pytest.raises(CheckpointError) as info:
                view[name]
            assert_changed(info, file, size)
            assert f'"{name}"' in str(info.value)
            out = np.zeros(len(before[name]), np.uint8)
            with pytest.raises(CheckpointError) as info:
                view.read_into(name, out)
            assert_changed(info, file, size)
            assert not out.any(), "nothing was written"
    with kda_tp.open_rank(checkpoint, tp_rank=1, tp_size=2, backend=backend) as again:
        assert {name: bytes(np.asarray(again[name].data)) for name in NAMES} == before


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_source_refuses_a_file_rewritten_in_place_on_every_read_path(
    checkpoint: Path, backend: str
) -> None:
    file = checkpoint / "model.safetensors"
    size = file.stat().st_size
    source = SafetensorsSource(file, backend)
    o_proj = KdaTpPlan.from_config(source, 1, 2)["o_proj"]
    source.get(EMBED)
    rewrite_in_place(file)
    reads = {
        "get": lambda: source.get(EMBED),
        "read_range": lambda: source.read_range(Q_PROJ, 0, 8),
        "read_columns": lambda: source.read_columns(O_PROJ, o_proj),
        "file_range": lambda: source.file_range(Q_PROJ),
    }
    for what, read in reads.items():
        with pytest.raises(CheckpointError) as info:
            read()
        assert_changed(info, file, size)
        assert "cannot be copied" in str(info.value) if what == "file_range" else (
            "cannot be read" in str(info.value))
    source.close()
