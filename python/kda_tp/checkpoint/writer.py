"""Streaming, crash-safe writers for safetensors files and their index.

The safetensors layout written here::

    [0, 8)                 header length N, unsigned 64-bit little-endian
    [8, 8 + N)             UTF-8 JSON header, right-padded with spaces so 8 + N is a multiple of 8
    [8 + N, end)           tensor data, tensors back to back in the order given, no gaps

The JSON header maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(byte offsets relative to the start of the data section) and may carry ``"__metadata__"``, a flat
str -> str object.

Each file is written atomically (``files.atomic_write``): a hidden temporary file in the
destination directory, flushed and fsync'd, then renamed over the final name. A reader therefore
sees either the old file or the complete new one, never a half-written file under the final
name.

Only numpy and the standard library are used.
"""

from __future__ import annotations

import errno
import io
import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..errors import CheckpointError, DtypeMismatchError, OutputError, ShapeMismatchError
from ..model.dtypes import DTYPE_BITS, tensor_nbytes
from . import files

__all__ = ["FileRange", "TensorSpec", "write_index", "write_safetensors"]

@dataclass(frozen=True)
class FileRange:
    """A tensor's bytes as a range of an open file, copied into the output by the kernel.

    Attributes:
        fd: the source file descriptor (the writer neither closes nor moves it).
        offset: absolute byte offset of the first byte in that file.
        nbytes: number of bytes.
        fallback: returns the same bytes as a buffer (see :data:`TensorSpec`); used where the
            kernel cannot copy between the two files (``copy_file_range`` and ``sendfile``
            unsupported, e.g. EXDEV, EINVAL or ENOSYS) or the output is not an OS file.
    """

    fd: int
    offset: int
    nbytes: int
    fallback: Callable[[], Any]


#: One tensor to write: ``(name, dtype, shape, nbytes, get_bytes)``. ``nbytes`` is a byte count
#: (not an element count) and must equal ``tensor_nbytes(dtype, shape)``. ``get_bytes`` is
#: called with no arguments, once, when the writer reaches that tensor, and must return a
#: C-contiguous buffer-protocol object (numpy array of any dtype, bytes, bytearray, memoryview)
#: holding exactly ``nbytes`` bytes of little-endian tensor data, or a :class:`FileRange` of
#: ``nbytes`` bytes (copied file to file with ``os.copy_file_range``, else ``os.sendfile``).
TensorSpec = tuple[str, str, tuple[int, ...], int, Callable[[], Any]]

# copy_file_range/sendfile cannot copy between these two files: use the buffer path instead.
_NO_KERNEL_COPY = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}

_METADATA_KEY = "__metadata__"

def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Iterable[TensorSpec],
    metadata: Mapping[str, str] | None = None,
    *,
    sync: bool = True,
    mode: int | None = None,
) -> int:
    """Write a safetensors file, pulling one tensor's bytes at a time.

    Args:
        path: final file name. Its directory must exist; an existing file is replaced atomically.
        tensors: ``(name, dtype, shape, nbytes, get_bytes)`` tuples (see :data:`TensorSpec`),
            laid out in the file in this order. The header is built from the declared sizes
            before any ``get_bytes`` is called; each buffer is written straight to the file and
            released before the next ``get_bytes`` call, so at most one tensor's data is alive.
        metadata: optional str -> str map stored as ``"__metadata__"`` in the header.
        sync: fsync the file and its directory (survives power loss). Without it the file is
            still never seen half-written under ``path`` by other processes, and a killed
            writer leaves only a hidden temporary file; ``kda-tp shard`` writes without it
            for speed (run ``sync`` afterwards where power-loss durability matters).
        mode: the file's permission bits (e.g. ``0o600``, an input file's, so a private
            checkpoint's output stays private), set before any byte is written; default
            ``0o666`` less the umask, as ``open`` gives.

    Returns:
        The size of the data section in bytes (the sum of all ``nbytes``), which is the value
        ``write_index`` expects as ``total_size`` when summed over a checkpoint's files.

    Raises:
        DtypeMismatchError: a dtype string that is not a safetensors dtype (``DTYPE_BITS``).
        ShapeMismatchError: a negative or non-integer dimension, an ``nbytes`` that disagrees
            with ``shape`` x dtype size, or a ``get_bytes`` result whose length is not ``nbytes``
            (the message names the tensor and both byte counts).
        OutputError: a duplicate or reserved tensor name, non-string metadata, or any OS error
            while creating, writing, syncing or renaming the file (e.g. ENOSPC, EACCES); the
            message names the file and the OS error, which is chained as ``__cause__``.
        TypeError: ``get_bytes`` returned something without the buffer protocol, or a
            non-contiguous buffer.

    Errors raised by ``get_bytes`` itself (including an ``OSError`` from reading an input) are
    re-raised unchanged. Whatever the error, the temporary file is removed and no file appears
    under ``path`` (a file already there is left as it was). The one exception is a failed fsync
    of the directory after the rename: the file is then complete and in place, and the
    ``OutputError`` says so.
    """
    path = Path(path)
    specs = list(tensors)
    header = _build_header(path, specs, metadata)
    data_size = sum(spec[3] for spec in specs)

    def write_body(f: BinaryIO) -> None:
        files.checked_write(f, path, header)
        for name, _dtype, _shape, nbytes, get_bytes in specs:
            data = get_bytes()
            if isinstance(data, FileRange):
                if data.nbytes != nbytes:
                    raise ShapeMismatchError(
                        f"{name}: get_bytes returned a file range of {data.nbytes} bytes, the "
                        f"header declares {nbytes} bytes"
                    )
                if _copy_file_range(f, path, name, data):
                    continue
                data = data.fallback()
            view = _byte_view(name, data, nbytes)
            del data  # only the view keeps the buffer alive, and it is released below
            files.checked_write(f, path, view)
            view.release()

    files.atomic_write(path, write_body, sync=sync, mode=mode)
    return data_size


