"""Types of the Rust extension module ``kda_tp._native`` (rust/py.rs), for type checkers.

Hand-written; ``tests/integration/test_types.py`` runs ``mypy.stubtest`` against the built module, so a
class, method or argument added in Rust without a line here fails the tests. The API reference
(mkdocstrings) documents ``KdaShard`` and ``KdaTensorPlan`` from the docstrings here;
``KdaTpPlan`` and ``MlaTpPlan`` are documented on their subclasses in ``kda_tp.rank``, the readers in
``kda_tp.checkpoint``. Sizes are elements unless a name says bytes.
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
    "MlaTpPlan",
    "TensorBytes",
    "WritableBytes",
    "shard_bytes",
    "shard_into",
    "copy_into",
    "digest",
    "digest_if_equal",
]

__version__: str
#: Plan names of the projections a checkpoint may block-quantize (FP8).
QUANTIZABLE: list[str]

@final
class KdaShard:
    """How one KDA tensor maps onto ranks (an int-valued enum: ``int(KdaShard.HEAD_ROWS) == 1``)."""

    REPLICATED: ClassVar[KdaShard]
    """Every rank holds the whole tensor (``f_a_proj``, ``g_a_proj``, ``o_norm``)."""
    HEAD_ROWS: ClassVar[KdaShard]
    """The leading dimension is heads; each rank keeps its head range (``b_proj``, ``A_log``)."""
    CHANNEL_ROWS: ClassVar[KdaShard]
    """The leading dimension is ``heads * head_dim``; each rank keeps its channel range
    (column-parallel: ``q/k/v_proj``, ``q/k/v_conv1d``, ``f_b_proj``, ``g_b_proj``, ``g_proj``,
    ``dt_bias``)."""
    CHANNEL_COLS: ClassVar[KdaShard]
    """The trailing (input) dimension is ``heads * head_dim``; each rank keeps every row's
    channel range, and its output is a partial sum to all-reduce (row-parallel: ``o_proj``)."""
    @property
    def name(self) -> str:
        """The member's name, e.g. ``"CHANNEL_COLS"``."""
    def __int__(self) -> int: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class KdaTensorPlan:
    """One tensor's placement for one rank, in a flat ``[rows, row_elems]`` view of the on-disk
    tensor (``plan["o_proj"]``, ``plan.tensors``).

    Counts are elements unless the name says bytes. For CHANNEL_COLS the sharded axis is
    ``row_elems`` (columns); for the row kinds it is ``rows``.
    """

    @property
    def name(self) -> str:
        """Plan name, e.g. ``"q_proj"``: the checkpoint name without the layer prefix
        and ``.weight``."""
    @property
    def kind(self) -> KdaShard:
        """How the tensor is split: a :class:`KdaShard`."""
    @property
    def dtype(self) -> str:
        """Safetensors dtype name, e.g. ``"BF16"``."""
    @property
    def elem_bytes(self) -> int:
        """Bytes per element."""
    @property
    def full_rows(self) -> int:
        """Rows of the full tensor viewed as ``[rows, row_elems]``."""
    @property
    def full_row_elems(self) -> int:
        """Elements per row of the full tensor."""
    @property
    def local_rows(self) -> int:
        """Rows this rank keeps."""
    @property
    def local_row_elems(self) -> int:
        """Elements per row this rank keeps (fewer than ``full_row_elems`` only for
        CHANNEL_COLS)."""
    @property
    def src_row_offset(self) -> int:
        """First row of this rank's slice (0 for REPLICATED and CHANNEL_COLS)."""
    @property
    def src_col_offset(self) -> int:
        """First element of this rank's column slice in every row (CHANNEL_COLS only,
        else 0)."""
    @property
    def local_bytes(self) -> int:
        """Bytes of this rank's part."""
    @property
    def full_bytes(self) -> int:
        """Bytes of the full tensor (a byte count, not the bytes)."""
    @property
    def disk_shape(self) -> tuple[int, ...]:
        """The full shape as Kimi-Linear stores it, e.g. ``(1, 1, H, 1)`` for ``A_log``."""
    @property
    def byte_range(self) -> tuple[int, int] | None:
        """``(start, stop)`` byte range of this rank's part in the full tensor, or None
        for CHANNEL_COLS (a strided gather, not one range)."""
    @property
    def block(self) -> tuple[int, int] | None:
        """``(rows, cols)`` block edge in elements when the weight is block-quantized
        (FP8), else None."""
    @property
    def scale(self) -> KdaTensorPlan | None:
        """The plan of a block-quantized weight's F32 scale grid, else None: same kind
        as the weight, rows and columns counted in blocks, ``src_row_offset`` /
        ``src_col_offset`` the first block this rank keeps (the blocks covering its
        range), ``disk_shape`` ``(ob, 1, ib, 1)`` (ModelOpt) or ``(ob, ib)``."""
    def sharded_axis(self, disk_shape: Sequence[int]) -> int | None:
        """The on-disk axis sharded in a tensor stored with shape ``disk_shape`` (None when
        replicated): for the row kinds the first axis of extent ``full_rows`` after only unit
        axes (``(1, 1, H, 1)`` -> 2, ``(H,)`` -> 0, ``(C, 1, K)`` -> 0), for CHANNEL_COLS the
        last.

        Raises:
            ShapeMismatchError: ``disk_shape`` does not hold exactly this tensor.
        """
    def local_shape(self, disk_shape: Sequence[int]) -> tuple[int, ...]:
        """This rank's shape of a tensor stored as ``disk_shape``: the same number of
        dimensions, with the sharded axis reduced, e.g. ``(8192, 1, 4)`` -> ``(4096, 1, 4)``.

        Raises:
            ShapeMismatchError: ``disk_shape`` does not hold exactly this tensor.
        """
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

