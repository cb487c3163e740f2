"""kda_tp: split the weights of KDA (Kimi Delta Attention) layers across tensor-parallel ranks.

The face of the package is what a loader needs, as safetensors' ``safe_open`` is::

    with kda_tp.open_rank("Kimi-K3", tp_rank=r, tp_size=8) as view:
        for name in view.keys():
            view.read_into(name, params[name])   # or view[name]

:func:`open_rank` (one rank's view, :class:`KdaShardedSource`, with its :class:`KdaTpPlan`),
:func:`describe` (a checkpoint read once), the plan's classes, the safetensors reader and its
:class:`Tensor` records, :func:`shard_bytes` (a rank's bytes of a full tensor), the errors and
``__version__``. The tools live behind their folders' faces: ``kda_tp.shard`` (rank
checkpoints), ``kda_tp.audit`` (what an engine loaded, dumps, digests), ``kda_tp.guard`` (the
engine plugins' checks), ``kda_tp.engines`` (engines' fused layouts), ``kda_tp.reference`` (the
numeric proof), ``kda_tp.torch``, ``kda_tp.oracle``, ``kda_tp.synth``, ``kda_tp.model``,
``kda_tp.checkpoint``, ``kda_tp.rank``, ``kda_tp.output``; ``kda_tp.cli`` is the ``kda-tp``
command line. ARCHITECTURE.md maps them.

``import kda_tp`` imports no other module: each name below (and each folder) is imported on
first use (numpy and the Rust core with the first), so that the package and the ``kda-tp``
command start fast and a Ctrl-C during those imports can be reported cleanly
(``kda_tp.__main__``).
"""

from importlib import import_module

# Imported on first use (__getattr__ below), seen here by type checkers and the API docs.
# typing.TYPE_CHECKING without importing typing (type checkers read any TYPE_CHECKING alike).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from . import (
        audit as audit,
        checkpoint as checkpoint,
        cli as cli,
        engines as engines,
        errors,
        guard as guard,
        model as model,
        oracle as oracle,
        output as output,
        rank as rank,
        reference as reference,
        shard as shard,
        synth as synth,
        torch as torch,
    )
    from ._native import __version__
    from .checkpoint.description import CheckpointDescription, describe
    from .checkpoint.reader import SafetensorsSource, Tensor, shard_bytes
    from .errors import *  # noqa: F403 - the errors, as errors.__all__ lists them
    from .rank.plan import KdaShard, KdaTensorPlan, KdaTpPlan
    from .rank.view import KdaShardedSource, open_rank

__all__ = [
    "__version__",
    "open_rank",
    "KdaShardedSource",
    "describe",
    "CheckpointDescription",
    "KdaTpPlan",
    "KdaTensorPlan",
    "KdaShard",
    "SafetensorsSource",
    "Tensor",
    "shard_bytes",
    "errors",
]

#: The module each public name is imported from on first use.
_LAZY = {
    "__version__": "_native",
    "open_rank": "rank.view",
    "KdaShardedSource": "rank.view",
    "describe": "checkpoint.description",
    "CheckpointDescription": "checkpoint.description",
    "KdaTpPlan": "rank.plan",
    "KdaTensorPlan": "rank.plan",
    "KdaShard": "rank.plan",
    "SafetensorsSource": "checkpoint.reader",
    "Tensor": "checkpoint.reader",
    "shard_bytes": "checkpoint.reader",
}

#: The folders (and modules) importable as attributes of the face: ``kda_tp.audit.audit(...)``
#: after ``import kda_tp``.
_FOLDERS = frozenset({"audit", "checkpoint", "cli", "engines", "errors", "guard", "model",
                      "oracle", "output", "rank", "reference", "shard", "synth", "torch"})


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None and name not in _FOLDERS:
        # The errors: every name of `kda_tp.errors.__all__` (the list written once, there).
        errors_module = import_module(f"{__name__}.errors")
        if name not in errors_module.__all__:
            raise AttributeError(f"module 'kda_tp' has no attribute {name!r}")
        module = "errors"
    elif module is None:
        module = name
    found = import_module(f"{__name__}.{module}")
    value = found if module == name else getattr(found, name)  # `errors`: the module itself
    globals()[name] = value  # later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *import_module(f"{__name__}.errors").__all__})
