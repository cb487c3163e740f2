"""Reading KDA geometry from a model config, as the model's own reference code reads it.

The rules are chosen by ``model_type`` (top level, else ``text_config.model_type``); each rule
below names the code it follows.

* **GLM-5.3-Flash** (``glm5_next``, ``glm5_next_text``; ``RULES_GLM``): transformers'
  ``configuration_glm5_next.py`` (``Glm5NextTextConfig``), the model's reference implementation.
  The text fields sit under ``text_config`` (wrapper) or at the top level (flat text-only
  config): ``hidden_size``, ``linear_head_dim``, ``linear_num_heads``,
  ``linear_conv_kernel_dim``, each overridden by ``linear_attn_config.head_dim`` /
  ``num_heads`` / ``short_conv_kernel_size``, transformers' defaults when absent. The forget
  gate is lower-bounded: ``linear_lower_bound`` (default -5.0), overridden by
  ``linear_attn_config.gate_lower_bound``; if that leaves none and ``linear_attn_config
  .safe_gate`` (default true) holds, -5.0. KDA layers are the ``"linear_attention"`` entries of
  ``layer_types`` (``kda_layers`` is ignored); without ``layer_types``, every layer but each
  fourth (``index % 4 == 3`` is full attention) of ``num_hidden_layers``.
* **Kimi-Linear and Kimi K3** (``kimi_linear``, ``kimi_k3``, ``kimi_k3_text``;
  ``RULES_KIMI``): the keys below, at the top level or under ``text_config``; a forget-gate
  bound must lie in ``-5 <= bound < 0``, the range vLLM and SGLang assert.
* **Any other** ``model_type`` with KDA keys (``RULES_GENERIC``): the same keys as Kimi,
  any bound below 0.

Kimi and generic keys: ``hidden_size`` and ``linear_attn_config`` with ``head_dim``,
``num_heads``, ``short_conv_kernel_size``, ``kda_layers`` (1-based layer numbers) and, for K3,
``use_full_rank_gate`` (bool) and ``gate_lower_bound`` (float < 0; none: the softplus gate),
with ``layer_types`` (below) when ``kda_layers`` is absent; or
transformers' native ``kimi_linear`` and Qwen3-Next style: ``hidden_size``,
``linear_key_head_dim`` / ``linear_num_key_heads`` (or the older ``linear_head_dim`` /
``linear_num_heads``), ``linear_conv_kernel_dim``, with KDA layers marked
``"linear_attention"`` or ``"kda_attention"`` in ``layer_types``. For a wrapper (Kimi K3's
``model_type: kimi_k3``) they are read under ``text_config`` when the top level has none.

A config that describes no KDA layer (a Llama config, an empty ``kda_layers``) is refused with
a message that starts "no KDA layers".
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..errors import CheckpointError
from .families import FAMILIES, RULES_GENERIC, RULES_GLM, RULES_KIMI
from .json_reader import MAX_INT_DIGITS, read_json, short_repr

__all__ = [
    "KdaConfig",
    "RULES",
    "describes_kda",
    "MAX_LAYERS",
    "load_config",
    "no_config_message",
    "parse_config",
]

# Larger than any real model dimension; above it a config value is taken as corrupt.
_MAX_DIM = 2**31

#: Most decoder layers a config may declare (``num_hidden_layers``), where kda_tp lists them
#: (GLM-5.3-Flash without ``layer_types``); published models have under 200.
MAX_LAYERS = 2**16

CONFIG_NAME = "config.json"

# The gate is computed in float32: a lower bound beyond its range would turn the gate into inf/NaN.
_FLOAT32_MAX = 3.4028234663852886e38

#: ``layer_types`` entries that mark a KDA layer (transformers' ``kimi_linear``, Qwen3-Next).
KDA_LAYER_TYPES = ("linear_attention", "kda_attention")

#: Rule set -> (the ``model_type`` values that select it, what it follows), for messages; the
#: ``model_type`` values are those of the families in :data:`kda_tp.model.FAMILIES`.
RULES: dict[str, tuple[tuple[str, ...], str]] = {
    rules: (
        tuple(t for f in FAMILIES.values() if f.rules == rules for t in f.model_types),
        follows,
    )
    for rules, follows in (
        (RULES_GLM, "GLM-5.3-Flash, as transformers' configuration_glm5_next.py reads it"),
        (RULES_KIMI,
         "Kimi-Linear / Kimi K3 (linear_attn_config; bound range as vLLM and SGLang assert)"),
        (RULES_GENERIC, "unknown model_type: Kimi-Linear keys, any bound below 0"),
    )
}

# Glm5NextTextConfig's defaults (transformers configuration_glm5_next.py).
_GLM_DEFAULTS = {
    "hidden_size": 4096,
    "linear_head_dim": 128,
    "linear_num_heads": 64,
    "linear_conv_kernel_dim": 4,
    "num_hidden_layers": 45,
    "linear_lower_bound": -5.0,
}
# transformers configuration_utils.py: ALLOWED_ATTN_LAYER_TYPES, which validate_layer_type checks
# a GLM-5.3-Flash layer_types against, and _LEGACY_LAYER_TYPE_REMAP, applied before the check.
_GLM_LAYER_TYPES = (
    "full_attention", "sliding_attention", "chunked_attention", "window_attention",
    "indexed_attention", "compressed_sparse_attention", "heavily_compressed_attention",
    "minimax_m3_sparse", "conv", "moe", "hybrid", "hybrid_sliding",
    "reference_sliding_attention", "linear_attention",
)
_LEGACY_LAYER_TYPES = {
    "mamba": "linear_attention",
    "attention": "full_attention",
    "deepseek_sparse_attention": "indexed_attention",
    "qwen_sparse_attention": "indexed_attention",
}
# vLLM (kda.py) and SGLang assert -5 <= gate_lower_bound < 0 for Kimi models.
_KIMI_BOUND_MIN = -5.0


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
        gate_lower_bound: the forget gate's lower bound (< 0): the gate is
            ``bound * sigmoid(exp(A_log) * (f + dt_bias))``; None for the unbounded softplus gate
            ``-exp(A_log) * softplus(f + dt_bias)``.
        gate_bound_key: where ``gate_lower_bound`` came from: the config key, with a
            ``text_config.`` prefix when read there (``"text_config.linear_lower_bound"``), or
            ``"default (linear_lower_bound)"`` / ``"default (safe_gate)"`` for GLM-5.3-Flash's
            defaults; with no bound, the key that was looked for, e.g.
            ``"no linear_attn_config.gate_lower_bound"`` or ``"text_config.linear_lower_bound =
            null"``.
        rules: the rule set that read the config: ``RULES_GLM``, ``RULES_KIMI`` or
            ``RULES_GENERIC`` (see the module docstring).
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
    gate_bound_key: str = "no linear_attn_config.gate_lower_bound"
    rules: str = RULES_GENERIC

    @property
    def forget_gate(self) -> str:
        """``"lower_bound"`` (``bound * sigmoid(...)``) or ``"softplus"`` (no bound)."""
        return "softplus" if self.gate_lower_bound is None else "lower_bound"

    def describe_gate(self) -> str:
        """One line for people, e.g. ``forget gate: lower bound -5.0 (from
        text_config.linear_lower_bound); config rules: GLM-5.3-Flash, as transformers'
        configuration_glm5_next.py reads it``."""
        if self.gate_lower_bound is None:
            gate = f"softplus, no lower bound ({self.gate_bound_key})"
        else:
            gate = f"lower bound {self.gate_lower_bound} (from {self.gate_bound_key})"
        return f"forget gate: {gate}; config rules: {RULES[self.rules][1]}"


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read ``config.json`` (or the ``config.json`` inside a checkpoint directory) as a dict.

    Raises:
        CheckpointError: the file is missing (the message says which: a directory without
            ``config.json``, a missing directory, or a missing ``.json`` file), not a regular
            file, unreadable, larger than ``MAX_JSON_BYTES``, nested
            deeper than ``MAX_JSON_DEPTH``, holding an integer of
            more than ``MAX_INT_DIGITS`` digits, or not a JSON
            object.
    """
    given = Path(path)
    path = given / CONFIG_NAME if given.is_dir() else given
    try:
        config = read_json(path, "the config")
    except FileNotFoundError:
        raise CheckpointError(_not_found(given)) from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: the config is {type(config).__name__}, not a JSON object")
    return config



