"""The adapter that presents one tensor-parallel rank's shard of a checkpoint.

:class:`KdaShardedSource` wraps any tensor source (a :class:`~kda_tp.SafetensorsSource`, or
anything with ``names()`` and ``get(name)``; see :mod:`kda_tp.checkpoint.reader`) and returns this
rank's slice of every KDA tensor with its local shape, every other tensor untouched. An engine's
fused parameters are built from a view in :mod:`kda_tp.engines`
(:func:`~kda_tp.engines.build_param`).
"""

from __future__ import annotations

import os
import weakref
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .. import _native
from ..checkpoint.description import describe
from ..checkpoint.memory import MemorySource, is_tensor_mapping
from ..checkpoint.names import (
    FULL_RANK_GATE,
    LOW_RANK_GATE,
    checkpoint_suffix,
    gate_form_problem,
    location,
    param_name,
)
from ..checkpoint.destinations import check_torch_destination, destination
from ..checkpoint.reader import (
    SafetensorsSource,
    Tensor,
    TensorSource,
    missing_tensor,
    readonly_bytes,
    shard_bytes,
)
from ..errors import (
    CheckpointError,
    DtypeMismatchError,
    KdaTpError,
    PlanError,
    TensorNotFoundError,
    UsageError,
)
from ..model.dtypes import import_torch, numpy_dtype
from ..model.quant import SCALE_SUFFIXES
from .mla import MlaTpPlan, planned_mla_tensors
from .plan import KdaShard, KdaTensorPlan, KdaTpPlan

__all__ = ["STAGING_BYTES", "KdaShardedSource", "TensorSlice", "open_rank"]

#: The host staging buffer's size for ``read_into`` a tensor on another device (bytes).
STAGING_BYTES = 64 << 20


def _checked_name(name: object, call: str) -> str:
    """``name`` when it is a ``str``.

    Raises:
        UsageError: another type (``bytes`` included), with the fix.
    """
    if isinstance(name, str):
        return name
    fix = " (decode it: name.decode())" if isinstance(name, (bytes, bytearray)) else ""
    raise UsageError(
        f"{call}: a tensor name is a str, got {type(name).__name__} {name!r}{fix}"
    )

# The zero-padded A_log tensors whose padding a view has checked, by opened checkpoint.
_PADDING_CHECKED: weakref.WeakKeyDictionary[SafetensorsSource, set[str]] = (
    weakref.WeakKeyDictionary())


