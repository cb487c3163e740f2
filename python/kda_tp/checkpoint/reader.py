"""Reading safetensors checkpoints: :class:`SafetensorsSource` and its :class:`Tensor` records.

A *source* is anything with ``names() -> list[str]`` and ``get(name) -> record | None``, where a
record has ``dtype`` (safetensors dtype name, e.g. ``"BF16"``), ``shape`` (tuple) and ``data``
(the raw little-endian bytes, any buffer-protocol object). :class:`SafetensorsSource` is one;
``kda_tp.KdaShardedSource`` (one rank's view) is another. This module knows files and
bytes, not the shard plan: ``kda_tp.rank.plan`` and ``kda_tp.rank.view`` build on it.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np

from .. import _native
from ..errors import (
    CheckpointError,
    DtypeMismatchError,
    OpenFilesLimitError,
    ShapeMismatchError,
    UsageError,
)
from ..model.config import load_config
from ..model.dtypes import DTYPE_SIZES, import_torch, numpy_dtype, torch_dtype
from .names import location
from .files import open_files_error

__all__ = ["BACKEND_ENV", "BACKENDS", "INDEX_NAME", "InfoSource", "Tensor", "TensorSource",
           "SafetensorsSource", "checked_get", "checked_info", "missing_tensor", "numpy_dtype",
           "readonly_bytes", "refuse_index_member", "shard_bytes"]

_T = TypeVar("_T")

#: The index of a sharded Hugging Face checkpoint directory.
INDEX_NAME = "model.safetensors.index.json"


def refuse_index_member(path: str | os.PathLike[str]) -> None:
    """Refuse one ``.safetensors`` file of an indexed checkpoint where a whole checkpoint is
    needed: alone it lacks the tensors the index puts in the other files (KDA layers,
    embeddings, MLA layers).

    Raises:
        CheckpointError: ``path`` is such a file; the message names the directory to pass.
    """
    path = Path(path)
    if path.suffix == ".safetensors" and path.is_file() and (path.parent / INDEX_NAME).is_file():
        raise CheckpointError(
            f"{path} is one file of an indexed checkpoint; pass the directory {path.parent} "
            f"(it has {INDEX_NAME})"
        )

BACKEND_ENV = "KDA_TP_BACKEND"
#: The read backends of :class:`SafetensorsSource`.
BACKENDS = ("mmap", "pread")

class Tensor:
    """One tensor: safetensors dtype name, shape, and raw bytes.

    Attributes:
        name: the checkpoint name, e.g. ``model.layers.0.self_attn.q_proj.weight``.
        dtype: safetensors dtype name, e.g. ``"BF16"``.
        shape: shape in elements (a tuple); for a shard, the rank's local shape.
        data: read-only 1-D ``uint8`` numpy array of the raw little-endian bytes, row-major.
            Row-sliced and replicated tensors view the mapped file directly (no copy).

    ``writable`` (optional, keyword): a function of no arguments returning the same bytes as a
    writable 1-D ``uint8`` array that is the receiver's to write (a
    :class:`SafetensorsSource` gives a range of its copy-on-write mapping): what
    :meth:`to_torch` hands torch when ``data`` is read-only memory it does not own.
    """

    __slots__ = ("name", "dtype", "shape", "data", "_writable")

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], data: np.ndarray, *,
                 writable: Callable[[], np.ndarray] | None = None):
        self.name = name
        self.dtype = dtype
        self.shape = tuple(shape)
        self.data = data
        self._writable = writable

    @property
    def nbytes(self) -> int:
        """Size of the data in bytes."""
        return self.data.nbytes

    @property
    def array(self) -> np.ndarray:
        """A read-only typed view of ``data`` with ``shape`` (BF16 as ``ml_dtypes.bfloat16``).

        No copy is made. Raises DtypeMismatchError for dtypes numpy cannot represent.
        """
        return self.data.view(numpy_dtype(self.dtype)).reshape(self.shape)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        array = self.array
        if dtype is not None:
            return array.astype(dtype)
        return array.copy() if copy else array

    def __bytes__(self) -> bytes:
        return self.data.tobytes()

    def writable_data(self) -> np.ndarray:
        """``data``'s bytes as a 1-D ``uint8`` array the caller may write (what
        :meth:`to_torch` hands torch), without a copy where that is safe:

        * ``data`` itself when it is writable, or memory this tensor owns (``o_proj``'s
          gathered columns, an aligned copy: no one else sees it; ``data`` is marked writable
          then, as it now is);
        * for a tensor of a ``"mmap"`` :class:`SafetensorsSource` (and a rank's view of one),
          the same bytes in the file's copy-on-write mapping (``MAP_PRIVATE``, ``PROT_READ |
          PROT_WRITE``, as safetensors gives torch): nothing is copied until a page is written;
          a written page (4 KiB) becomes this process's own memory, the file never changes,
          and ``data``, ``view[name]`` and every read of the source keep the file's bytes. The
          writable buffers of one source share its copy-on-write mapping, as safetensors'
          ``get_tensor`` calls share one storage: two of the same tensor see each other's
          writes;
        * else (``"pread"``: data already a private copy; a custom source's read-only array) a
          copy.
        """
        data = self.data
        if data.flags.owndata and not data.flags.writeable:
            data.flags.writeable = True  # now torch's to write: numpy says so too
        if data.flags.writeable:
            return data
        if self._writable is not None:
            return self._writable()
        return data.copy()

    def to_torch(self) -> Any:
        """This tensor as a CPU ``torch.Tensor`` of its dtype and shape, writable, sharing
        memory wherever that is safe (see :meth:`writable_data`): with the ``"mmap"`` backend a
        view of the file's copy-on-write mapping, so in-place ops (``mul_``, ``add_``, an
        optimizer step after ``load_state_dict(..., assign=True)``) work, cost a page copy only
        where they write, and never change the file. BF16 and FP8 included (see
        :func:`torch_dtype`).

        Raises:
            MissingDependencyError: torch is not installed (``pip install 'kda_tp[torch]'``).
            DtypeMismatchError: a dtype torch has no equivalent for.
        """
        torch = import_torch()
        try:
            dtype = torch_dtype(self.dtype)
        except DtypeMismatchError as e:
            raise DtypeMismatchError(f"{self.name}: {e}") from None
        if not self.nbytes:
            return torch.empty(self.shape, dtype=dtype)
        data = self.writable_data()
        with warnings.catch_warnings():
            # Memory this tensor owns but numpy marks read-only (a gather): torch warns that it
            # cannot mark it read-only; it is torch's to write (writable_data).
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(data, dtype=torch.uint8)
        return raw.view(dtype).reshape(self.shape)

    def __repr__(self) -> str:
        return f"Tensor({self.name!r}, dtype={self.dtype}, shape={self.shape})"


class TensorSource(Protocol):
    """What :class:`~kda_tp.rank.view.KdaShardedSource` needs from the source it wraps."""

    def names(self) -> list[str]: ...

    def get(self, name: str) -> Any: ...


class InfoSource(Protocol):
    """A source that answers a tensor's ``(dtype, shape)`` without reading its data
    (:class:`SafetensorsSource`, a rank's view)."""

    def info(self, name: str) -> tuple[str, tuple[int, ...]] | None: ...


def readonly_bytes(data: Any) -> np.ndarray:
    """``data`` (any buffer-protocol object) as a read-only 1-D ``uint8`` array; no copy unless
    ``data`` is a strided numpy array or memoryview."""
    if isinstance(data, (np.ndarray, memoryview)):
        data = np.ascontiguousarray(data)  # copies only a strided view
    array = np.frombuffer(data, dtype=np.uint8)
    array.flags.writeable = False
    return array


def shard_bytes(tensor_plan: _native.KdaTensorPlan, buffer: Any) -> np.ndarray:
    """This rank's bytes of one full tensor.

    Args:
        tensor_plan: the plan entry (``plan["q_proj"]``).
        buffer: the full tensor's raw bytes, ``tensor_plan.full_bytes`` long; any
            buffer-protocol object (bytes, bytearray, memoryview, numpy array of any dtype,
            row-major; a strided array or memoryview is first copied to contiguous memory).
            Not written by another thread during the call (the gather reads it with the GIL
            released); a :class:`SafetensorsSource`'s arrays never are.

    Returns:
        A read-only 1-D ``uint8`` array of ``tensor_plan.local_bytes`` bytes. For replicated and
        row-sliced tensors (one contiguous byte range) it is a view of ``buffer``; for
        ``CHANNEL_COLS`` (``o_proj``, a strided gather of every row's column range) it is a new
        array, filled by several threads with the GIL released when large.

    Raises:
        ShapeMismatchError: ``len(buffer)`` is not ``tensor_plan.full_bytes``.
    """
    out = _native.shard_bytes(tensor_plan, readonly_bytes(buffer))
    out.flags.writeable = False
    return out


def _open_files_limit(path: Path) -> OpenFilesLimitError | None:
    """When opening ``path`` failed: the error naming ``RLIMIT_NOFILE`` if the limit is what
    failed (every file of a checkpoint stays open), else None.

    The native reader opens the files its index names in name order and stops at the first
    missing one, so the limit failed only when the files it reached all exist.
    """
    names: list[str] | None = None
    if (path / INDEX_NAME).is_file():
        try:
            weight_map = json.loads((path / INDEX_NAME).read_bytes())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return None  # RecursionError: json's own, nesting past its stack
    error = open_files_error(1 if names is None else len(names), path)
    if error is None or names is None:
        return error
    reached = names[: max(error.limit - error.open_now, 0) + 1]
    if not all(isinstance(n, str) and (path / n).exists() for n in reached):
        return None
    return error


class SafetensorsSource:
    """A safetensors checkpoint as a tensor source.

    Args:
        path: a ``.safetensors`` file, or a directory holding ``model.safetensors.index.json``
            and the files it names (or exactly one ``.safetensors`` file).
        backend: ``"mmap"`` (the default: tensors view a read-only mapping of the file, no copy)
            or ``"pread"`` (each ``get`` copies the tensor with positioned reads and nothing is
            mapped, for network filesystems). Defaults to ``$KDA_TP_BACKEND``, else ``"mmap"``.

    Every file's header is validated when the source opens (each file's length against its
    header; at most 32 axes per tensor, what numpy 1.x holds), and each file's identity is
    recorded then (size, mtime and ctime to the nanosecond, device, inode). Every read compares
    the file with that record (one ``fstat`` per read) and refuses a file that changed since it
    was opened (truncated, or rewritten in place), on both backends: a ``CheckpointError``
    naming the file and what changed, never bytes read at the old offsets; reopen the source.
    A file replaced by rename (``os.replace``, safetensors' own writer) or unlinked keeps
    reading its old, unchanged bytes; a ctime that moved while the path still names the open
    file (a chmod, a hard link) is refused, as a rewrite that put the old mtime back would be. What no check can catch: with ``"mmap"``, an array handed out before the
    file was truncated views the mapping, and touching its lost pages afterwards kills the
    process with SIGBUS; ``"pread"`` copies, so its arrays stay as they were read.

    Raises:
        CheckpointError: a missing, corrupt or inconsistent file or index.
        OpenFilesLimitError: the files are more than the process may hold open (every file
            stays open while the source is; the message names ``RLIMIT_NOFILE``, its value,
            the files needed and ``ulimit -n``).
        UsageError: a ``backend`` (or ``$KDA_TP_BACKEND``) other than ``"mmap"`` or
            ``"pread"``.
    """

    def __init__(self, path: str | os.PathLike[str], backend: str | None = None):
        given = backend
        backend = backend or os.environ.get(BACKEND_ENV) or "mmap"
        if backend not in BACKENDS:
            where = f"backend={backend!r}" if given else f"{BACKEND_ENV}={backend!r}"
            raise UsageError(
                f"{where}: the read backend must be {' or '.join(map(repr, BACKENDS))}"
                + ("" if given else f" (unset {BACKEND_ENV} for the default, mmap)")
            )
        self.path = Path(path)
        if self.path.suffix == ".json" and self.path.is_file():
            raise CheckpointError(
                f"{self.path}: a JSON file; expected a checkpoint directory or a .safetensors file"
            )
        self.backend = backend
        try:
            self._checkpoint: _native.Checkpoint | _Closed = _native.Checkpoint(self.path, backend)
        except CheckpointError as e:
            # Every file stays open: past RLIMIT_NOFILE the error names the limit, not a file.
            limit = _open_files_limit(self.path)
            if limit is not None:
                raise limit from e
            raise
        self._config: dict[str, Any] | None = None
        self._names: tuple[str, ...] | None = None

    @property
    def root(self) -> Path:
        """The checkpoint directory (a single file's directory)."""
        return Path(self._checkpoint.root)

    @property
    def config(self) -> dict[str, Any] | None:
        """The parsed ``config.json`` beside the weights, or None when there is none.

        Raises:
            CheckpointError: ``config.json`` exists but is not a regular file holding a JSON
                object.
        """
        # exists(), not is_file(): a config.json that is a directory or FIFO is an error.
        if self._config is None and (self.root / "config.json").exists():
            self._config = load_config(self.root)
        return self._config

    def names(self) -> list[str]:
        """Every tensor name, file by file in data order (a new list each call; the names
        are read from the headers once)."""
        if self._names is None:
            self._names = tuple(self._checkpoint.names())
        return list(self._names)

    def keys(self) -> list[str]:
        """:meth:`names`, under the name safetensors' ``safe_open`` and a rank's view use."""
        return self.names()

    def info(self, name: str) -> tuple[str, tuple[int, ...]] | None:
        """``(dtype, shape)`` of a tensor from the header alone, or None when absent."""
        found = self._checkpoint.info(name)
        return None if found is None else (found[0], tuple(found[1]))

    def file_of(self, name: str) -> Path | None:
        """The file holding ``name``, or None."""
        found = self._checkpoint.info(name)
        return None if found is None else Path(found[2])

    def files(self) -> list[tuple[Path, dict[str, str] | None]]:
        """``(path, __metadata__ or None)`` for every file of the checkpoint."""
        return [(Path(p), meta) for p, meta, _ in self._checkpoint.files()]

    def mappings(self) -> list[tuple[int, int]]:
        """Address ranges ``[start, stop)`` of the file mappings (empty for ``"pread"``)."""
        return [m for _, _, m in self._checkpoint.files() if m is not None]

    def get(self, name: str) -> Tensor | None:
        """The tensor ``name``, or None when the checkpoint has no such tensor.

        None, not an error, as ``Mapping.get`` does: a misspelt name is not caught here, so
        check ``name in source`` (or iterate over :meth:`names`) where that matters.

        With ``"mmap"`` the data views the mapping: no bytes are copied, and the array keeps the
        mapping alive after the source is gone. A tensor whose data offset is not aligned for
        its dtype is copied into aligned memory instead.

        Raises:
            CheckpointError: the file changed since the source opened it (see the class).
        """
        found = self._checkpoint.info(name)
        if found is None:
            return None
        dtype, shape, _ = found
        return Tensor(name, dtype, tuple(shape), self._read(name, dtype, 0, None),
                      writable=self.writable(name, 0, None))

    def writable(self, name: str, start: int, stop: int | None) -> Callable[[], np.ndarray] | None:
        """For ``Tensor(..., writable=)``: a function giving bytes ``[start, stop)`` of tensor
        ``name`` (``stop`` None: its end) as a writable ``uint8`` array, a range of the file's
        copy-on-write mapping (see :meth:`Tensor.writable_data`); None with ``"pread"``, whose
        arrays are private copies already. The function raises ``CheckpointError`` when the
        file changed since the source opened it."""
        if self.backend == "pread":
            return None
        return partial(self._read_writable, name, start, stop)

    def _read_writable(self, name: str, start: int, stop: int | None) -> np.ndarray:
        data = np.asarray(self._checkpoint.read_writable(name, start, stop))
        found = self._checkpoint.info(name)
        if found is not None and data.ctypes.data % max(1, _itemsize(found[0])):
            data = data.copy()  # misaligned for its dtype in the file: aligned copy
        return data

    def read_range(self, name: str, start: int, stop: int) -> np.ndarray:
        """Bytes ``[start, stop)`` of tensor ``name``'s data, as a read-only ``uint8`` array.

        A view of the mapping with ``"mmap"``; with ``"pread"`` only these bytes are read (a
        rank's row slice is ``1/tp_size`` of the tensor).

        Raises:
            CheckpointError: no such tensor, ``start`` past its end or past ``stop``, or the
                file changed since the source opened it.
            UsageError: ``start`` or ``stop`` negative, ``>= 2**64``, a bool or not an integer.
        """
        for what, value in (("start", start), ("stop", stop)):
            if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                    or not 0 <= value < 2**64):
                shown = "an integer of more than 64 bits" if isinstance(value, int) else repr(value)
                raise UsageError(
                    f"read_range({name!r}, ...): {what} must be a byte offset (an integer in "
                    f"[0, 2**64)), got {shown}"
                )
        found = self._checkpoint.info(name)
        if found is None:
            raise CheckpointError(f"{self.root}: no tensor named {name!r}")
        return self._read(name, found[0], int(start), int(stop))

    def read_columns(self, name: str, tensor_plan: _native.KdaTensorPlan) -> np.ndarray:
        """This rank's column block of a ``CHANNEL_COLS`` tensor (``o_proj``), as a new read-only
        ``uint8`` array of ``tensor_plan.local_bytes`` bytes (row-major ``[rows, local cols]``).

        With ``"pread"`` only those bytes are read from the file: one positioned read per row's
        column span, spread over a few threads for large tensors, never the whole tensor. With
        ``"mmap"`` the block is gathered from the mapping (as :func:`shard_bytes` does).

        Raises:
            CheckpointError: no such tensor, the plan's block lies past its end, or the file
                changed since the source opened it.
            ShapeMismatchError: the tensor's byte size is not ``tensor_plan.full_bytes``.
        """
        found = self._checkpoint.info(name)
        if found is None:
            raise CheckpointError(f"{self.root}: no tensor named {name!r}")
        if self.backend != "pread":
            return shard_bytes(tensor_plan, self._read(name, found[0], 0, None))
        full = int(np.prod(found[1], dtype=np.int64)) * _itemsize(found[0])
        if full != tensor_plan.full_bytes:
            raise ShapeMismatchError(
                f"{self.file_of(name)}: {name}: {full} bytes on disk, the plan's full tensor is "
                f"{tensor_plan.full_bytes} bytes"
            )
        row = tensor_plan.full_row_elems * tensor_plan.elem_bytes
        data = np.asarray(self._checkpoint.read_spans(
            name,
            tensor_plan.src_col_offset * tensor_plan.elem_bytes,
            tensor_plan.local_row_elems * tensor_plan.elem_bytes,
            row,
            tensor_plan.full_rows,
        ))
        data.flags.writeable = False
        return data

    @property
    def bytes_read(self) -> int:
        """Bytes read from the checkpoint's safetensors files with read calls since it was opened.

        The headers (read at open, on both backends) plus, with ``"pread"``, every tensor byte
        read. With ``"mmap"`` tensor data reaches the process through page faults of the mapping
        and is not counted. A rank's KDA tensors read through :class:`KdaShardedSource` on
        ``"pread"`` cost their local bytes: row slices and ``o_proj``'s column block are read
        alone.
        """
        return self._checkpoint.bytes_read

    def _read(self, name: str, dtype: str, start: int, stop: int | None) -> np.ndarray:
        data = np.asarray(self._checkpoint.read(name, start, stop))
        if data.ctypes.data % max(1, _itemsize(dtype)):
            data = data.copy()  # misaligned for its dtype in the file: aligned copy
            data.flags.writeable = False
        return data

    def file_range(
        self, name: str, start: int = 0, stop: int | None = None
    ) -> tuple[int, int, int] | None:
        """Where bytes ``[start, stop)`` of tensor ``name`` lie in the file this source opened,
        for file-to-file copies by the kernel (``os.copy_file_range``, ``os.sendfile``).

        Returns ``(fd, begin, end)``: a file descriptor this source owns (valid while the source
        is alive; never close it) and absolute byte offsets in that file (``stop`` is clamped to
        the tensor's length, None meaning its end). It is the file opened with the source, even
        if the path has since been replaced. None for an unknown name or ``start`` past the
        tensor. The file is checked unchanged when the range is given (as for every read); the
        copy that follows is the caller's, so a short copy means the file shrank since.

        Raises:
            CheckpointError: the file changed since the source opened it (see the class).
        """
        return self._checkpoint.file_range(name, start, stop)

    def release(self, name: str) -> None:
        """Drop this process's resident pages of tensor ``name`` (``"mmap"`` only).

        For streaming over checkpoints larger than memory: the kernel's page cache keeps the
        data, and arrays already viewing the tensor stay valid (their next access maps the
        pages again from the unchanged file). A no-op for ``"pread"`` and unknown names.
        """
        self._checkpoint.release(name)

    def __contains__(self, name: str) -> bool:
        return self._checkpoint.info(name) is not None

    def close(self) -> None:
        """Close the checkpoint: its file mappings and descriptors are released as soon as no
        array returned by :meth:`get` or :meth:`read_range` still views them (such an array
        keeps its mapping alive and stays valid). Every later call but :meth:`close` raises
        ``CheckpointError``; closing twice is harmless."""
        self._checkpoint = _Closed(self.path)
        self._names = None

    def __enter__(self) -> SafetensorsSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsSource({str(self.path)!r}, backend={self.backend!r})"