def _few(numbers: list[int]) -> str:
    """The first 8 of ``numbers``, comma-separated, and how many more."""
    more = f", ... ({len(numbers) - 8} more)" if len(numbers) > 8 else ""
    return ", ".join(map(str, numbers[:8])) + more



def no_config_message(directory: str | os.PathLike[str]) -> str:
    """The message for a checkpoint directory without ``config.json``, with the fix.

    Args:
        directory: the checkpoint directory, named at the start of the message.
    """
    return (f"{directory}: no {CONFIG_NAME} in this directory; kda_tp reads the model's geometry "
            f"and its KDA layers from it: put the model's {CONFIG_NAME} there")


def _not_found(given: Path) -> str:
    """Why ``load_config(given)`` found no file: a directory without a config, or a missing
    path (the missing directory, or the config file), in the one wording kda_tp uses for a
    missing path: ``PATH: no such file or directory``."""
    if given.is_dir():
        return no_config_message(given)
    if given.suffix != ".json":
        return f"{given}: no such file or directory"
    if not given.parent.is_dir():
        return f"{given.parent}: no such file or directory"
    return f"{given}: no such file or directory"


def parse_config(config: Mapping[str, Any], source: str = "<dict>") -> KdaConfig:
    """Extract the KDA geometry from a config dict, with the rules its ``model_type`` selects
    (see the module docstring).

    Raises:
        CheckpointError: the config is not a mapping; it describes no KDA layer ("no KDA
            layers: ..."); a required key is missing; a size is not an integer in
            ``[1, 2**31)`` (layer indices: ``[0, 2**31)``); ``use_full_rank_gate`` or
            ``safe_gate`` is not a bool; a forget-gate bound is not a finite number below 0
            (Kimi models: not in ``[-5, 0)``, the range vLLM and SGLang assert). The message
            names ``source`` and the key.
    """
    if not isinstance(config, Mapping):
        raise CheckpointError(f"{source}: the config is {type(config).__name__}, not a JSON object")
    rules = _rules(config)
    if rules == RULES_GLM:
        return _parse_glm(config, source)
    if not _has_kda_keys(config) and isinstance(config.get("text_config"), Mapping):
        config, source, where = config["text_config"], f"{source}:text_config", "text_config."
    else:
        where = ""
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
    bound_key = f"{where}linear_attn_config.gate_lower_bound"
    gate_bound_key = f"no {bound_key}"
    linear = config.get("linear_attn_config")
    if linear is not None:
        if not isinstance(linear, Mapping):
            raise CheckpointError(f"{source}: 'linear_attn_config' is not an object")
        lac = "linear_attn_config."
        head_dim = dim(linear, "head_dim", lac)
        heads = dim(linear, "num_heads", lac)
        conv_kernel = dim(linear, "short_conv_kernel_size", lac)
        layers = linear.get("kda_layers")
        if layers is None:
            # transformers' KimiLinearConfig writes layer_types beside a linear_attn_config
            # that may have no kda_layers (configuration_kimi_linear.py, __post_init__).
            kda_layers = _layer_types(config, KDA_LAYER_TYPES, source)
        elif isinstance(layers, list):
            kda_layers = _kimi_kda_layers(config, layers, f"{where}{lac}kda_layers", source)
        else:
            raise CheckpointError(f"{source}: '{lac}kda_layers' is not a list")
        full_rank_gate = linear.get("use_full_rank_gate", False)
        if not isinstance(full_rank_gate, bool):
            raise CheckpointError(
                f"{source}: '{lac}use_full_rank_gate' = {full_rank_gate!r} is not a bool"
            )
        # vLLM and SGLang (kimi_linear.py, kimi_k3.py) take the bound from this key alone.
        lower_bound = _bound(linear.get("gate_lower_bound"), bound_key, source, rules)
        if lower_bound is not None:
            gate_bound_key = bound_key
    else:
        native = "linear_key_head_dim" in config or "linear_num_key_heads" in config
        head_dim = dim(config, "linear_key_head_dim" if native else "linear_head_dim")
        heads = dim(config, "linear_num_key_heads" if native else "linear_num_heads")
        conv_kernel = dim(config, "linear_conv_kernel_dim")
        kda_layers = _layer_types(config, KDA_LAYER_TYPES, source)
    return KdaConfig(
        hidden=dim(config, "hidden_size"),
        head_dim=head_dim,
        heads=heads,
        conv_kernel=conv_kernel,
        kda_layers=kda_layers,
        rms_norm_eps=_eps(config, source),
        source=source,
        full_rank_gate=full_rank_gate,
        gate_lower_bound=lower_bound,
        gate_bound_key=gate_bound_key,
        rules=rules,
    )


