"""Reading KDA geometry from a model config.

Three key styles are understood, at the top level or, for multimodal wrappers such as Kimi K3's
(``model_type: kimi_k3``), under ``text_config`` when the top level has no KDA geometry:

* Kimi-Linear / Kimi K3: ``hidden_size`` and ``linear_attn_config`` with ``head_dim``,
  ``num_heads``, ``short_conv_kernel_size``, ``kda_layers`` (1-based layer numbers) and, for
  K3, ``use_full_rank_gate`` (bool) and ``gate_lower_bound`` (float < 0).
* transformers' native ``kimi_linear`` and Qwen3-Next style: ``hidden_size``,
  ``linear_key_head_dim`` / ``linear_num_key_heads`` (or the older ``linear_head_dim`` /
  ``linear_num_heads``), ``linear_conv_kernel_dim``, with KDA layers marked
  ``"linear_attention"`` or ``"kda_attention"`` in ``layer_types``.

A config that describes no KDA layer (a Llama config, an empty ``kda_layers``) is refused with
a message that starts "no KDA layers".
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .errors import CheckpointError

__all__ = ["KdaConfig", "load_config", "no_config_message", "parse_config"]

# Larger than any real model dimension; above it a config value is taken as corrupt.
_MAX_DIM = 2**31

CONFIG_NAME = "config.json"

# The gate is computed in float32: a lower bound beyond its range would turn the gate into inf/NaN.
_FLOAT32_MAX = 3.4028234663852886e38

#: ``layer_types`` entries that mark a KDA layer (transformers' ``kimi_linear``, Qwen3-Next).
KDA_LAYER_TYPES = ("linear_attention", "kda_attention")


@dataclass(frozen=True)
class KdaConfig:
    """The KDA geometry of a model config.

    Attributes:
        hidden: hidden size (elements).
        head_dim: elements per KDA head.
        heads: KDA head count before sharding.
        conv_kernel: short-convolution kernel width.
        kda_layers: 0-based indices of the KDA layers, or None when the config does not say.
        rms_norm_eps: epsilon of the gated output RMSNorm (``rms_norm_eps``, default 1e-5).
        source: where the config came from (a path, or ``"<dict>"``; ``...:text_config`` for a
            wrapper), for error messages.
        full_rank_gate: Kimi K3's full-rank output gate ``g_proj``
            (``linear_attn_config.use_full_rank_gate``), instead of ``g_a_proj``/``g_b_proj``.
        gate_lower_bound: Kimi K3's forget-gate lower bound (``gate_lower_bound``, < 0), or None
            for Kimi-Linear's unbounded softplus gate.
    """

    hidden: int
    head_dim: int
    heads: int
    conv_kernel: int
    kda_layers: tuple[int, ...] | None
    rms_norm_eps: float
    source: str
    full_rank_gate: bool = False
    gate_lower_bound: float | None = None


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read ``config.json`` (or the ``config.json`` inside a checkpoint directory) as a dict.

    Raises:
        CheckpointError: the file is missing (the message says which: a directory without
            ``config.json``, a missing directory, or a missing ``.json`` file), not a regular
            file, unreadable or not a JSON object.
    """
    given = Path(path)
    path = given / CONFIG_NAME if given.is_dir() else given
    if path.exists() and not path.is_file():
        # A FIFO would block read_text() forever; a directory or device is no config either.
        raise CheckpointError(f"{path}: not a regular file")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(_not_found(given)) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read the config as JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: the config is {type(config).__name__}, not a JSON object")
    return config


def no_config_message(directory: str | os.PathLike[str]) -> str:
    """The message for a checkpoint directory without ``config.json``, with the fix.

    Args:
        directory: the checkpoint directory, named at the start of the message.
    """
    return (f"{directory}: no {CONFIG_NAME} in this directory; kda_tp reads the model's geometry "
            f"and its KDA layers from it: put the model's {CONFIG_NAME} there")


def _not_found(given: Path) -> str:
    """Why ``load_config(given)`` found no file: a directory without a config, a missing
    directory, or a missing config file."""
    if given.is_dir():
        return no_config_message(given)
    if given.suffix != ".json":
        return f"{given}: no such directory"
    if not given.parent.is_dir():
        return f"{given.parent}: no such directory"
    return f"{given}: no such config file"


