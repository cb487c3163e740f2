"""One flow for every engine: check a model's first load, then follow its updates
(:func:`on_load`), with what one engine adapter (:class:`Engine`) says of the model.

An engine adapter (``kda_tp.guard.vllm``, ``kda_tp.guard.sglang``) knows its engine's facts:
the rank and world size of the group the KDA heads are split over, the pipeline stage's layers,
whether the model is a speculative draft, which checkpoint a load is checked against, how it
holds its parameters after a post-load repack and how to read them back, the copies it derives
from them, its model dtype and its label in the lines. :func:`on_load` reads the mode once,
walks ``named_parameters()`` once, reads the rank once, runs the first-load check
(:func:`kda_tp.guard.check`) and builds the rank's update target from the plan the check
built: a fix here lands for every engine, and a third engine is one adapter.

This module imports no engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from ..errors import GuardError, KdaTpError
from ._first_load import GuardResult, check
from ._live import Follower, follow, followed
from ._modes import LoadSource, cannot_check, mode, update_checkpoint, warn_once
from ._names import looks_kda
from ._record import RECORD
from ._target import Reader

__all__ = ["Engine", "follow_model", "on_load"]


class Engine(Protocol):
    """What the guard needs to know of one engine, for one model on one rank (an adapter
    built per model: ``kda_tp.guard.vllm``'s, ``kda_tp.guard.sglang``'s).

    Attributes:
        name: the engine's name in the update lines (``"vllm"``, ``"sglang"``).
        reader: how the engine holds its parameters after loading (``Reader``: the
            layouts' view of a parameter, and its post-load repack read back).
    """

    name: str
    reader: Reader

    def label(self) -> str:
        """This process in the lines (``"vllm"``, ``"sglang attn_dp rank 1"``)."""

    def is_draft(self) -> bool:
        """Whether the model is a speculative draft's (EAGLE, MTP): not checked."""

    def rank_size(self) -> tuple[int, int]:
        """The rank and world size of the group the engine splits the KDA heads over."""

    def stage_layers(self, names: Iterable[str]) -> list[int] | None:
        """The KDA layers a pipeline stage holds (``kda_tp.guard._names.stage_layers``); None
        without pipeline parallelism (every KDA layer)."""

    def load_source(self, where: str, given: str | None) -> LoadSource:
        """What the load is checked against (``kda_tp.guard.load_checkpoint`` with the
        engine's model path, load format, revision and download directory)."""

    def held(self, model: Any, params: Mapping[str, Any]
             ) -> tuple[dict[str, Any], dict[str, str]]:
        """``params`` with each parameter the engine repacked after loading read back, and
        each repacked one's ``kda_tp.guard._repacked.GEMM`` or why it cannot be read back."""

    def derived(self, model: Any) -> dict[str, Any]:
        """The engine's derived copies of KDA parameters, by full name."""

    def model_dtype(self) -> str | None:
        """The engine's model dtype as a safetensors name (None: its default)."""


def on_load(engine: Engine, model: Any, *, where: str, kind: str = "first load",
            given: str | None = None, guard_mode: str | None = None, record: bool = True,
            follows: bool = True) -> tuple[GuardResult | None, Follower | None]:
    """Check ``model``'s load on this rank, then follow its updates.

    Args:
        engine: the engine adapter.
        model: the loaded ``torch.nn.Module``.
        where: the label of the check's lines (``"vllm DefaultModelLoader"``, ``"sglang"``).
        kind: the record's kind of check (``"first load"``, ``"reload_weights"``...).
        given: the path the weights were just read from (a reload from disk): checked
            against it whatever ``KDA_TP_GUARD_CHECKPOINT`` says.
        guard_mode: as for :func:`kda_tp.guard.check` (None: ``KDA_TP_GUARD``'s, read here
            once).
        record: count the verdict in the process's record (not for a live audit).
        follows: follow the model's later updates (``follow_model``).

    Returns:
        ``(result, follower)``: the check's result (None when nothing was checked: mode
        ``off``, a draft, no KDA name, a dummy or ``sharded_state`` load, no local checkpoint)
        and the model's follower (None when its updates are not followed).

    Raises:
        GuardError: as :func:`kda_tp.guard.check` (mode ``fail``); also a
            ``KDA_TP_GUARD_CHECKPOINT`` that is not there, and a checkpoint whose config gives
            no plan for the model's updates.
    """
    chosen = guard_mode or mode()
    if chosen == "off" and not follows:
        return None, None
    # mode off: nothing is checked now, but the model is followed all the same (every later
    # call reads the mode again: off at the first load and fail later checks the later refits)
    params = {n: engine.reader.described(n, p) for n, p in model.named_parameters()}
    if not looks_kda(params) or engine.is_draft():  # check() warns for one without A_log
        return None, None
    rank, size = engine.rank_size()
    layers = engine.stage_layers(params)
    found = engine.load_source(f"{where}: tp rank {rank}/{size}", given)
    result = None
    if found.why:
        if chosen != "off":
            warn_once(found.why)
    elif chosen != "off" and found.check_load and found.checkpoint:  # not a dummy load, nor a variable not there
        values, repacked = engine.held(model, params)
        try:
            result = check(values, found.checkpoint, tp_rank=rank, tp_size=size,
                           derived=engine.derived(model), where=where, layers=layers,
                           guard_mode=chosen, repacked=repacked,
                           model_dtype=engine.model_dtype())
        except GuardError as error:
            if error.result is not None and record:  # a FAIL raised: counted too
                RECORD.ran(kind, error.result.line())
            raise
        if result is not None and record:
            RECORD.ran(kind, result.line())
    if not follows:
        return result, None
    return result, follow_model(engine, model, found, result, (rank, size), layers, known=True)


def follow_model(engine: Engine, model: Any, found: LoadSource | None = None,
                 result: GuardResult | None = None, ranks: tuple[int, int] | None = None,
                 layers: Iterable[int] | None = None, *, known: bool = False
                 ) -> Follower | None:
    """Follow every later update of ``model`` (:func:`kda_tp.guard.follow`): from the plan
    the first load's check built (``result``), else from the load's checkpoint. Idempotent; a
    draft model, a model without KDA names or without ``load_weights`` is not followed; no
    local checkpoint: one warning, not followed.

    Args:
        engine: the engine adapter.
        model: the loaded ``torch.nn.Module``.
        found: what the load was checked against (a dummy load's first update must fill
            every region); None: the engine's load source, now.
        result: the first load's check.
        ranks: the rank and world size, when read already.
        layers: the pipeline stage's KDA layers, when known already.
        known: the model is known to be a KDA model that is no draft (``on_load`` checked).

    Raises:
        GuardError: mode ``fail`` and the checkpoint's config gives no plan for the model's
            KDA parameters.
    """
    how = followed(model)
    if how is not None or not callable(getattr(model, "load_weights", None)):
        return how
    if not known:
        names = [n for n, _ in model.named_parameters()]
        if not looks_kda(names) or engine.is_draft():
            return None
        layers = engine.stage_layers(names)
    rank, size = ranks or engine.rank_size()
    where = f"{engine.label()} update: tp rank {rank}/{size}"
    if found is None:
        found = engine.load_source(where, None)
    plan = result.plan if result is not None else None
    checkpoint = update_checkpoint(found, plan, where)
    if checkpoint is None:
        return None
    try:
        return follow(model, engine.name, None if plan is not None else checkpoint,
                      tp_rank=rank, tp_size=size, layers=layers, dummy=found.dummy, plan=plan,
                      reader=engine.reader,
                      mla_plan=result.mla_plan if result is not None else None)
    except KdaTpError as error:
        cannot_check(f"kda_tp guard: {where}: the updates of this model cannot be checked "
                     f"against {found.checkpoint}: {error}")
        return None
