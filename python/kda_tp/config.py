"""Reading KDA geometry from a model config.

Two key styles are understood:

* Kimi-Linear: ``hidden_size`` and ``linear_attn_config`` with ``head_dim``, ``num_heads``,
  ``short_conv_kernel_size`` and ``kda_layers`` (1-based layer numbers).
* Qwen3-Next style: ``hidden_size``, ``linear_key_head_dim``, ``linear_num_key_heads``,
  ``linear_conv_kernel_dim``, with KDA layers marked ``"linear_attention"`` in ``layer_types``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .errors import CheckpointError

__all__ = ["KdaConfig", "load_config", "parse_config"]

# Larger than any real model dimension; above it a config value is taken as corrupt.
_MAX_DIM = 2**31

CONFIG_NAME = "config.json"


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
        source: where the config came from (a path, or ``"<dict>"``), for error messages.
    """

    hidden: int
    head_dim: int
    heads: int
    conv_kernel: int
    kda_layers: tuple[int, ...] | None
    rms_norm_eps: float
    source: str


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read ``config.json`` (or the ``config.json`` inside a checkpoint directory) as a dict.

    Raises:
        CheckpointError: the file is missing, not a regular file, unreadable or not a JSON
            object.
    """
    path = Path(path)
    if path.is_dir():
        path = path / CONFIG_NAME
    if path.exists() and not path.is_file():
        # A FIFO would block read_text() forever; a directory or device is no config either.
        raise CheckpointError(f"{path}: not a regular file")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read the config as JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: the config is {type(config).__name__}, not a JSON object")
    return config


def parse_config(config: Mapping[str, Any], source: str = "<dict>") -> KdaConfig:
    """Extract the KDA geometry from a config dict.

    Raises:
        CheckpointError: the config is not a mapping, a required key is missing, or a value is
            not an integer in ``[1, 2**31)`` (layer indices: ``[0, 2**31)``); the message names
            ``source`` and the key.
    """

    if not isinstance(config, Mapping):
        raise CheckpointError(f"{source}: the config is {type(config).__name__}, not a JSON object")

    def dim(mapping: Mapping[str, Any], key: str, where: str = "") -> int:
        if key not in mapping:
            raise CheckpointError(f"{source}: config has no {where}{key!r}")
        return _int_in_range(mapping[key], f"{where}{key}", source, low=1)

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
        else:
            raise CheckpointError(f"{source}: '{where}kda_layers' is not a list")
    else:
        head_dim = dim(config, "linear_key_head_dim")
        heads = dim(config, "linear_num_key_heads")
        conv_kernel = dim(config, "linear_conv_kernel_dim")
        types = config.get("layer_types")
        if types is None:
            kda_layers = None
        elif isinstance(types, list):
            kda_layers = tuple(i for i, t in enumerate(types) if t == "linear_attention")
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
    )


def _int_in_range(value: Any, key: str, source: str, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < _MAX_DIM:
        raise CheckpointError(
            f"{source}: {key!r} = {value!r} is not an integer in [{low}, 2**31)"
        )
    return value
