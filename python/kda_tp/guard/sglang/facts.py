"""What the SGLang plugin (:mod:`kda_tp.guard.sglang`) reads from SGLang 0.5.23: the ranks of
its attention tensor-parallel group, the DP-attention and pipeline ranks, the checkpoint a
model runner's load is checked against; gathered for the guard's one flow as SGLang's adapter
(:class:`SglangEngine`).

This module imports SGLang only inside its functions (they run in an SGLang process).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from ...engines.derived import derived_copies
from ...engines.dtype import model_dtype_name
from .._derived import mla_copies
from .._modes import LoadSource, load_checkpoint
from .._names import stage_layers
from .._target import Reader, Spelling, mapper_spelling

__all__ = ["SglangEngine", "checkpoint_of", "label", "parallel", "parallel_int", "rank_and_size"]


#: The module of verl's SGLang delta loader, whose ``_masked_copy()`` NaN-sentinel copy an
#: update's reference follows (``_SglangReader.masked_copy``).
VERL_DELTA_LOADER = "verl.workers.rollout.sglang_rollout.delta_loader"


class _SglangReader:
    """How SGLang holds its parameters: as loaded (no post-load repack kda_tp knows of), its
    names mapped by the model class's ``hf_to_sglang_mapper``."""

    def described(self, name: str, param: Any) -> Any:
        return param

    def read_back(self, module: Any, param: Any) -> tuple[Any, str | None]:
        return param, None

    def masked_copy(self, copy: Any) -> bool:
        """Whether ``copy`` (what ``torch.Tensor.copy_`` is now) is the NaN-sentinel copy a
        sparse patch into SGLang is loaded with: SGLang 0.5.23 has none of its own, and verl's
        SGLang delta loader (``apply_delta`` in ``verl/workers/rollout/sglang_rollout/
        delta_loader.py``, verl 0.9.1) loads its NaN-marked patches under its ``_masked_copy()``
        context, whose ``masked_copy_`` is known by its code object (``VERL_DELTA_LOADER``
        must be imported, as it is in the process that applies the patch). Any other function,
        one that merely wraps it included, is not."""
        loader = sys.modules.get(VERL_DELTA_LOADER)
        context = getattr(loader, "_masked_copy", None)
        context = getattr(context, "__wrapped__", context)  # under contextlib.contextmanager
        code = getattr(copy, "__code__", None)
        consts = getattr(getattr(context, "__code__", None), "co_consts", ())
        return code is not None and any(code is c for c in consts)

    def spelling(self, model: Any) -> Spelling | None:
        """The model class's ``hf_to_sglang_mapper`` (K3's ``load_weights`` applies it to every
        fed name: ``language_model.layers.`` for ``language_model.model.layers.``)."""
        return mapper_spelling(model, "hf_to_sglang_mapper")


class SglangEngine:
    """SGLang's facts about one model runner's model (:class:`kda_tp.guard.Engine`): SGLang
    holds its KDA parameters as loaded (no post-load repack kda_tp knows of).

    Args:
        runner: the ``ModelRunner``.
    """

    name = "sglang"
    reader: Reader = _SglangReader()

    def __init__(self, runner: Any):
        self.runner = runner

    def label(self) -> str:
        return label()

    def is_draft(self) -> bool:
        return bool(getattr(self.runner, "is_draft_worker", False))

    def rank_size(self) -> tuple[int, int]:
        return rank_and_size()

    def stage_layers(self, names: Iterable[str]) -> list[int] | None:
        """The pipeline stage's KDA layers (``kda_tp.guard._names.stage_layers``) when SGLang
        runs several stages; None without."""
        size = parallel_int(parallel(), "pp_size")
        return stage_layers(names) if size > 1 else None

    def load_source(self, where: str, given: str | None) -> LoadSource:
        return _load_source(self.runner, where, given)

    def held(self, model: Any, params: Mapping[str, Any]
             ) -> tuple[dict[str, Any], dict[str, str]]:
        return dict(params), {}

    def derived(self, model: Any) -> dict[str, Any]:
        return {**derived_copies(model), **mla_copies(model)}

    def model_dtype(self) -> str | None:
        return model_dtype_name(getattr(getattr(self.runner, "model_config", None), "dtype",
                                        None))


def parallel() -> Any:
    """SGLang's parallel context (``get_parallel()``) of this process."""
    from sglang.srt.runtime_context import get_parallel

    return get_parallel()


def rank_and_size() -> tuple[int, int]:
    """``(attn_tp_rank, attn_tp_size)`` of this process, from SGLang's ``get_parallel()``:
    the group SGLang's KDA layers shard their heads over (the TP group without DP attention)."""
    context = parallel()
    return int(context.attn_tp_rank), int(context.attn_tp_size)


def label() -> str:
    """``"sglang"``, with the DP-attention and pipeline ranks when there are several."""
    context = parallel()
    label = "sglang"
    for what in ("attn_dp", "pp"):
        try:
            size, rank = getattr(context, f"{what}_size"), getattr(context, f"{what}_rank")
        except (AttributeError, ValueError):  # a context without that group published
            continue
        if isinstance(size, int) and size > 1:
            label += f" {what} rank {rank}"
    return label


def _load_source(runner: Any, where: str, given: str | None = None) -> LoadSource:
    """:func:`kda_tp.guard.load_checkpoint` for a model runner."""
    load_config = getattr(runner, "load_config", None)
    load_format = getattr(load_config, "load_format", "")
    config = runner.model_config
    return load_checkpoint(str(config.model_path), str(getattr(load_format, "value", load_format)),
                           where, given=given, revision=getattr(config, "revision", None),
                           download_dir=getattr(load_config, "download_dir", None))


def checkpoint_of(runner: Any, quiet: bool = False) -> str | None:
    """The local checkpoint a model runner's load is checked against
    (:func:`kda_tp.guard.load_checkpoint`): ``KDA_TP_GUARD_CHECKPOINT`` if set, else
    ``runner.model_config.model_path`` (a Hugging Face repository id: its local snapshot, if
    cached). None for a ``sharded_state`` load without the variable (one warning unless
    ``quiet``); ``""`` for a variable naming a path that is not there, in mode ``warn``
    (warned).

    Raises:
        GuardError: mode ``fail`` and ``KDA_TP_GUARD_CHECKPOINT`` names a path that is not there.
    """
    found = _load_source(runner, "sglang")
    if found.why and not quiet:
        warnings.warn(found.why, RuntimeWarning, stacklevel=2)
    return found.checkpoint


def parallel_int(parallel: Any, name: str) -> int:
    """``parallel.<name>`` as an int (0 when SGLang's context does not publish it)."""
    try:
        value = getattr(parallel, name)
    except Exception:  # noqa: BLE001 - a context without that group published (its own error)
        return 0
    return value if isinstance(value, int) else 0
