"""The exception hierarchy of kda_tp.

Every error the package raises on purpose derives from :class:`KdaTpError`, so a loader can catch
the whole family with one ``except``. Errors caused by a bad value the caller passed (a geometry,
a buffer, a tensor) also derive from ``ValueError``. Messages name the tensor (or file) and
give the expected and the actual value.

The Rust core raises these same classes (it imports them from this module), so there is one
definition of each. An error from the Rust core also keeps the fields of the Rust error as
attributes (the allowed TP sizes of a refused ``tp_size``, the tensor, the expected and actual
size or shape), so code reacts to them without parsing the message; an attribute a refusal does
not have is None, as it is on the same class raised from Python. :class:`ShardInterrupted` (Ctrl-C during ``shard_checkpoint``) is a
``KeyboardInterrupt``, not an error; it lives here so that the command line can catch it without
importing the writer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

__all__ = [
    "KdaTpError",
    "PlanError",
    "ShapeMismatchError",
    "DtypeMismatchError",
    "BufferLayoutError",
    "CheckpointError",
    "TensorNotFoundError",
    "OutputError",
    "OpenFilesLimitError",
    "MissingDependencyError",
    "EngineLayoutError",
    "GuardError",
    "GuardModeError",
    "GuardWarning",
    "UsageError",
    "ShardInterrupted",
]


class KdaTpError(Exception):
    """Base class of every error raised by kda_tp."""


class PlanError(KdaTpError, ValueError):
    """A refused tensor-parallel geometry.

    Raised by ``KdaTpPlan`` for ``tp_rank >= tp_size``, a zero size, a head count not divisible
    by ``tp_size``, a local q|k width ``2 * local_heads * head_dim`` that is not a multiple of
    ``qk_multiple`` (256 by default: the fused conv + L2-norm kernel handles two heads per
    256-thread block), an unknown tensor or dtype name, or sizes whose byte counts overflow.

    Example message: ``KDA TP requires heads (6) divisible by tp_size (4)``.

    Attributes (set by the Rust plan, ``rust/error.rs``; None where the refusal has no such
    field, and on a ``PlanError`` raised from Python):
        field: the argument refused: a size that is 0 (``"hidden"``, ``"tp_size"``, ...) or
            not a non-negative 64-bit integer, ``"a_log_len"`` (shorter than the heads),
            ``"block"`` (an edge of ``quant_block`` that is 0 or over 65536),
            ``"quant_block"`` (not a pair), ``"quantized"`` (without ``quant_block``) or
            ``"scale_layout"``.
        tp_rank: the refused rank (``tp_rank >= tp_size``, with ``tp_size``).
        tp_size: the refused world size (a rank out of range, heads not divisible by it, or
            its local q|k width breaking the ``qk_multiple`` rule).
        heads, head_dim, qk_multiple: the geometry a ``tp_size`` was refused for (``heads``
            also for a short ``a_log_len``).
        allowed_tp_sizes: the world sizes this geometry passes with this ``qk_multiple``,
            ascending (tuple of int; ``()`` when none does), for a refused ``tp_size``; None
            also above 2**20 heads (not listed).
        head_divisors: the divisors of ``heads``, ascending: the world sizes that pass with
            ``qk_multiple=1`` (the rule off); None when ``allowed_tp_sizes`` is.
        tensor: the plan name refused (unknown, not quantizable, an unsupported dtype, a byte
            size that overflows, block scales that cannot follow a rank's range).
        dtype: the refused dtype name of ``tensor``, e.g. ``"I32"``.
    """

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        heads: int | None = None,
        head_dim: int | None = None,
        qk_multiple: int | None = None,
        allowed_tp_sizes: tuple[int, ...] | None = None,
        head_divisors: tuple[int, ...] | None = None,
        tensor: str | None = None,
        dtype: str | None = None,
    ):
        super().__init__(message)
        self.field = field
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.heads = heads
        self.head_dim = head_dim
        self.qk_multiple = qk_multiple
        self.allowed_tp_sizes = allowed_tp_sizes
        self.head_divisors = head_divisors
        self.tensor = tensor
        self.dtype = dtype


class ShapeMismatchError(KdaTpError, ValueError):
    """A buffer or tensor whose size or shape disagrees with the plan.

    Example message: ``q_proj: buffer is 2046 bytes, the plan's full shape [256, 4] x 2 bytes
    implies 2048 bytes``.

    Attributes (set by the Rust core; None where the refusal has no such field, and on a
    ``ShapeMismatchError`` raised from Python):
        tensor: the plan name, e.g. ``"q_proj"`` (``"q_proj (local output)"`` for an output
            buffer of the wrong size).
        expected_bytes, actual_bytes: the buffer's required and actual length in bytes.
        expected_shape, actual_shape: for an on-disk shape that cannot hold the tensor, the
            shape the plan expects (Kimi-Linear's, e.g. ``(1, 1, 32, 1)``; any shape with the
            same elements in the same order is accepted) and the shape found (tuples of int).
    """

    def __init__(
        self,
        message: str,
        *,
        tensor: str | None = None,
        expected_bytes: int | None = None,
        actual_bytes: int | None = None,
        expected_shape: tuple[int, ...] | None = None,
        actual_shape: tuple[int, ...] | None = None,
    ):
        super().__init__(message)
        self.tensor = tensor
        self.expected_bytes = expected_bytes
        self.actual_bytes = actual_bytes
        self.expected_shape = expected_shape
        self.actual_shape = actual_shape


class DtypeMismatchError(KdaTpError, ValueError):
    """A KDA tensor whose dtype is not the one the plan expects.

    Example message: ``model.layers.0.self_attn.A_log: dtype I32, expected F32``.
    """


class BufferLayoutError(KdaTpError, ValueError):
    """An output buffer that cannot be written in place: read-only, not C-contiguous, holding
    Python objects, or not a buffer at all.

    Raised by ``KdaShardedSource.read_into`` before anything is read or written, and by the
    Rust slicers (``kda_tp._native``) for an input or output array that is not C-contiguous.

    Example message: ``model.layers.0.self_attn.o_proj.weight: the output buffer is read-only``.
    """


class CheckpointError(KdaTpError):
    """A checkpoint or config that is missing, corrupt or inconsistent.

    Covers unreadable or malformed safetensors files (header, offsets, length), a broken
    ``model.safetensors.index.json``, a missing or invalid ``config.json``, and a KDA layer that
    lacks one of its tensors. Messages name the file and, where there is one, the tensor.

    Attributes (set by the Rust reader; None on a ``CheckpointError`` raised from Python):
        path: the file or directory refused (``pathlib.Path``): the safetensors file, the
            index, or the checkpoint directory.
        tensor: the tensor name asked for and not found, else None.
    """

    def __init__(self, message: str, *, path: Path | None = None, tensor: str | None = None):
        super().__init__(message)
        self.path = path
        self.tensor = tensor


class TensorNotFoundError(CheckpointError, KeyError):
    """A tensor name the checkpoint does not hold, asked for by indexing a rank's view
    (``view[name]``, ``view.get_tensor(name)``), as ``safe_open``'s ``get_tensor`` refuses it.

    Also a ``KeyError``, so ``except KeyError`` works as with a mapping. The message names the
    tensor and the checkpoint.
    """

    def __str__(self) -> str:
        # KeyError's own __str__ shows the repr of its argument (quotes around the message).
        return str(self.args[0]) if self.args else ""


class OutputError(KdaTpError):
    """An output location that cannot be written safely.

    Raised for a non-empty output directory without ``force``, an output directory inside the
    input checkpoint, and OS write failures such as a full disk. Nothing half-written is left
    under a final file name when this is raised.
    """


class OpenFilesLimitError(KdaTpError):
    """Reading needs more files open at once than the process may open (``RLIMIT_NOFILE``).

    Raised instead of the ``Too many open files`` (EMFILE) of the file where the limit was met,
    which blames that file: a checkpoint, or one rank of a ``save_sharded_state`` dump, in
    thousands of files is read with every file open.

    Attributes:
        needed: the files the read holds open at once.
        open_now: the descriptors the process had open already.
        limit: the soft limit (``ulimit -n``); ``hard`` the hard limit it can be raised to.

    Example message: ``/dumps/k3: reading it holds 2000 files open at once, and 12 are open
    already, over this process's limit of 1024 open files (RLIMIT_NOFILE; hard limit 524288);
    raise it in the shell that runs kda-tp, e.g. ulimit -n 4096, and run again``.
    """

    def __init__(self, message: str, needed: int, open_now: int, limit: int, hard: int):
        super().__init__(message)
        self.needed = needed
        self.open_now = open_now
        self.limit = limit
        self.hard = hard


class MissingDependencyError(KdaTpError, ImportError):
    """An optional dependency that a feature needs is not installed.

    Example message: ``kda_tp.torch needs PyTorch (torch >= 2.5), which is not installed:
    pip install 'kda_tp[torch]'``.
    """


class EngineLayoutError(KdaTpError, ValueError):
    """A serving engine's parameter layout (``kda_tp.engines``) that does not fit the request.

    Raised for an unknown layout or parameter name, a layout of another model family than the
    plan (K3's ``g_proj`` vs ``g_a_proj``/``g_b_proj``), block-FP8 weights in a layout without
    scale grids, ``tp_size > 1`` for an engine that keeps KDA replicated, or an output buffer
    of the wrong size for ``kda_tp.engines.build_param``.

    Example message: ``vllm-0.33-k3: no parameter 'in_proj.weight'; its parameters: [...]``.
    """


class GuardError(KdaTpError, RuntimeError):
    """The guard (``kda_tp.guard``) found a rank's loaded KDA weights wrong: start-up stops.

    Raised by ``kda_tp.guard.check`` in mode ``fail`` (the default of ``KDA_TP_GUARD``) when a
    KDA parameter a serving engine loaded differs from the checkpoint's slice for its rank, or
    when the loaded parameters cannot be audited at all (no engine layout fits their names).
    The message is the audit's diagnosis: layer, parameter, part, and what the part holds
    instead (e.g. another rank's slice).

    Attributes:
        report: the ``kda_tp.audit.AuditReport`` of the rank, or None when the audit
            could not run (the message says why).
        result: the rank's ``kda_tp.guard.GuardResult`` (its parameter count, bytes and
            seconds) when a check ran and failed; None otherwise.

    Example message: ``kda_tp guard: vllm worker 1: tp rank 1/4: KDA weights differ from
    /models/k3 ... rank 1 model.layers.0.self_attn.o_proj.weight: values differ in o_proj; ...``.
    """

    def __init__(self, message: str, report: Any = None, result: Any = None):
        super().__init__(message)
        self.report = report
        self.result = result


class GuardModeError(GuardError, ValueError):
    """An invalid value of the guard's mode variable ``KDA_TP_GUARD``.

    Example message: ``KDA_TP_GUARD='strict' is not a guard mode; use fail (the default), warn
    or off``.
    """


class GuardWarning(KdaTpError, UserWarning):
    """A failing verdict of the guard in mode ``warn`` (``KDA_TP_GUARD=warn``): the engine goes
    on, and the verdict is issued through Python's ``warnings`` as well as logged at ERROR on
    the logger ``kda_tp.guard`` (a stack that hides the engine's log lines still shows it).

    Raised, not only shown, where warnings are errors (``-W error``, pytest's
    ``filterwarnings = error``): a ``KdaTpError`` then, caught with the family.

    Example message: ``kda_tp guard: vllm load_weights: tp rank 1/2: 9 KDA parameters updated
    (vllm-0.33-kimi-linear), 1179648 bytes, 0.004 s: FAIL (1 wrong) ...``.
    """


class UsageError(KdaTpError, ValueError):
    """An argument or setting outside what the function takes, where no other class applies.

    Raised for a read backend other than ``"mmap"`` or ``"pread"`` (the ``backend`` argument,
    ``$KDA_TP_BACKEND`` or ``kda_tp._native.Checkpoint``'s), and a byte offset of ``SafetensorsSource.read_range`` that is
    negative, ``>= 2**64``, a bool or not an integer. (A bad geometry is a :class:`PlanError`.)

    Example message: ``KDA_TP_BACKEND='bogus': the read backend must be "mmap" or "pread"``.
    """


class ShardInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped :func:`kda_tp.shard.shard_checkpoint`.

    A ``KeyboardInterrupt``, so code that does not expect it still stops. When it is raised the
    writer threads have stopped and this run's partial directories are removed; the ranks in
    ``completed`` were renamed into place before the interrupt and are complete.

    Attributes:
        out_dir: the output directory.
        tp_size: the world size of the run.
        completed: ranks this run wrote completely, sorted.
        remaining: ranks of ``0..tp_size-1`` that ``out_dir`` still lacks, sorted (the
            ``--ranks`` that would finish the job).
    """

    def __init__(
        self, out_dir: Path, tp_size: int, completed: tuple[int, ...], remaining: tuple[int, ...]
    ):
        super().__init__(
            f"interrupted: ranks {list(completed)} of {tp_size} complete in {out_dir}, "
            f"{list(remaining)} missing"
        )
        self.out_dir = out_dir
        self.tp_size = tp_size
        self.completed = completed
        self.remaining = remaining
