"""The engine's model dtype: what a serving engine casts the KDA parameters to that have no
dtype of their own (projections, ``o_norm``; not the F32 ``A_log``, ``dt_bias`` or convs a
layout fixes, nor FP8 weights).

One rule for ``kda-tp dump``, ``kda-tp digests``, ``kda-tp audit`` and the guard: the
engine's ``--dtype`` when it is given (``model_dtype=``), else its ``auto`` dtype, read from the
checkpoint's ``config.json`` as the engine reads it:

* vLLM 0.33 (``vllm/config/model.py``: ``_get_and_verify_dtype``; ``ModelArchConfigConvertorBase
  .get_torch_dtype``): the config's ``dtype`` (transformers reads a ``torch_dtype`` key as
  ``dtype``), else ``text_config``'s, else the common dtype of the checkpoint's tensors
  (F32 when any is F32), else F32; then ``auto`` turns F32 into the platform's preferred dtype,
  BF16 (Ampere and later GPUs, x86 and aarch64 CPUs).
* SGLang 0.5.23 (``srt/configs/model_config.py``: ``_get_and_verify_dtype`` on
  ``get_hf_text_config``): ``text_config``'s ``dtype`` (it inherits the top level's when it
  has none), else the top level's, else F32; then ``auto`` turns F32 into F16 ("the common
  practice for float32 models").
* transformers 5 (``from_pretrained``'s ``dtype="auto"``): the config's dtype as vLLM reads
  it, else F32.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..checkpoint.description import CheckpointDescription
from ..errors import DtypeMismatchError
from ..model.dtypes import FP8_DTYPES, MODEL_DTYPES, SPELLINGS

__all__ = ["config_dtype", "config_model_dtype", "engine_model_dtype", "model_dtype_name"]


def _dtype_of(config: Mapping[str, Any] | None) -> str | None:
    """A config level's ``dtype`` (else its ``torch_dtype``) as a safetensors name; None when
    it has none or names no float dtype an engine runs in."""
    if not isinstance(config, Mapping):
        return None
    value = config.get("dtype") or config.get("torch_dtype")
    name = model_dtype_name(value) if isinstance(value, str) else None
    return name if name in MODEL_DTYPES else None


def config_dtype(config: Mapping[str, Any] | None, engine: str) -> str | None:
    """The dtype ``engine`` (``"vllm"``, ``"sglang"``, ``"transformers"``) reads from a
    checkpoint's config (see the module's text for where each looks), before its ``auto``
    rule; None when the config says none."""
    top = _dtype_of(config)
    text = _dtype_of(config.get("text_config")) if isinstance(config, Mapping) else None
    return (text or top) if engine == "sglang" else (top or text)


def engine_model_dtype(description: CheckpointDescription, engine: str,
                       model_dtype: str | None = None) -> str:
    """The model dtype of ``engine`` serving a checkpoint: ``model_dtype`` (its ``--dtype``)
    when given, else its ``auto`` dtype for the checkpoint (the module's rule).

    Args:
        description: the checkpoint's description (``kda_tp.describe``: its config; for vLLM
            without a config dtype, its tensors' dtypes).
        engine: the engine of the layout (``EngineLayout.engine``).
        model_dtype: ``"BF16"``, ``"F16"`` or ``"F32"`` (also ``bfloat16``, ``float16``,
            ``float32``), or None for the engine's default.

    Returns:
        A safetensors dtype name, one of ``kda_tp.model.dtypes.MODEL_DTYPES``.

    Raises:
        DtypeMismatchError: ``model_dtype`` is not a model dtype.
    """
    config = description.config
    if model_dtype is None and config_dtype(config, engine) is None and engine == "vllm":
        return config_model_dtype(config, engine,
                                  tensors_dtype=_tensors_dtype(description.stored_dtypes))
    return config_model_dtype(config, engine, model_dtype)


def config_model_dtype(config: Mapping[str, Any] | None, engine: str,
                       model_dtype: str | None = None, *,
                       tensors_dtype: str | None = None) -> str:
    """:func:`engine_model_dtype` from a config alone (no checkpoint on disk: an RL refit's
    tensors are in memory): ``model_dtype`` when given, else the config's dtype as ``engine``
    reads it, else ``tensors_dtype`` (vLLM's dtype for a config without one, when known),
    with F32 or none becoming the engine's default (vLLM BF16, SGLang F16).

    Raises:
        DtypeMismatchError: ``model_dtype`` is not a model dtype.
    """
    if model_dtype is not None:
        name = model_dtype_name(model_dtype) or (
            # Any case, as the command line's --dtype: "bf16", "BFloat16", "float32".
            SPELLINGS.get(model_dtype.lower(), model_dtype.upper())
            if isinstance(model_dtype, str) else str(model_dtype))
        if name not in MODEL_DTYPES:
            raise DtypeMismatchError(
                f"model_dtype {model_dtype!r} is not a model dtype an engine runs in; pass one "
                f"of {', '.join(MODEL_DTYPES)} (--dtype bfloat16, float16, float32), or none "
                "for the engine's default"
            )
        return name
    found = config_dtype(config, engine) or tensors_dtype
    if found in (None, "F32"):
        return {"vllm": "BF16", "sglang": "F16"}.get(engine, "F32")
    return found


def _tensors_dtype(seen: frozenset[str]) -> str | None:
    """vLLM's dtype for a config without one, from the dtypes of the checkpoint's tensors
    (``seen``): the dtype they all cast to without loss (``common_broadcastable_dtype``): F32
    when any is F32 (or F64), F16 when all are F16 (FP8 casts to it without loss), else BF16;
    None without float tensors."""
    if seen & {"F32", "F64"}:
        return "F32"
    if "F16" in seen and "BF16" not in seen:
        return "F16"
    if seen & {"BF16", "F16", *FP8_DTYPES}:
        return "BF16"
    return None


def model_dtype_name(dtype: Any) -> str | None:
    """The safetensors name (``"BF16"``) of a float dtype as torch, numpy, a config or an
    engine's ``--dtype`` spells it (``torch.bfloat16``, ``np.dtype("float32")``,
    ``"bfloat16"``, ``"BF16"``: ``kda_tp.model.dtypes.SPELLINGS``); None for any other
    (an integer dtype, an unknown name)."""
    text = str(dtype)
    if text in SPELLINGS.values():
        return text
    return SPELLINGS.get(text.lower().removeprefix("torch."))
