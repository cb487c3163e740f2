"""kda_tp: split the weights of KDA (Kimi Delta Attention) layers across tensor-parallel ranks.

The shard plan and the slicers are a Rust core; this package adds checkpoint sources, the
adapter that presents one rank's shard, a pure-Python oracle (``kda_tp.oracle``), a numpy
reference forward (``kda_tp.reference``) and the ``kda-tp`` command line.
"""

from typing import TYPE_CHECKING, Any

from . import errors
from ._native import __version__
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
]


def __getattr__(name: str) -> Any:
    # The numeric check pulls in the reference forward and the oracle; import it on first use
    # so that `import kda_tp` (and every `kda-tp` command) starts faster.
    if name == "check_tp_equivalence":
        from .equivalence import check_tp_equivalence  # noqa: PLC0415

        return check_tp_equivalence
    raise AttributeError(f"module 'kda_tp' has no attribute {name!r}")