def parse_config(config: Mapping[str, Any], source: str = "<dict>") -> KdaConfig:
    """Extract the KDA geometry from a config dict (see the module docstring for the keys).

    Raises:
        CheckpointError: the config is not a mapping; it describes no KDA layer ("no KDA
            layers: ..."); a required key is missing; a size is not an integer in
            ``[1, 2**31)`` (layer indices: ``[0, 2**31)``); ``use_full_rank_gate`` is not a bool
            or ``gate_lower_bound`` not a finite number below 0. The message names ``source``
            and the key.
    """
    if not isinstance(config, Mapping):
        raise CheckpointError(f"{source}: the config is {type(config).__name__}, not a JSON object")
    if not _has_kda_keys(config) and isinstance(config.get("text_config"), Mapping):
        config, source = config["text_config"], f"{source}:text_config"
    if not _has_kda_keys(config):
        raise CheckpointError(
            f"{source}: no KDA layers: the config has no linear_attn_config, "
            f"linear_key_head_dim or linear_head_dim (model_type {config.get('model_type')!r})"
        )

    def dim(mapping: Mapping[str, Any], key: str, where: str = "") -> int:
        if key not in mapping:
            raise CheckpointError(f"{source}: config has no {where}{key!r}")
        return _int_in_range(mapping[key], f"{where}{key}", source, low=1)

    full_rank_gate, lower_bound = False, None
    linear = config.get("linear_attn_config")
    if linear is not None:
        if not isinstance(linear, Mapping):
            raise CheckpointError(f"{source}: 'linear_attn_config' is not an object")
        where = "linear_attn_config."
        head_dim = dim(linear, "head_dim", where)
        heads = dim(linear, "num_heads", where)
        conv_kernel = dim(linear, "short_conv_kernel_size", where)
        layers = linear.get("kda_layers")
        if layers is None:
            kda_layers = None
        elif isinstance(layers, list):
            # Kimi-Linear numbers layers from 1.
            kda_layers = tuple(
                _int_in_range(n, f"{where}kda_layers", source, low=1) - 1 for n in layers
            )
            if not kda_layers:
                raise CheckpointError(f"{source}: no KDA layers: '{where}kda_layers' is empty")
        else:
            raise CheckpointError(f"{source}: '{where}kda_layers' is not a list")
        full_rank_gate = linear.get("use_full_rank_gate", False)
        if not isinstance(full_rank_gate, bool):
            raise CheckpointError(
                f"{source}: '{where}use_full_rank_gate' = {full_rank_gate!r} is not a bool"
            )
        lower_bound = linear.get("gate_lower_bound")
        if lower_bound is not None and (
            isinstance(lower_bound, bool)
            or not isinstance(lower_bound, (int, float))
            or not -_FLOAT32_MAX <= lower_bound < 0
        ):
            raise CheckpointError(
                f"{source}: '{where}gate_lower_bound' = {lower_bound!r} is not a number below 0 "
                "that float32 can hold (K3 uses -5.0)"
            )
    else:
        native = "linear_key_head_dim" in config or "linear_num_key_heads" in config
        head_dim = dim(config, "linear_key_head_dim" if native else "linear_head_dim")
        heads = dim(config, "linear_num_key_heads" if native else "linear_num_heads")
        conv_kernel = dim(config, "linear_conv_kernel_dim")
        types = config.get("layer_types")
        if types is None:
            kda_layers = None
        elif isinstance(types, list):
            kda_layers = tuple(i for i, t in enumerate(types) if t in KDA_LAYER_TYPES)
            if not kda_layers:
                raise CheckpointError(
                    f"{source}: no KDA layers: 'layer_types' has no "
                    f"{' or '.join(map(repr, KDA_LAYER_TYPES))} entry"
                )
        else:
            raise CheckpointError(f"{source}: 'layer_types' is not a list")
    eps = config.get("rms_norm_eps", 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise CheckpointError(f"{source}: 'rms_norm_eps' = {eps!r} is not a number in (0, 1)")
    return KdaConfig(
        hidden=dim(config, "hidden_size"),
        head_dim=head_dim,
        heads=heads,
        conv_kernel=conv_kernel,
        kda_layers=kda_layers,
        rms_norm_eps=float(eps),
        source=source,
        full_rank_gate=full_rank_gate,
        gate_lower_bound=None if lower_bound is None else float(lower_bound),
    )


def _has_kda_keys(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` (one level, no wrapper) names any KDA geometry key."""
    return any(
        key in config
        for key in ("linear_attn_config", "linear_key_head_dim", "linear_num_key_heads",
                    "linear_head_dim", "linear_num_heads")
    )


def _int_in_range(value: Any, key: str, source: str, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < _MAX_DIM:
        raise CheckpointError(
            f"{source}: {key!r} = {value!r} is not an integer in [{low}, 2**31)"
        )
    return value
