"""Tensor sources: a safetensors checkpoint, and the adapter that presents one rank's shard of it.

A *source* is anything with ``names() -> list[str]`` and ``get(name) -> record | None``, where a
record has ``dtype`` (safetensors dtype name, e.g. ``"BF16"``), ``shape`` (tuple) and ``data``
(the raw little-endian bytes, any buffer-protocol object). :class:`SafetensorsSource` and
:class:`KdaShardedSource` are sources and return :class:`Tensor` records.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import ml_dtypes
import numpy as np

from . import _native
from .config import load_config, parse_config
from .errors import (
    BufferLayoutError,
    CheckpointError,
    DtypeMismatchError,
    KdaTpError,
    ShapeMismatchError,
)
from .plan import KdaShard, KdaTensorPlan, KdaTpPlan
from .quant import SCALE_SUFFIXES

__all__ = ["Tensor", "TensorSource", "SafetensorsSource", "KdaShardedSource", "shard_bytes"]

BACKEND_ENV = "KDA_TP_BACKEND"

_NUMPY_DTYPES: dict[str, Any] = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "I16": np.int16,
    "U16": np.uint16,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I32": np.int32,
    "U32": np.uint32,
    "F32": np.float32,
    "F64": np.float64,
    "I64": np.int64,
    "U64": np.uint64,
    "C64": np.complex64,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype name (BF16 and FP8 through ``ml_dtypes``).

    Raises:
        DtypeMismatchError: a dtype with no numpy equivalent (packed 4- and 6-bit floats).
    """
    try:
        return np.dtype(_NUMPY_DTYPES[dtype])
    except KeyError:
        raise DtypeMismatchError(f"dtype {dtype} has no numpy equivalent") from None


class Tensor:
    """One tensor: safetensors dtype name, shape, and raw bytes.

    Attributes:
        name: the checkpoint name, e.g. ``model.layers.0.self_attn.q_proj.weight``.
        dtype: safetensors dtype name, e.g. ``"BF16"``.
        shape: shape in elements (a tuple); for a shard, the rank's local shape.
        data: read-only 1-D ``uint8`` numpy array of the raw little-endian bytes, row-major.
            Row-sliced and replicated tensors view the mapped file directly (no copy).
    """

    __slots__ = ("name", "dtype", "shape", "data")

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], data: np.ndarray):
        self.name = name
        self.dtype = dtype
        self.shape = tuple(shape)
        self.data = data

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

    def to_torch(self) -> Any:
        """This tensor as a ``torch.Tensor`` sharing the memory (no copy), BF16 and FP8 included.

        See :func:`kda_tp.torch.to_torch` (dtypes, read-only memory).

        Raises:
            MissingDependencyError: torch is not installed (``pip install 'kda_tp[torch]'``).
            DtypeMismatchError: a dtype torch has no equivalent for.
        """
        from .torch import to_torch  # noqa: PLC0415 - optional dependency

        return to_torch(self)

    def __repr__(self) -> str:
        return f"Tensor({self.name!r}, dtype={self.dtype}, shape={self.shape})"


class TensorSource(Protocol):
    """What :class:`KdaShardedSource` needs from the source it wraps."""

    def names(self) -> list[str]: ...

    def get(self, name: str) -> Any: ...


def _writable_bytes(name: str, out: Any) -> np.ndarray:
    """``out`` as a writable 1-D ``uint8`` array sharing its memory (for ``read_into``).

    Raises:
        BufferLayoutError: ``out`` is read-only, not C-contiguous, an object array, or not a
            buffer.
    """
    if isinstance(out, np.ndarray):
        if out.dtype.hasobject:
            raise BufferLayoutError(
                f"{name}: the output buffer is a numpy array of Python objects ({out.dtype})"
            )
        array = out
    else:
        try:
            view = memoryview(out)
        except TypeError:
            raise BufferLayoutError(
                f"{name}: the output ({type(out).__name__}) does not expose the buffer protocol"
            ) from None
        if view.readonly:
            raise BufferLayoutError(f"{name}: the output buffer is read-only")
        if not view.c_contiguous:
            raise BufferLayoutError(f"{name}: the output buffer is not C-contiguous")
        # cast() refuses views with a zero-length dimension; an empty one is written as is.
        array = np.frombuffer(view.cast("B"), np.uint8) if view.nbytes else np.empty(0, np.uint8)
    if not array.flags.writeable:
        raise BufferLayoutError(f"{name}: the output buffer is read-only")
    if not array.flags.c_contiguous:
        raise BufferLayoutError(f"{name}: the output buffer is not C-contiguous")
    return array.reshape(-1).view(np.uint8)


