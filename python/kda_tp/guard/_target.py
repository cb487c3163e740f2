"""One rank's KDA parameters as the update checker needs them, built once per model.

A :class:`RankTarget` is made from what the first load's check built for the rank (its
:class:`~kda_tp.engines.RankPlan`: the plan, the engine layout and its parameter plans) and the
rank's parameters, or from a checkpoint's description when no check ran: every region of every
KDA parameter (each part, and the zero padding rows), and the checkpoint names an update feeds
for them. How the engine holds its parameters (its post-load repack and how to read it back)
is the engine adapter's (a :class:`Reader`). It keeps the parameter objects: an update reads them as they are, and the target is
reused for every later update while the engine holds the same objects in the same shapes
(:meth:`RankTarget.holds`). It keeps neither the description nor the checkpoint open.

This module imports no engine and no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ..checkpoint.description import CheckpointDescription
from ..checkpoint.names import checkpoint_suffix, param_location, param_name
from ..engines.build import RankPlan
from ..engines.dtype import model_dtype_name
from ..engines.registry import get_layout, recognise
from ..errors import EngineLayoutError
from ..model.dtypes import numpy_dtype
from ..model.quant import SCALE_SUFFIXES
from ..rank.plan import KdaTensorPlan, KdaTpPlan

__all__ = ["AS_HELD", "PADDING", "Place", "RankTarget", "Reader", "Spelling", "mapper_spelling"]

#: The part label of a parameter's zero padding rows (the engine's rule: zero after every
#: load, e.g. vLLM K3's ``in_proj_qkvgfab``).
PADDING = "padding"

#: An engine's own name mapping: a name as fed -> the name the engine loads it as (None: the
#: engine drops it), e.g. vLLM's ``WeightsMapper.map_name`` of the served model class.
Spelling = Callable[[str], "str | None"]


def mapper_spelling(model: Any, attribute: str) -> Spelling | None:
    """The name mapping a model class keeps as ``attribute`` (vLLM's ``hf_to_vllm_mapper``,
    SGLang's ``hf_to_sglang_mapper``: a ``WeightsMapper`` with ``map_name``, or ``_map_name``
    in older releases and SGLang), as its model's ``load_weights`` applies it; None when the
    model has none."""
    mapper = getattr(model, attribute, None)
    spell = getattr(mapper, "map_name", None) or getattr(mapper, "_map_name", None)
    return spell if callable(spell) else None


class Reader(Protocol):
    """How an engine holds its parameters (the engine adapter's part of a target)."""

    def described(self, name: str, param: Any) -> Any:
        """``param`` as the engine layouts describe it (its bytes, maybe another view)."""

    def read_back(self, module: Any, param: Any) -> tuple[Any, str | None]:
        """What ``module`` holds as its ``weight`` (``param``) after the engine's post-load
        repack: ``(value, how)``, ``how`` None (as it is), ``kda_tp.guard._repacked.GEMM`` (read
        through the engine's GEMM) or why it cannot be read back (not checked)."""

    def masked_copy(self, copy: Any) -> bool:
        """Whether ``copy`` (what ``torch.Tensor.copy_`` is now) is the engine's own
        NaN-sentinel copy (a NaN fed keeps the old value), which an update's reference then
        follows; any other replacement is not trusted."""

    def spelling(self, model: Any) -> Spelling | None:
        """The engine's own name mapping for ``model`` (:data:`Spelling`), which it applies to
        every name an update feeds (``mapper_spelling``); None: names are loaded as fed."""


class _AsHeld:
    """An engine that holds every parameter as loaded (no repack, no other view)."""

    def described(self, name: str, param: Any) -> Any:
        return param

    def read_back(self, module: Any, param: Any) -> tuple[Any, str | None]:
        return param, None

    def masked_copy(self, copy: Any) -> bool:
        return False

    def spelling(self, model: Any) -> Spelling | None:
        return None


#: The :class:`Reader` of an engine that holds its parameters as loaded.
AS_HELD: Reader = _AsHeld()


@dataclass(frozen=True)
class Place:
    """One region of one KDA parameter.

    Attributes:
        name: the parameter's full name (``model.layers.0.self_attn.in_proj_qkvgfab.weight``).
        layer: its decoder layer.
        part: the plan part it holds (``"k_proj"``, ``"q_proj.scale"``) or :data:`PADDING`.
        dtype: the parameter's dtype (safetensors name).
        start: its first element in the parameter, flat (elements, not bytes).
        stop: one past its last element.
    """

    name: str
    layer: int
    part: str
    dtype: str
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        """The region's size in bytes."""
        return (self.stop - self.start) * numpy_dtype(self.dtype).itemsize


class RankTarget:
    """One rank's KDA parameters and what an update feeds for them.

    Attributes:
        plan: the rank's plan (``KdaTpPlan``; an RL refit changes values, not shapes).
        layers: the KDA layers of the target (a pipeline stage's, or every one).
        layout: the engine layout of the parameters.
        tp_rank, tp_size: the engine's tensor-parallel rank and world size.
        prefix: the checkpoint's decoder prefix (``"model.layers."``): fed names are
            checkpoint names under it.
        fed: checkpoint name of a KDA tensor an update may feed -> ``(layer, part, its plan
            entry)``, for the parts this rank holds (scale grids under each spelling); every
            other name the engine loads as one of these (its own name mapping,
            ``Reader.spelling``) is placed too (:meth:`place`).
        places: ``(layer, part)`` -> the regions that part fills.
        regions: parameter name -> every region of it (its parts, then its padding).
        params: parameter name -> the parameter as the layouts describe it
            (``Reader.described``), as the engine held it when the target was built.
        mla: the rank's MLA plan (``kda_tp.rank.MlaTpPlan``) or None; ``mla_params``: the
            names of the MLA parameters among ``params`` (their parts in ``places`` and
            ``fed`` too).
    """

    def __init__(self, rank_plan: RankPlan, params: Mapping[str, Any], layers: Iterable[int],
                 slots: Mapping[str, tuple[Any, str, Any]], reader: Reader,
                 spelling: Spelling | None = None, mla: Any = None):
        self.rank_plan, self.reader, self.spelling, self.mla = rank_plan, reader, spelling, mla
        plan, layout, prefix = rank_plan.plan, rank_plan.layout, rank_plan.prefix
        self.plan, self.layout, self.prefix = plan, layout, prefix
        self.tp_rank, self.tp_size = plan.tp_rank, plan.tp_size
        self.layers = layers = frozenset(layers)
        found: dict[tuple[int, str], str] = {}
        for name in params:
            location = param_location(name)
            if location is not None and location[1] in layers and \
                    location[2] in layout.suffixes:
                found[(location[1], location[2])] = name
        self.params = {name: params[name] for name in found.values()}
        self.places: dict[tuple[int, str], list[Place]] = {}
        self.regions: dict[str, list[Place]] = {}
        for param in layout.params_for(plan):
            for layer in sorted(layers):
                held = found.get((layer, param.suffix))
                if held is None:
                    continue  # another pipeline stage's layer, or a parameter the engine lacks
                dtype = model_dtype_name(getattr(self.params[held], "dtype", None))
                pplan = rank_plan.param_plan(param.suffix, dtype)
                size = numpy_dtype(pplan.dtype).itemsize
                spans = [(r.part, r.byte_range) for r in pplan.regions]
                if pplan.padding is not None:
                    spans.append((PADDING, pplan.padding))
                for part, (start, stop) in spans:
                    place = Place(held, layer, part, pplan.dtype, start // size, stop // size)
                    self.regions.setdefault(held, []).append(place)
                    if part != PADDING:
                        self.places.setdefault((layer, part), []).append(place)
        suffixes: dict[str, tuple[str, KdaTensorPlan]] = {}
        for t in plan.tensors:
            suffixes[checkpoint_suffix(t.name)] = (t.name, t)
            if t.scale is not None:
                for written in SCALE_SUFFIXES:
                    suffixes[f"{t.name}.{written}"] = (f"{t.name}.scale", t.scale)
        self.fed: dict[str, tuple[int, str, KdaTensorPlan]] = {
            param_name(prefix, layer, suffix): (layer, part, entry)
            for layer in layers for suffix, (part, entry) in suffixes.items()
            if (layer, part) in self.places}
        self._suffixes = frozenset(suffixes)
        self.mla_params: frozenset[str] = frozenset()
        if mla is not None and layout.mla:
            self.fed.update(self._mla_places(params, mla))
        self._slots = {name: slots[name] for name in self.params if name in slots}
        self._shapes = {name: tuple(getattr(v, "shape", ())) for name, v in self.params.items()}
        # The engine's spelling of every fed name -> its place (two names the engine loads as
        # one, with different places, place neither: never guessed).
        self._spelled: dict[str, tuple[int, str, KdaTensorPlan] | None] = {}
        if spelling is not None:
            for name, hit in self.fed.items():
                key = spelling(name)
                if key is not None:
                    self._spelled[key] = hit if self._spelled.get(key, hit) == hit else None
        self._seen: dict[str, tuple[int, str, KdaTensorPlan] | None] = {}

    def _mla_places(self, params: Mapping[str, Any], mla: Any
                    ) -> dict[str, tuple[int, str, KdaTensorPlan]]:
        """Add the regions of the hybrid's MLA parameters this rank holds (the layout's MLA
        table, ``EngineLayout.mla_param_plan`` for ``mla``, a ``kda_tp.rank.MlaTpPlan``: a
        layer that is not a KDA one of the target holding the table's names) to
        :attr:`places` and :attr:`regions`, and return the checkpoint names an update feeds
        for their parts (each MLA plan tensor of each such layer)."""
        layout, table = self.layout, {p.suffix for p in self.layout.mla_params_for(mla)}
        held: dict[tuple[int, str], str] = {}
        for name in params:
            location = param_location(name)
            if location is not None and location[1] not in self.layers and \
                    location[2] in table:
                held[(location[1], location[2])] = name
        for (layer, suffix), name in sorted(held.items()):
            self.params[name] = params[name]
            dtype = model_dtype_name(getattr(params[name], "dtype", None))
            pplan = layout.mla_param_plan(suffix, mla, dtype)
            size = numpy_dtype(pplan.dtype).itemsize
            spans = [(r.part, r.byte_range) for r in pplan.regions]
            if pplan.padding is not None:
                spans.append((PADDING, pplan.padding))
            for part, (start, stop) in spans:
                place = Place(name, layer, part, pplan.dtype, start // size, stop // size)
                self.regions.setdefault(name, []).append(place)
                if part != PADDING:
                    self.places.setdefault((layer, part), []).append(place)
        self.mla_params = frozenset(held.values())
        return {param_name(self.prefix, layer, checkpoint_suffix(t.name)): (layer, t.name, t)
                for layer in sorted({layer for layer, _ in held}) for t in mla.tensors
                if (layer, t.name) in self.places}

    def place(self, name: str) -> tuple[int, str, KdaTensorPlan] | None:
        """Where a tensor fed as ``name`` goes: ``(layer, part, its plan entry)`` for a
        checkpoint name of ``fed``, or for any other name the engine's own name mapping
        loads as one (K3: ``language_model.layers.`` for ``language_model.model.layers.``;
        GLM-5.3: ``model.language_model.`` and ``language_model.model.``); None for a name
        that is no KDA tensor of this rank. A name not in ``fed`` costs one call of the
        engine's mapping the first time it is seen, one dictionary lookup after."""
        hit = self.fed.get(name)
        if hit is not None or self.spelling is None:
            return hit
        try:
            return self._seen[name]
        except KeyError:
            pass
        try:
            key = self.spelling(name)
        except Exception:  # noqa: BLE001 - the engine's mapping refuses it: the engine's call will
            key = None
        hit = self._seen[name] = self._spelled.get(key) if key is not None else None
        return hit

    def unplaced(self, name: str) -> int | None:
        """The layer of this target that a name the guard cannot place (:meth:`place` None)
        names a KDA tensor of, as a checkpoint spells it (``...layers.{i}.self_attn.`` and a
        KDA tensor's checkpoint suffix), under another prefix than the checkpoint's or the
        engine's mapping knows; None for any other name. What such a name feeds may change
        the layer's parameters unseen (the follower compares them before and after the call)."""
        if self.place(name) is not None:
            return None
        location = param_location(name)
        if location is None or location[1] not in self.layers or \
                location[2] not in self._suffixes:
            return None
        return location[1]

    def layer_params(self, layer: int) -> list[str]:
        """The names of the parameters that hold layer ``layer``'s KDA tensors."""
        return sorted({place.name for (at, _), places in self.places.items() if at == layer
                       for place in places})

    @classmethod
    def of(cls, rank_plan: RankPlan, params: Mapping[str, Any], *, model: Any = None,
           reader: Reader = AS_HELD, mla: Any = None) -> RankTarget:
        """The target of one rank from the plan the first load's check built for it (its
        layout and layers, nothing planned again).

        Args:
            rank_plan: the rank's plan (``kda_tp.audit.auditor.RankAudit.plan``).
            params: the rank's parameters by full name (``model.named_parameters()``);
                only the KDA ones are kept.
            model: the ``torch.nn.Module`` holding ``params``: :meth:`holds` then tells
                whether the engine still holds the same objects.
            reader: how the engine holds them (its adapter's).
            mla: the rank's MLA plan (``kda_tp.rank.MlaTpPlan``, the first load's check
                judged the MLA layers with it): the MLA parameters are kept too, and what an
                update feeds for them placed and judged as for the KDA ones; None: only the
                KDA ones.
        """
        described = {n: reader.described(n, p) for n, p in params.items() if isinstance(n, str)}
        slots = _slots(model, described) if model is not None else {}
        return cls(rank_plan, described, rank_plan.layers, slots, reader,
                   reader.spelling(model) if model is not None else None, mla)

    @classmethod
    def build(cls, description: CheckpointDescription, params: Mapping[str, Any], *,
              tp_rank: int, tp_size: int, engine: str | None = None,
              layers: Iterable[int] | None = None, model: Any = None,
              reader: Reader = AS_HELD) -> RankTarget:
        """The target of one rank from a checkpoint's description (no first-load check ran:
        a dummy load, a load path that could not be checked).

        Args:
            description: the checkpoint's description (``kda_tp.describe``): config, decoder
                prefix, KDA layers and tensor headers, read once; not kept.
            params: the rank's parameters by full name (``model.named_parameters()``: torch
                tensors on any device, or numpy arrays); only the KDA ones are kept.
            tp_rank: the engine's tensor-parallel rank (0-based).
            tp_size: the engine's tensor-parallel world size.
            engine: a layout name (``kda_tp.engines.LAYOUTS``); None: recognised from the KDA
                parameter names and the checkpoint's model family.
            layers: the KDA layers this rank holds (a pipeline stage's); None: every KDA layer.
            model: the ``torch.nn.Module`` holding ``params``: :meth:`holds` then tells
                whether the engine still holds the same objects.
            reader: how the engine holds them (its adapter's).

        Raises:
            CheckpointError: the description has no config or no KDA layer.
            EngineLayoutError: no layout, or several, fit the parameter names.
            PlanError: the world size does not divide the heads.
        """
        plan = KdaTpPlan.from_description(description, tp_rank, tp_size, qk_multiple=1)
        chosen = set(description.kda_layers(layers))
        described = {n: reader.described(n, p) for n, p in params.items() if isinstance(n, str)}
        suffixes = {loc[2] for n in described
                    if (loc := param_location(n)) is not None and loc[1] in chosen}
        if engine is not None:
            layout = get_layout(engine)
        else:
            fitting = recognise(suffixes, description.family.name)
            if len(fitting) != 1:
                raise EngineLayoutError(
                    f"the engine's KDA parameter names {sorted(suffixes)} fit "
                    f"{'no' if not fitting else 'several'} {description.family.name} engine "
                    f"layouts{': ' + ', '.join(x.name for x in fitting) if fitting else ''}")
            layout = fitting[0]
        slots = _slots(model, described) if model is not None else {}
        # Each parameter planned for the dtype it is held in, as it is asked for.
        rank_plan = RankPlan(plan, layout, None, description.prefix, tuple(sorted(chosen)), {})
        return cls(rank_plan, described, chosen, slots, reader,
                   reader.spelling(model) if model is not None else None)

    def rebuilt(self, model: Any) -> RankTarget:
        """The same target for the parameter objects ``model`` holds now (after the engine
        re-registered some): same plan, layout and layers."""
        params = {n: self.reader.described(n, p) for n, p in model.named_parameters()}
        return RankTarget(self.rank_plan, params, self.layers, _slots(model, params),
                          self.reader, self.spelling, self.mla)

    def holds(self, model: Any) -> bool:
        """Whether ``model`` holds the target's parameter objects, in the same shapes (an
        engine that re-registers a parameter, or repacks it, needs a new target). True for a
        target built without a model."""
        for name, (module, attr, obj) in self._slots.items():
            now = getattr(module, "_parameters", {}).get(attr)
            if now is not obj or tuple(getattr(now, "shape", ())) != \
                    tuple(getattr(obj, "shape", ())):
                return False
        return True

    def meta(self, model: Any) -> bool:
        """Whether ``model`` holds some of the target's parameters on the meta device now: it
        is inside vLLM's layerwise reload (the target's objects hold the values again once
        the reload finalizes)."""
        for module, attr, _ in self._slots.values():
            now = getattr(module, "_parameters", {}).get(attr)
            if now is not None and getattr(now, "is_meta", False):
                return True
        return False

    def current(self, name: str) -> Any:
        """Parameter ``name`` as its module holds it now: :meth:`read`'s value."""
        return self.read(name)[0]

    def read(self, name: str) -> tuple[Any, str | None]:
        """Parameter ``name`` as its module holds it now (after an update that re-registered
        it, the new object), as the layouts describe it; a weight the engine repacked after
        the update (vLLM's CPU GEMM dispatch) read back through the engine
        (``Reader.read_back``); the target's object without a model.

        Returns:
            ``(value, how)``: ``how`` is None (held as it is),
            ``kda_tp.guard._repacked.GEMM`` (read back through the engine's GEMM: some
            values it cannot carry, :func:`~kda_tp.guard.read_back_difference`) or why the
            repacked weight cannot be read back (not checked).
        """
        slot = self._slots.get(name)
        if slot is None:
            return self.params[name], None
        module, attr, _ = slot
        now = getattr(module, "_parameters", {}).get(attr)
        if now is None:
            return self.params[name], None
        return (self.reader.read_back(module, now) if attr == "weight"
                else (self.reader.described(name, now), None))

    def held(self, name: str) -> tuple[Any, str | None]:
        """The target's own object of parameter ``name`` read where the engine reads it: as
        it is, or, emptied by the engine's repack, through its module's read-back (vLLM's
        GEMM, whose kernel keeps the values while a layerwise reload holds the module's
        parameters on the meta device). ``(value, how)`` as :meth:`read` returns it."""
        slot = self._slots.get(name)
        if slot is None:
            return self.params[name], None
        module, attr, obj = slot
        return (self.reader.read_back(module, obj) if attr == "weight"
                else (self.params[name], None))

    @property
    def nbytes(self) -> int:
        """Bytes of the rank's KDA parameters."""
        return sum(p.nbytes for places in self.regions.values() for p in places)


def _slots(model: Any, params: Mapping[str, Any]) -> dict[str, tuple[Any, str, Any]]:
    """For each KDA parameter name: ``(its module, attribute, the registered object)``."""
    out: dict[str, tuple[Any, str, Any]] = {}
    for name in params:
        if param_location(name) is None:
            continue
        path, _, attr = name.rpartition(".")
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue
        registered = getattr(module, "_parameters", {}).get(attr)
        if registered is not None:
            out[name] = (module, attr, registered)
    return out
