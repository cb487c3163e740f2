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

import os
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


def _later_ctime(path: Path, opened: os.stat_result) -> None:
    """Wait (for a state, not a time) until a change made now gets a later ctime than
    ``opened``'s, on file systems whose timestamps are coarse."""
    probe = path.with_name("probe")
    while True:
        probe.write_bytes(b"x")
        if probe.stat().st_ctime_ns > opened.st_ctime_ns:
            return


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_same_size_rewrite_with_the_old_mtime_and_a_new_hard_link_is_refused(
    checkpoint: Path, backend: str
) -> None:
    """Issue 38 F14: a ctime that moved was excused whenever the link count changed, so the
    same bytes' length rewritten in place, the old mtime put back (``touch -r``) and a hard
    link made meanwhile read as unchanged. Only an unlink or a rename over the path (the path
    names another file, or no link is left) excuses a ctime now."""
    file = checkpoint / "model.safetensors"
    with kda_tp.open_rank(checkpoint, tp_rank=1, tp_size=2, backend=backend) as view:
        opened = file.stat()
        _later_ctime(file, opened)
        raw = bytearray(file.read_bytes())
        raw[-4:] = b"\x7f\x7f\x7f\x7f"  # the last tensor's last bytes, the length unchanged
        with open(file, "r+b") as f:
            f.write(raw)
        os.utime(file, ns=(opened.st_atime_ns, opened.st_mtime_ns))
        os.link(file, checkpoint / "linked.safetensors.bak")
        now = file.stat()
        assert (now.st_ino, now.st_size, now.st_mtime_ns) == (
            opened.st_ino, opened.st_size, opened.st_mtime_ns)
        assert now.st_nlink == opened.st_nlink + 1
        with pytest.raises(CheckpointError, match=r"the file changed since it was opened \(ctime "):
            view[EMBED]


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_file_unlinked_or_replaced_while_open_still_reads_its_bytes(
    checkpoint: Path, backend: str
) -> None:
    """What a ctime that moved alone is excused for: the path no longer names the open file.
    The open file moved to another name and a new file written at its path (refused before:
    the link count had not changed), then that other name removed (no link left)."""
    file = checkpoint / "model.safetensors"
    with kda_tp.open_rank(checkpoint, tp_rank=1, tp_size=2, backend=backend) as view:
        before = bytes(np.asarray(view[Q_PROJ].data))
        _later_ctime(file, file.stat())
        os.replace(file, checkpoint / "old.bin")
        file.write_bytes((checkpoint / "old.bin").read_bytes())
        assert bytes(np.asarray(view[Q_PROJ].data)) == before
        (checkpoint / "old.bin").unlink()
        assert bytes(np.asarray(view[Q_PROJ].data)) == before
        # Moved away with nothing at its path: it may be written under its new name, refused.
    with kda_tp.open_rank(checkpoint, tp_rank=1, tp_size=2, backend=backend) as view:
        _later_ctime(file, file.stat())
        os.replace(file, checkpoint / "moved.bin")
        with pytest.raises(CheckpointError, match="changed since it was opened"):
            view[Q_PROJ]
        os.replace(checkpoint / "moved.bin", file)
