"""One description of a checkpoint: what kda_tp reads from a model before it plans a rank.

:func:`describe` inspects a checkpoint (or a bare config) once per process: the config and
its family (:mod:`kda_tp.model.families`), the KDA geometry and gate (``KdaConfig``),
the declared quantization, the decoder prefix, and every ``self_attn`` tensor of the decoder
layers, found in one pass over the names. Each part is read the first time something asks for
it and kept: a rank's plan (``KdaTpPlan.from_description``) is then arithmetic on the facts of
the selected KDA layers (:meth:`CheckpointDescription.layer_facts`, read and checked once per
layer selection), and a rank's view (``KdaShardedSource``) checks each KDA tensor against its
plan from the recorded headers, without listing or matching the names again.

A :class:`~kda_tp.SafetensorsSource` keeps its description for as long as it is open, so every
rank's plan and view over one opened checkpoint share it; any other tensor source is described
anew each time (it may change between calls).
"""

from __future__ import annotations

import math
import os
import re
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from .. import _native
from ..errors import CheckpointError, DtypeMismatchError, ShapeMismatchError
from ..model.config import CONFIG_NAME, KdaConfig, load_config, no_config_message, parse_config
from ..model.dtypes import FLOAT_DTYPES, FP8_DTYPES
from ..model.families import ModelFamily, family_for
from ..model.quant import BlockFormat, ModelOptModules, declared_quantization
from .layers import check_layers, config_layer_count
from .names import (
    LAYER_NUMBER,
    LAYER_TENSOR,
    check_gate_form,
    decoder_prefix,
    kda_tensor_name,
    layer_number_problem,
    location,
)
from .reader import SafetensorsSource, refuse_index_member

__all__ = ["CheckpointDescription", "LayerFacts", "assumed_layout", "check_declared", "describe",
           "open_checkpoint"]

_LAYER = re.compile(rf"^({LAYER_NUMBER})\.")
# "Read the config from the source" (a bare config may be any object: parse_config refuses it).
_UNSET: Any = object()


def assumed_layout(
    config: KdaConfig,
) -> tuple[dict[str, str] | None, dict[str, tuple[int, ...]], str]:
    """What a bare config's plan assumes of the checkpoint it does not see: the stored dtypes
    and on-disk shapes of its model family's checkpoints (``ModelFamily.stored_dtypes`` and
    ``flat_a_log`` in ``kda_tp.model.FAMILIES``).

    GLM-5.3-Flash: transformers' ``modeling_glm5_next.py`` creates the convs, ``A_log`` (1-D
    ``[H]``) and ``dt_bias`` in float32, so its checkpoints store them as F32. Kimi-Linear and
    any other family: the plan's defaults (BF16 except the F32 ``A_log [1, 1, H, 1]`` and
    ``dt_bias``, Kimi-Linear's checkpoints).

    Args:
        config: the parsed config.

    Returns:
        ``(dtypes, shapes, family)``: the dtypes by plan name for ``KdaTpPlan`` (None: the
        plan's defaults), on-disk shapes by plan name that differ from the plan's (elements),
        and whose defaults they are, for people (``"GLM-5.3-Flash's"``).
    """
    family = family_for(config.rules, config.full_rank_gate)
    dtypes = None if family.stored_dtypes is None else dict(family.stored_dtypes)
    shapes: dict[str, tuple[int, ...]] = {"A_log": (config.heads,)} if family.flat_a_log else {}
    return dtypes, shapes, family.possessive


