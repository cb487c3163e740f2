"""What each engine rank must hold, hashed as vLLM's weight checksums: from a checkpoint, or on
the trainer's side of an RL weight update from the tensors it is about to send.

:func:`engine_digests` hashes the parameters an engine's ranks must hold for a checkpoint
(``kda_tp.audit.expected_params``) as vLLM's ``Worker.compute_weight_checksums`` does: the
SHA-256 of each parameter's raw bytes, keyed ``dp0:pp0:pcp0:tp{r}:<name>`` (:data:`DIGEST_KEY`),
to compare with the checksums a running vLLM reports (``POST /weight_checker`` with ``"action":
"checksum"``) with nothing installed in the engine.

:func:`expected_digests` needs no checkpoint on disk and gathers nothing: it takes the full checkpoint-format tensors a trainer hands to the engine
(``model.layers.3.self_attn.q_proj.weight``: the names and layout of the model's checkpoint, as
``load_weights`` and the weight-transfer APIs take them) and the model's config, and returns
the SHA-256 of every KDA parameter of every engine rank, keyed as ``kda-tp digests`` (and
vLLM's ``compute_weight_checksums``) keys them. It walks the same list as
:func:`~kda_tp.audit.engine_digests` does for a checkpoint (``kda_tp.engines.engine_params``, each
parameter built by ``kda_tp.engines.build_param``), one KDA layer at a time, as soon as
that layer's tensors have all arrived.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import _native
from ..checkpoint.description import CheckpointDescription
from ..checkpoint.names import checkpoint_suffix, kda_tensor_name, param_location, param_name
from ..checkpoint.reader import SafetensorsSource, Tensor, readonly_bytes
from ..checkpoint.values import as_record
from ..engines.build import engine_params, param_plan
from ..engines.derived import MLA_DERIVED
from ..engines.dtype import config_model_dtype
from ..engines.layout import EngineLayout, EngineParamPlan
from ..engines.registry import LAYOUTS, get_layout
from ..errors import (CheckpointError, DtypeMismatchError, EngineLayoutError, PlanError,
                      ShapeMismatchError, UsageError)
from ..model.config import KdaConfig, load_config
from ..model.dtypes import FP8_DTYPES
from ..model.mla import MlaConfig, parse_mla_config
from ..rank.mla import MlaTpPlan, mla_tensor_name
from ..rank.plan import KdaTpPlan
from ..rank.view import KdaShardedSource
from ._diagnosis import cast_nan, cast_overflow
from .expected_params import build_checked, checked_ranks, expected_params

__all__ = ["DIGEST_KEY", "engine_digests", "expected_digests", "param_digest", "vllm_layout"]

#: The last name part of the tensors only a KDA layer holds (as the audit's markers).
_MARKERS = ("A_log", "dt_bias")


def _shown(item: object) -> str:
    """A short description of a fed item that is not a ``(name, tensor)`` pair."""
    text = repr(item)
    return f"{type(item).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


class _LayerTensors:
    """One KDA layer's tensors as they arrived, as the source a :class:`KdaShardedSource`
    wraps (``names``, ``get``, ``info``)."""

    def __init__(self, prefix: str, layer: int) -> None:
        self.prefix, self.layer = prefix, layer
        self.tensors: dict[str, Tensor] = {}

    def names(self) -> list[str]:
        return list(self.tensors)

    def get(self, name: str) -> Tensor | None:
        return self.tensors.get(name)

    def info(self, name: str) -> tuple[str, tuple[int, ...]] | None:
        found = self.tensors.get(name)
        return None if found is None else (found.dtype, found.shape)

    def __repr__(self) -> str:
        return f"the tensors fed for KDA layer {self.layer} ({self.prefix}{self.layer}.self_attn.*)"


#: vLLM 0.33's key of one parameter's checksum (``Worker._weight_checksum_prefix`` + the
#: parameter's name): data-parallel index, pipeline, prefill-context-parallel and
#: tensor-parallel rank. A KDA model served with tensor parallelism alone has ``dp0:pp0:pcp0``.
DIGEST_KEY = "dp0:pp0:pcp0:tp{rank}:{name}"

def engine_digests(
    checkpoint: str | os.PathLike[str] | SafetensorsSource,
    *,
    engine: str | EngineLayout,
    tp_size: int,
    ranks: Sequence[int] | None = None,
    model_dtype: str | None = None,
) -> dict[str, str]:
    """The SHA-256 of every KDA parameter an engine's ranks must hold, keyed as vLLM keys its
    weight checksums.

    vLLM 0.33's ``Worker.compute_weight_checksums`` returns, for every parameter of the model
    (``named_parameters()``; buffers are not included), ``sha256(p.detach().cpu().contiguous()
    .view(-1).view(torch.uint8).numpy()).hexdigest()`` (``vllm/model_executor/model_loader/
    weight_checksum.py``: ``compute_tensor_digests``), keyed ``dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:``
    + the name. This computes the same for the parameters of :func:`write_engine_dump`: the
    hash of the row-major raw bytes, in the parameter's dtype, of what the engine's loader
    leaves in each KDA parameter, keyed with :data:`DIGEST_KEY`; for a hybrid whose MLA layers
    can be planned, every MLA parameter too, under its ``named_parameters()`` name, and the
    ``W_UK_T`` / ``W_UV`` parameters vLLM derives from each ``kv_b_proj`` after loading (the
    copy's row-major bytes, as ``.contiguous()`` gives them). A digest can only match
    where the engine keeps the parameter as loaded: see ``docs/audit.md`` for the parameters
    vLLM rewrites after loading.

    Args:
        checkpoint: the checkpoint the engine loads (as for :func:`write_engine_dump`).
        engine: a vLLM layout or its name (``"vllm-0.33-k3"``, ``"vllm-0.33-kimi-linear"``,
            ``"vllm-0.33-glm-5.3"``).
        tp_size: the engine's tensor-parallel world size.
        ranks: the ranks (default: all).
        model_dtype: the engine's model dtype, as for :func:`write_engine_dump`.

    Returns:
        ``{key: hex digest}``, ranks in order, then layers, then the layout's parameters.

    Raises:
        EngineLayoutError: a layout of another engine than vLLM (its checksums, where it has
            any, are keyed otherwise), and as :func:`write_engine_dump`.
        PlanError, CheckpointError, DtypeMismatchError: as :func:`write_engine_dump`.
    """
    _, by_rank = expected_params(checkpoint, vllm_layout(engine), tp_size, ranks, model_dtype)
    return {DIGEST_KEY.format(rank=r, name=p.name):
            param_digest(p.build()) if p.derived else _promised_digest(r, p.name, p.plan, p.build())
            for r, params in by_rank for p in params}


def vllm_layout(engine: str | EngineLayout) -> EngineLayout:
    """``engine``'s layout, which must be a vLLM one: digests are vLLM's weight checksums
    (``engine_digests`` and ``kda_tp.audit.expected_digests``).

    Raises:
        EngineLayoutError: an unknown layout, or one of another engine (the message lists the
            vLLM layouts).
    """
    layout = get_layout(engine)
    if layout.engine != "vllm":
        vllm = ", ".join(n for n, lay in LAYOUTS.items() if lay.engine == "vllm")
        raise EngineLayoutError(
            f"{layout.name}: digests are vLLM's weight checksums (compute_weight_checksums); "
            f"{layout.engine} computes none of its own keyed so. Pass a vLLM layout: {vllm}"
        )
    return layout


def _promised_digest(rank: int, name: str, plan: EngineParamPlan, built: np.ndarray) -> str:
    """:func:`param_digest` of a built parameter whose bytes the engine's own are sure to be.

    Raises:
        CheckpointError: a part the engine casts holds a NaN, whose bits after the cast are the
            engine's device's and code path's (``kda_tp.audit._diagnosis.cast_nan``).
    """
    nan = cast_nan(plan, built.reshape(-1))
    if nan is not None:
        raise CheckpointError(f"rank {rank} {name}: {nan}")
    return param_digest(built)


def param_digest(built: np.ndarray) -> str:
    """The SHA-256 (hex) of a parameter's row-major raw bytes, as vLLM's
    ``compute_tensor_digests`` hashes them."""
    data = np.ascontiguousarray(built).reshape(-1).view(np.uint8)
    return hashlib.sha256(data.data).hexdigest()


def expected_digests(
    tensors: Iterable[tuple[str, Any]] | Mapping[str, Any],
    config: Mapping[str, Any] | str | os.PathLike[str],
    *,
    engine: str | EngineLayout,
    tp_size: int,
    ranks: Sequence[int] | None = None,
    model_dtype: str | None = None,
) -> dict[str, str]:
    """The SHA-256 of every KDA parameter each engine rank must hold once ``tensors`` are
    loaded, keyed as ``kda-tp digests`` keys them (``dp0:pp0:pcp0:tp{r}:<engine name>``,
    :data:`~kda_tp.audit.DIGEST_KEY`): the trainer's side of an RL refit, to compare with
    the checksums the engine reports after the update (vLLM: ``POST /weight_checker`` with
    ``"action": "checksum"``, or ``collective_rpc("compute_weight_checksums")``).

    For the same tensors this equals :func:`~kda_tp.audit.engine_digests` on a checkpoint holding
    them (the same parameters, built by ``kda_tp.engines.build_param`` and hashed the same
    way). Nothing is gathered and nothing is written: each KDA layer is hashed as soon as all
    its tensors have arrived, then dropped, so the extra memory is one KDA layer's tensors (a
    host copy of those on a GPU) and one engine parameter. Tensors that are not a KDA layer's
    (embeddings, MLP, full-attention layers, other stacks) are skipped without being read.

    What it takes: every KDA tensor of every KDA layer the config lists, each once; the
    digests are of whole models, never of a partial update. An update that sends only some
    KDA tensors (one layer, or ``q_proj`` alone) is refused, naming what each incomplete layer
    lacks: an engine parameter fuses several checkpoint tensors (``in_proj_qkvgfab``: q, k, v,
    g, f and b) and a layer's parameters share one plan, so the tensors an update leaves
    unchanged must be fed too (the trainer's full state dict holds them). Inside the engine,
    the guard checks a partial update from what it sends (``docs/guard.md``).

    The hybrids' MLA layers (from the config, where it gives their geometry) are hashed too,
    each as soon as the tensors the layout's MLA parameters are made of have all arrived: their
    parameters under their ``named_parameters()`` names and the ``W_UK_T`` / ``W_UV`` vLLM
    derives from ``kv_b_proj``, as :func:`~kda_tp.audit.engine_digests` keys them. An update
    that sends no tensor of the MLA layers gets the KDA digests alone; one that sends some of
    an MLA layer's is refused as an incomplete KDA layer is.

    How it reads ``tensors``: once, in order, in this call. A generator (or any iterator) is
    consumed: pass a fresh one to each call, or a mapping or list to read the same tensors
    again. Each tensor is taken as it arrives (a torch tensor is copied to the host then) and
    kept only until its KDA layer is complete.

    Args:
        tensors: the full tensors in checkpoint format, as ``(name, tensor)`` pairs (any
            iterable, a generator included: read once, see above) or a mapping; each a numpy
            array (BF16 as ``ml_dtypes.bfloat16``), a torch tensor on any device, or a
            :class:`~kda_tp.Tensor`. Every KDA tensor of every KDA layer must be there, once.
        config: the model's config: the ``config.json`` dict, its path, or the checkpoint
            directory holding it (read for the geometry, the KDA layers and the family).
        engine: a vLLM layout or its name (``"vllm-0.33-k3"``, ``"vllm-0.33-kimi-linear"``,
            ``"vllm-0.33-glm-5.3"``; ``kda_tp.engines.LAYOUTS``).
        tp_size: the engine's tensor-parallel world size.
        ranks: the ranks (default: all).
        model_dtype: the engine's model dtype for the parameters it casts to it (``"BF16"``,
            ``"F16"``, ``"F32"``): the engine's ``--dtype``; None: its default for ``config``
            (``kda_tp.engines.config_model_dtype``: the config's ``dtype`` /
            ``torch_dtype``, F32 or none meaning BF16), as for ``engine_digests``.

    Returns:
        ``{key: hex digest}``: ranks in order, then KDA layers, then the layout's parameters.

    Raises:
        EngineLayoutError: a layout of another engine than vLLM, of another model family than
            the config's, or that does not fit the geometry.
        PlanError: ``tp_size`` not a positive integer or not a split the heads allow; a rank
            out of range or repeated; an empty rank list.
        CheckpointError: an invalid config, a config that does not list its KDA layers, a KDA
            layer whose tensors are incomplete (a partial update: the message names what each
            layer lacks), unknown or sent twice, a value that is not a
            tensor; ``A_log``/``dt_bias`` of a layer the config does not list as KDA (under the
            KDA layers' prefix: the config of another model).
        UsageError: ``tensors`` is neither a mapping nor an iterable (None, say), or yields
            something other than ``(name, tensor)`` pairs (a list of names, say); ``config``
            is neither a dict nor a path.
        DtypeMismatchError: a KDA tensor of a dtype the plan does not take (block-FP8 tensors
            are not handled here: use ``engine_digests`` on the checkpoint), or a cast to
            ``model_dtype`` that overflows.
        ShapeMismatchError: a KDA tensor whose shape does not hold the plan's.
    """
    if not isinstance(tensors, Mapping) and not hasattr(tensors, "__iter__"):
        raise UsageError(
            f"tensors: expected a mapping of names to tensors or (name, tensor) pairs, got "
            f"{type(tensors).__name__}; pass the state dict or state_dict.items()"
        )
    if not isinstance(config, (Mapping, str, os.PathLike)):
        raise UsageError(
            f"config: expected the model's config.json (a dict, or its path), got "
            f"{type(config).__name__}"
        )
    layout = vllm_layout(engine)
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise PlanError(f"tp_size must be a positive integer, got {tp_size!r}")
    config_dict = (load_config(Path(config)) if isinstance(config, (str, os.PathLike))
                   else dict(config))
    where = str(config) if isinstance(config, (str, os.PathLike)) else "config"
    # The config alone (no checkpoint: the tensors are in memory).
    description = CheckpointDescription(None, config_dict, where)
    kda = description.kda
    if kda.kda_layers is None:
        raise CheckpointError(f"{where}: the config does not list the KDA layers "
                              "(linear_attn_config.kda_layers or layer_types)")
    family = description.family.name
    if layout.family != family:
        raise EngineLayoutError(f"{layout.name}: this layout is for {layout.family}, but the "
                                f"config is {family}'s")
    wanted = checked_ranks(ranks, tp_size)
    # The plan with the family's assumed dtypes: which tensors a KDA layer holds, and a world
    # size the heads refuse, refused before any tensor is read.
    required = {checkpoint_suffix(t.name) for t in
                KdaTpPlan.from_description(description, 0, tp_size, qk_multiple=1).tensors}
    model_dtype = config_model_dtype(config_dict, layout.engine, model_dtype)
    try:
        mla = parse_mla_config(config_dict, kda)
    except CheckpointError:  # the config lacks an MLA size: its MLA layers are not planned
        mla = None
    digests = _Digests(kda, required, layout, tp_size, wanted, model_dtype, mla)
    for item in tensors.items() if isinstance(tensors, Mapping) else tensors:
        if not isinstance(item, tuple | list) or len(item) != 2 or not isinstance(item[0], str):
            raise UsageError(
                f"tensors: expected (name, tensor) pairs or a mapping of names to tensors, got "
                f"an item {_shown(item)}; pass state_dict.items() or the state dict itself"
            )
        digests.feed(*item)
        del item  # nothing here holds a tensor while the next one is produced
    return digests.result(where)


class _Digests:
    """The digests of the KDA layers fed so far: each layer's tensors kept until the layer is
    complete, then hashed for every wanted rank and dropped."""

    def __init__(self, kda: KdaConfig, required: set[str], layout: EngineLayout, tp_size: int,
                 wanted: list[int], model_dtype: str | None, mla: MlaConfig | None) -> None:
        self.kda, self.required, self.layout = kda, required, layout
        self.tp_size, self.wanted, self.model_dtype = tp_size, wanted, model_dtype
        self.layers = set(kda.kda_layers or ())
        # The MLA layers hashed, and the plan tensors their parameters are made of.
        self.mla = mla if mla is not None and layout.mla else None
        self.mla_layers = set(self.mla.layers) if self.mla else set()
        self.mla_parts = {part for p in layout.mla for part in p.parts}
        self.mla_pending: dict[tuple[str, int], dict[str, Tensor]] = {}
        self.pending: dict[tuple[str, int], _LayerTensors] = {}
        self.done: dict[tuple[str, int], list[list[tuple[str, str]]]] = {}
        self.plans: list[KdaTpPlan] = []
        #: KDA markers (``A_log``, ``dt_bias``) fed for layers the config does not list.
        self.strays: dict[tuple[str, int], list[str]] = {}

    def feed(self, name: str, value: Any) -> None:
        """Take one fed tensor: kept if it is a KDA layer's, its layer hashed once complete.

        Raises:
            CheckpointError: a KDA tensor sent twice, or after its layer was hashed.
        """
        # A decoder layer's attention tensor: (prefix, layer, name after self_attn.).
        location = param_location(name)
        if location is not None and location[1] not in self.layers:
            if location[2].rsplit(".", 1)[-1] in _MARKERS:
                self.strays.setdefault(location[:2], []).append(name)
            elif location[1] in self.mla_layers:
                self.feed_mla(name, location[:2], value)
            return
        if location is None:
            return
        key = location[:2]
        if key in self.done:
            raise CheckpointError(f"{name}: KDA layer {key[1]} was complete and hashed when "
                                  "this tensor arrived; send each KDA tensor once")
        group = self.pending.setdefault(key, _LayerTensors(*key))
        if name in group.tensors:
            raise CheckpointError(f"{name}: sent twice; send each KDA tensor once")
        group.tensors[name] = as_record(name, value)
        if not self.required <= set(_suffixes(group)):
            return
        if not self.plans:
            self.plans = [_plan(self.kda, group, self.required, r, self.tp_size)
                          for r in range(self.tp_size)]
        self.done[key] = [_hash_layer(group, self.plans[r], self.layout, self.model_dtype)
                          for r in self.wanted]
        del self.pending[key]

    def feed_mla(self, name: str, key: tuple[str, int], value: Any) -> None:
        """Take one tensor of an MLA layer: kept if the layout's MLA parameters are made of it,
        its layer hashed once complete.

        Raises:
            CheckpointError: a tensor sent twice, or after its layer was hashed.
        """
        parts = {mla_tensor_name(key[0], key[1], part): part for part in self.mla_parts}
        part = parts.get(name)
        if part is None:
            return  # not a table's part (GLM-5.3's DSA indexer)
        if key in self.done:
            raise CheckpointError(f"{name}: MLA layer {key[1]} was complete and hashed when "
                                  "this tensor arrived; send each MLA tensor once")
        group = self.mla_pending.setdefault(key, {})
        if part in group:
            raise CheckpointError(f"{name}: sent twice; send each MLA tensor once")
        group[part] = as_record(name, value)
        if len(group) < len(self.mla_parts):
            return
        assert self.mla is not None  # mla_layers is empty otherwise
        self.done[key] = [_hash_mla_layer(key, group, self.mla, self.layout, r, self.tp_size,
                                          self.model_dtype) for r in self.wanted]
        del self.mla_pending[key]

    def result(self, where: str) -> dict[str, str]:
        """Every digest, ranks in order, then layers, then parameters.

        Raises:
            CheckpointError: a KDA layer of the config incomplete or never fed, or KDA tensors
                under several prefixes.
        """
        prefixes = sorted({prefix for prefix, _ in self.done})
        if len(prefixes) > 1:
            raise CheckpointError(f"KDA tensors under several prefixes {prefixes}: cannot tell "
                                  "which stack the engine loads them into")
        for (prefix, layer), names in sorted(self.strays.items()):
            if prefix in prefixes:
                raise CheckpointError(
                    f"{', '.join(sorted(names))}: layer {layer} holds KDA tensors, but the "
                    f"{where} lists no KDA layer {layer} (its KDA layers: {sorted(self.layers)});"
                    " is this the config of the model being updated?"
                )
        for (prefix, layer), group in sorted(self.mla_pending.items()):
            absent = sorted(mla_tensor_name(prefix, layer, p) for p in self.mla_parts - set(group))
            raise CheckpointError(
                f"the tensors fed do not complete MLA layer {layer}: it lacks "
                f"{', '.join(absent)}; expected_digests hashes whole MLA layers (an engine "
                "parameter may join several of their tensors, W_UK_T/W_UV come from the whole "
                "kv_b_proj): feed every MLA tensor of the layer, the unchanged ones too, or none"
            )
        missing = sorted(self.layers - {layer for _, layer in self.done})
        if missing:
            lacking = "; ".join(
                f"layer {layer} lacks {', '.join(sorted(self.required - set(_suffixes(g))))}"
                for (_, layer), g in sorted(self.pending.items(), key=lambda kv: kv[0][1])
                if layer in missing
            )
            raise CheckpointError(
                f"the tensors fed do not complete KDA layers {missing} of the "
                f"{len(self.layers)} the {where} lists"
                f"{': ' + lacking if lacking else ' (none of their tensors came)'}; "
                "expected_digests hashes whole KDA layers (an engine parameter such as "
                "in_proj_qkvgfab fuses several checkpoint tensors), so a partial update is not "
                "hashed from what it sends alone: feed every KDA tensor of every KDA layer, the "
                "unchanged ones too (the trainer's full state dict), or let the guard check the "
                "partial update inside the engine (docs/guard.md)"
            )
        out: dict[str, str] = {}
        for i in range(len(self.wanted)):
            for key in sorted(self.done, key=lambda k: k[1]):
                out.update(self.done[key][i])
        return out


def _suffixes(group: _LayerTensors) -> list[str]:
    """The names after ``self_attn.`` of the tensors a layer received (``q_proj.weight``)."""
    return [name.rsplit(".self_attn.", 1)[1] for name in group.tensors]


def _plan(kda: KdaConfig, first: _LayerTensors, required: set[str], rank: int,
          tp_size: int) -> KdaTpPlan:
    """Rank ``rank``'s plan, with the dtypes, gate rank and stored ``A_log`` length of the
    first complete KDA layer's tensors (as ``KdaTpPlan.from_config`` reads them from a
    checkpoint's first KDA layer)."""
    dtypes: dict[str, str] = {}
    for name, tensor in first.tensors.items():
        suffix = name.rsplit(".self_attn.", 1)[1]
        if suffix not in required:
            continue  # KdaShardedSource names what a KDA layer must not hold
        if tensor.dtype in FP8_DTYPES:
            raise DtypeMismatchError(
                f"{name}: dtype {tensor.dtype}: block-FP8 KDA weights are not handled from "
                "tensors in memory; hash the checkpoint with kda_tp.audit.engine_digests"
            )
        dtypes[suffix.removesuffix(".weight")] = tensor.dtype
    a_log = first.tensors[kda_tensor_name(first.prefix, first.layer, "A_log")]
    stored = math.prod(a_log.shape)
    f_a = first.tensors[kda_tensor_name(first.prefix, first.layer, "f_a_proj")]
    return KdaTpPlan(rank, tp_size, kda.hidden, kda.head_dim, kda.heads, kda.conv_kernel,
                     f_a.shape[0], qk_multiple=1, dtypes=dtypes,
                     full_rank_gate=kda.full_rank_gate,
                     a_log_len=stored if stored > kda.heads else None)


def _hash_layer(group: _LayerTensors, plan: KdaTpPlan, layout: EngineLayout,
                model_dtype: str | None) -> list[tuple[str, str]]:
    """``(key, digest)`` of every engine parameter of one KDA layer on ``plan``'s rank, built
    and refused as ``engine_digests`` builds and refuses them."""
    shard = KdaShardedSource(group, plan, layers=[group.layer])
    prefix = layout.state_dict_prefix(shard.prefix)
    out = []
    for layer, param in engine_params(shard, layout):
        name = param_name(prefix, layer, param.suffix)
        planned = param_plan(shard, layout, param.suffix, model_dtype=model_dtype)
        built = build_checked(shard, layout, layer, planned, name, model_dtype,
                              "pass another model_dtype, or none for the tensors' own")
        out.append((DIGEST_KEY.format(rank=plan.tp_rank, name=name),
                    _promised_digest(plan.tp_rank, name, planned, built)))
    return out


def _hash_mla_layer(key: tuple[str, int], group: dict[str, Tensor], mla: MlaConfig,
                    layout: EngineLayout, rank: int, tp_size: int,
                    model_dtype: str | None) -> list[tuple[str, str]]:
    """``(key, digest)`` of every MLA parameter of one MLA layer on rank ``rank`` (the
    layout's MLA table, each part this rank's slice of the fed tensor, cast to
    ``model_dtype``), and of the copies the engine derives from ``kv_b_proj`` as parameters.

    Raises:
        PlanError: a dtype the MLA plan does not take (block-FP8), heads ``tp_size`` does not
            split.
        ShapeMismatchError: a tensor whose shape is not the config's MLA geometry's.
        DtypeMismatchError: a cast to ``model_dtype`` that overflows.
    """
    prefix, layer = key
    plan = MlaTpPlan.from_mla_config(mla, rank, tp_size,
                                     {part: t.dtype for part, t in group.items()})
    for part, tensor in group.items():
        if tuple(tensor.shape) != tuple(plan[part].disk_shape):
            name = mla_tensor_name(prefix, layer, part)
            raise ShapeMismatchError(
                f"{name}: shape {list(tensor.shape)}, expected {list(plan[part].disk_shape)} "
                "from the config's MLA geometry (num_attention_heads, q_lora_rank, "
                "kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim); fix the config "
                "or the tensor"
            )
    engine_prefix = layout.state_dict_prefix(prefix)
    derived = {n: d for n, d in MLA_DERIVED.get(layout.name, {}).items() if not d.attribute}

    def read(part: str, dst: np.ndarray) -> None:
        _native.shard_into(plan[part], readonly_bytes(group[part].data), dst)

    out = []
    for param in layout.mla_params_for(plan):
        planned = layout.mla_param_plan(param.suffix, plan, model_dtype)
        name = param_name(engine_prefix, layer, param.suffix)
        with np.errstate(over="ignore"):  # an overflow is refused below
            built = planned.fill(None, read, lambda part: plan[part].local_bytes)
        overflow = cast_overflow(planned, built.reshape(-1),
                                 lambda part: group[part].array.reshape(-1))
        if overflow is not None:
            raise DtypeMismatchError(f"rank {rank} {name}: {overflow}; pass another "
                                     "model_dtype, or none for the tensors' own")
        out.append((DIGEST_KEY.format(rank=rank, name=name),
                    _promised_digest(rank, name, planned, built)))
        if param.suffix == "kv_b_proj.weight":
            out += [(DIGEST_KEY.format(rank=rank, name=param_name(engine_prefix, layer, n)),
                     param_digest(d.derive(built, plan))) for n, d in derived.items()]
    return out