def _check_out(name: str, dtype: str, out: Any, target: np.ndarray, expected: int) -> None:
    """Refuse an output buffer of the wrong byte size or item size (for ``read_into``)."""
    itemsize = out.itemsize if isinstance(out, np.ndarray) else memoryview(out).itemsize
    elem = _itemsize(dtype)
    if itemsize not in (1, elem):
        raise ShapeMismatchError(
            f"{name}: the output buffer has {itemsize}-byte items, the tensor's dtype {dtype} "
            f"has {elem}-byte elements"
        )
    if target.nbytes != expected:
        raise ShapeMismatchError(
            f"{name}: the output buffer is {target.nbytes} bytes, this rank's tensor is "
            f"{expected} bytes"
        )


def _readonly_bytes(data: Any) -> np.ndarray:
    if isinstance(data, (np.ndarray, memoryview)):
        data = np.ascontiguousarray(data)  # copies only a strided view
    array = np.frombuffer(data, dtype=np.uint8)
    array.flags.writeable = False
    return array


def shard_bytes(tensor_plan: KdaTensorPlan, buffer: Any) -> np.ndarray:
    """This rank's bytes of one full tensor.

    Args:
        tensor_plan: the plan entry (``plan["q_proj"]``).
        buffer: the full tensor's raw bytes, ``tensor_plan.full_bytes`` long; any
            buffer-protocol object (bytes, bytearray, memoryview, numpy array of any dtype,
            row-major; a strided array or memoryview is first copied to contiguous memory).

    Returns:
        A read-only 1-D ``uint8`` array of ``tensor_plan.local_bytes`` bytes. For replicated and
        row-sliced tensors (one contiguous byte range) it is a view of ``buffer``; for
        ``CHANNEL_COLS`` (``o_proj``, a strided gather of every row's column range) it is a new
        array, filled by several threads with the GIL released when large.

    Raises:
        ShapeMismatchError: ``len(buffer)`` is not ``tensor_plan.full_bytes``.
    """
    out = _native.shard_bytes(tensor_plan, _readonly_bytes(buffer))
    out.flags.writeable = False
    return out