def describes_kda(config: Any) -> bool:
    """Whether a parsed ``config.json`` describes KDA layers at all (cheap: keys only, nothing
    validated): a GLM-5.3-Flash config (``glm5_next``), or KDA geometry keys
    (``linear_attn_config``, ``linear_head_dim``, ...) at the top level or in ``text_config``.
    False for a non-KDA model (Llama, DeepSeek, a draft model's own config); a True config may
    still be refused by :func:`parse_config`."""
    if not isinstance(config, Mapping):
        return False
    text = config.get("text_config")
    return (_rules(config) == RULES_GLM or _has_kda_keys(config)
            or (isinstance(text, Mapping) and _has_kda_keys(text)))


def _rules(config: Mapping[str, Any]) -> str:
    """The rule set for ``config``: by its ``model_type``, else by ``text_config.model_type``."""
    text = config.get("text_config")
    model_types = [config.get("model_type")]
    if isinstance(text, Mapping):
        model_types.append(text.get("model_type"))
    for model_type in model_types:
        for rules, (names, _) in RULES.items():
            if model_type in names:
                return rules
    return RULES_GENERIC


def _parse_glm(config: Mapping[str, Any], source: str) -> KdaConfig:
    """GLM-5.3-Flash, as transformers reads it (``configuration_glm5_next.py``:
    ``Glm5NextConfig`` takes the text fields from ``text_config``, or from the top level when
    there is none; ``Glm5NextTextConfig.__post_init__`` applies ``linear_attn_config``)."""
    where = ""
    if isinstance(config.get("text_config"), Mapping):
        config, source, where = config["text_config"], f"{source}:text_config", "text_config."
    given = config.get("linear_attn_config")
    if given is not None and not isinstance(given, Mapping):
        raise CheckpointError(f"{source}: '{where}linear_attn_config' is not an object")
    linear: Mapping[str, Any] = given or {}

    def dim(key: str, linear_key: str | None = None) -> int:
        # linear_attn_config's key wins over the flat one; Glm5NextTextConfig's default last.
        if linear_key is not None and linear_key in linear:
            name, value = f"linear_attn_config.{linear_key}", linear[linear_key]
        else:
            name, value = key, config.get(key, _GLM_DEFAULTS[key])
        return _int_in_range(value, f"{where}{name}", source, low=1)

    # Glm5NextTextConfig.__post_init__: linear_lower_bound (default -5.0), then
    # linear_attn_config.gate_lower_bound, then -5.0 if none and safe_gate (default true).
    if "linear_lower_bound" in config:
        bound, key = config["linear_lower_bound"], f"{where}linear_lower_bound"
    else:
        bound, key = _GLM_DEFAULTS["linear_lower_bound"], "default (linear_lower_bound)"
    if given is not None:
        if "gate_lower_bound" in linear:
            bound = linear["gate_lower_bound"]
            key = f"{where}linear_attn_config.gate_lower_bound"
        safe_gate = linear.get("safe_gate", True)
        if not isinstance(safe_gate, bool):
            raise CheckpointError(
                f"{source}: '{where}linear_attn_config.safe_gate' = {safe_gate!r} is not a bool"
            )
        if safe_gate and bound is None:
            bound = -5.0
            key = (
                f"{where}linear_attn_config.safe_gate" if "safe_gate" in linear
                else "default (safe_gate)"
            )
    lower_bound = _bound(bound, key, source, RULES_GLM)

    # Glm5NextTextConfig.__post_init__: layer_types, "full_attention" read as
    # "indexed_attention"; without it index % 4 == 3 is full attention. kda_layers is not read.
    count = dim("num_hidden_layers")
    if config.get("layer_types") is None:
        # The layers are listed from the count alone: bound it before listing them.
        if count > MAX_LAYERS:
            raise CheckpointError(
                f"{source}: '{where}num_hidden_layers' = {count} is more than MAX_LAYERS = "
                f"{MAX_LAYERS} and the config has no '{where}layer_types' to say which are KDA; "
                "not a config kda_tp can read"
            )
        kda_layers: tuple[int, ...] | None = tuple(i for i in range(count) if i % 4 != 3)
        if not kda_layers:
            raise CheckpointError(f"{source}: no KDA layers: '{where}num_hidden_layers' = {count}")
    else:
        # Glm5NextTextDecoderLayer builds KDA for "linear_attention" only.
        kda_layers = _glm_layer_types(config, count, where, source)
    return KdaConfig(
        hidden=dim("hidden_size"),
        head_dim=dim("linear_head_dim", "head_dim"),
        heads=dim("linear_num_heads", "num_heads"),
        conv_kernel=dim("linear_conv_kernel_dim", "short_conv_kernel_size"),
        kda_layers=kda_layers,
        rms_norm_eps=_eps(config, source),
        source=source,
        gate_lower_bound=lower_bound,
        gate_bound_key=key if lower_bound is not None else f"{key} = null",
        rules=RULES_GLM,
    )