class KdaShardedSource:
    """One tensor-parallel rank's view of a checkpoint.

    For every KDA layer ``i``, ``...layers.{i}.self_attn.<tensor>.weight`` (``A_log`` and
    ``dt_bias`` without ``.weight``) is returned as this rank's slice with its local shape, in
    the on-disk rank (conv ``[C, 1, K]`` -> ``[C/T, 1, K]``, ``A_log`` ``[1, 1, H, 1]`` ->
    ``[1, 1, H/T, 1]``, K3's zero-padded ``A_log`` ``[P]`` -> ``[H/T]``, ``o_proj``
    ``[hidden, C]`` -> ``[hidden, C/T]``). Every other name, including full-attention (MLA)
    layers' ``self_attn.q_proj``/``g_proj``/``o_proj`` (K3's MLA ``g_proj``/``o_proj`` have the
    KDA names and shapes: layer type comes from the config alone; sliced only with ``mla``) and
    vision-tower tensors, passes through untouched. At ``tp_size == 1`` it is the identity, except that a padded
    ``A_log`` loses its padding.

    Args:
        source: the full checkpoint (any object with ``names()`` and ``get(name)``).
        plan: this rank's :class:`KdaTpPlan`.
        layers: 0-based KDA layer indices; default: from ``source.config`` (Kimi-Linear's
            ``linear_attn_config.kda_layers`` is 1-based and converted).
        mla: this rank's :class:`~kda_tp.rank.MlaTpPlan`: the MLA layers the config names
            (``mla_layers``) are sliced by it too (``kda_tp.rank.mla.planned_mla_tensors``,
            which says what it refuses), instead of passing through (``shard``, ``verify``
            and ``load_rank`` give the plan ``kda_tp.rank.mla.rank_mla_plan`` makes); None
            (the default) for the KDA-only view the audit and the guard use.

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
        TypeError: ``plan`` is not a :class:`KdaTpPlan`.
    """

    def __init__(self, source: TensorSource, plan: KdaTpPlan, layers: Iterable[int] | None = None,
                 *, mla: MlaTpPlan | None = None):
        if not isinstance(plan, _native.KdaTpPlan):
            raise TypeError(
                f"KdaShardedSource(source, plan): plan must be a KdaTpPlan (from "
                f"KdaTpPlan.from_config(source, tp_rank, tp_size)), got {type(plan).__name__}"
            )
        self.source = source
        self.plan = plan
        # What the checkpoint holds, read once per opened checkpoint (kda_tp.checkpoint.describe).
        self.description = described = describe(source)
        self.layers = described.kda_layers(layers)
        self.prefix = described.prefix
        described.check_names(self.layers)
        by_suffix = {checkpoint_suffix(t.name): t for t in plan.tensors}
        required = set(by_suffix)
        for t in plan.tensors:
            if t.scale is not None:
                # A block scale has two spellings; a layer holds exactly one of them.
                by_suffix.update({f"{t.name}.{s}": t.scale for s in SCALE_SUFFIXES})
                required.add(t.scale.name)
        # checkpoint name -> (plan entry, local shape)
        self._planned: dict[str, tuple[KdaTensorPlan, tuple[int, ...]]] = {}
        local_shapes: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}
        seen: dict[int, dict[str, str]] = {i: {} for i in self.layers}
        for layer in self.layers:
            for suffix, name in described.attention(layer):
                entry = by_suffix.get(suffix)
                if entry is None:
                    raise self._unknown(name, layer, suffix, sorted(by_suffix))
                header = described.header(name)
                if header is None:
                    raise missing_tensor(source, name)
                dtype, shape = header
                if dtype != entry.dtype:
                    followed = param_name(described.prefix, self.layers[0], suffix)
                    raise DtypeMismatchError(
                        f"{location(source, name)}: {name}: dtype {dtype}, expected "
                        f"{entry.dtype} as {followed} (the first KDA layer, whose dtypes the plan "
                        "follows); every KDA layer must store a tensor in one dtype: convert "
                        "the odd layers' tensors, or select layers of one dtype (--layers)"
                    )
                key = (entry.name, tuple(shape))
                if key not in local_shapes:  # the same arithmetic for every layer
                    try:
                        local_shapes[key] = entry.local_shape(list(shape))
                    except KdaTpError as e:
                        raise type(e)(f"{location(source, name)}: {name}: {e}") from None
                self._planned[name] = (entry, local_shapes[key])
                key_name = entry.name if entry.name.endswith(".scale") else suffix
                first = seen[layer].get(key_name)
                if first is not None and first.endswith(suffix):
                    # The same tensor under two spellings of the layer number (layers.0 and
                    # layers.00): an engine would load one of them, not both.
                    raise CheckpointError(
                        f"{location(source, name)}: {name}: KDA layer {layer} holds {suffix} "
                        f"twice, as {first} and {name} (its layer number written two ways); "
                        "keep one of them"
                    )
                if first is not None:
                    raise CheckpointError(
                        f"{location(source, name)}: {name}: KDA layer {layer} holds both "
                        f"{' and '.join(SCALE_SUFFIXES)} for {key_name.removesuffix('.scale')}"
                    )
                seen[layer][key_name] = name
        for layer in self.layers:
            missing = sorted(required - seen[layer].keys())
            if missing:
                lacking = ", ".join(
                    f"self_attn.{m.removesuffix('.scale')}.weight_scale (its block scale)"
                    if m.endswith(".scale") else f"self_attn.{m}"
                    for m in missing
                )
                raise CheckpointError(f"{location(source)}: KDA layer {layer} lacks {lacking}")
        # A SafetensorsSource's bytes do not change while it is open: its padding is read once
        # for all its ranks' views.
        checked = (_PADDING_CHECKED.setdefault(source, set())
                   if isinstance(source, SafetensorsSource) else set())
        for name, (entry, _) in self._planned.items():
            if (entry.name == "A_log" and entry.full_rows > plan.full_heads
                    and name not in checked):
                self._check_padding(name, entry, plan.full_heads)
                checked.add(name)
        self.mla = mla
        self.mla_layers: tuple[int, ...] = ()
        if mla is not None:
            self.mla_layers, mla_planned = planned_mla_tensors(described, mla)
            self._planned.update(mla_planned)
        self._closed = False
        self._names: frozenset[str] | None = None

    def _unknown(self, name: str, layer: int, suffix: str, known: list[str]) -> CheckpointError:
        """The error for a KDA layer's ``self_attn`` tensor this plan has no entry for."""
        where = f"{location(self.source, name)}: {name}"
        if suffix in LOW_RANK_GATE + FULL_RANK_GATE:
            return CheckpointError(f"{where}: {gate_form_problem(self.plan.full_rank_gate)}")
        if suffix.rsplit(".", 1)[-1] in SCALE_SUFFIXES:
            weight = suffix.rsplit(".", 1)[0]
            return CheckpointError(
                f"{where}: a block scale, but {weight} is not block-quantized in this checkpoint "
                "(its weight is not FP8, or the config declares no block-FP8 format)"
            )
        return CheckpointError(
            f"{where}: KDA layer {layer} holds a self_attn tensor the plan does not know; it "
            f"cannot be sharded safely (known: {known})"
        )

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
                f"{location(self.source, name)}: {name}: padding entry {heads + i} is "
                f"{tail[i].item()!r}, expected 0 (A_log stores {entry.full_rows} entries for "
                f"{heads} heads; entries {heads}..{entry.full_rows - 1} must be zero padding)"
            )

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

    def _lookup(self, name: str) -> Tensor | None:
        """This rank's tensor ``name`` (:meth:`get_tensor`), or None when the source has no
        tensor ``name``."""
        self._check_open()
        planned = self._planned.get(name)
        if planned is None:
            return self.source.get(name)
        entry, local_shape = planned
        read_range = getattr(self.source, "read_range", None)
        if entry.byte_range is not None and read_range is not None:
            # One contiguous range: read only it (its size was checked with the shape).
            writable = getattr(self.source, "writable", None)
            return Tensor(name, entry.dtype, local_shape, read_range(name, *entry.byte_range),
                          writable=None if writable is None else writable(name, *entry.byte_range))
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
        use several threads. The bytes written equal ``view[name].data``. With the ``"pread"``
        backend a row slice is first read into a temporary copy (the rank's rows only), then
        copied into ``out``.

        Args:
            name: a checkpoint tensor name (KDA or passed through), as in :meth:`names`.
            out: where the tensor goes, every byte overwritten, row-major in the local shape:

                * a *typed* destination, of exactly the tensor's dtype and this rank's shape
                  (``info(name)``): a C-contiguous numpy array (BF16 as
                  ``ml_dtypes.bfloat16``), or a contiguous ``torch.Tensor`` (a parameter
                  included: ``view.read_into(name, param)``, written under ``detach()``). A CPU
                  tensor is written in place; a tensor on another device (CUDA) is filled
                  through a host staging buffer (pinned for CUDA), as ``kda_tp.torch.load_rank``
                  does, in chunks of at most 64 MiB;
                * a *byte* destination, checked by byte count alone: a ``uint8``/``int8`` array
                  or tensor of any shape, ``bytearray``, a byte ``memoryview``, ``mmap``, of
                  exactly the local tensor's size in bytes (``prod(info(name)[1])`` x the
                  dtype's size).

                No other thread may read or write it until the call returns (as with
                ``file.readinto``, the copy runs with the GIL released).

        The source's bytes must not be written during the call either: a
        :class:`SafetensorsSource`'s never are (a read-only mapping, or a copy numpy cannot make
        writable); a custom source's arrays are its owner's to keep still.

        Raises:
            TensorNotFoundError: the view has no tensor ``name`` (the ``KeyError`` that
                ``view[name]`` raises).
            DtypeMismatchError: a typed destination of another dtype (an ``np.float16`` buffer
                for a BF16 tensor: same item size, other numbers); the message names the
                tensor, both dtypes and the fix.
            ShapeMismatchError: a typed destination of another shape (the transposed
                ``o_proj``), or a byte destination of another byte count.
            BufferLayoutError: ``out`` is read-only, not C-contiguous, an object array, or not
                a buffer.
            UsageError: ``name`` is not a ``str``.
            CheckpointError: reading fails (a file that changed since it was opened included).
        """
        self._check_open()
        found = self.info(_checked_name(name, "read_into"))
        if found is None:
            raise self._not_found(name)
        dtype, shape = found
        device = getattr(out, "device", None)
        if device is not None and getattr(device, "type", "cpu") != "cpu" and hasattr(
                out, "is_contiguous"):
            self._read_into_device(name, dtype, shape, out)
            return
        self._read_bytes_into(name, destination(name, dtype, shape, out))

    def _read_bytes_into(self, name: str, target: np.ndarray) -> None:
        """Write this rank's bytes of ``name`` into ``target``, a checked 1-D ``uint8`` array."""
        planned = self._planned.get(name)
        if planned is None:
            record = self.source.get(name)
            if record is None:
                raise self._not_found(name)
            _native.copy_into(readonly_bytes(record.data), target)
            return
        entry = planned[0]
        read_range = getattr(self.source, "read_range", None)
        if entry.byte_range is not None and read_range is not None:
            _native.copy_into(read_range(name, *entry.byte_range), target)
            return
        record = self.source.get(name)
        if record is None:
            raise self._not_found(name)
        _native.shard_into(entry, readonly_bytes(record.data), target)

    def _read_into_device(self, name: str, dtype: str, shape: tuple[int, ...], out: Any) -> None:
        """``read_into`` a torch tensor off the CPU: the bytes go through a host staging buffer
        (pinned for CUDA) of at most :data:`STAGING_BYTES`, then ``copy_`` to the device."""
        torch = import_torch()
        check_torch_destination(name, dtype, shape, out)
        flat = out.detach().reshape(-1).view(torch.uint8)
        nbytes = flat.numel()
        if not nbytes:
            return
        cuda = out.device.type == "cuda"
        if nbytes <= STAGING_BYTES:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
            self._read_bytes_into(name, host.numpy())
            flat.copy_(host)
            return
        data = self.get_tensor(name).data
        host = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=cuda)
        for start in range(0, nbytes, STAGING_BYTES):
            stop = min(start + STAGING_BYTES, nbytes)
            host.numpy()[: stop - start] = data[start:stop]
            flat[start:stop].copy_(host[: stop - start])

    def _not_found(self, name: str) -> TensorNotFoundError:
        return TensorNotFoundError(
            f"{location(self.source)}: no tensor named {name!r} in this checkpoint (its "
            "names: keys())"
        )

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"{location(self.source)}: this rank's view is closed")

    def release(self, name: str) -> None:
        """Drop this process's resident pages of the source's tensor ``name`` (see
        :meth:`SafetensorsSource.release`); a no-op when the wrapped source has no
        ``release``."""
        release = getattr(self.source, "release", None)
        if release is not None:
            release(name)

    def keys(self) -> list[str]:
        """Every tensor name, as ``safe_open``'s ``keys()``: the wrapped source's names."""
        return self.names()

    def get_tensor(self, name: str) -> Tensor:
        """This rank's tensor ``name``, as ``safe_open``'s ``get_tensor`` (``view[name]`` is the
        same call): a local slice for KDA tensors, else the source's record. Row-sliced and
        replicated tensors are views of the source's bytes (no copy); ``o_proj`` is gathered
        into a new array.

        Raises:
            TensorNotFoundError: the checkpoint has no tensor ``name`` (a ``KeyError`` and a
                ``CheckpointError``; the message names the tensor and the checkpoint).
            CheckpointError: the view is closed.
        """
        found = self._lookup(_checked_name(name, "view[name]"))
        if found is None:
            raise self._not_found(name)
        return found

    def get_slice(self, name: str) -> TensorSlice:
        """This rank's tensor ``name`` for lazy slicing, as ``safe_open``'s ``get_slice``
        (safetensors' ``PySafeSlice``): ``get_shape()``, ``get_dtype()`` and ``[...]``
        indexing of the rank's local tensor (KDA tensors sliced by the plan first, every other
        tensor whole). Nothing is read until it is indexed; then a row-sliced, replicated or
        passed-through tensor is indexed in place in the file mapping (only the pages the index
        touches are read), and ``o_proj`` is gathered once.

        Raises:
            TensorNotFoundError: the view has no tensor ``name`` (as ``view[name]``).
            UsageError: ``name`` is not a ``str``.
            CheckpointError: the view is closed.
        """
        self._check_open()
        found = self.info(_checked_name(name, "get_slice"))
        if found is None:
            raise self._not_found(name)
        return TensorSlice(self, name, *found)

    def metadata(self) -> dict[str, str] | None:
        """The checkpoint's safetensors ``__metadata__``, as ``safe_open``'s ``metadata()``: the
        string map of its header (of an indexed checkpoint's files together: the first file's
        value for a key several files give), or None when no file has one (a state dict's
        view included)."""
        self._check_open()
        files = getattr(self.source, "files", None)
        if files is None:
            metadata = getattr(self.source, "metadata", None)
            return None if metadata is None else metadata()
        merged: dict[str, str] = {}
        found = False
        for _, meta in files():
            if meta is not None:
                found = True
                for key, value in meta.items():
                    merged.setdefault(key, value)
        return merged if found else None

    def __getitem__(self, name: str) -> Tensor:
        return self.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        """The tensor names (:meth:`names`), as iterating a dict gives its keys.

        Raises:
            CheckpointError: the view is closed.
        """
        self._check_open()
        return iter(self.names())

    def __len__(self) -> int:
        """How many tensors the checkpoint holds (``len(names())``).

        Raises:
            CheckpointError: the view is closed.
        """
        self._check_open()
        return len(self.names())

    def __contains__(self, name: object) -> bool:
        """Whether the checkpoint holds ``name`` (False for a non-``str``): a dictionary lookup
        for a KDA tensor and for a source that answers membership itself (a
        ``SafetensorsSource``), else a set of its names built once.

        Raises:
            CheckpointError: the view is closed (as ``view[name]`` does).
        """
        self._check_open()
        if not isinstance(name, str):
            return False
        if name in self._planned:
            return True
        if hasattr(type(self.source), "__contains__"):
            return name in self.source  # type: ignore[operator]
        if self._names is None:
            self._names = frozenset(self.source.names())
        return name in self._names

    def close(self) -> None:
        """Close the view and the source it wraps (its ``close()``, if it has one): a
        :class:`SafetensorsSource` drops its file mappings and descriptors once no array
        returned by ``view[name]`` still views them. Later reads raise ``CheckpointError``;
        closing twice is harmless."""
        self._closed = True
        close = getattr(self.source, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> KdaShardedSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"KdaShardedSource({self.source!r}, tp_rank={self.plan.tp_rank}, "
            f"tp_size={self.plan.tp_size}, layers={list(self.layers)})"
        )


