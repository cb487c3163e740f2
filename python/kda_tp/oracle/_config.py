"""The oracle's reading of a ``config.json``: KDA geometry and layers, and the FP8 block size.

Written on its own from transformers' configuration classes and the model cards, never from
``kda_tp.model.config``, which it checks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kda_tp.errors import CheckpointError

@dataclass(frozen=True)
class KdaConfig:
    """KDA geometry read from a ``config.json``. ``kda_layers`` are 0-based layer indices;
    ``full_rank_gate`` is Kimi K3's ``use_full_rank_gate``."""

    hidden: int
    head_dim: int
    heads: int
    conv_kernel: int
    kda_layers: frozenset[int]
    full_rank_gate: bool = False


def read_kda_config(config: Mapping[str, Any], layers: Iterable[int] | None = None) -> KdaConfig:
    """The KDA geometry of a parsed ``config.json``.

    GLM-5.3-Flash (``model_type`` ``glm5_next`` or ``glm5_next_text``, at the top level or in
    ``text_config``) is read as transformers reads it: its ``text_config`` (or, flat, the top
    level), ``linear_head_dim`` / ``linear_num_heads`` / ``linear_conv_kernel_dim`` (a
    ``linear_attn_config`` ``head_dim`` / ``num_heads`` / ``short_conv_kernel_size`` wins;
    defaults 128, 64, 4, hidden 4096) and the ``"linear_attention"`` entries of ``layer_types``
    (default: 0-based index not 3 mod 4 of ``num_hidden_layers``, 45); never ``kda_layers``.

    Any other wrapper config (Kimi K3's ``model_type: kimi_k3``) keeps the language model's keys
    under ``text_config``; they are read from there when the top level has none. Two layouts are
    understood:

    * Kimi-Linear / Kimi K3: ``hidden_size`` and ``linear_attn_config`` with ``head_dim``,
      ``num_heads``, ``short_conv_kernel_size``, ``kda_layers`` (1-based layer numbers) and
      optionally ``use_full_rank_gate``.
    * transformers' ``kimi_linear`` / Qwen3-Next style: ``hidden_size``,
      ``linear_key_head_dim`` and ``linear_num_key_heads`` (older spelling: ``linear_head_dim``
      and ``linear_num_heads``), ``linear_conv_kernel_dim`` and ``layer_types``, where
      ``"linear_attention"`` or ``"kda_attention"`` at index ``i`` marks 0-based layer ``i``
      as KDA.

    ``layers`` (0-based) stands in for a Kimi-style config without ``kda_layers`` (``kda-tp
    shard --layers`` records them in each rank's header as ``kda_tp_layers``).

    Raises:
        CheckpointError: neither layout is present ("no KDA layers"), no layer is KDA, or a
            value has the wrong type.
    """
    text = config.get("text_config")
    model_types = {config.get("model_type")}
    if isinstance(text, Mapping):
        model_types.add(text.get("model_type"))
    if model_types & {"glm5_next", "glm5_next_text"}:
        return _read_glm_config(text if isinstance(text, Mapping) else config)
    layout_keys = ("linear_attn_config", "linear_key_head_dim", "linear_head_dim")
    if not any(k in config for k in layout_keys) and isinstance(text, Mapping):
        config = text
    try:
        if isinstance(config.get("linear_attn_config"), Mapping):
            lac = config["linear_attn_config"]
            result = KdaConfig(
                hidden=config["hidden_size"],
                head_dim=lac["head_dim"],
                heads=lac["num_heads"],
                conv_kernel=lac["short_conv_kernel_size"],
                kda_layers=(
                    _kimi_kda_layers(lac["kda_layers"], config.get("num_hidden_layers"))
                    if "kda_layers" in lac or layers is None
                    else frozenset(layers)
                ),
                full_rank_gate=lac.get("use_full_rank_gate", False) is True,
            )
        elif "layer_types" in config and (
            "linear_key_head_dim" in config or "linear_head_dim" in config
        ):
            key = "linear_key_head_dim" if "linear_key_head_dim" in config else "linear_head_dim"
            heads = "linear_num_key_heads" if key == "linear_key_head_dim" else "linear_num_heads"
            result = KdaConfig(
                hidden=config["hidden_size"],
                head_dim=config[key],
                heads=config[heads],
                conv_kernel=config["linear_conv_kernel_dim"],
                kda_layers=frozenset(
                    i
                    for i, t in enumerate(config["layer_types"])
                    if t in ("linear_attention", "kda_attention")
                ),
            )
        else:
            raise CheckpointError(
                "config.json: no KDA layers: neither linear_attn_config (Kimi-Linear, K3) nor "
                "layer_types + linear_key_head_dim (kimi_linear, Qwen3-Next style)"
            )
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"config.json: missing or malformed KDA key: {exc}") from exc
    sizes = (result.hidden, result.head_dim, result.heads, result.conv_kernel)
    if not all(isinstance(v, int) and v > 0 for v in sizes) or not all(
        isinstance(i, int) and i >= 0 for i in result.kda_layers
    ):
        raise CheckpointError(f"config.json: KDA geometry is not positive integers: {result}")
    if not result.kda_layers:
        raise CheckpointError("config.json: no KDA layers: the config marks no layer as KDA")
    return result