def _kimi_kda_layers(
    config: Mapping[str, Any], layers: list[Any], key: str, source: str
) -> tuple[int, ...]:
    """0-based KDA layers from Kimi-Linear's 1-based ``linear_attn_config.kda_layers``.

    transformers' ``KimiLinearConfig`` writes ``layer_types[n - 1]`` for each ``n``, so a
    repeated number names one layer twice (kda_tp would plan and check it twice) and a number
    beyond ``num_hidden_layers`` fails there with an IndexError: both are refused here.
    """
    numbers = [_int_in_range(n, key, source, low=1) for n in layers]
    if not numbers:
        raise CheckpointError(f"{source}: no KDA layers: '{key}' is empty")
    repeated = sorted(n for n, times in Counter(numbers).items() if times > 1)
    if repeated:
        raise CheckpointError(
            f"{source}: '{key}' = {short_repr(layers)} lists layer {_few(repeated)} more "
            "than once; list each KDA layer once (1-based)"
        )
    count = config.get("num_hidden_layers")
    if isinstance(count, int) and not isinstance(count, bool):
        beyond = [n for n in numbers if n > count]
        if beyond:
            raise CheckpointError(
                f"{source}: '{key}' = {short_repr(layers)}: {_few(beyond)} beyond "
                f"num_hidden_layers = {count} (kda_layers are 1-based: 1..{count})"
            )
    return tuple(n - 1 for n in numbers)


