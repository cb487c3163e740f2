"""kda_tp: split the weights of KDA (Kimi Delta Attention) layers across tensor-parallel ranks.

The shard plan and the slicers are a Rust core; this package adds checkpoint sources, the
adapter that presents one rank's shard, serving engines' fused layouts (``kda_tp.engines``) and
the audit of an engine's loaded weights (:func:`audit`), a pure-Python oracle (``kda_tp.oracle``), a numpy
reference forward (``kda_tp.reference``) and the ``kda-tp`` command line.
"""

from typing import TYPE_CHECKING, Any

from . import errors
from ._native import __version__

# `audit` is imported here, not on first use like check_tp_equivalence: the function has the
# name of its module, and importing the module kda_tp.audit (the CLI does) would otherwise
# leave `kda_tp.audit` bound to the module. It adds only its own small body: its imports
# (numpy, the plan, the adapter, the engine tables) are loaded by `import kda_tp` anyway.
from .audit import AuditReport, audit
from .errors import (
    BufferLayoutError,
    CheckpointError,
    DtypeMismatchError,
    EngineLayoutError,
    KdaTpError,
    MissingDependencyError,
    OutputError,
    PlanError,
    ShapeMismatchError,
)
from .plan import KdaShard, KdaTensorPlan, KdaTpPlan
from .quant import dequantize
from .source import KdaShardedSource, SafetensorsSource, Tensor, shard_bytes

if TYPE_CHECKING:  # imported on first use (below), seen here by type checkers and the API docs
    from .equivalence import check_tp_equivalence

__all__ = [
    "__version__",
    "errors",
    "KdaTpError",
    "PlanError",
    "ShapeMismatchError",
    "DtypeMismatchError",
    "BufferLayoutError",
    "CheckpointError",
    "OutputError",
    "MissingDependencyError",
    "EngineLayoutError",
    "KdaShard",
    "KdaTensorPlan",
    "KdaTpPlan",
    "Tensor",
    "SafetensorsSource",
    "KdaShardedSource",
    "shard_bytes",
    "dequantize",
    "check_tp_equivalence",
    "audit",
    "AuditReport",
]


def __getattr__(name: str) -> Any:
    # The numeric check pulls in the reference forward and the oracle; import it on first use
    # so that `import kda_tp` (and every `kda-tp` command) starts faster.
    if name == "check_tp_equivalence":
        from .equivalence import check_tp_equivalence  # noqa: PLC0415

        return check_tp_equivalence
    raise AttributeError(f"module 'kda_tp' has no attribute {name!r}")