class TensorSlice:
    """One tensor of a rank's view, sliced lazily: ``view.get_slice(name)``, as safetensors'
    ``PySafeSlice``.

    ``get_shape()`` is the rank's local shape (a list, as safetensors gives it), ``get_dtype()``
    the safetensors dtype name (``"BF16"``), and ``s[index]`` any numpy basic index of the local
    tensor (``s[:, 0:64]``, ``s[3]``, ``s[...]``) as a read-only typed numpy array (BF16 as
    ``ml_dtypes.bfloat16``; ``torch.from_numpy(s[...].copy())`` for torch).
    """

    def __init__(self, view: KdaShardedSource, name: str, dtype: str, shape: tuple[int, ...]):
        self._view = view
        self.name = name
        self._dtype = dtype
        self._shape = shape

    def get_shape(self) -> list[int]:
        """The rank's local shape."""
        return list(self._shape)

    def get_dtype(self) -> str:
        """The safetensors dtype name."""
        return self._dtype

    def __getitem__(self, index: Any) -> np.ndarray:
        """``index`` of the local tensor, read now.

        Raises:
            DtypeMismatchError: a dtype numpy cannot hold (packed 4- and 6-bit floats).
            IndexError: an index outside the local shape (numpy's).
        """
        result: np.ndarray = self._view[self.name].array[index]
        return result

    def __repr__(self) -> str:
        return f"TensorSlice({self.name!r}, dtype={self._dtype}, shape={list(self._shape)})"