@dataclass(frozen=True)
class LayerFacts:
    """What a plan takes from a checkpoint's selected KDA layers (or assumes for a bare config).

    Attributes:
        layers: the selected KDA layers, 0-based (None for a bare config without ``layers``).
        dtypes: safetensors dtype per plan name (None: the plan's defaults).
        quantized: plan names of the block-FP8 weights (empty: none).
        a_log_len: entries of a zero-padded ``A_log`` (None: one per head).
        gate_rank: ``f_a_proj``'s row count in the first selected layer (None for a bare
            config: the plan takes ``head_dim``, Kimi-Linear's choice).
        disk_shapes: the first selected layer's on-disk shape per plan name (empty for a bare
            config).
    """

    layers: tuple[int, ...] | None
    dtypes: Mapping[str, str] | None
    quantized: tuple[str, ...]
    a_log_len: int | None
    gate_rank: int | None
    disk_shapes: Mapping[str, tuple[int, ...]]


class CheckpointDescription:
    """A checkpoint (or a bare config) as kda_tp reads it before planning: read once, shared.

    Build it with :func:`describe`. Every attribute is read the first time it is asked for,
    and raises then what the read finds wrong (so a checkpoint whose config is fine but whose
    layer 5 lacks a tensor plans rank 0 and refuses its view, as before).

    Attributes:
        root: the checkpoint directory (None for a config dict or a source without one).
        where: the config's location, named in messages.
    """

    def __init__(
        self,
        source: Any | None,
        config: Any = None,
        where: str = "config",
        root: Path | None = None,
    ):
        # describe() makes the reference weak where the source keeps this description.
        self._source: Any = source
        self._config = _UNSET if config is None and source is not None else config
        self._headers: dict[str, tuple[str, tuple[int, ...]] | None] = {}
        self.where = where
        self.root = root
        self._facts: dict[tuple[int, ...] | None, LayerFacts] = {}

    @property
    def source(self) -> Any:
        """The opened checkpoint (a :class:`~kda_tp.SafetensorsSource` or any object with
        ``names()`` and ``get(name)``), or None for a bare config.

        Raises:
            CheckpointError: the ``SafetensorsSource`` was dropped (a description does not keep
                its checkpoint open; the views and loaders using it do).
        """
        if isinstance(self._source, weakref.ref):
            found = self._source()
            if found is None:
                raise CheckpointError(f"{self.where}: the checkpoint this description read was "
                                      "dropped; describe an open one")
            return found
        return self._source

    @cached_property
    def config(self) -> Mapping[str, Any]:
        """The parsed ``config.json``.

        Raises:
            CheckpointError: the checkpoint has no ``config.json``, or it is invalid.
        """
        if self._config is not _UNSET:
            given: Mapping[str, Any] = self._config
            return given
        config: Mapping[str, Any] | None = getattr(self.source, "config", None)
        if config is None:
            root = getattr(self.source, "root", None)
            if root is None:
                raise CheckpointError(f"{self.where}: the source has no config")
            raise CheckpointError(no_config_message(root))
        return config

    @cached_property
    def kda(self) -> KdaConfig:
        """The KDA geometry and gate (``kda_tp.model.parse_config``).

        Raises:
            CheckpointError: as ``parse_config``.
        """
        return parse_config(self.config, self.where)

    @property
    def family(self) -> ModelFamily:
        """The model family (``kda_tp.model.family_for`` of :attr:`kda`)."""
        return family_for(self.kda.rules, self.kda.full_rank_gate)

    @cached_property
    def quantization(self) -> tuple[BlockFormat | str | None, ModelOptModules | None]:
        """``(format, ModelOpt module declarations)`` the config declares
        (``kda_tp.model.declared_quantization``, read once)."""
        return declared_quantization(self.config, self.root)

    @cached_property
    def prefix(self) -> str:
        """The decoder prefix of the KDA layers (``kda_tp.checkpoint.names.decoder_prefix``).

        Raises:
            CheckpointError: ``A_log`` tensors under more than one prefix.
        """
        return decoder_prefix(self.source, self._a_log_names)

    @cached_property
    def _names(self) -> list[str]:
        names: list[str] = self.source.names()
        return names

    @cached_property
    def _lines(self) -> str | None:
        """The names one per line, with a newline before the first and after the last, for
        searches at C speed over a header of ~70k names (Kimi K3's); None when some name holds
        a newline itself (then the names are walked one by one)."""
        names = self._names
        lines = "\n" + "\n".join(names) + "\n"
        return lines if lines.count("\n") == len(names) + 1 else None

    def _names_with(self, part: str, *, at_end: bool = False) -> list[str]:
        """The names holding ``part`` (``at_end``: ending with it), in order."""
        lines = self._lines
        if lines is None:
            return [n for n in self._names if (n.endswith(part) if at_end else part in n)]
        needle = part + "\n" if at_end else part
        found = []
        pos = lines.find(needle, 1)
        while pos >= 0:
            start = lines.rfind("\n", 0, pos) + 1
            end = lines.find("\n", pos + len(part))
            found.append(lines[start:end])
            pos = lines.find(needle, end)
        return found

    @cached_property
    def _a_log_names(self) -> list[str]:
        return self._names_with("self_attn.A_log", at_end=True)

    @cached_property
    def _attention(self) -> dict[int, list[tuple[str, str]]]:
        """Layer -> its ``(suffix after self_attn., name)`` under the prefix, in name order."""
        prefix, cut = self.prefix, len(self.prefix)
        attention: dict[int, list[tuple[str, str]]] = {}
        for name in self._names_with(".self_attn."):
            if name.startswith(prefix):
                match = LAYER_TENSOR.match(name[cut:])
                if match is not None:
                    attention.setdefault(int(match.group(1)), []).append((match.group(2), name))
        return attention

    @cached_property
    def _bad_number(self) -> tuple[str, str] | None:
        """The first name under the prefix whose layer number no loader reads, with why."""
        prefix, cut, lines = self.prefix, len(self.prefix), self._lines
        if lines is None:
            candidates: Iterable[str] = (n for n in self._names if n.startswith(prefix))
        else:
            # Only the names under the prefix not followed by ASCII digits and a dot.
            unusual = re.compile(re.escape("\n" + prefix) + rf"(?!{LAYER_NUMBER}\.)")
            candidates = (lines[m.start() + 1:lines.find("\n", m.end())]
                          for m in unusual.finditer(lines))
        for name in candidates:
            problem = layer_number_problem(name[cut:])
            if problem is not None:
                return name, problem
        return None

    @cached_property
    def a_log_layers(self) -> tuple[int, ...]:
        """0-based indices of the layers holding ``self_attn.A_log`` under the prefix."""
        prefix, cut = self.prefix, len(self.prefix)
        found = set()
        for name in self._a_log_names:
            if name.startswith(prefix) and (match := _LAYER.match(name[cut:])):
                found.add(int(match.group(1)))
        return tuple(sorted(found))

    @cached_property
    def layer_count(self) -> int | None:
        """The decoder layer count: the config's ``num_hidden_layers``, else one more than the
        largest layer index under the prefix; None when
        neither says."""
        count = config_layer_count(getattr(self.source, "config", None) or {})
        if count is not None:
            return count
        prefix, lines = self.prefix, self._lines
        if lines is None:
            numbers = {m.group(1) for n in self._names
                       if n.startswith(prefix) and (m := _LAYER.match(n[len(prefix):]))}
        else:
            numbers = set(re.findall(re.escape("\n" + prefix) + rf"({LAYER_NUMBER})\.", lines))
        return max(map(int, numbers)) + 1 if numbers else None

    def attention(self, layer: int) -> list[tuple[str, str]]:
        """``(suffix after self_attn., checkpoint name)`` of layer ``layer``'s ``self_attn``
        tensors, in name order (empty when it has none)."""
        return self._attention.get(layer, [])

    def check_names(self, kda_layers: Iterable[int]) -> None:
        """Refuse what no plan can shard: a name under the prefix whose layer number is not
        ASCII digits (or too long), and a layer outside ``kda_layers`` holding KDA-only
        tensors (``A_log``, ``dt_bias``).

        Raises:
            CheckpointError: naming the file and the tensor.
        """
        if self._bad_number is not None:
            name, problem = self._bad_number
            raise CheckpointError(f"{location(self.source, name)}: {name}: {problem}")
        wanted = set(kda_layers)
        for layer, tensors in self._attention.items():
            if layer in wanted:
                continue
            for suffix, name in tensors:
                if suffix in ("A_log", "dt_bias"):
                    raise CheckpointError(
                        f"{location(self.source, name)}: {name}: layer {layer} holds a KDA "
                        f"tensor but is not a KDA layer (KDA layers: {sorted(wanted)})"
                    )

    def kda_layers(self, layers: Iterable[int] | None = None) -> tuple[int, ...]:
        """0-based KDA layer indices: ``layers`` (sorted, each once) if given, else the
        config's.

        Raises:
            CheckpointError: ``layers`` is None and the checkpoint has no config, or the config
                does not list the KDA layers.
        """
        if layers is not None:
            return tuple(sorted({int(i) for i in layers}))
        if self._config is _UNSET and getattr(self.source, "config", None) is None:
            root = getattr(self.source, "root", None)
            if root is not None:
                raise CheckpointError(no_config_message(root))
        elif self.kda.kda_layers is not None:
            return self.kda.kda_layers
        raise CheckpointError(
            f"{self.where}: the config does not list the KDA layers (linear_attn_config.kda_layers "
            "or layer_types); pass layers=[...] (0-based)"
        )

    def header(self, name: str) -> tuple[str, tuple[int, ...]] | None:
        """``(dtype, on-disk shape)`` of tensor ``name``, from the header; None when absent."""
        if name in self._headers:
            return self._headers[name]
        info = getattr(self.source, "info", None)
        if info is not None:
            found: tuple[str, tuple[int, ...]] | None = info(name)
        else:
            record = self.source.get(name)
            found = None if record is None else (record.dtype, tuple(record.shape))
        if isinstance(self.source, SafetensorsSource):  # its headers do not change while open
            self._headers[name] = found
        return found

    @cached_property
    def stored_dtypes(self) -> frozenset[str]:
        """The dtypes (safetensors names) of every tensor the checkpoint holds, from its
        headers: what vLLM's ``auto`` dtype reads for a config without one
        (``kda_tp.engines.engine_model_dtype``). Empty for a bare config."""
        if self.source is None:
            return frozenset()
        info = getattr(self.source, "info", None)
        found = set()
        for name in self._names:
            if info is not None:
                header = info(name)
                if header is not None:
                    found.add(header[0])
            elif (record := self.source.get(name)) is not None:
                found.add(record.dtype)
        return frozenset(found)

    def layer_facts(self, layers: Iterable[int] | None = None) -> LayerFacts:
        """What a plan takes from the checkpoint: read from the first selected KDA layer's
        headers, every selected layer's projections checked against the declared quantization;
        for a bare config, what its family's checkpoints store (``assumed_layout``). Read
        once per layer selection.

        Args:
            layers: 0-based KDA layer indices, checked as ``--layers`` is
                (``kda_tp.checkpoint.check_layers``); None: the config's KDA layers.

        Raises:
            CheckpointError, DtypeMismatchError, PlanError: as ``KdaTpPlan.from_config``.
        """
        kda = self.kda
        checked: tuple[int, ...] | None = None
        if layers is not None:
            # The same checks as the command line's --layers (1-based, non-KDA, out of range).
            known = kda.kda_layers
            if known is None and self.source is not None:
                known = self.a_log_layers or None
            count = config_layer_count(self.config)
            if count is None and self.source is not None:
                count = self.layer_count
            checked = check_layers(layers, known, count, option="layers")
        if checked in self._facts:
            return self._facts[checked]
        facts = self._read_facts(checked)
        self._facts[checked] = facts
        return facts

    def _read_facts(self, layers: tuple[int, ...] | None) -> LayerFacts:
        kda = self.kda
        fmt, modules = self.quantization
        if self.source is None:
            # A bare config: what its family's checkpoints store, every projection block-FP8
            # under a block format.
            quantized = tuple(_native.QUANTIZABLE) if isinstance(fmt, BlockFormat) else ()
            return LayerFacts(layers, assumed_layout(kda)[0], quantized, None, None, {})
        source = self.source
        indices = self.kda_layers(layers)
        if not indices:
            raise CheckpointError(f"{self.where}: no KDA layer to read the dtypes from")
        layer, prefix = indices[0], self.prefix
        check_gate_form(source, prefix, layer, kda.full_rank_gate)
        packed = [name for suffix, name in self.attention(layer) if suffix.endswith("_packed")]
        if packed:
            raise CheckpointError(
                f"{location(source, packed[0])}: {packed[0]}: packed 4-bit KDA weights "
                f"({_format_name(fmt)}) are not supported; kda_tp slices "
                "BF16/F16/F32 KDA weights and FP8 block-quantized projections"
            )
        # Every KDA layer's projections against what the config declares for them (nothing
        # to check when it declares neither a block format nor ModelOpt modules).
        for index in indices if isinstance(fmt, BlockFormat) or modules is not None else ():
            for name in _native.QUANTIZABLE:
                full_name = kda_tensor_name(prefix, index, name)
                info = self.header(full_name)
                if info is not None:
                    check_declared(source, full_name, info[0], fmt, modules)
        headers = {}
        for name in _tensor_names(kda.full_rank_gate):
            full_name = kda_tensor_name(prefix, layer, name)
            info = self.header(full_name)
            if info is None:
                raise CheckpointError(f"{location(source)}: KDA layer {layer} lacks {full_name}")
            if info[0] in FP8_DTYPES:
                _check_quantizable(source, full_name, name, fmt)
            elif info[0] not in FLOAT_DTYPES:
                declared = f"; the config declares {fmt}" if isinstance(fmt, str) else ""
                raise DtypeMismatchError(
                    f"{location(source, full_name)}: {full_name}: dtype {info[0]} is not "
                    f"allowed for a KDA tensor: {', '.join(FLOAT_DTYPES)}, or "
                    f"{' / '.join(FP8_DTYPES)} with a block scale for a block-quantized "
                    f"projection{declared}"
                )
            headers[name] = info
        stored = math.prod(headers["A_log"][1])
        f_a_shape = headers["f_a_proj"][1]
        gate_rank = f_a_shape[0] if len(f_a_shape) == 2 else None
        return LayerFacts(
            layers=layers,
            dtypes={name: dtype for name, (dtype, _) in headers.items()},
            quantized=tuple(n for n, (dtype, _) in headers.items() if dtype in FP8_DTYPES),
            a_log_len=stored if stored > kda.heads else None,
            gate_rank=gate_rank,
            disk_shapes={name: shape for name, (_, shape) in headers.items()},
        )

    def require_gate_rank(self, facts: LayerFacts) -> int:
        """``facts.gate_rank``, read from the first selected layer's ``f_a_proj``.

        Raises:
            ShapeMismatchError: that ``f_a_proj`` is not 2-D ``[gate_rank, hidden]``.
        """
        if facts.gate_rank is not None:
            return facts.gate_rank
        layer = self.kda_layers(facts.layers)[0]
        name = kda_tensor_name(self.prefix, layer, "f_a_proj")
        raise ShapeMismatchError(
            f"{location(self.source, name)}: {name}: on-disk shape "
            f"{list(facts.disk_shapes['f_a_proj'])} is not 2-D [gate_rank, hidden], so the gate "
            "rank cannot be read from it"
        )

    def plan_options(self, facts: LayerFacts) -> dict[str, Any]:
        """The keyword arguments of ``KdaTpPlan`` these facts give: ``dtypes``,
        ``full_rank_gate``, ``a_log_len`` and, for block-FP8 weights, ``quant_block``,
        ``scale_layout`` and ``quantized``."""
        fmt = self.quantization[0]
        options: dict[str, Any] = {
            "dtypes": None if facts.dtypes is None else dict(facts.dtypes),
            "full_rank_gate": self.kda.full_rank_gate,
            "a_log_len": facts.a_log_len,
        }
        if isinstance(fmt, BlockFormat) and facts.quantized:
            options.update(quant_block=fmt.block, scale_layout=fmt.scale_layout)
            if self.source is not None:
                options["quantized"] = list(facts.quantized)
        return options

    def __repr__(self) -> str:
        what = repr(self.source) if self.source is not None else self.where
        return f"CheckpointDescription({what})"


