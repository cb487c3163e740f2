"""Block-quantized (FP8) KDA checkpoints: recognising the format, and dequantizing.

Supported, recognised from the config (never from tensor shapes alone), for KDA projections
``q/k/v_proj``, ``g_proj`` (or ``g_a_proj``/``g_b_proj``), ``f_a_proj``, ``f_b_proj``, ``b_proj``
and ``o_proj``; conv weights, ``A_log``, ``dt_bias`` and ``o_norm`` are never quantized:

==============================  ===============================  ===========================
format (config)                 tensors per quantized weight     scale grid
==============================  ===============================  ===========================
NVIDIA ModelOpt ``FP8_PB_WO``   ``<p>.weight`` F8_E4M3 [out, in] ``<p>.weight_scale`` F32
(``quant_method: modelopt`` /   (Kimi K3's ``nvidia/Kimi-K3-``   ``[ceil(out/128), 1,
``modelopt_mixed``, or          ``NVFP4`` release quantizes its  ceil(in/128), 1]``
``hf_quant_config.json``)       KDA projections this way)
DeepSeek-style FP8              ``<p>.weight`` F8                ``<p>.weight_scale_inv`` F32
(``quant_method: fp8``,                                          ``[ceil(out/bo), ceil(in/bi)]``
``weight_block_size: [bo, bi]``)                                 (multiplied, despite the name)
compressed-tensors FP8 block    ``<p>.weight`` F8                ``<p>.weight_scale`` F32
(``quant_method:                                                 ``[ceil(out/bo),
compressed-tensors``, weights                                    ceil(in/bi)]``
``strategy: block``,
``block_structure: [bo, bi]``)
==============================  ===============================  ===========================

What the config declares is checked against every KDA projection of every KDA layer
(``KdaTpPlan.from_config``): ModelOpt's FP8 is E4M3 by definition (an ``F8_E5M2`` weight is
refused), and a ModelOpt ``MIXED_PRECISION`` config's per-module ``quant_algo``
(``ModelOptModules``) must be ``FP8_PB_WO`` for an FP8 projection and absent (or
excluded) for an unquantized one; a KDA module declared ``NVFP4`` (or any other algorithm) is
refused with a message naming it.

Element ``(i, j)`` of a weight dequantizes as ``weight[i, j] * scale[i // bo, j // bi]``
(:func:`dequantize`). How a rank's scale grid is cut is the Rust core's rule (``KdaTensorPlan
.scale``): the blocks covering its weight range.

NVFP4 (ModelOpt or compressed-tensors ``nvfp4-pack-quantized``), MXFP4 and 4-bit
group-quantized KDA weights (compressed-tensors ``pack-quantized``: ``weight_packed`` plus group
scales) are refused with a message naming the format. Checkpoints that quantize only layers
outside KDA (Kimi K3's official MXFP4 experts, RedHat's NVFP4 experts, GLM-5.3-Flash's FP8)
shard as usual: those tensors pass through byte for byte.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, ShapeMismatchError
from .dtypes import FP8_DTYPES
from .json_reader import read_json

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "BlockFormat",
    "ModelOptModules",
    "SCALE_SUFFIXES",
    "declared_quantization",
    "dequantize",
    "quantization_config",
]

#: Names of a block scale after ``<p>.``: ModelOpt and compressed-tensors, DeepSeek.
SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv")
HF_QUANT_CONFIG = "hf_quant_config.json"
# ModelOpt's FP8_PB_WO block is fixed at 128 x 128.
_MODELOPT_BLOCK = (128, 128)


@dataclass(frozen=True)
class BlockFormat:
    """A recognised block-FP8 format.

    Attributes:
        name: human-readable format name, for messages.
        block: ``(rows, cols)`` block edge in weight elements.
        scale_layout: ``"modelopt"`` (4-D ``[ob, 1, ib, 1]`` grids) or ``"grid"`` (2-D).
        weight_dtypes: the safetensors dtypes its weights may have (ModelOpt: ``F8_E4M3``
            only, its FP8 is E4M3 by definition).
    """

    name: str
    block: tuple[int, int]
    scale_layout: str
    weight_dtypes: tuple[str, ...] = FP8_DTYPES


def quantization_config(config: Mapping[str, Any], root: Path | None = None) -> Mapping[str, Any] | None:
    """The quantization description a model config declares, or None.

    ``quantization_config`` at the top level, then under ``text_config``, then ModelOpt's
    ``hf_quant_config.json`` in ``root`` (its ``quantization`` object, with ``quant_method:
    "modelopt"`` added).

    Args:
        config: the model config (``config.json`` as a dict).
        root: the checkpoint directory, where ``hf_quant_config.json`` may lie (None: not
            looked for).

    Returns:
        The ``quantization_config`` mapping (``quant_method``, ``quant_algo``, ...), or None.

    Raises:
        CheckpointError: an ``hf_quant_config.json`` that is unreadable, not JSON, beyond
            the bounds of ``kda_tp.model.json_reader.read_json`` (size, depth, digits) or has no
            ``quantization`` object.
    """
    quant = config.get("quantization_config")
    if not isinstance(quant, Mapping) and isinstance(config.get("text_config"), Mapping):
        quant = config["text_config"].get("quantization_config")
    if not isinstance(quant, Mapping) and root is not None and (root / HF_QUANT_CONFIG).is_file():
        try:
            hf = read_json(root / HF_QUANT_CONFIG)
        except FileNotFoundError as e:  # removed since is_file() said it was there
            raise CheckpointError(f"{root / HF_QUANT_CONFIG}: cannot read it: {e}") from None
        body = hf.get("quantization") if isinstance(hf, Mapping) else None
        if not isinstance(body, Mapping):
            raise CheckpointError(
                f"{root / HF_QUANT_CONFIG}: expected a JSON object with a \"quantization\" "
                f"object (ModelOpt's layout), got {json.dumps(hf)[:80]}"
            )
        quant = {"quant_method": "modelopt", **body}
    return quant if isinstance(quant, Mapping) else None


def declared_quantization(
    config: Mapping[str, Any], root: Path | None = None
) -> tuple[BlockFormat | str | None, ModelOptModules | None]:
    """What a config declares of quantization, with one read of its
    :func:`quantization_config` (and of ``hf_quant_config.json``).

    Returns:
        The block-FP8 format: a :class:`BlockFormat`; or a string naming a quantization format
        kda_tp cannot slice KDA weights in (e.g. ``"NVFP4 (compressed-tensors
        nvfp4-pack-quantized)"``), to be used in a refusal if the KDA layers turn out to be
        quantized; or None when the config declares no quantization. And the per-module
        declarations of a ModelOpt config (``ModelOptModules``), None when the config is
        not ModelOpt's.

    Raises:
        CheckpointError: a block-FP8 config whose block size is missing or not two positive
            integers; an ``hf_quant_config.json`` that is not JSON or has no ``quantization``
            object.
    """
    quant = quantization_config(config, root)
    return _block_format(quant), _modelopt_modules(quant)


def _block_format(quant: Mapping[str, Any] | None) -> BlockFormat | str | None:
    if quant is None:
        return None
    method = str(quant.get("quant_method", "")).lower()
    if method in ("modelopt", "modelopt_mixed"):
        algos = {str(quant.get("quant_algo", ""))}
        layers = quant.get("quantized_layers")
        if isinstance(layers, Mapping):
            algos |= {str(v.get("quant_algo", "")) for v in layers.values() if isinstance(v, Mapping)}
        if "FP8_PB_WO" in algos:
            # ModelOpt's FP8 is E4M3 by definition (the ``fp8`` of its recipes is (4, 3) bits).
            return BlockFormat("ModelOpt FP8_PB_WO (128x128 blocks)", _MODELOPT_BLOCK, "modelopt",
                               ("F8_E4M3",))
        return f"ModelOpt {'/'.join(sorted(a for a in algos if a)) or 'unknown'}"
    if method == "fp8":
        block = quant.get("weight_block_size")
        if block is None:
            return "per-tensor FP8 (quant_method fp8 without weight_block_size)"
        return BlockFormat("DeepSeek-style FP8 block", _block(block, "weight_block_size"), "grid")
    if method == "compressed-tensors":
        fmt = str(quant.get("format", ""))
        groups = quant.get("config_groups") or {}
        for group in groups.values() if isinstance(groups, Mapping) else ():
            weights = group.get("weights") if isinstance(group, Mapping) else None
            if isinstance(weights, Mapping) and weights.get("strategy") == "block":
                block = _block(weights.get("block_structure"), "block_structure")
                return BlockFormat("compressed-tensors FP8 block", block, "grid")
        names = {
            "nvfp4-pack-quantized": "NVFP4",
            "mxfp4-pack-quantized": "MXFP4",
            "pack-quantized": "4-bit group-quantized (weight_packed + group scales)",
        }
        return f"{names.get(fmt, 'unsupported')} (compressed-tensors {fmt or 'format unknown'})"
    return f"quant_method {method or 'unknown'!r}"


@dataclass(frozen=True)
class ModelOptModules:
    """What a ModelOpt config says about individual modules.

    ModelOpt's ``MIXED_PRECISION`` configs (``quant_method: modelopt_mixed``, or
    ``hf_quant_config.json`` with ``quant_algo: MIXED_PRECISION``) list every quantized module
    in ``quantized_layers`` with its own ``quant_algo`` (``FP8_PB_WO``, ``NVFP4``, ``FP8``,
    ``MXFP8``, ...); a module not listed is not quantized. Every ModelOpt config may list
    ``exclude_modules``, fnmatch patterns of modules left unquantized. Module names are
    checkpoint names without ``.weight``; NVIDIA's Kimi K3 export lists each one in several
    spellings (``language_model.model.layers.N...``, ``model.layers.N...``,
    ``layers.N...``), and any of them counts.

    Attributes:
        quantized_layers: module -> ``quant_algo``; None when the config is not
            ``MIXED_PRECISION`` (then the top-level ``quant_algo`` applies to every module
            not excluded).
        exclude_modules: the fnmatch patterns.
    """

    quantized_layers: Mapping[str, str] | None
    exclude_modules: tuple[str, ...]

    def algo(self, module: str) -> str | None:
        """The ``quant_algo`` ``quantized_layers`` gives ``module`` under any of its spellings;
        None when not listed (or when the config is not ``MIXED_PRECISION``)."""
        if self.quantized_layers is None:
            return None
        for alias in _module_aliases(module):
            if alias in self.quantized_layers:
                return self.quantized_layers[alias]
        return None

    def excluded_by(self, module: str) -> str | None:
        """The ``exclude_modules`` pattern that matches ``module`` (any spelling), or None."""
        for pattern in self.exclude_modules:
            if any(fnmatch.fnmatchcase(alias, pattern) for alias in _module_aliases(module)):
                return pattern
        return None


def _modelopt_modules(quant: Mapping[str, Any] | None) -> ModelOptModules | None:
    if quant is None or str(quant.get("quant_method", "")).lower() not in (
        "modelopt", "modelopt_mixed"
    ):
        return None
    listed = None
    mixed = str(quant.get("quant_method")).lower() == "modelopt_mixed"
    if mixed or quant.get("quant_algo") == "MIXED_PRECISION":
        layers = quant.get("quantized_layers")
        listed = {
            str(module): str(entry.get("quant_algo", ""))
            for module, entry in (layers.items() if isinstance(layers, Mapping) else ())
            if isinstance(entry, Mapping)
        }
    excluded = quant.get("exclude_modules")
    patterns = tuple(str(p) for p in excluded) if isinstance(excluded, list) else ()
    return ModelOptModules(listed, patterns)


def _module_aliases(module: str) -> list[str]:
    """``module`` and the spellings ModelOpt's Kimi K3 export also lists it under: without
    ``language_model.``, and without ``language_model.model.``."""
    names = [module]
    for prefix in ("language_model.", "language_model.model."):
        if module.startswith(prefix):
            names.append(module[len(prefix):])
    return names


def _block(value: Any, key: str) -> tuple[int, int]:
    if (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        return int(value[0]), int(value[1])
    raise CheckpointError(f"quantization_config: {key} = {value!r} is not two positive integers")


def dequantize(weight: Any, scale: Any, block: tuple[int, int] = _MODELOPT_BLOCK) -> np.ndarray:
    """A block-quantized weight as float32: ``weight[i, j] * scale[i // bo, j // bi]``.

    Args:
        weight: the weight ``[out, in]``, any array-like (``ml_dtypes.float8_e4m3fn`` /
            ``float8_e5m2`` for FP8, e.g. ``Tensor.array``; any float dtype works).
        scale: its scale grid, 2-D ``[ceil(out/bo), ceil(in/bi)]`` (DeepSeek
            ``weight_scale_inv``, compressed-tensors) or ModelOpt's 4-D
            ``[ceil(out/bo), 1, ceil(in/bi), 1]``, any float dtype.
        block: ``(bo, bi)`` block edge in elements (128 x 128 in every published checkpoint).
            A rank's local weight and local grid (``KdaTensorPlan.scale``) dequantize with the
            same call, because a rank's range starts on a block boundary or lies in one block.

    Returns:
        float32 array of the weight's shape.

    Raises:
        ShapeMismatchError: the weight is not 2-D, the grid is not 2-D or ``[ob, 1, ib, 1]``,
            or its shape is not ``ceil(out/bo) x ceil(in/bi)``; the message gives both shapes.
    """
    import numpy as np  # noqa: PLC0415 - start-up time: the model facts import no numpy

    w = np.asarray(weight)
    grid = np.asarray(scale)
    bo, bi = block
    if w.ndim != 2:
        raise ShapeMismatchError(f"weight: shape {w.shape}, expected 2-D [out, in]")
    if grid.ndim == 4 and grid.shape[1] == grid.shape[3] == 1:
        grid = grid[:, 0, :, 0]
    want = (-(-w.shape[0] // bo), -(-w.shape[1] // bi))
    if grid.shape != want:
        raise ShapeMismatchError(
            f"scale: shape {list(np.asarray(scale).shape)} does not match the weight "
            f"{list(w.shape)} in {bo}x{bi} blocks; expected {list(want)} (or "
            f"{[want[0], 1, want[1], 1]})"
        )
    full = np.repeat(np.repeat(grid.astype(np.float32), bo, axis=0), bi, axis=1)
    return w.astype(np.float32) * full[: w.shape[0], : w.shape[1]]