@disjoint_base
class MlaTpPlan:
    """The per-rank shard plan for one MLA layer (documented on ``kda_tp.rank.MlaTpPlan``)."""

    def __new__(
        cls,
        tp_rank: int,
        tp_size: int,
        hidden: int,
        heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        *,
        q_lora_rank: int | None = None,
        output_gate: bool = False,
        indexer: tuple[int, int, int] | None = None,
        dtypes: dict[str, str] | None = None,
        quant_block: tuple[int, int] | None = None,
        quantized: Sequence[str] | None = None,
        scale_layout: str = "grid",
    ) -> Self: ...
    @property
    def tp_rank(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def local_heads(self) -> int: ...
    @property
    def hidden(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def q_lora_rank(self) -> int | None: ...
    @property
    def kv_lora_rank(self) -> int: ...
    @property
    def qk_nope_head_dim(self) -> int: ...
    @property
    def qk_rope_head_dim(self) -> int: ...
    @property
    def v_head_dim(self) -> int: ...
    @property
    def output_gate(self) -> bool: ...
    @property
    def indexer(self) -> tuple[int, int, int] | None: ...
    @property
    def tensors(self) -> list[KdaTensorPlan]: ...
    @property
    def local_bytes(self) -> int: ...
    @property
    def full_bytes(self) -> int: ...
    def names(self) -> list[str]: ...
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

def digest(data: npt.NDArray[np.uint8]) -> bytes:
    """The 16-byte exact digest of a C-contiguous 1-D uint8 array's bytes (XXH3-128 over 1 MiB
    chunks hashed in parallel, combined in order), the GIL released."""

def digest_if_equal(data: npt.NDArray[np.uint8], expected: npt.NDArray[np.uint8]) -> bytes | None:
    """``data``'s digest when ``data`` and ``expected`` hold the same bytes (one pass over
    both); None when they differ anywhere."""

@final
class TensorBytes:
    """The raw bytes of one tensor, viewed by numpy through ``__array_interface__``."""

    @property
    def __array_interface__(self) -> dict[str, Any]: ...
    def __len__(self) -> int: ...

@final
class WritableBytes:
    """One tensor's bytes for a receiver that may write them (a range of the file's
    copy-on-write mapping, or a copy), viewed by numpy through ``__array_interface__``."""

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
    def read_writable(
        self, name: str, start: int = 0, stop: int | None = None
    ) -> WritableBytes: ...
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