_DESCRIBED: weakref.WeakKeyDictionary[SafetensorsSource, CheckpointDescription] = (
    weakref.WeakKeyDictionary()
)


def describe(
    checkpoint: Mapping[str, Any] | str | os.PathLike[str] | Any,
) -> CheckpointDescription:
    """The description of a checkpoint or a bare config.

    Args:
        checkpoint: a :class:`~kda_tp.SafetensorsSource` (its description is kept while it is
            alive: every later call returns the same one; the description refers to it weakly,
            so keep the source while using the description), a checkpoint directory, a
            ``.safetensors`` file, a ``config.json`` path, a config dict, or any tensor source
            with ``names()`` and ``get(name)`` (described anew).

    Raises:
        CheckpointError: one file of an indexed checkpoint (pass the directory); a path with
            no config (a directory without ``config.json``, a missing file).
    """
    if isinstance(checkpoint, SafetensorsSource):
        found = _DESCRIBED.get(checkpoint)
        if found is None:
            refuse_index_member(checkpoint.path)
            found = CheckpointDescription(
                checkpoint, where=str(checkpoint.root / CONFIG_NAME), root=checkpoint.root
            )
            # The source keeps its description: a weak reference back, so that the source
            # (and its mappings) goes when its last user drops it.
            found._source = weakref.ref(checkpoint)
            _DESCRIBED[checkpoint] = found
        return found
    if isinstance(checkpoint, (str, os.PathLike)):
        path = Path(checkpoint)
        source = open_checkpoint(path)
        if source is not None and not path.is_dir():
            path = path.parent
        config = load_config(path)
        root = path if path.is_dir() else path.parent
        where = str(path / CONFIG_NAME if path.is_dir() else path)
        return CheckpointDescription(source, config, where, root)
    if not callable(getattr(checkpoint, "names", None)):
        return CheckpointDescription(None, checkpoint, "config")
    at: Path | None = getattr(checkpoint, "root", None)
    where = str(Path(at) / CONFIG_NAME) if at is not None else repr(checkpoint)
    return CheckpointDescription(checkpoint, where=where, root=at)