def _glm_layer_types(
    config: Mapping[str, Any], count: int, where: str, source: str
) -> tuple[int, ...]:
    """0-based KDA layers (``"linear_attention"``) of a GLM-5.3-Flash ``layer_types``, checked
    as transformers checks it: legacy names remapped (``configuration_utils.py``,
    ``remap_legacy_layer_types``), every entry in ``ALLOWED_ATTN_LAYER_TYPES`` and one entry per
    layer (``PreTrainedConfig.validate_layer_type``)."""
    types = config["layer_types"]
    key = f"{where}layer_types"
    if not isinstance(types, list):
        raise CheckpointError(f"{source}: '{key}' is not a list")
    # Glm5NextTextConfig.__post_init__ reads "full_attention" as "indexed_attention".
    remapped = [_LEGACY_LAYER_TYPES.get(t, t) if isinstance(t, str) else t for t in types]
    unknown = [t for t in remapped if t not in _GLM_LAYER_TYPES]
    if unknown:
        raise CheckpointError(
            f"{source}: '{key}' has {', '.join(map(repr, unknown))}: transformers refuses "
            f"GLM-5.3-Flash layer types outside {', '.join(_GLM_LAYER_TYPES)} (KDA layers are "
            "'linear_attention')"
        )
    if len(types) != count:
        raise CheckpointError(
            f"{source}: '{key}' has {len(types)} entries but {where}num_hidden_layers is "
            f"{count}: transformers requires one entry per layer"
        )
    kda_layers = tuple(i for i, t in enumerate(remapped) if t == "linear_attention")
    if not kda_layers:
        raise CheckpointError(f"{source}: no KDA layers: '{key}' has no 'linear_attention' entry")
    return kda_layers


