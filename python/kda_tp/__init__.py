"""kda_tp: split the weights of KDA (Kimi Delta Attention) layers across tensor-parallel ranks.

The shard plan and the slicers are a Rust core; this package adds checkpoint sources, one
description of a checkpoint (:func:`describe`), the adapter that presents one rank's shard
(:func:`open_rank` opens it in one call), serving engines' fused layouts (``kda_tp.engines``), the
audit of an engine's loaded weights (:func:`audit`) and what an engine must hold, as a dump or as
vLLM's weight digests (:func:`write_engine_dump`, :func:`engine_digests`), a pure-Python oracle
(``kda_tp.oracle``), a numpy reference forward (``kda_tp.reference``) and the ``kda-tp`` command
line.

``import kda_tp`` imports no other module: each public name below is imported from its module on
first use (numpy and the Rust core with it), so that the package and the ``kda-tp`` command
start fast and a Ctrl-C during those imports can be reported cleanly (``kda_tp.__main__``).
"""

from importlib import import_module

# Imported on first use (__getattr__ below), seen here by type checkers and the API docs.
# typing.TYPE_CHECKING without importing typing (type checkers read any TYPE_CHECKING alike).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from . import errors
    from ._native import __version__
    from .audit.auditor import AuditReport, audit
    from .audit.dump import engine_digests, write_engine_dump
    from .audit.digests import expected_digests
    from .reference.equivalence import check_tp_equivalence
    from .errors import (
        BufferLayoutError,
        CheckpointError,
        DtypeMismatchError,
        EngineLayoutError,
        GuardError,
        KdaTpError,
        MissingDependencyError,
        OutputError,
        PlanError,
        ShapeMismatchError,
        TensorNotFoundError,
        UsageError,
    )
    from .checkpoint.description import CheckpointDescription, describe
    from .rank.plan import KdaShard, KdaTensorPlan, KdaTpPlan
    from .model.quant import dequantize
    from .rank.view import KdaShardedSource, SafetensorsSource, Tensor, open_rank, shard_bytes

__all__ = [
    "__version__",
    "errors",
    "KdaTpError",
    "PlanError",
    "ShapeMismatchError",
    "DtypeMismatchError",
    "BufferLayoutError",
    "CheckpointError",
    "TensorNotFoundError",
    "OutputError",
    "MissingDependencyError",
    "EngineLayoutError",
    "GuardError",
    "UsageError",
    "KdaShard",
    "KdaTensorPlan",
    "KdaTpPlan",
    "Tensor",
    "SafetensorsSource",
    "KdaShardedSource",
    "open_rank",
    "describe",
    "CheckpointDescription",
    "shard_bytes",
    "dequantize",
    "check_tp_equivalence",
    "audit",
    "AuditReport",
    "write_engine_dump",
    "engine_digests",
    "expected_digests",
]

#: The module each public name is imported from on first use.
_LAZY = {
    "__version__": "_native",
    "errors": "errors",
    "KdaTpError": "errors",
    "PlanError": "errors",
    "ShapeMismatchError": "errors",
    "DtypeMismatchError": "errors",
    "BufferLayoutError": "errors",
    "CheckpointError": "errors",
    "TensorNotFoundError": "errors",
    "OutputError": "errors",
    "MissingDependencyError": "errors",
    "EngineLayoutError": "errors",
    "GuardError": "errors",
    "UsageError": "errors",
    "KdaShard": "plan",
    "KdaTensorPlan": "plan",
    "KdaTpPlan": "plan",
    "Tensor": "source",
    "SafetensorsSource": "source",
    "KdaShardedSource": "source",
    "open_rank": "source",
    "describe": "description",
    "CheckpointDescription": "description",
    "shard_bytes": "source",
    "dequantize": "quant",
    "check_tp_equivalence": "equivalence",
    "audit": "engine_audit",
    "AuditReport": "engine_audit",
    "write_engine_dump": "engine_dump",
    "engine_digests": "engine_dump",
    "expected_digests": "expected",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kda_tp' has no attribute {name!r}")
    found = import_module(f"{__name__}.{module}")
    value = getattr(found, name, found)  # `errors` is the module itself
    globals()[name] = value  # later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