def open_checkpoint(path: str | os.PathLike[str]) -> SafetensorsSource | None:
    """The checkpoint at ``path``, opened: a ``.safetensors`` file (beside its ``config.json``)
    or a directory holding ``.safetensors`` files; None where ``path`` is a bare config (a
    ``config.json``, or a directory without ``.safetensors`` files). The one answer to
    "checkpoint or config?", for :func:`describe` and ``kda-tp plan``.

    Raises:
        CheckpointError: one file of an indexed checkpoint (pass the directory); a
            ``.safetensors`` path that cannot be opened.
    """
    path = Path(path)
    refuse_index_member(path)
    if (path.name.endswith(".safetensors") and not path.is_dir()) or (
            path.is_dir() and any(path.glob("*.safetensors"))):
        return SafetensorsSource(path)
    return None


def _check_quantizable(
    source: Any, full_name: str, name: str, fmt: BlockFormat | str | None
) -> None:
    """Refuse an FP8 KDA tensor that is not a projection, or whose checkpoint's config declares
    no block-FP8 format (the format comes from the config, never from shapes)."""
    where = f"{location(source, full_name)}: {full_name}"
    if name not in _native.QUANTIZABLE:
        raise CheckpointError(
            f"{where}: {name} is stored as FP8, but conv weights, A_log, dt_bias and o_norm are "
            "never quantized; this checkpoint is not supported"
        )
    if not isinstance(fmt, BlockFormat):
        raise CheckpointError(
            f"{where}: an FP8 weight, but the config declares "
            f"{_format_name(fmt)}; supported block-FP8 formats: ModelOpt FP8_PB_WO, "
            "DeepSeek-style fp8 with weight_block_size, compressed-tensors FP8 block"
        )


