"""`kda-tp shard` copies contiguous tensor bytes file to file in the kernel.

Row-sliced, replicated and passed-through tensors go through ``os.copy_file_range`` (else
``os.sendfile``, else the buffer path), ``o_proj`` through the gather. Every path writes the
same bytes; failures of the kernel copy are named errors and leave nothing behind.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from kda_tp.checkpoint import writer as _io
from kda_tp.errors import CheckpointError, OutputError
from kda_tp.shard import shard_checkpoint, verify_shards
from kda_tp.synth import write_small_checkpoint

from tp_fixtures import tree

GEOMETRY = dict(
    hidden=64, heads=4, head_dim=64, conv_kernel=4, gate_rank=16, num_layers=2, kda_layers=[0, 1]
)

pytestmark = pytest.mark.skipif(
    not hasattr(os, "copy_file_range"), reason="os.copy_file_range needs Linux"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_small_checkpoint(tmp_path_factory.mktemp("ckpt") / "ckpt", **GEOMETRY, seed=5)


def _unsupported(code: int):
    def fail(*_args, **_kwargs):
        raise OSError(code, os.strerror(code))

    return fail


def _counting(real, calls: list[int]):
    def wrapped(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    return wrapped


def test_every_fallback_writes_the_same_bytes(checkpoint: Path, tmp_path: Path, monkeypatch):
    copies: list[int] = []
    monkeypatch.setattr(os, "copy_file_range", _counting(os.copy_file_range, copies))
    shard_checkpoint(checkpoint, tmp_path / "kernel", 2)
    assert copies, "copy_file_range was used"
    assert verify_shards(checkpoint, tmp_path / "kernel").ok
    reference = tree(tmp_path / "kernel")

    # Across file systems on an old kernel: sendfile takes over.
    sends: list[int] = []
    monkeypatch.setattr(os, "copy_file_range", _unsupported(errno.EXDEV))
    monkeypatch.setattr(os, "sendfile", _counting(os.sendfile, sends))
    shard_checkpoint(checkpoint, tmp_path / "sendfile", 2)
    assert sends, "sendfile was used"
    assert tree(tmp_path / "sendfile") == reference

    # Neither: the bytes go through this process as before.
    for code in (errno.EINVAL, errno.ENOSYS):
        monkeypatch.setattr(os, "sendfile", _unsupported(code))
        shard_checkpoint(checkpoint, tmp_path / f"write{code}", 2)
        assert tree(tmp_path / f"write{code}") == reference


def test_both_backends_copy_in_the_kernel(checkpoint: Path, tmp_path: Path, monkeypatch):
    shard_checkpoint(checkpoint, tmp_path / "mmap", 2, backend="mmap")
    copies: list[int] = []
    monkeypatch.setattr(os, "copy_file_range", _counting(os.copy_file_range, copies))
    shard_checkpoint(checkpoint, tmp_path / "pread", 2, backend="pread")
    assert copies
    assert tree(tmp_path / "pread") == tree(tmp_path / "mmap")


def test_a_full_disk_during_the_kernel_copy(checkpoint: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setattr(os, "copy_file_range", _unsupported(errno.ENOSPC))
    out = tmp_path / "out"
    with pytest.raises(OutputError, match="No space left on device") as info:
        shard_checkpoint(checkpoint, out, 2)
    assert "copying model." in str(info.value) and str(out) in str(info.value)
    assert not out.exists(), "nothing is left behind, the output directory it created included"


def test_an_input_that_ends_early_is_a_checkpoint_error(
    checkpoint: Path, tmp_path: Path, monkeypatch
):
    """copy_file_range returns 0 at the end of the input: the file shrank while open."""
    monkeypatch.setattr(os, "copy_file_range", lambda *_a, **_k: 0)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="truncated while open"):
        shard_checkpoint(checkpoint, out, 2)
    assert not out.exists()


def test_a_file_like_output_gets_the_buffer_path(tmp_path: Path, checkpoint: Path):
    """The kernel copies between OS files only; a FileRange written to anything else falls back
    to its buffer (the writer's fault-injection tests rely on this)."""
    source_path = next(checkpoint.glob("*.safetensors"))
    with open(source_path, "rb") as src:
        data = source_path.read_bytes()[:64]
        piece = _io.FileRange(src.fileno(), 0, 64, lambda: data)

        class Sink:
            def __init__(self):
                self.chunks = []

            def write(self, chunk):
                self.chunks.append(bytes(chunk))
                return len(chunk)

        sink = Sink()
        assert not _io._copy_file_range(sink, tmp_path / "x", "t", piece)
        assert sink.chunks == []
