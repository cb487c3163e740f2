"""What each rank of a serving engine must hold for a checkpoint's KDA layers: every KDA
parameter of an engine layout, in order, built one at a time as the engine's own loader leaves it
(:func:`kda_tp.engines.build_param`), a cast to the model dtype that overflows refused; then,
where the hybrid's MLA layers can be planned (``kda_tp.rank.mla.rank_mla_plan``) and the layout
has an MLA table, every MLA parameter (``kda_tp.engines.build.build_mla_param``) and the copies
vLLM derives from ``kv_b_proj`` as parameters (``W_UK_T``, ``W_UV``: in its checksums, never in
a dump). The dump (:mod:`kda_tp.audit.dump`: files) and the digests
(:mod:`kda_tp.audit.digests`: hashes) walk this list.
"""

from __future__ import annotations

import functools
import operator
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..checkpoint.description import describe
from ..checkpoint.names import kda_tensor_name, param_name
from ..checkpoint.reader import SafetensorsSource
from ..engines.build import RankPlan, build_mla_param, build_param
from ..engines.derived import MLA_DERIVED
from ..engines.dtype import config_dtype, engine_model_dtype
from ..engines.layout import EngineLayout, EngineParamPlan, mla_unjudged
from ..engines.registry import get_layout, layouts_for
from ..errors import DtypeMismatchError, EngineLayoutError, PlanError
from ..rank.mla import mla_tensor_name, rank_mla_plan
from ..rank.plan import KdaTpPlan, distinct_ranks
from ..rank.view import KdaShardedSource
from ._diagnosis import cast_overflow

__all__ = ["ExpectedParam", "build_checked", "checked_ranks", "expected_params"]


@dataclass(frozen=True)
class ExpectedParam:
    """One parameter an engine rank must hold: its engine name, plan, and how to build it.

    Attributes:
        name: the parameter's name in the engine's ``state_dict()``.
        plan: its plan (shape, dtype, part regions; :func:`kda_tp.engines.param_plan`).
        build: builds it (:func:`build_checked`): a numpy array of ``plan.shape`` and
            ``plan.dtype`` (a derived copy: of its own shape, in ``plan.dtype``).
        dump_name: the name a ``save_sharded_state`` dump gives it when not ``name``
            (``EngineParam.dump_suffix``: vLLM GLM-5.3's ``mla_attn.o_proj.weight``); None:
            ``name``.
        mla: a parameter of one of the hybrid's MLA layers.
        derived: a copy the engine derives from the MLA layer's ``kv_b_proj`` after loading
            and keeps as a parameter (vLLM's ``W_UK_T`` / ``W_UV``): in ``named_parameters()``
            and vLLM's checksums, not in a dump (vLLM's ``save_sharded_state`` raises on them);
            ``plan`` is then ``kv_b_proj``'s.
    """

    name: str
    plan: EngineParamPlan
    build: Callable[[], np.ndarray]
    dump_name: str | None = None
    mla: bool = False
    derived: bool = False