def write_index(
    path: str | os.PathLike[str],
    weight_map: Mapping[str, str],
    total_size: int,
    *,
    sync: bool = True,
    mode: int | None = None,
) -> None:
    """Write a Hugging Face ``model.safetensors.index.json`` atomically.

    The file holds ``{"metadata": {"total_size": total_size}, "weight_map": {...}}`` with the
    weight map sorted by tensor name (see ``files.write_json`` for the formatting).

    Args:
        path: final file name (normally ``<dir>/model.safetensors.index.json``).
        weight_map: tensor name -> file name of the safetensors file holding it (relative to the
            index's directory).
        total_size: sum of the tensors' data sizes in bytes (headers not included).
        sync: fsync the file and its directory (see :func:`write_safetensors`).
        mode: the file's permission bits (see :func:`write_safetensors`).

    Raises:
        OutputError: ``total_size`` is not a non-negative int, or an OS error while writing.
    """
    if isinstance(total_size, bool) or not isinstance(total_size, int) or total_size < 0:
        raise OutputError(f"{path}: total_size must be a non-negative int, got {total_size!r}")
    document = {
        "metadata": {"total_size": total_size},
        "weight_map": {name: weight_map[name] for name in sorted(weight_map)},
    }
    files.write_json(path, document, sync=sync, mode=mode)


def _build_header(path: Path, specs: list[TensorSpec], metadata: Mapping[str, str] | None) -> bytes:
    """Validate the declared tensors and return the length-prefixed, padded header bytes."""
    header: dict[str, Any] = {}
    if metadata is not None:
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise OutputError(
                    f"{path}: safetensors metadata must map str to str, got {key!r}: {value!r}"
                )
        header[_METADATA_KEY] = dict(metadata)
    offset = 0
    for name, dtype, shape, nbytes, _get_bytes in specs:
        if name == _METADATA_KEY:
            raise OutputError(f"{path}: {_METADATA_KEY!r} is reserved and cannot name a tensor")
        if name in header:
            raise OutputError(f"{path}: duplicate tensor name {name!r}")
        dims = tuple(shape)
        try:
            expected = tensor_nbytes(dtype, dims)
        except (DtypeMismatchError, ShapeMismatchError) as e:
            raise type(e)(f"{name}: {e}") from None
        if nbytes != expected:
            raise ShapeMismatchError(
                f"{name}: declared {nbytes} bytes, but shape {list(dims)} of {dtype} "
                f"({DTYPE_BITS[dtype]} bits each) is {expected} bytes"
            )
        header[name] = {
            "dtype": dtype,
            "shape": [int(d) for d in dims],
            "data_offsets": [offset, offset + expected],
        }
        offset += expected
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-(8 + len(encoded)) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


def _byte_view(name: str, buffer: Any, nbytes: int) -> memoryview:
    """Return a flat unsigned-byte view of ``buffer``, refusing a length other than ``nbytes``."""
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise TypeError(f"{name}: get_bytes returned a non-contiguous numpy array")
        view = buffer.reshape(-1).view(np.uint8).data
    else:
        view = memoryview(buffer)
        if not view.c_contiguous:
            raise TypeError(f"{name}: get_bytes returned a non-contiguous buffer")
        if view.format != "B" or view.ndim != 1:
            # cast() refuses views with a zero-length dimension; an empty view writes nothing.
            view = view.cast("B") if view.nbytes else memoryview(b"")
    if view.nbytes != nbytes:
        actual = view.nbytes
        view.release()
        raise ShapeMismatchError(
            f"{name}: get_bytes returned {actual} bytes, the header declares {nbytes} bytes"
        )
    return view


def _copy_file_range(f: BinaryIO, path: Path, name: str, source: FileRange) -> bool:
    """Append ``source``'s bytes to ``f`` inside the kernel (no copy through this process):
    ``os.copy_file_range``, else ``os.sendfile``. Returns False, having written nothing, where
    neither can copy between these files or ``f`` is not an OS file; the caller then writes the
    bytes itself.

    Raises:
        OutputError: the copy failed otherwise (e.g. ENOSPC); names the file and the tensor.
        CheckpointError: the input ended before the range did (truncated while open).
    """
    if not isinstance(f, (io.BufferedWriter, io.FileIO)) or not source.nbytes:
        return False  # a file-like object (or nothing to copy): the plain write path
    try:
        f.flush()  # the header and earlier tensors first
    except OSError as exc:
        raise OutputError(f"{path}: write failed: {exc}") from exc
    out_fd = f.fileno()
    copy = getattr(os, "copy_file_range", None)
    done = 0
    while done < source.nbytes:
        offset, count = source.offset + done, source.nbytes - done
        try:
            if copy is not None:
                n = copy(source.fd, out_fd, count, offset)
            else:
                n = os.sendfile(out_fd, source.fd, offset, count)
        except OSError as exc:
            if exc.errno in _NO_KERNEL_COPY and copy is not None:
                copy = None  # e.g. across file systems on older kernels: try sendfile
                continue
            if exc.errno in _NO_KERNEL_COPY and done == 0:
                return False
            raise OutputError(f"{path}: copying {name} failed: {exc}") from exc
        if n == 0:
            raise CheckpointError(
                f"{name}: the input file ended at byte {offset}, before the tensor's bytes "
                f"{source.offset}..{source.offset + source.nbytes} (truncated while open)"
            )
        done += n
    return True