class SafetensorsSource:
    """A safetensors checkpoint as a tensor source.

    Args:
        path: a ``.safetensors`` file, or a directory holding ``model.safetensors.index.json``
            and the files it names (or exactly one ``.safetensors`` file).
        backend: ``"mmap"`` (the default: tensors view a read-only mapping of the file, no copy)
            or ``"pread"`` (each ``get`` copies the tensor with positioned reads and nothing is
            mapped, for network filesystems). Defaults to ``$KDA_TP_BACKEND``, else ``"mmap"``.

    Every file's header is validated when the source opens, and each file's length is checked
    against its header. With ``"mmap"``, truncating a file while it is open makes later reads of
    the lost pages kill the process with SIGBUS; use ``"pread"`` where files may change.

    Raises:
        CheckpointError: a missing, corrupt or inconsistent file or index.
    """

    def __init__(self, path: str | os.PathLike[str], backend: str | None = None):
        backend = backend or os.environ.get(BACKEND_ENV) or "mmap"
        self.path = Path(path)
        if self.path.suffix == ".json" and self.path.is_file():
            raise CheckpointError(
                f"{self.path}: a JSON file; expected a checkpoint directory or a .safetensors file"
            )
        self.backend = backend
        self._checkpoint = _native.Checkpoint(self.path, backend)
        self._config: dict[str, Any] | None = None

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
        """Every tensor name, file by file in data order."""
        return self._checkpoint.names()

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
        """
        found = self._checkpoint.info(name)
        if found is None:
            return None
        dtype, shape, _ = found
        return Tensor(name, dtype, tuple(shape), self._read(name, dtype, 0, None))

    def read_range(self, name: str, start: int, stop: int) -> np.ndarray:
        """Bytes ``[start, stop)`` of tensor ``name``'s data, as a read-only ``uint8`` array.

        A view of the mapping with ``"mmap"``; with ``"pread"`` only these bytes are read (a
        rank's row slice is ``1/tp_size`` of the tensor).

        Raises:
            CheckpointError: no such tensor, or ``start`` past its end.
        """
        found = self._checkpoint.info(name)
        if found is None:
            raise CheckpointError(f"{self.root}: no tensor named {name!r}")
        return self._read(name, found[0], start, stop)

    def read_columns(self, name: str, tensor_plan: KdaTensorPlan) -> np.ndarray:
        """This rank's column block of a ``CHANNEL_COLS`` tensor (``o_proj``), as a new read-only
        ``uint8`` array of ``tensor_plan.local_bytes`` bytes (row-major ``[rows, local cols]``).

        With ``"pread"`` only those bytes are read from the file: one positioned read per row's
        column span, spread over a few threads for large tensors, never the whole tensor. With
        ``"mmap"`` the block is gathered from the mapping (as :func:`shard_bytes` does).

        Raises:
            CheckpointError: no such tensor, or the plan's block lies past its end.
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
        tensor. Reads through it are not checked against truncation: a short copy means the
        file shrank.
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

    def __repr__(self) -> str:
        return f"SafetensorsSource({str(self.path)!r}, backend={self.backend!r})"


def _itemsize(dtype: str) -> int:
    try:
        return numpy_dtype(dtype).itemsize
    except DtypeMismatchError:
        return 1


def _location(source: Any, name: str | None = None) -> str:
    """Where ``name`` (or the checkpoint) lives, for error messages: the tensor's file, else the
    source's root directory, else the source's repr."""
    file_of = getattr(source, "file_of", None)
    if name is not None and file_of is not None:
        found = file_of(name)
        if found is not None:
            return str(found)
    root = getattr(source, "root", None)
    return str(root) if root is not None else repr(source)


# After the decoder prefix: `12.self_attn.q_proj.weight` -> ("12", "q_proj.weight").
_LAYER_TENSOR = re.compile(r"^(\d+)\.self_attn\.(.+)$")
# `model.layers.3.self_attn.A_log` -> "model.layers.": A_log exists only in KDA layers.
_KDA_MARKER = re.compile(r"^((?:.*\.)?layers\.)\d+\.self_attn\.A_log$")
# A_log and dt_bias are bare parameters; every other KDA tensor is a module's `.weight`.
_BARE = {"A_log", "dt_bias"}
DEFAULT_PREFIX = "model.layers."


def decoder_prefix(source: Any) -> str:
    """The name prefix of the decoder layers holding the KDA tensors, up to the layer index.

    It is the prefix of the ``...layers.{i}.self_attn.A_log`` tensors (``"model.layers."`` in
    Kimi-Linear, ``"language_model.model.layers."`` in some multimodal checkpoints), so other
    stacks with ``layers.{i}.self_attn`` tensors (a vision tower, a draft model) are never taken
    for KDA layers. Without any ``A_log``, ``"model.layers."``.

    Raises:
        CheckpointError: ``A_log`` tensors appear under more than one prefix.
    """
    prefixes = {m.group(1) for n in source.names() if (m := _KDA_MARKER.match(n))}
    if len(prefixes) > 1:
        raise CheckpointError(
            f"{_location(source)}: KDA tensors (A_log) under several prefixes {sorted(prefixes)}; "
            "cannot tell which stack to shard"
        )
    return prefixes.pop() if prefixes else DEFAULT_PREFIX


def kda_tensor_name(prefix: str, layer: int, plan_name: str) -> str:
    """The checkpoint name of a plan tensor: ``model.layers.0.self_attn.q_proj.weight``."""
    return f"{prefix}{layer}.self_attn.{checkpoint_suffix(plan_name)}"


def checkpoint_suffix(plan_name: str) -> str:
    """The name after ``self_attn.`` of a plan tensor: ``q_proj.weight``, but ``A_log``."""
    return plan_name if plan_name in _BARE else f"{plan_name}.weight"


_LOW_RANK_GATE = ("g_a_proj.weight", "g_b_proj.weight")
_FULL_RANK_GATE = ("g_proj.weight",)


def check_gate_form(source: Any, prefix: str, layer: int, full_rank_gate: bool) -> None:
    """Refuse a KDA layer whose output gate is not the form the config says.

    Kimi K3 (``use_full_rank_gate: true``) has one ``g_proj.weight``; Kimi-Linear has
    ``g_a_proj.weight`` and ``g_b_proj.weight``. A layer holding the other form (or both) cannot
    be sharded by this plan.

    Raises:
        CheckpointError: naming the file, the tensor found and the config key.
    """
    wrong = _LOW_RANK_GATE if full_rank_gate else _FULL_RANK_GATE
    for suffix in wrong:
        name = f"{prefix}{layer}.self_attn.{suffix}"
        if name in source.names():
            raise CheckpointError(
                f"{_location(source, name)}: {name}: {_gate_form_problem(full_rank_gate)}"
            )


def _gate_form_problem(full_rank_gate: bool) -> str:
    if full_rank_gate:
        return (
            "the config sets linear_attn_config.use_full_rank_gate (one full-rank g_proj per KDA "
            "layer), but this KDA layer holds the low-rank g_a_proj/g_b_proj"
        )
    return (
        "this KDA layer holds a full-rank g_proj, but the config does not set "
        "linear_attn_config.use_full_rank_gate (it expects the low-rank g_a_proj/g_b_proj)"
    )


def scale_tensor_name(source: Any, prefix: str, layer: int, plan_name: str) -> str | None:
    """The checkpoint name of a block-quantized weight's scale grid in ``source``:
    ``...{plan_name}.weight_scale`` (ModelOpt, compressed-tensors) or ``.weight_scale_inv``
    (DeepSeek), whichever ``source.get`` finds; None if neither."""
    for suffix in SCALE_SUFFIXES:
        name = f"{prefix}{layer}.self_attn.{plan_name}.{suffix}"
        if source.get(name) is not None:
            return name
    return None


def kda_layer_indices(source: Any, layers: Iterable[int] | None) -> tuple[int, ...]:
    """0-based KDA layer indices: ``layers`` if given, else the source config's.

    Raises:
        CheckpointError: neither ``layers`` nor the config says which layers are KDA.
    """
    if layers is not None:
        return tuple(sorted({int(i) for i in layers}))
    config = getattr(source, "config", None)
    if config is not None:
        root = getattr(source, "root", None)
        where = str(Path(root) / "config.json") if root is not None else "config"
        kda_layers = parse_config(config, where).kda_layers
        if kda_layers is not None:
            return kda_layers
    raise CheckpointError(
        f"{source!r}: the config does not list the KDA layers (linear_attn_config.kda_layers or "
        "layer_types); pass layers=[...] (0-based)"
    )


class KdaShardedSource:
    """One tensor-parallel rank's view of a checkpoint.

    For every KDA layer ``i``, ``...layers.{i}.self_attn.<tensor>.weight`` (``A_log`` and
    ``dt_bias`` without ``.weight``) is returned as this rank's slice with its local shape, in
    the on-disk rank (conv ``[C, 1, K]`` -> ``[C/T, 1, K]``, ``A_log`` ``[1, 1, H, 1]`` ->
    ``[1, 1, H/T, 1]``, K3's zero-padded ``A_log`` ``[P]`` -> ``[H/T]``, ``o_proj``
    ``[hidden, C]`` -> ``[hidden, C/T]``). Every other name, including full-attention (MLA)
    layers' ``self_attn.q_proj``/``g_proj``/``o_proj`` (K3's MLA ``g_proj``/``o_proj`` have the
    KDA names and shapes: layer type comes from the config alone) and vision-tower tensors,
    passes through untouched. At ``tp_size == 1`` it is the identity, except that a padded
    ``A_log`` loses its padding.

    Args:
        source: the full checkpoint (any object with ``names()`` and ``get(name)``).
        plan: this rank's :class:`KdaTpPlan`.
        layers: 0-based KDA layer indices; default: from ``source.config`` (Kimi-Linear's
            ``linear_attn_config.kda_layers`` is 1-based and converted).

    Every KDA tensor is checked when the adapter is built, so bad input fails before any
    data is read or written; for a zero-padded ``A_log`` that includes reading its padding.

    Raises:
        CheckpointError: the KDA layers are unknown, a KDA layer lacks one of its tensors or
            holds a ``self_attn`` tensor the plan does not know (it could not be sharded
            correctly; e.g. the other output-gate form than the config's), a non-KDA layer holds
            KDA-only tensors (``A_log``, ``dt_bias``), or a padded ``A_log`` has a non-zero
            entry past the heads (the message gives the tensor, the index and the value).
        DtypeMismatchError: a KDA tensor's dtype is not the plan's.
        ShapeMismatchError: a KDA tensor's shape does not hold the plan's tensor.
    """

    def __init__(self, source: TensorSource, plan: KdaTpPlan, layers: Iterable[int] | None = None):
        self.source = source
        self.plan = plan
        self.layers = kda_layer_indices(source, layers)
        wanted = set(self.layers)
        by_suffix = {checkpoint_suffix(t.name): t for t in plan.tensors}
        required = set(by_suffix)
        for t in plan.tensors:
            if t.scale is not None:
                # A block scale has two spellings; a layer holds exactly one of them.
                by_suffix.update({f"{t.name}.{s}": t.scale for s in SCALE_SUFFIXES})
                required.add(t.scale.name)
        self.prefix = decoder_prefix(source)
        # checkpoint name -> (plan entry, local shape)
        self._planned: dict[str, tuple[KdaTensorPlan, tuple[int, ...]]] = {}
        seen: dict[int, set[str]] = {i: set() for i in self.layers}
        for name in source.names():
            if not name.startswith(self.prefix):
                continue
            match = _LAYER_TENSOR.match(name[len(self.prefix) :])
            if match is None:
                continue
            layer, suffix = int(match.group(1)), match.group(2)
            if layer not in wanted:
                if suffix in _BARE:
                    raise CheckpointError(
                        f"{_location(source, name)}: {name}: layer {layer} holds a KDA tensor "
                        f"but is not a KDA layer (KDA layers: {list(self.layers)})"
                    )
                continue
            entry = by_suffix.get(suffix)
            if entry is None and suffix in _LOW_RANK_GATE + _FULL_RANK_GATE:
                raise CheckpointError(
                    f"{_location(source, name)}: {name}: "
                    f"{_gate_form_problem(plan.full_rank_gate)}"
                )
            if entry is None and suffix.rsplit(".", 1)[-1] in SCALE_SUFFIXES:
                weight = suffix.rsplit(".", 1)[0]
                raise CheckpointError(
                    f"{_location(source, name)}: {name}: a block scale, but {weight} is not "
                    "block-quantized in this checkpoint (its weight is not FP8, or the config "
                    "declares no block-FP8 format)"
                )
            if entry is None:
                raise CheckpointError(
                    f"{_location(source, name)}: {name}: KDA layer {layer} holds a self_attn "
                    f"tensor the plan does not know; it cannot be sharded safely "
                    f"(known: {sorted(by_suffix)})"
                )
            self._planned[name] = (entry, self._check(name, entry, source))
            key = entry.name if entry.name.endswith(".scale") else suffix
            if key in seen[layer]:
                raise CheckpointError(
                    f"{_location(source, name)}: {name}: KDA layer {layer} holds both "
                    f"{' and '.join(SCALE_SUFFIXES)} for {key.removesuffix('.scale')}"
                )
            seen[layer].add(key)
        for layer in self.layers:
            missing = sorted(required - seen[layer])
            if missing:
                lacking = ", ".join(
                    f"self_attn.{m.removesuffix('.scale')}.weight_scale (its block scale)"
                    if m.endswith(".scale") else f"self_attn.{m}"
                    for m in missing
                )
                raise CheckpointError(f"{_location(source)}: KDA layer {layer} lacks {lacking}")
        for name, (entry, _) in self._planned.items():
            if entry.name == "A_log" and entry.full_rows > plan.full_heads:
                self._check_padding(name, entry, plan.full_heads)

    def _check_padding(self, name: str, entry: KdaTensorPlan, heads: int) -> None:
        """Refuse a zero-padded ``A_log`` whose entries past the ``heads`` real ones are not all
        exactly 0 (Megatron-Bridge refuses the same: the padding carries no head)."""
        start = heads * entry.elem_bytes
        read_range = getattr(self.source, "read_range", None)
        if read_range is not None:
            raw = read_range(name, start, entry.full_bytes)
        else:
            raw = np.asarray(self.source.get(name).data)[start : entry.full_bytes]
        tail = np.frombuffer(raw, dtype=numpy_dtype(entry.dtype))
        nonzero = np.flatnonzero(tail)
        if nonzero.size:
            i = int(nonzero[0])
            raise CheckpointError(
                f"{_location(self.source, name)}: {name}: padding entry {heads + i} is "
                f"{tail[i].item()!r}, expected 0 (A_log stores {entry.full_rows} entries for "
                f"{heads} heads; entries {heads}..{entry.full_rows - 1} must be zero padding)"
            )

    @staticmethod
    def _check(name: str, entry: KdaTensorPlan, source: TensorSource) -> tuple[int, ...]:
        info = getattr(source, "info", None)
        if info is not None:
            dtype, shape = info(name)
        else:
            record = source.get(name)
            dtype, shape = record.dtype, tuple(record.shape)
        if dtype != entry.dtype:
            raise DtypeMismatchError(
                f"{_location(source, name)}: {name}: dtype {dtype}, expected {entry.dtype}"
            )
        try:
            return entry.local_shape(list(shape))
        except KdaTpError as e:
            raise type(e)(f"{_location(source, name)}: {name}: {e}") from None

    @property
    def config(self) -> dict[str, Any] | None:
        """The wrapped source's config (unchanged: it describes the full model)."""
        return getattr(self.source, "config", None)

    def names(self) -> list[str]:
        """The wrapped source's names, unchanged."""
        return self.source.names()

    def plan_entry(self, name: str) -> KdaTensorPlan | None:
        """The plan entry that slices checkpoint tensor ``name`` (a block scale's is the
        weight's ``.scale``), or None when ``name`` passes through."""
        planned = self._planned.get(name)
        return None if planned is None else planned[0]

    def is_sharded(self, name: str) -> bool:
        """Whether ``name`` is a KDA tensor this adapter slices (or would, at ``tp_size > 1``)."""
        return name in self._planned

    def info(self, name: str) -> tuple[str, tuple[int, ...]] | None:
        """``(dtype, local shape)`` without reading data, or None when absent."""
        planned = self._planned.get(name)
        if planned is not None:
            return planned[0].dtype, planned[1]
        info = getattr(self.source, "info", None)
        if info is not None:
            return info(name)
        record = self.source.get(name)
        return None if record is None else (record.dtype, tuple(record.shape))

    def get(self, name: str) -> Tensor | None:
        """This rank's tensor ``name``: a local slice for KDA tensors, else the source's record;
        None when the source has no such tensor (as ``Mapping.get``: a misspelt name is not an
        error here; check ``name in adapter`` where that matters).

        Row-sliced and replicated tensors are views of the source's bytes (no copy);
        ``o_proj`` is gathered into a new array.
        """
        planned = self._planned.get(name)
        if planned is None:
            return self.source.get(name)
        entry, local_shape = planned
        read_range = getattr(self.source, "read_range", None)
        if entry.byte_range is not None and read_range is not None:
            # One contiguous range: read only it (its size was checked with the shape).
            return Tensor(name, entry.dtype, local_shape, read_range(name, *entry.byte_range))
        read_columns = getattr(self.source, "read_columns", None)
        if entry.kind == KdaShard.CHANNEL_COLS and read_columns is not None:
            # o_proj: only this rank's column block of each row (pread reads nothing else).
            return Tensor(name, entry.dtype, local_shape, read_columns(name, entry))
        record = self.source.get(name)
        if record is None:
            return None
        return Tensor(name, record.dtype, local_shape, shard_bytes(entry, record.data))

    def read_into(self, name: str, out: Any) -> None:
        """Write this rank's tensor ``name`` into ``out``, a buffer the caller owns.

        The one-copy path for a loader: the bytes go from the source (the mapped file) straight
        into ``out``, with no intermediate array and the GIL released during the copy. Row-sliced
        (``q_proj``, ``A_log``, ...), replicated and passed-through tensors are one contiguous
        copy; ``o_proj`` (CHANNEL_COLS) is the strided column gather. Copies of 4 MiB or more
        use several threads. The bytes written equal ``get(name).data``. With the ``"pread"``
        backend a row slice is first read into a temporary copy (the rank's rows only), then
        copied into ``out``.

        Args:
            name: a checkpoint tensor name (KDA or passed through), as in :meth:`names`.
            out: a writable, C-contiguous numpy array (any dtype but object, with the item size
                1 or that of the tensor's dtype, any shape) or any other object exposing a
                writable C-contiguous buffer (``bytearray``, ``memoryview``, ``mmap``; for a
                CPU ``torch`` tensor pass ``t.view(-1).view(torch.uint8).numpy()``) of exactly
                the local tensor's size in bytes (``prod(info(name)[1])`` x the dtype's size).
                Every byte of it is overwritten, row-major in the local shape.

        Raises:
            ShapeMismatchError: ``out`` is not the local tensor's size in bytes, or its item
                size is neither 1 nor the tensor dtype's (the message names the tensor and gives
                both sizes in bytes).
            BufferLayoutError: ``out`` is read-only, not C-contiguous, an object array, or not
                a buffer.
            CheckpointError: the source has no tensor ``name``, or reading it fails.
        """
        target = _writable_bytes(name, out)
        planned = self._planned.get(name)
        if planned is None:
            record = self.source.get(name)
            if record is None:
                raise CheckpointError(f"{_location(self.source)}: no tensor named {name!r}")
            data = _readonly_bytes(record.data)
            _check_out(name, record.dtype, out, target, data.nbytes)
            _native.copy_into(data, target)
            return
        entry = planned[0]
        _check_out(name, entry.dtype, out, target, entry.local_bytes)
        read_range = getattr(self.source, "read_range", None)
        if entry.byte_range is not None and read_range is not None:
            _native.copy_into(read_range(name, *entry.byte_range), target)
            return
        record = self.source.get(name)
        if record is None:
            raise CheckpointError(f"{_location(self.source)}: no tensor named {name!r}")
        _native.shard_into(entry, _readonly_bytes(record.data), target)

    def __contains__(self, name: str) -> bool:
        return name in self.names()

    def __repr__(self) -> str:
        return (
            f"KdaShardedSource({self.source!r}, tp_rank={self.plan.tp_rank}, "
            f"tp_size={self.plan.tp_size}, layers={list(self.layers)})"
        )