def _kimi_kda_layers(numbers: Any, count: Any) -> frozenset[int]:
    """0-based layers from Kimi-Linear's 1-based ``kda_layers``: each listed once, none beyond
    ``num_hidden_layers`` (transformers' ``KimiLinearConfig`` sets ``layer_types[n - 1]``)."""
    numbers = list(numbers)
    if len(set(numbers)) != len(numbers):
        raise CheckpointError(
            f"config.json: linear_attn_config.kda_layers {numbers} repeats a layer"
        )
    if isinstance(count, int) and any(isinstance(n, int) and n > count for n in numbers):
        raise CheckpointError(
            f"config.json: linear_attn_config.kda_layers {numbers} goes beyond "
            f"num_hidden_layers {count}"
        )
    return frozenset(n - 1 for n in numbers)


# How transformers (configuration_utils.py) reads one entry of a GLM-5.3-Flash ``layer_types``:
# the layer type it becomes, or no entry when validate_layer_type refuses it. The names of
# ALLOWED_ATTN_LAYER_TYPES stand for themselves; _LEGACY_LAYER_TYPE_REMAP's older names are
# read as their newer ones before the check.
_LAYER_TYPE_AS_READ = {
    **{name: name for name in (
        "full_attention", "sliding_attention", "chunked_attention", "window_attention",
        "indexed_attention", "compressed_sparse_attention", "heavily_compressed_attention",
        "minimax_m3_sparse", "conv", "moe", "hybrid", "hybrid_sliding",
        "reference_sliding_attention", "linear_attention",
    )},
    "mamba": "linear_attention",
    "attention": "full_attention",
    "deepseek_sparse_attention": "indexed_attention",
    "qwen_sparse_attention": "indexed_attention",
}
# The layer types transformers allows (named in the refusal), in its order.
_ALLOWED_LAYER_TYPES = tuple(t for t, read in _LAYER_TYPE_AS_READ.items() if t == read)


def _read_glm_config(text: Mapping[str, Any]) -> KdaConfig:
    """GLM-5.3-Flash's text config as transformers' ``Glm5NextTextConfig`` reads it: a
    ``linear_attn_config`` key wins over the flat one, then the class default; KDA layers are the
    ``"linear_attention"`` entries of ``layer_types`` (default: every layer whose 0-based index
    is not 3 mod 4); ``kda_layers`` is not read."""
    lac = text.get("linear_attn_config") or {}
    if not isinstance(lac, Mapping):
        raise CheckpointError("config.json: linear_attn_config is not an object")

    def get(flat: str, nested: str, default: int) -> Any:
        return lac[nested] if nested in lac else text.get(flat, default)

    types = text.get("layer_types")
    count = text.get("num_hidden_layers", 45)
    if types is None:
        kda = frozenset(i for i in range(count) if i % 4 != 3)
    else:
        # transformers: legacy names remapped, then PreTrainedConfig.validate_layer_type.
        read = [_LAYER_TYPE_AS_READ.get(t) for t in types]
        unknown = [t for t, as_read in zip(types, read, strict=True) if as_read is None]
        if unknown:
            raise CheckpointError(
                f"config.json: layer_types has {unknown}: transformers allows only "
                f"{_ALLOWED_LAYER_TYPES} for GLM-5.3-Flash"
            )
        types = read
        if len(types) != count:
            raise CheckpointError(
                f"config.json: layer_types has {len(types)} entries, num_hidden_layers is {count}"
            )
        kda = frozenset(i for i, t in enumerate(types) if t == "linear_attention")
    result = KdaConfig(
        hidden=text.get("hidden_size", 4096),
        head_dim=get("linear_head_dim", "head_dim", 128),
        heads=get("linear_num_heads", "num_heads", 64),
        conv_kernel=get("linear_conv_kernel_dim", "short_conv_kernel_size", 4),
        kda_layers=kda,
    )
    sizes = (result.hidden, result.head_dim, result.heads, result.conv_kernel)
    if not all(isinstance(v, int) and v > 0 for v in sizes) or not result.kda_layers:
        raise CheckpointError(f"config.json: GLM-5.3-Flash KDA geometry is not valid: {result}")
    return result


def config_block(config: Mapping[str, Any], directory: Path) -> tuple[int, int] | None:
    """The FP8 block edge a config declares: 128 x 128 for NVIDIA ModelOpt (``modelopt``,
    ``modelopt_mixed`` or an ``hf_quant_config.json``), ``weight_block_size`` for DeepSeek-style
    ``fp8``, a block ``block_structure`` for compressed-tensors; None otherwise."""
    quant = config.get("quantization_config")
    if not isinstance(quant, Mapping):
        quant = (config.get("text_config") or {}).get("quantization_config")
    if not isinstance(quant, Mapping):
        if (directory / "hf_quant_config.json").is_file():
            return (128, 128)
        return None
    method = quant.get("quant_method")
    if method in ("modelopt", "modelopt_mixed"):
        return (128, 128)
    if method == "fp8" and quant.get("weight_block_size"):
        return tuple(quant["weight_block_size"])
    if method == "compressed-tensors":
        for group in (quant.get("config_groups") or {}).values():
            weights = group.get("weights") or {}
            if weights.get("strategy") == "block":
                return tuple(weights["block_structure"])
    return None
