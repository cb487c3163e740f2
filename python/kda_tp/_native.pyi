"""Types of the Rust extension module ``kda_tp._native`` (rust/py.rs), for type checkers.

Hand-written; ``tests/test_types.py`` runs ``mypy.stubtest`` against the built module, so a
class, method or argument added in Rust without a line here fails the tests. The package's
public docstrings live in ``kda_tp.plan`` and ``kda_tp.source``; sizes are elements unless a
name says bytes.
"""

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, final

import numpy as np
import numpy.typing as npt
from typing_extensions import Self, disjoint_base

__all__ = [
    "__version__",
    "QUANTIZABLE",
    "Checkpoint",
    "KdaShard",
    "KdaTensorPlan",
    "KdaTpPlan",
    "TensorBytes",
    "shard_bytes",
    "shard_into",
    "copy_into",
]

__version__: str
#: Plan names of the projections a checkpoint may block-quantize (FP8).
QUANTIZABLE: list[str]

@final
class KdaShard:
    """How one KDA tensor maps onto ranks (an int-valued enum: ``int(KdaShard.HEAD_ROWS) == 1``)."""

    REPLICATED: ClassVar[KdaShard]
    HEAD_ROWS: ClassVar[KdaShard]
    CHANNEL_ROWS: ClassVar[KdaShard]
    CHANNEL_COLS: ClassVar[KdaShard]
    @property
    def name(self) -> str: ...
    def __int__(self) -> int: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class KdaTensorPlan:
    """One tensor's placement for one rank, as a flat ``[rows, row_elems]`` view."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> KdaShard: ...
    @property
    def dtype(self) -> str: ...
    @property
    def elem_bytes(self) -> int: ...
    @property
    def full_rows(self) -> int: ...
    @property
    def full_row_elems(self) -> int: ...
    @property
    def local_rows(self) -> int: ...
    @property
    def local_row_elems(self) -> int: ...
    @property
    def src_row_offset(self) -> int: ...
    @property
    def src_col_offset(self) -> int: ...
    @property
    def local_bytes(self) -> int: ...
    @property
    def full_bytes(self) -> int: ...
    @property
    def disk_shape(self) -> tuple[int, ...]: ...
    @property
    def byte_range(self) -> tuple[int, int] | None: ...
    @property
    def block(self) -> tuple[int, int] | None: ...
    @property
    def scale(self) -> KdaTensorPlan | None: ...
    def sharded_axis(self, disk_shape: Sequence[int]) -> int | None: ...
    def local_shape(self, disk_shape: Sequence[int]) -> tuple[int, ...]: ...
    def __eq__(self, other: object, /) -> bool: ...
    __hash__: ClassVar[None]  # type: ignore[assignment]

@disjoint_base
class KdaTpPlan:
    """The per-rank shard plan for one KDA block (documented on ``kda_tp.KdaTpPlan``)."""

    def __new__(
        cls,
        tp_rank: int,
        tp_size: int,
        hidden: int,
        head_dim: int,
        full_heads: int,
        conv_kernel: int,
        gate_rank: int,
        *,
        qk_multiple: int = 256,
        dtypes: dict[str, str] | None = None,
        full_rank_gate: bool = False,
        a_log_len: int | None = None,
        quant_block: tuple[int, int] | None = None,
        quantized: Sequence[str] | None = None,
        scale_layout: str = "grid",
    ) -> Self: ...
    @property
    def tp_rank(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def hidden(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def full_heads(self) -> int: ...
    @property
    def local_heads(self) -> int: ...
    @property
    def conv_kernel(self) -> int: ...
    @property
    def gate_rank(self) -> int: ...
    @property
    def qk_multiple(self) -> int: ...
    @property
    def full_rank_gate(self) -> bool: ...
    @property
    def a_log_len(self) -> int: ...
    @property
    def tensors(self) -> list[KdaTensorPlan]: ...
    @property
    def local_bytes(self) -> int: ...
    @property
    def full_bytes(self) -> int: ...
    @property
    def needs_output_all_reduce(self) -> bool: ...
    def get(self, name: str) -> KdaTensorPlan | None: ...
    def __getitem__(self, name: str, /) -> KdaTensorPlan: ...
    def __contains__(self, name: str, /) -> bool: ...
    def __eq__(self, other: object, /) -> bool: ...
    __hash__: ClassVar[None]  # type: ignore[assignment]

def shard_bytes(plan: KdaTensorPlan, full: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """This rank's bytes of one full tensor held in a 1-D uint8 array."""

def shard_into(
    plan: KdaTensorPlan, full: npt.NDArray[np.uint8], out: npt.NDArray[np.uint8]
) -> None:
    """This rank's bytes of one full tensor written into ``out`` (``plan.local_bytes`` bytes)."""

def copy_into(src: npt.NDArray[np.uint8], out: npt.NDArray[np.uint8]) -> None:
    """``src`` copied into ``out`` (same length in bytes), the GIL released."""

@final
class TensorBytes:
    """The raw bytes of one tensor, viewed by numpy through ``__array_interface__``."""

    @property
    def __array_interface__(self) -> dict[str, Any]: ...
    def __len__(self) -> int: ...

@final
class Checkpoint:
    """A validated safetensors checkpoint (wrapped by ``kda_tp.SafetensorsSource``)."""

    def __new__(cls, path: str | os.PathLike[str], backend: str = "mmap") -> Self: ...
    @property
    def root(self) -> Path: ...
    def names(self) -> list[str]: ...
    def info(self, name: str) -> tuple[str, list[int], Path] | None: ...
    def read(self, name: str, start: int = 0, stop: int | None = None) -> TensorBytes: ...
    def read_spans(
        self, name: str, start: int, span: int, stride: int, count: int
    ) -> TensorBytes: ...
    @property
    def bytes_read(self) -> int: ...
    def file_range(
        self, name: str, part_start: int = 0, part_stop: int | None = None
    ) -> tuple[int, int, int] | None: ...
    def release(self, name: str) -> None: ...
    def files(self) -> list[tuple[Path, dict[str, str] | None, tuple[int, int] | None]]: ...