def open_rank(
    checkpoint: str | os.PathLike[str] | SafetensorsSource | Mapping[str, Any]
    | Sequence[tuple[str, Any]],
    *,
    tp_rank: int,
    tp_size: int,
    layers: Iterable[int] | None = None,
    qk_multiple: int = 256,
    backend: str | None = None,
    config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    mla: bool = False,
) -> KdaShardedSource:
    """One tensor-parallel rank's view of a checkpoint, with its plan on it (``view.plan``), in
    one call: what a loader opens, as it opens a file with safetensors' ``safe_open``::

        with kda_tp.open_rank("Kimi-K3", tp_rank=r, tp_size=8) as view:
            for name in view.keys():
                view.read_into(name, params[name])   # or view[name] / view.get_tensor(name)

    The checkpoint is described once per opened source (``kda_tp.describe``), so
    the plan costs no second read of the headers and the view checks each KDA tensor once.

    A trainer's tensors go through the same door (RL weight sync: the state dict, not files)::

        view = kda_tp.open_rank(model.state_dict(), config="Kimi-K3/config.json",
                                tp_rank=r, tp_size=8)

    gives the same view, plan, refusals and bytes as the checkpoint would: nothing is copied or
    gathered that the plan does not slice (a CPU tensor's row slice is a view of its memory; a
    CUDA tensor's slice is cut on the device and only its bytes reach the host).

    Args:
        checkpoint: a checkpoint directory, a ``.safetensors`` file, an open
            :class:`SafetensorsSource` (closed with the view), or in-memory tensors: a mapping
            (or a list of ``(name, tensor)`` pairs) of checkpoint-format names to numpy arrays
            or ``torch.Tensor`` on any device (see
            ``kda_tp.checkpoint.memory.MemorySource``).
        tp_rank: this rank, ``0 <= tp_rank < tp_size``.
        tp_size: the tensor-parallel world size.
        layers: 0-based KDA layer indices (default: the config's), checked as
            ``KdaTpPlan.from_config`` checks them.
        qk_multiple: see :class:`KdaTpPlan`.
        backend: ``"mmap"`` or ``"pread"`` (see :class:`SafetensorsSource`) for a path.
        config: for in-memory tensors (and only for them), the model's ``config.json``: a dict,
            or the path of the file or of its directory.
        mla: slice the hybrid's MLA layers too (``view.mla``, ``view.mla_layers``; see
            :class:`KdaShardedSource`; a KDA-only model has none); False passes them through
            whole.

    Returns:
        The rank's :class:`KdaShardedSource`, a context manager whose ``close()`` releases the
        file mappings.

    Raises:
        CheckpointError: a file is already a tensor-parallel shard (its header names a
            ``tp_rank`` and ``tp_size``: a rank ``shard`` wrote), or as below.
        CheckpointError, DtypeMismatchError, ShapeMismatchError, PlanError: as
            ``KdaTpPlan.from_config`` and :class:`KdaShardedSource`.
        UsageError: an unknown ``backend``; ``checkpoint`` of another type (``bytes``
            included); ``config`` given with a checkpoint (it has its own ``config.json``) or
            missing for in-memory tensors; a ``tp_rank`` or ``tp_size`` that is no integer.
        PlanError: ``tp_rank`` outside ``0..tp_size-1`` (the message gives the range and the
            fix).
    """
    tp_rank, tp_size = _rank_and_size(tp_rank, tp_size)
    source: Any
    if is_tensor_mapping(checkpoint):
        source = MemorySource(checkpoint, config)  # type: ignore[arg-type]
    else:
        if config is not None:
            raise UsageError(
                "open_rank(checkpoint, config=...): config= is for in-memory tensors; a "
                "checkpoint reads its own config.json"
            )
        if not isinstance(checkpoint, (str, os.PathLike, SafetensorsSource)):
            fix = (" (decode it: os.fsdecode(path))"
                   if isinstance(checkpoint, (bytes, bytearray)) else "")
            raise UsageError(
                f"open_rank: checkpoint must be a path (str or os.PathLike), an open "
                f"SafetensorsSource, or a mapping of tensor names to arrays/tensors; got "
                f"{type(checkpoint).__name__}{fix}"
            )
        source = (checkpoint if isinstance(checkpoint, SafetensorsSource)
                  else SafetensorsSource(checkpoint, backend))
    selected = None if layers is None else list(layers)
    try:
        for path, meta in (source.files() if isinstance(source, SafetensorsSource) else []):
            if meta and "tp_rank" in meta and "tp_size" in meta:
                raise CheckpointError(
                    f"{path}: already a tensor-parallel shard (rank {meta['tp_rank']} of "
                    f"{meta['tp_size']}, its header says); open the original checkpoint"
                )
        description = describe(source)
        plan = KdaTpPlan.from_description(description, tp_rank, tp_size,
                                          qk_multiple=qk_multiple, layers=selected)
        mla_plan = MlaTpPlan.from_description(description, tp_rank, tp_size) if mla else None
        return KdaShardedSource(source, plan, selected, mla=mla_plan)
    except BaseException:
        if source is not checkpoint:
            source.close()
        raise


def _rank_and_size(tp_rank: Any, tp_size: Any) -> tuple[int, int]:
    """``(tp_rank, tp_size)`` as ints (any integer type, numpy's included, through
    ``operator.index``), checked as the command line checks ``--tp-rank``.

    Raises:
        UsageError: a value that is no integer (a bool, a float, a string).
        PlanError: ``tp_size < 1`` or ``tp_rank`` outside ``0..tp_size-1``.
    """
    values = []
    for what, value in (("tp_rank", tp_rank), ("tp_size", tp_size)):
        try:
            if isinstance(value, bool):
                raise TypeError
            values.append(operator.index(value))
        except TypeError:
            raise UsageError(f"open_rank: {what} must be an integer, got {value!r}") from None
    rank, size = values
    if size < 1:
        raise PlanError(f"open_rank: tp_size must be at least 1, got {size}")
    if not 0 <= rank < size:
        raise PlanError(
            f"open_rank: tp_rank {rank} is outside 0..{size - 1} for tp_size {size} (ranks "
            f"count from 0: the last of {size} is {size - 1}); pass tp_rank in 0..{size - 1}"
        )
    return rank, size