class _Closed:
    """What a closed :class:`SafetensorsSource` holds instead of its checkpoint: every use
    raises."""

    def __init__(self, path: Path):
        self.path = path

    def __getattr__(self, name: str) -> Any:
        raise CheckpointError(f"{self.path}: the checkpoint is closed")


def _itemsize(dtype: str) -> int:
    # 1 for the packed sub-byte floats (F4, F6): their tensors are handled as bytes.
    return DTYPE_SIZES.get(dtype, 1)


def missing_tensor(source: Any, name: str) -> CheckpointError:
    """The error for a tensor that ``source.names()`` lists but ``source`` cannot find."""
    return CheckpointError(
        f"{location(source, name)}: {name}: listed by the checkpoint but not found in it"
    )


def checked_info(source: InfoSource, name: str) -> tuple[str, tuple[int, ...]]:
    """``source.info(name)`` (dtype, shape) for a name taken from ``source.names()``.

    Raises:
        CheckpointError: ``source`` has no tensor ``name`` after all.
    """
    return _found(source.info(name), source, name)


def checked_get(source: TensorSource, name: str) -> Tensor:
    """``source.get(name)`` for a name taken from ``source.names()``.

    Raises:
        CheckpointError: ``source`` has no tensor ``name`` after all.
    """
    found: Tensor | None = source.get(name)
    return _found(found, source, name)


def _found(found: _T | None, source: Any, name: str) -> _T:
    """``found``, what ``source`` answered for ``name``; :func:`missing_tensor` when None."""
    if found is None:
        raise missing_tensor(source, name)
    return found