def _bound(value: Any, key: str, source: str, rules: str) -> float | None:
    """A forget-gate lower bound read from ``key``, checked; None stays None."""
    if value is None:
        return None
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if rules == RULES_KIMI:
        if not (number and _KIMI_BOUND_MIN <= value < 0):
            raise CheckpointError(
                f"{source}: '{key}' = {value!r} is not in [-5, 0): vLLM and SGLang assert "
                "-5 <= gate_lower_bound < 0 for Kimi models (K3 uses -5.0)"
            )
    elif not (number and -_FLOAT32_MAX <= value < 0):
        raise CheckpointError(
            f"{source}: '{key}' = {value!r} is not a number below 0 that float32 can hold "
            "(GLM-5.3-Flash and K3 use -5.0)"
        )
    return float(value)


def _layer_types(
    config: Mapping[str, Any], kda_types: tuple[str, ...], source: str
) -> tuple[int, ...] | None:
    """0-based indices of the ``layer_types`` entries in ``kda_types``; None without the key."""
    types = config.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list):
        raise CheckpointError(f"{source}: 'layer_types' is not a list")
    kda_layers = tuple(i for i, t in enumerate(types) if t in kda_types)
    if not kda_layers:
        raise CheckpointError(
            f"{source}: no KDA layers: 'layer_types' has no "
            f"{' or '.join(map(repr, kda_types))} entry"
        )
    return kda_layers


def _eps(config: Mapping[str, Any], source: str) -> float:
    eps = config.get("rms_norm_eps", 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise CheckpointError(f"{source}: 'rms_norm_eps' = {eps!r} is not a number in (0, 1)")
    return float(eps)


def _has_kda_keys(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` (one level, no wrapper) names any KDA geometry key."""
    return any(
        key in config
        for key in ("linear_attn_config", "linear_key_head_dim", "linear_num_key_heads",
                    "linear_head_dim", "linear_num_heads")
    )


def _int_in_range(value: Any, key: str, source: str, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < _MAX_DIM:
        # repr() of an int past 4300 digits raises; a dict from Python may hold one.
        huge = isinstance(value, int) and abs(value) >= 10**MAX_INT_DIGITS
        shown = f"an integer of more than {MAX_INT_DIGITS} digits" if huge else repr(value)
        raise CheckpointError(
            f"{source}: {key!r} = {shown} is not an integer in [{low}, 2**31)"
        )
    return value