def check_declared(
    source: Any,
    full_name: str,
    dtype: str,
    fmt: BlockFormat | str | None,
    declared: ModelOptModules | None,
) -> None:
    """Refuse a KDA (or MLA) projection ``full_name`` stored as ``dtype`` whose dtype
    contradicts the config: an FP8 dtype the format ``fmt`` does not use (``F8_E5M2`` under
    ModelOpt), or, under ModelOpt (``declared``), a ``quant_algo`` kda_tp cannot slice (e.g.
    ``NVFP4``), an ``FP8_PB_WO`` module that is not FP8, or an FP8 module that
    ``quantized_layers`` does not list or ``exclude_modules`` excludes.

    Raises:
        DtypeMismatchError: an FP8 dtype the format does not use.
        CheckpointError: a module declaration the weight contradicts (the message names the
            module, the declaration and the dtype on disk).
    """
    fp8 = dtype in FP8_DTYPES
    if fp8 and isinstance(fmt, BlockFormat) and dtype not in fmt.weight_dtypes:
        raise DtypeMismatchError(
            f"{location(source, full_name)}: {full_name}: dtype {dtype}, but {fmt.name} weights are "
            f"{' or '.join(fmt.weight_dtypes)} (ModelOpt's FP8 is E4M3 by definition); the "
            "config and the weights disagree"
        )
    if declared is None:
        return
    where = f"{location(source, full_name)}: {full_name}"
    module = full_name.removesuffix(".weight")
    algo = declared.algo(module)
    if algo is not None and algo != "FP8_PB_WO":
        raise CheckpointError(
            f"{where}: the config's quantized_layers declares {module} as ModelOpt {algo} "
            f"(on disk: {dtype}); kda_tp slices BF16/F16/F32 attention weights and ModelOpt "
            f"FP8_PB_WO (128x128 block FP8) projections, not {algo} ones"
        )
    if algo == "FP8_PB_WO" and not fp8:
        raise CheckpointError(
            f"{where}: dtype {dtype}, but the config's quantized_layers declares {module} as "
            "ModelOpt FP8_PB_WO (F8_E4M3 with a block scale); the config and the weights "
            "disagree"
        )
    if algo is None and fp8:
        pattern = declared.excluded_by(module)
        if pattern is not None:
            why = f"its exclude_modules pattern {pattern!r} leaves {module} unquantized"
        elif declared.quantized_layers is not None:
            why = f"its quantized_layers does not list {module} (so it is not quantized)"
        else:
            return
        raise CheckpointError(
            f"{where}: stored as {dtype}, but the config says otherwise: {why}; the config and "
            "the weights disagree"
        )


def _format_name(fmt: BlockFormat | str | None) -> str:
    """What a config declares, for messages: a format's name, or "no quantization_config"."""
    if isinstance(fmt, BlockFormat):
        return f"{fmt.name}, whose weights are F8 with a block scale"
    return fmt or "no quantization_config"


def _tensor_names(full_rank_gate: bool) -> list[str]:
    """Plan names of one KDA block with the given output-gate form, in plan order."""
    plan = _native.KdaTpPlan(0, 1, 1, 128, 1, 1, 1, full_rank_gate=full_rank_gate)
    return [t.name for t in plan.tensors]
