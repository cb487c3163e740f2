"""Which layers of a KDA hybrid are MLA, and their geometry, read from the config only.

Every model kda_tp serves is a hybrid: its non-KDA decoder layers are MLA (multi-head latent
attention). The layer type comes from the config, never from tensor names or shapes (K3's MLA
``g_proj``/``o_proj`` have the KDA layer's names and shapes; the spec, ``tests/data/spec/mla.md``
section 0):

* **Kimi-Linear, Kimi K3**: 0-based layer ``i`` is KDA iff ``i + 1`` is in
  ``linear_attn_config.kda_layers``, else MLA (vLLM 0.33 ``kimi_linear.py`` configs,
  ``kimi_k3/nvidia/model.py``; SGLang's ``full_attention_layer_ids``). The MLA keys sit beside
  the KDA keys (top level, or ``text_config`` for K3's wrapper): ``num_attention_heads``
  (default 32, vLLM's ``KimiLinearConfig``), ``q_lora_rank`` (null: Kimi-Linear's full-rank
  ``q_proj``), ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``
  and ``mla_use_output_gate`` (K3's ``g_proj``, default false).
* **GLM-5.3-Flash**: every layer that is not ``"linear_attention"`` in ``layer_types`` (by
  default each fourth, ``i % 4 == 3``) is MLA with the DSA indexer (transformers'
  ``Glm5NextTextDecoderLayer``). Its keys default to transformers' ``Glm5NextTextConfig``
  (64 heads, ``q_lora_rank`` 1536, ``kv_lora_rank`` 512, ``qk_nope_head_dim`` 256,
  ``qk_rope_head_dim`` 0, ``v_head_dim`` 256; the indexer ``index_n_heads`` 32,
  ``index_head_dim`` 128, ``index_kpool`` 16), whose ``validate_architecture`` requires a
  ``q_lora_rank`` and NoPE (``qk_rope_head_dim`` 0). The indexer is built when
  ``index_topk`` is not null (vLLM ``glm5next/common/attention.py``; default 2048).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError
from .config import KdaConfig, parse_config
from .families import RULES_GLM

__all__ = ["MlaConfig", "mla_layers", "parse_mla_config"]

# Larger than any real model dimension, as for the KDA keys.
_MAX_DIM = 2**31

# transformers' Glm5NextTextConfig defaults.
_GLM_DEFAULTS: dict[str, Any] = {
    "num_attention_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 256,
    "qk_rope_head_dim": 0,
    "v_head_dim": 256,
    "index_topk": 2048,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_kpool": 16,
}
# vLLM's KimiLinearConfig defaults: the head count only; the MLA sizes have none.
_KIMI_DEFAULTS: dict[str, Any] = {"num_attention_heads": 32, "q_lora_rank": None}


@dataclass(frozen=True)
class MlaConfig:
    """The MLA layers of a hybrid config and their geometry (elements).

    Attributes:
        layers: 0-based indices of the MLA layers, ascending.
        hidden: ``hidden_size``.
        heads: ``num_attention_heads``, the MLA head count split over the ranks.
        q_lora_rank: ``q_lora_rank``; None for a full-rank ``q_proj`` (Kimi-Linear).
        kv_lora_rank: ``kv_lora_rank``.
        qk_nope_head_dim: ``qk_nope_head_dim``.
        qk_rope_head_dim: ``qk_rope_head_dim`` (0: NoPE, GLM-5.3-Flash).
        v_head_dim: ``v_head_dim``.
        output_gate: K3's MLA output gate ``g_proj`` (``mla_use_output_gate``).
        indexer: GLM-5.3-Flash's DSA indexer as ``(index_n_heads, index_head_dim,
            index_kpool)``; None when the layers have none.
        source: where the keys were read (a path or ``"<dict>"``, ``...:text_config`` for a
            wrapper), for messages.
    """

    layers: tuple[int, ...]
    hidden: int
    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    output_gate: bool
    indexer: tuple[int, int, int] | None
    source: str

    def plan_args(self) -> tuple[tuple[int, ...], dict[str, Any]]:
        """The geometry as ``kda_tp.rank.mla.MlaTpPlan``'s arguments after ``tp_rank,
        tp_size``: ``(hidden, heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
        v_head_dim)`` and the keywords ``q_lora_rank``, ``output_gate``, ``indexer``."""
        return ((self.hidden, self.heads, self.kv_lora_rank, self.qk_nope_head_dim,
                 self.qk_rope_head_dim, self.v_head_dim),
                {"q_lora_rank": self.q_lora_rank, "output_gate": self.output_gate,
                 "indexer": self.indexer})


def mla_layers(config: Mapping[str, Any], kda: KdaConfig | None = None) -> tuple[int, ...]:
    """The 0-based MLA layers of ``config``: every decoder layer of ``num_hidden_layers`` that
    is not KDA (``kda``: the parsed config, parsed here when not given). Empty when the config
    does not say which layers are KDA, or has no ``num_hidden_layers``.

    Raises:
        CheckpointError: as :func:`~kda_tp.model.parse_config`.
    """
    kda = parse_config(config) if kda is None else kda
    if kda.kda_layers is None:
        return ()
    text = _text(config, kda)
    count = text.get("num_hidden_layers", 45 if kda.rules == RULES_GLM else None)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        return ()
    kda_set = set(kda.kda_layers)
    return tuple(i for i in range(count) if i not in kda_set)


def parse_mla_config(
    config: Mapping[str, Any], kda: KdaConfig | None = None
) -> MlaConfig | None:
    """The MLA layers of ``config`` and their geometry (see the module docstring for the rules),
    or None when the config has no MLA layer (every layer KDA, or the layers unknown).

    Args:
        config: a parsed ``config.json``.
        kda: the config's KDA reading (:func:`~kda_tp.model.parse_config`), parsed here when
            not given.

    Raises:
        CheckpointError: an MLA size missing (a Kimi config without ``kv_lora_rank``,
            ``qk_nope_head_dim``, ``qk_rope_head_dim`` or ``v_head_dim``) or not an integer in
            range (``[1, 2**31)``; ``qk_rope_head_dim`` may be 0), ``mla_use_output_gate`` not
            a bool, a GLM-5.3-Flash config without ``q_lora_rank`` or with RoPE dims (its DSA
            layers are NoPE). The message names the source, the key, the value and the fix.
    """
    kda = parse_config(config) if kda is None else kda
    layers = mla_layers(config, kda)
    if not layers:
        return None
    text, source = _text(config, kda), kda.source
    where = "text_config." if source.endswith(":text_config") else ""
    glm = kda.rules == RULES_GLM
    defaults = _GLM_DEFAULTS if glm else _KIMI_DEFAULTS

    def value(key: str, *, low: int = 1, optional: bool = False) -> Any:
        found = text.get(key, defaults.get(key)) if key in text or key in defaults else ...
        if found is ...:
            raise CheckpointError(
                f"{source}: config has no '{where}{key}', which the MLA layers {_few(layers)} "
                f"need: add the model's {key} to its config.json"
            )
        if found is None and optional:
            return None
        if isinstance(found, bool) or not isinstance(found, int) or not low <= found < _MAX_DIM:
            raise CheckpointError(
                f"{source}: '{where}{key}' = {found!r} is not an integer in [{low}, 2**31); "
                f"the MLA layers {_few(layers)} need it: fix the config's {key}"
            )
        return found

    q_lora_rank = value("q_lora_rank", optional=True)
    rope = value("qk_rope_head_dim", low=0)
    gate = text.get("mla_use_output_gate", False)
    if gate is None:
        gate = False
    if not isinstance(gate, bool):
        raise CheckpointError(
            f"{source}: '{where}mla_use_output_gate' = {gate!r} is not a bool: write true or "
            "false"
        )
    indexer = None
    if glm:
        if q_lora_rank is None:
            raise CheckpointError(
                f"{source}: '{where}q_lora_rank' is null: transformers' Glm5NextTextConfig "
                "requires it for the DSA layers; set the model's q_lora_rank (1536)"
            )
        if rope:
            raise CheckpointError(
                f"{source}: '{where}qk_rope_head_dim' = {rope}: GLM-5.3-Flash's DSA layers are "
                "NoPE (transformers' Glm5NextTextConfig requires 0); set it to 0"
            )
        if value("index_topk", optional=True) is not None:
            indexer = (value("index_n_heads"), value("index_head_dim"), value("index_kpool"))
    return MlaConfig(
        layers=layers,
        hidden=kda.hidden,
        heads=value("num_attention_heads"),
        q_lora_rank=q_lora_rank,
        kv_lora_rank=value("kv_lora_rank"),
        qk_nope_head_dim=value("qk_nope_head_dim"),
        qk_rope_head_dim=rope,
        v_head_dim=value("v_head_dim"),
        output_gate=gate,
        indexer=indexer,
        source=source,
    )


def _text(config: Mapping[str, Any], kda: KdaConfig) -> Mapping[str, Any]:
    """The mapping the KDA keys were read from: ``text_config`` for a wrapper."""
    text = config.get("text_config")
    if kda.source.endswith(":text_config") and isinstance(text, Mapping):
        return text
    return config


def _few(layers: tuple[int, ...]) -> str:
    """The first 8 layers, comma-separated, and how many more."""
    more = f", ... ({len(layers) - 8} more)" if len(layers) > 8 else ""
    return ", ".join(map(str, layers[:8])) + more