def expected_params(
    checkpoint: str | os.PathLike[str] | SafetensorsSource,
    engine: str | EngineLayout,
    tp_size: int,
    ranks: Sequence[int] | None,
    model_dtype: str | None,
) -> tuple[EngineLayout, list[tuple[int, list[ExpectedParam]]]]:
    """The layout and, per rank, the KDA parameters it must hold, in order (nothing built yet):
    the list :func:`~kda_tp.audit.write_engine_dump` writes and
    :func:`~kda_tp.audit.engine_digests` hashes.

    Args:
        checkpoint: the checkpoint the engine loads (a directory, a ``.safetensors`` file, or
            an open :class:`~kda_tp.SafetensorsSource`).
        engine: the engine layout or its name.
        tp_size: the engine's tensor-parallel world size.
        ranks: the ranks (None: all).
        model_dtype: the engine's model dtype (None: its default for the checkpoint,
            :func:`kda_tp.engines.engine_model_dtype`).

    Raises:
        PlanError: ``tp_size`` not a positive integer or not a split the heads allow; a rank
            out of range or repeated; an empty rank list.
        EngineLayoutError: an unknown layout, one of another model family than the
            checkpoint's, or one that does not fit the checkpoint.
        CheckpointError: the checkpoint cannot be read or has no config.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise PlanError(f"tp_size must be a positive integer, got {tp_size!r}")
    source = (checkpoint if isinstance(checkpoint, SafetensorsSource)
              else SafetensorsSource(checkpoint))
    description = describe(source)
    layout = get_layout(engine)
    model_dtype = engine_model_dtype(description, layout.engine, model_dtype)
    # Any split the heads allow (no q|k width rule: the engine chose the world size); checked
    # before anything is sized by tp_size.
    plan0 = KdaTpPlan.from_description(description, 0, tp_size, qk_multiple=1)
    family = description.family.name
    if layout.family != family:
        fitting = ", ".join(lay.name for lay in layouts_for(family, plan0)) or "none"
        raise EngineLayoutError(
            f"{layout.name}: this layout is for {layout.family}, but the checkpoint "
            f"{source.path} is {family}; layouts that fit it: {fitting}"
        )
    out = []
    for r in checked_ranks(ranks, tp_size):
        shard = KdaShardedSource(source, plan0 if r == 0 else KdaTpPlan.from_description(
            description, r, tp_size, qk_multiple=1))
        rank_plan = RankPlan.of(shard.plan, layout, model_dtype, shard.prefix, shard.layers,
                                config_dtype(description.config, layout.engine))
        prefix = layout.state_dict_prefix(shard.prefix)
        params = []  # (layer, parameter)
        for layer in shard.layers:
            for suffix, plan in rank_plan.params.items():
                name = param_name(prefix, layer, suffix)
                build = functools.partial(
                    build_checked, shard, layout, layer, plan, name, model_dtype,
                    "pass another --dtype (model_dtype=), the one the engine runs in")
                params.append((layer, ExpectedParam(name, plan, build)))
        mla = rank_mla_plan(description, r, tp_size)[0] if layout.mla else None
        mla = None if mla is None or mla_unjudged(mla) else mla
        if mla is not None:
            params += _mla_params(KdaShardedSource(source, shard.plan, mla=mla), layout, prefix,
                                  model_dtype)
        # In layer order, as the engine's named_parameters() lists them (a stable sort keeps
        # each layer's parameters in the layout's order).
        out.append((r, [p for _, p in sorted(params, key=lambda lp: lp[0])]))
    return layout, out


def _mla_params(shard: KdaShardedSource, layout: EngineLayout, prefix: str,
                model_dtype: str) -> list[tuple[int, ExpectedParam]]:
    """The MLA parameters of ``shard``'s rank (a view slicing its MLA layers), and the copies
    the engine derives from ``kv_b_proj`` as parameters, in layer order, each with its
    layer."""
    mla = shard.mla
    assert mla is not None  # the caller opened the view with the MLA plan
    derived = {n: d for n, d in MLA_DERIVED.get(layout.name, {}).items() if not d.attribute}
    params = []
    for layer in shard.mla_layers:
        for p in layout.mla_params_for(mla):
            plan = layout.mla_param_plan(p.suffix, mla, model_dtype)
            name = param_name(prefix, layer, p.suffix)
            build = functools.partial(
                build_checked, shard, layout, layer, plan, name, model_dtype,
                "pass another --dtype (model_dtype=), the one the engine runs in", mla=True)
            params.append((layer, ExpectedParam(
                name, plan, build, p.dump_suffix and param_name(prefix, layer, p.dump_suffix),
                mla=True)))
            if p.suffix == "kv_b_proj.weight":
                params += [(layer, ExpectedParam(param_name(prefix, layer, n), plan,
                                                 functools.partial(_derive, build, d.derive, mla),
                                                 mla=True, derived=True))
                           for n, d in derived.items()]
    return params


def _derive(build: Callable[[], np.ndarray], derive: Callable[..., np.ndarray],
            mla: Any) -> np.ndarray:
    """A copy derived from ``kv_b_proj`` (``build``), in its dtype."""
    return derive(build(), mla)


def checked_ranks(ranks: Sequence[int] | None, tp_size: int) -> list[int]:
    """The engine ranks asked for, sorted (None: all ``tp_size`` of them).

    Raises:
        PlanError: an empty list, a rank that is not an integer in ``0..tp_size-1``, or a rank
            named twice.
    """
    given = list(range(tp_size)) if ranks is None else list(ranks)
    if not given:
        raise PlanError("no ranks to write: --ranks is empty (ranks=[]); pass at least one rank, "
                        "or none for all")
    wanted = []
    for r in given:
        try:  # any integer type (numpy's included), never a bool or a float
            index = None if isinstance(r, bool) else operator.index(r)
        except TypeError:
            index = None
        if index is None or not 0 <= index < tp_size:
            raise PlanError(f"rank {r!r} is out of range for tp_size {tp_size}: valid ranks "
                            f"are 0..{tp_size - 1}; pass ranks of that world size")
        wanted.append(index)
    distinct_ranks(wanted)
    return sorted(wanted)


def build_checked(shard: KdaShardedSource, layout: EngineLayout, layer: int,
                  plan: EngineParamPlan, name: str, model_dtype: str | None,
                  fix: str, *, mla: bool = False) -> np.ndarray:
    """Engine parameter ``plan.suffix`` of KDA layer ``layer`` on ``shard``'s rank, as the
    engine's loader leaves it (``kda_tp.engines.build_param``; with ``mla``, of MLA layer
    ``layer``: ``build_mla_param``, ``shard`` opened with the MLA plan), refused when a cast to
    the model dtype overflows.

    Args:
        plan: the parameter's plan (``kda_tp.engines.param_plan``, for ``model_dtype``).
        name: the parameter's engine name, for the message.
        fix: what the refusal tells the caller to do.

    Raises:
        DtypeMismatchError: a finite value becomes inf in the cast
            (``kda_tp.audit._diagnosis.cast_overflow``): the rank, the parameter and the value.
    """
    build, tensor_name = (build_mla_param, mla_tensor_name) if mla else (build_param,
                                                                        kda_tensor_name)
    with np.errstate(over="ignore"):  # an overflow is refused below
        built: np.ndarray = build(shard, layout, plan.suffix, layer, model_dtype=model_dtype,
                                  plan=plan)
    overflow = cast_overflow(plan, built.reshape(-1), lambda part: shard[
        tensor_name(shard.prefix, layer, part)].array.reshape(-1))
    if overflow is not None:
        raise DtypeMismatchError(f"rank {shard.plan.tp_rank} {name}: {overflow}; {fix}")
    return built
