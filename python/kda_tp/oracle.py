"""An independent, standard-library-only oracle for the KDA tensor-parallel shard plan.

This module restates the shard plan of one KDA (Kimi Delta Attention) block from the written
spec (``spec/tp.rs`` for the plan, ``spec/tp_bind.rs`` for applying it), without calling the
Rust core, so the two can be compared. It also carries a verifier that checks a sharded
checkpoint directory against its source checkpoint, usable in a user's own CI with nothing but
a Python interpreter::

    python -m kda_tp.oracle verify CHECKPOINT OUT

The plan, in short: rank ``r`` of ``tp_size`` owns the contiguous head range
``[r * H/T, (r+1) * H/T)``. Channel ``c = h * head_dim + d``, so that head range is the
contiguous channel range ``[r * C/T, (r+1) * C/T)`` with ``C = heads * head_dim``.

* column-parallel by output channel (rows of the on-disk ``[out, in]`` tensor):
  ``q/k/v_proj``, ``q/k/v_conv1d``, ``f_b_proj``, ``g_b_proj``, ``dt_bias``;
* by head: ``b_proj``, ``A_log``;
* replicated: ``f_a_proj``, ``g_a_proj`` (low-rank down-projections) and ``o_norm``
  (``[head_dim]``, shared by every head);
* row-parallel: ``o_proj`` ``[hidden, C]``, sliced on its input (last) axis; every rank's output
  is a partial sum, and one all-reduce follows it when ``tp_size > 1``.

Sizes are in elements unless a name says bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kda_tp.errors import CheckpointError, PlanError, ShapeMismatchError

__all__ = [
    "TENSOR_NAMES",
    "ELEM_BYTES",
    "MAX_BYTES",
    "OracleTensor",
    "OraclePlan",
    "KdaConfig",
    "plan",
    "shard_bytes",
    "local_shape",
    "plan_name",
    "read_kda_config",
    "verify",
    "main",
]

#: The tensors of one KDA block, by plan name, in plan order (spec ``tp.rs``, ``tensors``).
TENSOR_NAMES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "q_conv1d",
    "k_conv1d",
    "v_conv1d",
    "f_a_proj",
    "f_b_proj",
    "g_a_proj",
    "g_b_proj",
    "b_proj",
    "A_log",
    "dt_bias",
    "o_norm",
    "o_proj",
)

#: Bytes per element of the safetensors dtypes a KDA tensor may have.
ELEM_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8}

#: Largest byte size a tensor, or a whole block, may have (``isize::MAX`` on 64-bit targets, the
#: bound of a Rust slice and of a signed 64-bit file offset). Larger geometry is refused.
MAX_BYTES = 2**63 - 1

#: Default dtypes: BF16 everywhere, except the two float32 gate parameters (Kimi-Linear's
#: ``A_log`` and ``dt_bias`` are created float32; spec ``tp.rs`` uses ``F32`` for both).
_DEFAULT_DTYPE = "BF16"
_F32_TENSORS = ("A_log", "dt_bias")

_REPLICATED = "REPLICATED"
_HEAD_ROWS = "HEAD_ROWS"
_CHANNEL_ROWS = "CHANNEL_ROWS"
_CHANNEL_COLS = "CHANNEL_COLS"


@dataclass(frozen=True)
class OracleTensor:
    """One tensor's placement on one rank, in a flat ``[rows, row_elems]`` view of it.

    ``kind`` is ``"REPLICATED"``, ``"HEAD_ROWS"``, ``"CHANNEL_ROWS"`` or ``"CHANNEL_COLS"``. For
    the row kinds the sharded axis is ``rows``; for ``CHANNEL_COLS`` it is ``row_elems``. All
    counts and offsets are elements; ``src_row_offset`` counts rows, ``src_col_offset`` elements
    within a row. ``disk_shape`` is the full tensor's canonical Kimi-Linear on-disk shape.
    """

    name: str
    kind: str
    dtype: str
    elem_bytes: int
    full_rows: int
    full_row_elems: int
    local_rows: int
    local_row_elems: int
    src_row_offset: int
    src_col_offset: int
    disk_shape: tuple[int, ...]

    @property
    def local_bytes(self) -> int:
        """Bytes this rank stores for this tensor."""
        return self.local_rows * self.local_row_elems * self.elem_bytes

    @property
    def full_bytes(self) -> int:
        """Bytes the full tensor occupies on disk."""
        return self.full_rows * self.full_row_elems * self.elem_bytes


@dataclass(frozen=True)
class OraclePlan:
    """The shard plan of one KDA block on rank ``tp_rank`` of ``tp_size``.

    ``full_heads`` counts heads over all ranks, ``local_heads = full_heads / tp_size`` those of
    this rank. ``tensors`` holds one :class:`OracleTensor` per name of :data:`TENSOR_NAMES`, in
    that order.
    """

    tp_rank: int
    tp_size: int
    hidden: int
    head_dim: int
    full_heads: int
    local_heads: int
    conv_kernel: int
    gate_rank: int
    qk_multiple: int
    tensors: list[OracleTensor]

    @property
    def local_bytes(self) -> int:
        """Bytes this rank stores for the whole block."""
        return sum(t.local_bytes for t in self.tensors)

    @property
    def full_bytes(self) -> int:
        """Bytes the whole block occupies on disk."""
        return sum(t.full_bytes for t in self.tensors)

    @property
    def needs_output_all_reduce(self) -> bool:
        """Whether the block's output must be all-reduced (summed) after the row-parallel
        ``o_proj``: false only at ``tp_size == 1``, where each rank holds the whole of it."""
        return self.tp_size > 1

    def get(self, name: str) -> OracleTensor | None:
        """The entry for plan name ``name`` (e.g. ``"q_proj"``, ``"A_log"``), or ``None``."""
        return next((t for t in self.tensors if t.name == name), None)


def plan(
    tp_rank: int,
    tp_size: int,
    hidden: int,
    head_dim: int,
    full_heads: int,
    conv_kernel: int,
    gate_rank: int,
    *,
    qk_multiple: int = 256,
    dtypes: Mapping[str, str] | None = None,
) -> OraclePlan:
    """The shard plan of one KDA block for rank ``tp_rank`` of ``tp_size`` (spec ``tp.rs``,
    ``KdaTpPlan::new``).

    Args:
        tp_rank, tp_size: this rank and the tensor-parallel world size.
        hidden: hidden size of the model (elements).
        head_dim: elements per head; ``C = full_heads * head_dim`` is the channel count.
        full_heads: KDA heads over all ranks.
        conv_kernel: short-convolution kernel width ``K``.
        gate_rank: rows of the low-rank ``f_a_proj``/``g_a_proj`` down-projections.
        qk_multiple: the local q|k width ``2 * local_heads * head_dim`` must be a multiple of
            this (spec: 256, the fused conv + L2-norm kernel's two heads per 256-thread block);
            1 switches the rule off.
        dtypes: plan name -> ``"BF16"``, ``"F16"``, ``"F32"`` or ``"F64"``, overriding the
            defaults (BF16, F32 for ``A_log`` and ``dt_bias``).

    Returns:
        An :class:`OraclePlan`. Per tensor (full shape as ``[rows, row_elems]``, with
        ``Hl = full_heads / tp_size`` and ``Cl = Hl * head_dim``):

        ==========================  ============  ===================  ===========================
        tensor                      kind          full [rows, elems]   this rank keeps
        ==========================  ============  ===================  ===========================
        q/k/v_proj                  CHANNEL_ROWS  [C, hidden]          rows ``[r*Cl, (r+1)*Cl)``
        q/k/v_conv1d                CHANNEL_ROWS  [C, K]               rows ``[r*Cl, (r+1)*Cl)``
        f_a_proj, g_a_proj          REPLICATED    [gate_rank, hidden]  everything
        f_b_proj, g_b_proj          CHANNEL_ROWS  [C, gate_rank]       rows ``[r*Cl, (r+1)*Cl)``
        b_proj                      HEAD_ROWS     [H, hidden]          rows ``[r*Hl, (r+1)*Hl)``
        A_log                       HEAD_ROWS     [H, 1]               rows ``[r*Hl, (r+1)*Hl)``
        dt_bias                     CHANNEL_ROWS  [C, 1]               rows ``[r*Cl, (r+1)*Cl)``
        o_norm                      REPLICATED    [head_dim, 1]        everything
        o_proj                      CHANNEL_COLS  [hidden, C]          columns ``[r*Cl, (r+1)*Cl)``
        ==========================  ============  ===================  ===========================

    Raises:
        PlanError: ``tp_size == 0`` or ``tp_rank >= tp_size``; a zero (or negative) ``hidden``,
            ``head_dim``, ``full_heads``, ``conv_kernel``, ``gate_rank`` or ``qk_multiple``;
            ``full_heads`` not divisible by ``tp_size``; a local q|k width that is not a
            multiple of ``qk_multiple``; an unknown tensor name or dtype in ``dtypes``; a tensor
            or the whole block over :data:`MAX_BYTES` bytes.
    """
    if tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise PlanError(f"tp_rank {tp_rank} is not in [0, tp_size {tp_size})")
    for label, value in (
        ("hidden", hidden),
        ("head_dim", head_dim),
        ("full_heads", full_heads),
        ("conv_kernel", conv_kernel),
        ("gate_rank", gate_rank),
        ("qk_multiple", qk_multiple),
    ):
        if value <= 0:
            raise PlanError(f"degenerate KDA TP geometry: {label} is {value}, must be at least 1")
    if full_heads % tp_size:
        raise PlanError(f"KDA TP needs heads ({full_heads}) divisible by tp_size ({tp_size})")
    local_heads = full_heads // tp_size
    qk_width = 2 * local_heads * head_dim
    if qk_width % qk_multiple:
        raise PlanError(
            f"KDA TP: local q|k width 2 * {local_heads} heads * {head_dim} = {qk_width} "
            f"is not a multiple of {qk_multiple}"
        )
    chosen = _resolve_dtypes(dtypes)

    channels = full_heads * head_dim
    local_channels = local_heads * head_dim
    # name, kind, full rows, full elements per row, canonical on-disk shape.
    layout = (
        ("q_proj", _CHANNEL_ROWS, channels, hidden, (channels, hidden)),
        ("k_proj", _CHANNEL_ROWS, channels, hidden, (channels, hidden)),
        ("v_proj", _CHANNEL_ROWS, channels, hidden, (channels, hidden)),
        ("q_conv1d", _CHANNEL_ROWS, channels, conv_kernel, (channels, 1, conv_kernel)),
        ("k_conv1d", _CHANNEL_ROWS, channels, conv_kernel, (channels, 1, conv_kernel)),
        ("v_conv1d", _CHANNEL_ROWS, channels, conv_kernel, (channels, 1, conv_kernel)),
        ("f_a_proj", _REPLICATED, gate_rank, hidden, (gate_rank, hidden)),
        ("f_b_proj", _CHANNEL_ROWS, channels, gate_rank, (channels, gate_rank)),
        ("g_a_proj", _REPLICATED, gate_rank, hidden, (gate_rank, hidden)),
        ("g_b_proj", _CHANNEL_ROWS, channels, gate_rank, (channels, gate_rank)),
        ("b_proj", _HEAD_ROWS, full_heads, hidden, (full_heads, hidden)),
        ("A_log", _HEAD_ROWS, full_heads, 1, (1, 1, full_heads, 1)),
        ("dt_bias", _CHANNEL_ROWS, channels, 1, (channels,)),
        ("o_norm", _REPLICATED, head_dim, 1, (head_dim,)),
        ("o_proj", _CHANNEL_COLS, hidden, channels, (hidden, channels)),
    )
    tensors = []
    for name, kind, rows, row_elems, disk_shape in layout:
        elem_bytes = ELEM_BYTES[chosen[name]]
        if rows * row_elems * elem_bytes > MAX_BYTES:
            raise PlanError(
                f"KDA TP geometry too large: {name} {list(disk_shape)} x {elem_bytes} bytes "
                f"exceeds {MAX_BYTES} bytes"
            )
        if kind == _REPLICATED:
            local = (rows, row_elems, 0, 0)
        elif kind == _HEAD_ROWS:
            local = (local_heads, row_elems, tp_rank * local_heads, 0)
        elif kind == _CHANNEL_ROWS:
            local = (local_channels, row_elems, tp_rank * local_channels, 0)
        else:
            local = (rows, local_channels, 0, tp_rank * local_channels)
        tensors.append(
            OracleTensor(name, kind, chosen[name], elem_bytes, rows, row_elems, *local, disk_shape)
        )
    result = OraclePlan(
        tp_rank,
        tp_size,
        hidden,
        head_dim,
        full_heads,
        local_heads,
        conv_kernel,
        gate_rank,
        qk_multiple,
        tensors,
    )
    if result.full_bytes > MAX_BYTES:
        raise PlanError(
            f"KDA TP geometry too large: the block is {result.full_bytes} bytes, "
            f"over {MAX_BYTES} bytes"
        )
    return result


def _resolve_dtypes(dtypes: Mapping[str, str] | None) -> dict[str, str]:
    """Plan name -> dtype, the defaults overridden by ``dtypes``; PlanError on unknown keys or
    dtypes."""
    chosen = {n: "F32" if n in _F32_TENSORS else _DEFAULT_DTYPE for n in TENSOR_NAMES}
    for name, dtype in (dtypes or {}).items():
        if name not in chosen:
            raise PlanError(f"unknown KDA tensor {name!r}; the plan has {', '.join(TENSOR_NAMES)}")
        if dtype not in ELEM_BYTES:
            raise PlanError(f"{name}: dtype {dtype!r} is not one of {', '.join(ELEM_BYTES)}")
        chosen[name] = dtype
    return chosen


def shard_bytes(entry: OracleTensor, data: bytes | bytearray | memoryview) -> bytes:
    """This rank's bytes of one tensor (spec ``tp_bind.rs``, ``shard_bytes``).

    Args:
        entry: the tensor's plan entry.
        data: the whole tensor's raw bytes as stored on disk (row-major), exactly
            ``entry.full_bytes`` long.

    Returns:
        ``entry.local_bytes`` bytes: the whole tensor when replicated; for the row kinds the
        contiguous rows ``[src_row_offset, src_row_offset + local_rows)``; for ``CHANNEL_COLS``
        (``o_proj``) the elements ``[src_col_offset, src_col_offset + local_row_elems)`` of every
        row, rows kept in order (a strided gather, not a row slice).

    Raises:
        ShapeMismatchError: ``len(data) != entry.full_bytes``; the message names the tensor and
            both sizes.
    """
    view = memoryview(data).cast("B")
    if view.nbytes != entry.full_bytes:
        raise ShapeMismatchError(
            f"{entry.name}: {view.nbytes} bytes on disk, the plan's full shape "
            f"[{entry.full_rows}, {entry.full_row_elems}] x {entry.elem_bytes} bytes implies "
            f"{entry.full_bytes} bytes"
        )
    row_bytes = entry.full_row_elems * entry.elem_bytes
    if entry.kind == _CHANNEL_COLS:
        first = entry.src_col_offset * entry.elem_bytes
        width = entry.local_row_elems * entry.elem_bytes
        return b"".join(
            view[r * row_bytes + first : r * row_bytes + first + width]
            for r in range(entry.local_rows)
        )
    start = entry.src_row_offset * row_bytes
    return bytes(view[start : start + entry.local_rows * row_bytes])


def local_shape(entry: OracleTensor, disk_shape: Sequence[int]) -> tuple[int, ...]:
    """This rank's shape of a tensor stored with shape ``disk_shape`` (spec ``tp_bind.rs``,
    ``local_shape``): same rank as on disk, sharded axis reduced to the local extent.

    The sharded axis: for the row kinds, the first axis whose extent is not 1 (leading unit
    axes are padding, as in ``A_log``'s ``(1, 1, H, 1)``), or axis 0 when the tensor has a
    single row; for ``CHANNEL_COLS``, the last axis. So ``(1, 1, H, 1) -> (1, 1, H/T, 1)``,
    ``(H,) -> (H/T,)``, ``(C, 1, K) -> (C/T, 1, K)``, ``(C, K) -> (C/T, K)``,
    ``(hidden, C) -> (hidden, C/T)``. Replicated tensors keep ``disk_shape``.

    Raises:
        ShapeMismatchError: ``disk_shape`` does not hold ``full_rows * full_row_elems``
            elements, or its sharded axis is not ``full_rows`` long (row kinds) or its last
            axis is not ``full_row_elems`` long (``CHANNEL_COLS``).
    """
    shape = tuple(int(d) for d in disk_shape)
    expected = entry.full_rows * entry.full_row_elems

    def mismatch(why: str) -> ShapeMismatchError:
        return ShapeMismatchError(
            f"{entry.name}: on-disk shape {list(shape)} does not match the plan's "
            f"[{entry.full_rows}, {entry.full_row_elems}] (e.g. {list(entry.disk_shape)}): {why}"
        )

    if math.prod(shape) != expected:
        raise mismatch(f"{math.prod(shape)} elements, expected {expected}")
    if entry.kind == _REPLICATED:
        return shape
    if entry.kind == _CHANNEL_COLS:
        if not shape or shape[-1] != entry.full_row_elems:
            raise mismatch(f"the last axis must be {entry.full_row_elems} long")
        return shape[:-1] + (entry.local_row_elems,)
    if entry.full_rows == 1:
        axis = 0
    else:
        axis = next((i for i, d in enumerate(shape) if d != 1), len(shape))
    if axis >= len(shape) or shape[axis] != entry.full_rows:
        raise mismatch(f"the first non-unit axis must be {entry.full_rows} long")
    return shape[:axis] + (entry.local_rows,) + shape[axis + 1 :]


def plan_name(checkpoint_name: str) -> str:
    """The plan name of a ``self_attn`` tensor name (spec ``tp_bind.rs``, ``plan_name``).

    Strips a leading ``self_attn.`` and a trailing ``.weight`` where present:
    ``self_attn.q_proj.weight -> q_proj``, ``self_attn.A_log -> A_log`` (``A_log`` and
    ``dt_bias`` carry no ``.weight``). The result is a KDA tensor only if it is in
    :data:`TENSOR_NAMES`.
    """
    name = checkpoint_name.removeprefix("self_attn.")
    return name.removesuffix(".weight")


# ---------------------------------------------------------------------------------------------
# Verifier: a sharded checkpoint against its source, standard library only.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KdaConfig:
    """KDA geometry read from a ``config.json``. ``kda_layers`` are 0-based layer indices."""

    hidden: int
    head_dim: int
    heads: int
    conv_kernel: int
    kda_layers: frozenset[int]


def read_kda_config(config: Mapping[str, Any]) -> KdaConfig:
    """The KDA geometry of a parsed ``config.json``.

    Two layouts are understood:

    * Kimi-Linear: ``hidden_size`` and ``linear_attn_config`` with ``head_dim``, ``num_heads``,
      ``short_conv_kernel_size`` and ``kda_layers`` (1-based layer numbers).
    * Qwen3-Next style: ``hidden_size``, ``linear_key_head_dim``, ``linear_num_key_heads``,
      ``linear_conv_kernel_dim`` and ``layer_types``, where ``"linear_attention"`` at index
      ``i`` marks 0-based layer ``i`` as KDA.

    Raises:
        CheckpointError: neither layout is present, or a value has the wrong type.
    """
    try:
        if isinstance(config.get("linear_attn_config"), Mapping):
            lac = config["linear_attn_config"]
            result = KdaConfig(
                hidden=config["hidden_size"],
                head_dim=lac["head_dim"],
                heads=lac["num_heads"],
                conv_kernel=lac["short_conv_kernel_size"],
                kda_layers=frozenset(n - 1 for n in lac["kda_layers"]),
            )
        elif "layer_types" in config and "linear_key_head_dim" in config:
            result = KdaConfig(
                hidden=config["hidden_size"],
                head_dim=config["linear_key_head_dim"],
                heads=config["linear_num_key_heads"],
                conv_kernel=config["linear_conv_kernel_dim"],
                kda_layers=frozenset(
                    i for i, t in enumerate(config["layer_types"]) if t == "linear_attention"
                ),
            )
        else:
            raise CheckpointError(
                "config.json has neither linear_attn_config (Kimi-Linear) nor "
                "layer_types + linear_key_head_dim (Qwen3-Next style)"
            )
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"config.json: missing or malformed KDA key: {exc}") from exc
    sizes = (result.hidden, result.head_dim, result.heads, result.conv_kernel)
    if not all(isinstance(v, int) and v > 0 for v in sizes) or not all(
        isinstance(i, int) and i >= 0 for i in result.kda_layers
    ):
        raise CheckpointError(f"config.json: KDA geometry is not positive integers: {result}")
    return result


@dataclass(frozen=True)
class _TensorInfo:
    """Where one tensor lives: file, dtype, shape and absolute byte range in the file."""

    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def _read_safetensors_header(path: Path) -> tuple[dict[str, str], dict[str, _TensorInfo]]:
    """Parse one safetensors file's header: (``__metadata__``, tensor name -> info).

    Format: an 8-byte little-endian header length ``n``, ``n`` bytes of JSON, then the data
    region; each tensor's ``data_offsets`` are relative to the data region.

    Raises:
        CheckpointError: unreadable file, bad header, or offsets outside the file.
    """
    try:
        with path.open("rb") as f:
            size = path.stat().st_size
            prefix = f.read(8)
            if len(prefix) != 8:
                raise CheckpointError(f"{path}: shorter than the 8-byte safetensors prefix")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > size - 8:
                raise CheckpointError(f"{path}: header length {header_len} exceeds the file")
            header = json.loads(f.read(header_len))
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: __metadata__ is not a JSON object")
    data_start = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        try:
            begin, end = entry["data_offsets"]
            info = _TensorInfo(
                path, entry["dtype"], tuple(entry["shape"]), data_start + begin, data_start + end
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: {name}: malformed header entry") from exc
        if not data_start <= info.start <= info.end <= size:
            raise CheckpointError(f"{path}: {name}: data_offsets [{begin}, {end}) outside the file")
        tensors[name] = info
    return metadata, tensors


class _Checkpoint:
    """A Hugging Face checkpoint directory, read lazily: ``config.json`` plus either
    ``model.safetensors.index.json`` with its shards or a single ``*.safetensors`` file."""

    def __init__(self, directory: Path, *, require_index: bool) -> None:
        """Read the config and every safetensors header.

        Raises:
            CheckpointError: missing or invalid ``config.json``; missing index when
                ``require_index``; no or several safetensors files without an index; an index
                whose ``weight_map`` disagrees with the files' headers; a tensor in two files.
        """
        self.directory = directory
        config_path = directory / "config.json"
        try:
            self.config = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{config_path}: {exc}") from exc
        if not isinstance(self.config, dict):
            raise CheckpointError(f"{config_path}: not a JSON object")

        index_path = directory / "model.safetensors.index.json"
        weight_map = None
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
                files = sorted({directory / f for f in weight_map.values()})
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(f"{index_path}: no readable weight_map: {exc}") from exc
        elif require_index:
            raise CheckpointError(f"{index_path}: missing")
        else:
            files = sorted(directory.glob("*.safetensors"))
            if len(files) != 1:
                raise CheckpointError(
                    f"{directory}: expected model.safetensors.index.json or exactly one "
                    f"*.safetensors file, found {len(files)} safetensors files"
                )

        self.metadata: dict[Path, dict[str, str]] = {}
        self.tensors: dict[str, _TensorInfo] = {}
        for path in files:
            self.metadata[path], tensors = _read_safetensors_header(path)
            for name, info in tensors.items():
                if name in self.tensors:
                    raise CheckpointError(f"{directory}: {name} is in two files")
                self.tensors[name] = info
        if weight_map is not None:
            for name in sorted(set(weight_map) | set(self.tensors)):
                listed = weight_map.get(name)
                actual = self.tensors[name].path.name if name in self.tensors else None
                if listed != actual:
                    raise CheckpointError(
                        f"{index_path}: {name} is mapped to {listed}, found in {actual}"
                    )

    def read(self, name: str) -> bytes:
        """The raw bytes of tensor ``name``."""
        info = self.tensors[name]
        with info.path.open("rb") as f:
            f.seek(info.start)
            return f.read(info.end - info.start)

    def chunks(self, name: str, chunk: int = 64 << 20) -> Iterator[bytes]:
        """The raw bytes of tensor ``name``, in pieces of at most ``chunk`` bytes."""
        info = self.tensors[name]
        with info.path.open("rb") as f:
            f.seek(info.start)
            left = info.end - info.start
            while left:
                piece = f.read(min(chunk, left))
                if not piece:
                    raise CheckpointError(f"{info.path}: {name}: file ends inside the tensor")
                left -= len(piece)
                yield piece


_LAYER_ATTN = re.compile(r"(\d+)\.(self_attn\..+)")
_A_LOG = re.compile(r"((?:.*\.)?layers\.)\d+\.self_attn\.A_log")


def _decoder_prefix(names: Iterable[str]) -> str:
    """The prefix, up to the layer index, of the layers holding ``A_log`` (a KDA-only tensor):
    ``model.layers.`` for Kimi-Linear; other stacks (a vision tower) are never KDA layers."""
    prefixes = {m[1] for n in names if (m := _A_LOG.fullmatch(n))}
    return prefixes.pop() if len(prefixes) == 1 else "model.layers."


def _kda_plan_name(name: str, kda_layers: frozenset[int], prefix: str) -> str | None:
    """The plan name of checkpoint tensor ``name`` if it belongs to a KDA layer, else ``None``.

    Layer type comes from the config, never from a tensor's shape: full-attention (MLA) layers
    also have ``self_attn.q_proj`` and an ``o_proj`` of the same shape.
    """
    match = _LAYER_ATTN.fullmatch(name[len(prefix) :]) if name.startswith(prefix) else None
    if match is None or int(match[1]) not in kda_layers:
        return None
    candidate = plan_name(match[2])
    return candidate if candidate in TENSOR_NAMES else None


def verify(checkpoint_dir: str | Path, out_dir: str | Path) -> list[str]:
    """Check a tensor-parallel sharded checkpoint against its source, byte for byte.

    Args:
        checkpoint_dir: the full checkpoint: ``config.json`` (see :func:`read_kda_config`) and
            ``model.safetensors.index.json`` with its shards, or a single ``*.safetensors``.
        out_dir: the sharded output: directories ``rank0`` .. ``rank{T-1}``, each a checkpoint
            directory with ``config.json``, ``model.safetensors.index.json`` and the
            ``*.safetensors`` files it lists, every file's ``__metadata__`` carrying
            ``"tp_rank": "r"`` and ``"tp_size": "T"``.

    What is checked, per rank ``r``: the same tensor names as the source, none missing or extra;
    every KDA-layer tensor ``model.layers.{i}.self_attn.<name>[.weight]`` (``i`` in the config's
    KDA layers, ``<name>`` a plan name) has the source's dtype, the shape :func:`local_shape`
    gives and exactly the bytes :func:`shard_bytes` gives for rank ``r``; every other tensor is
    identical to the source in dtype, shape and bytes. The plan uses the config's geometry,
    ``gate_rank`` = rows of the first KDA layer's ``f_a_proj`` and the dtypes of that layer's
    tensors; it is built with ``qk_multiple=1``, since the 256-channel kernel rule does not
    change which bytes a rank holds.

    Returns:
        One line per problem found, each naming the rank and the file or tensor; empty when the
        output is a correct sharding of the source.
    """
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    try:
        source = _Checkpoint(checkpoint_dir, require_index=False)
        geometry = read_kda_config(source.config)
    except CheckpointError as exc:
        return [f"input: {exc}"]
    if not geometry.kda_layers:
        return [f"input: {checkpoint_dir}/config.json lists no KDA layer"]
    first = min(geometry.kda_layers)
    decoder = _decoder_prefix(source.tensors)
    prefix = f"{decoder}{first}.self_attn."
    f_a = source.tensors.get(prefix + "f_a_proj.weight")
    if f_a is None or not f_a.shape:
        return [f"input: {prefix}f_a_proj.weight is missing, so gate_rank is unknown"]
    dtypes = {
        name: source.tensors[full].dtype
        for name in TENSOR_NAMES
        for full in (prefix + name, prefix + name + ".weight")
        if full in source.tensors
    }

    if not out_dir.is_dir():
        return [f"output: {out_dir} is not a directory"]
    rank_dirs = sorted(
        (int(m[1]), p)
        for p in out_dir.iterdir()
        if p.is_dir() and (m := re.fullmatch(r"rank(\d+)", p.name))
    )
    if not rank_dirs:
        return [f"output: {out_dir} holds no rank<N> directory"]
    tp_size = _declared_tp_size(rank_dirs[0][1]) or len(rank_dirs)
    if [r for r, _ in rank_dirs] != list(range(tp_size)):
        names = [p.name for _, p in rank_dirs][:8]
        return [
            f"output: rank directories {names} are not rank0 .. rank{tp_size - 1} "
            f"(tp_size {tp_size}; incomplete run?)"
        ]

    problems = []
    for rank, rank_dir in rank_dirs:
        try:
            rank_plan = plan(
                rank,
                tp_size,
                geometry.hidden,
                geometry.head_dim,
                geometry.heads,
                geometry.conv_kernel,
                f_a.shape[0],
                qk_multiple=1,
                dtypes=dtypes,
            )
        except PlanError as exc:
            problems.append(f"rank{rank}: no shard plan for this geometry: {exc}")
            continue
        try:
            sharded = _Checkpoint(rank_dir, require_index=True)
        except CheckpointError as exc:
            problems.append(f"rank{rank}: {exc}")
            continue
        problems += _check_rank(source, sharded, rank_plan, geometry.kda_layers, decoder)
    return problems


def _declared_tp_size(rank_dir: Path) -> int | None:
    """``tp_size`` from the ``__metadata__`` of the first safetensors file in ``rank_dir``."""
    for path in sorted(rank_dir.glob("*.safetensors")):
        try:
            metadata, _ = _read_safetensors_header(path)
            return int(metadata["tp_size"])
        except (CheckpointError, KeyError, ValueError, OSError):
            return None
    return None


def _check_rank(
    source: _Checkpoint,
    sharded: _Checkpoint,
    rank_plan: OraclePlan,
    kda_layers: frozenset[int],
    decoder: str,
) -> list[str]:
    """The problems of one rank's directory; see :func:`verify`."""
    tag = f"rank{rank_plan.tp_rank}"
    problems = []
    for path, metadata in sharded.metadata.items():
        for key, want in (("tp_rank", rank_plan.tp_rank), ("tp_size", rank_plan.tp_size)):
            if metadata.get(key) != str(want):
                problems.append(
                    f"{tag}: {path.name}: __metadata__ {key} is {metadata.get(key)!r}, "
                    f"expected {str(want)!r}"
                )
    problems += [f"{tag}: {n}: missing" for n in sorted(source.tensors.keys() - sharded.tensors)]
    problems += [
        f"{tag}: {n}: not in the input" for n in sorted(sharded.tensors.keys() - source.tensors)
    ]

    for name in sorted(source.tensors.keys() & sharded.tensors.keys()):
        src, out = source.tensors[name], sharded.tensors[name]
        if out.dtype != src.dtype:
            problems.append(f"{tag}: {name}: dtype {out.dtype}, input has {src.dtype}")
            continue
        kda_name = _kda_plan_name(name, kda_layers, decoder)
        if kda_name is None:
            want_shape = src.shape
        else:
            found = rank_plan.get(kda_name)
            assert found is not None  # _kda_plan_name returns only plan names
            entry = found
            if src.dtype != entry.dtype:
                problems.append(
                    f"{tag}: {name}: input dtype {src.dtype} differs from the first KDA "
                    f"layer's {entry.dtype}"
                )
                continue
            try:
                want_shape = local_shape(entry, src.shape)
            except ShapeMismatchError as exc:
                problems.append(f"{tag}: {name}: input {exc}")
                continue
        if out.shape != want_shape:
            problems.append(f"{tag}: {name}: shape {list(out.shape)}, expected {list(want_shape)}")
            continue
        try:
            if kda_name is None:
                same = out.end - out.start == src.end - src.start and all(
                    a == b for a, b in zip(source.chunks(name), sharded.chunks(name), strict=True)
                )
            else:
                same = sharded.read(name) == shard_bytes(entry, source.read(name))
        except (CheckpointError, ShapeMismatchError) as exc:
            problems.append(f"{tag}: {name}: {exc}")
            continue
        if not same:
            what = "this rank's slice of the input" if kda_name else "the input"
            problems.append(f"{tag}: {name}: bytes differ from {what}")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m kda_tp.oracle verify CHECKPOINT OUT``.

    Prints each problem to stderr and a one-line summary to stdout. Returns the exit status:
    0 when the output is a correct sharding of the checkpoint, 1 otherwise (2 for bad usage,
    from argparse).
    """
    parser = argparse.ArgumentParser(
        prog="python -m kda_tp.oracle",
        description="Check a KDA tensor-parallel sharded checkpoint against its source.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("verify", help="compare OUT/rank*/ with CHECKPOINT byte for byte")
    check.add_argument("checkpoint", type=Path, help="the full (unsharded) checkpoint directory")
    check.add_argument("out", type=Path, help="the directory holding rank0 .. rank{T-1}")
    args = parser.parse_args(argv)

    problems = verify(args.checkpoint, args.out)
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print(f"FAIL: {len(problems)} problem(s) in {args.out} against {args.checkpoint}")
        return 1
    print(f"OK: {args.out} is a correct tensor-parallel sharding of {args.checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
