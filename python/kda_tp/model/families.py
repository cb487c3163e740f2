"""The model families kda_tp knows: one entry per family, every other list derived from it.

A family entry says how the family's configs are read (its ``model_type`` values and the rule
set, ``kda_tp.model.config``), its names (for people, for the engine tables in
:mod:`kda_tp.engines`, for ``kda-tp demo --model``), where its checkpoints keep the decoder
layers, what a bare config's plan assumes its checkpoints store, and the geometry and config
dialect of its synthetic checkpoints (:mod:`kda_tp.synth`). Adding a family is one entry here
plus its engine tables; the config rules (``config.RULES``), ``engines.FAMILIES``, the CLI's
``--model`` choices, ``synth.GEOMETRIES`` and the names in messages are derived from
:data:`FAMILIES`.

This module imports nothing of kda_tp's (it sits beside ``errors`` at the bottom).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = [
    "FAMILIES",
    "ModelFamily",
    "RULES_GENERIC",
    "RULES_GLM",
    "RULES_KIMI",
    "demo_geometries",
    "family_for",
]

#: Rule set of GLM-5.3-Flash configs (transformers ``glm5_next``).
RULES_GLM = "glm5_next"
#: Rule set of Kimi-Linear and Kimi K3 configs.
RULES_KIMI = "kimi"
#: Rule set of a config whose ``model_type`` kda_tp does not know, but which has KDA keys.
RULES_GENERIC = "generic"


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    """One model family (an entry states only what differs from the defaults: Kimi-Linear's).

    Attributes:
        name: the engine tables' name (``EngineLayout.family``): ``"kimi-k3"``.
        display: the name in messages: ``"Kimi K3"``.
        model_types: the config ``model_type`` values (top level or ``text_config``) that
            select ``rules``.
        rules: the config rule set, ``RULES_KIMI`` or ``RULES_GLM``.
        full_rank_gate: whether the family's KDA layers have the full-rank output gate
            ``g_proj`` (K3), which tells it from another family read by the same rules.
        decoder_prefix: the name prefix of its decoder layers (up to the layer index) in its
            published checkpoints; ``kda_tp.checkpoint.names.decoder_prefix`` reads a checkpoint's own.
        lm_head: the name of its ``lm_head`` weight.
        stored_dtypes: the dtypes (by plan name) its checkpoints store where they differ from
            the plan's defaults, assumed by a plan made from a bare config; None: the plan's
            defaults (Kimi-Linear's), which a bare K3 config is planned with too.
        flat_a_log: its checkpoints store ``A_log`` 1-D ``[H]`` (else ``[1, 1, H, 1]``).
        padded_a_log: its checkpoints store ``A_log`` 1-D with more entries than heads, the
            entries past the heads zero (K3).
        conv_dtype: the dtype its checkpoints store the q/k/v conv weights in; None: the
            weights' dtype.
        o_norm_dtype: the dtype its checkpoints store ``o_norm`` in; None: the weights' dtype.
        last_layer_full_attention: its last decoder layer is full attention, whatever
            ``geometry``'s ``full_attn_every`` says (K3).
        vision_tower: its checkpoints hold a vision tower (K3), whose ``self_attn`` names must
            never be taken for KDA.
        demo: the ``kda-tp demo --model`` and ``synth.GEOMETRIES`` name.
        style: the synthetic checkpoint's config dialect (``synth.write_small_checkpoint``).
        geometry: the synthetic checkpoint's sizes (elements): ``hidden``, ``heads``,
            ``head_dim``, ``conv_kernel``, ``gate_rank``, and ``full_attn_every`` (n: layers
            n, 2n, ... 1-based are full attention; None: every layer is KDA).
        variants: further ``synth.GEOMETRIES`` entries of the family: name -> what differs
            (``{"kimi-k3-fp8": {"fp8": True}}``).
    """

    name: str
    display: str
    model_types: tuple[str, ...]
    rules: str
    full_rank_gate: bool = False
    decoder_prefix: str
    lm_head: str = "lm_head.weight"
    stored_dtypes: Mapping[str, str] | None = None
    flat_a_log: bool = False
    padded_a_log: bool = False
    conv_dtype: str | None = None
    o_norm_dtype: str | None = None
    last_layer_full_attention: bool = False
    vision_tower: bool = False
    demo: str
    style: str
    geometry: Mapping[str, Any]
    variants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @property
    def possessive(self) -> str:
        """``"GLM-5.3-Flash's"``: whose stored dtypes a bare config's plan assumes."""
        return f"{self.display}'s" if self.stored_dtypes is not None else "Kimi-Linear's"


_F32 = "F32"


def _geometry(hidden: int, heads: int, full_attn_every: int | None) -> dict[str, Any]:
    """A demo geometry (:attr:`ModelFamily.geometry`); every family's KDA layers have
    ``head_dim`` 128, a conv kernel of 4 and (synthetic) gate rank 128."""
    return {"hidden": hidden, "heads": heads, "head_dim": 128, "conv_kernel": 4,
            "gate_rank": 128, "full_attn_every": full_attn_every}

_ENTRIES = (
    ModelFamily(
        name="kimi-linear",
        display="Kimi-Linear",
        model_types=("kimi_linear",),
        rules=RULES_KIMI,
        decoder_prefix="model.layers.",
        demo="kimi-linear",
        style="kimi",
        geometry=_geometry(hidden=2304, heads=32, full_attn_every=4),
    ),
    # transformers' modeling_glm5_next.py creates the convs, A_log (1-D [H]) and dt_bias in
    # float32, so its checkpoints store them as F32.
    ModelFamily(
        name="glm-5.3",
        display="GLM-5.3-Flash",
        model_types=("glm5_next", "glm5_next_text"),
        rules=RULES_GLM,
        decoder_prefix="model.language_model.layers.",
        stored_dtypes=dict.fromkeys(("q_conv1d", "k_conv1d", "v_conv1d", "A_log", "dt_bias"),
                                    _F32),
        flat_a_log=True,
        conv_dtype=_F32,
        demo="glm-5.3-flash",
        style="glm",
        geometry=_geometry(hidden=4096, heads=64, full_attn_every=None),
    ),
    # Kimi K3 (2.8T): 93 layers, every 4th and the last MLA; one KDA layer is about 0.89 GB.
    ModelFamily(
        name="kimi-k3",
        display="Kimi K3",
        model_types=("kimi_k3", "kimi_k3_text"),
        rules=RULES_KIMI,
        full_rank_gate=True,
        decoder_prefix="language_model.model.layers.",
        lm_head="language_model.lm_head.weight",
        padded_a_log=True,
        conv_dtype=_F32,
        o_norm_dtype=_F32,
        last_layer_full_attention=True,
        vision_tower=True,
        demo="kimi-k3",
        style="k3",
        geometry=_geometry(hidden=7168, heads=96, full_attn_every=4),
        # The attention projections in FP8 128x128 blocks (NVIDIA's ModelOpt release).
        variants={"kimi-k3-fp8": {"fp8": True}},
    ),
)

#: Every family by its engine-table name (read-only), in ``kda-tp demo --model``'s order.
FAMILIES: Mapping[str, ModelFamily] = MappingProxyType({f.name: f for f in _ENTRIES})


def family_for(rules: str, full_rank_gate: bool) -> ModelFamily:
    """The family of a parsed config (``KdaConfig.rules``, ``KdaConfig.full_rank_gate``).

    A full-rank output gate is Kimi K3's whatever the rules; otherwise the family read by
    ``rules`` without it, a config of unknown ``model_type`` (``RULES_GENERIC``) being read
    as Kimi-Linear.
    """
    wanted = RULES_KIMI if rules == RULES_GENERIC else rules
    for family in FAMILIES.values():
        if family.full_rank_gate == full_rank_gate and (full_rank_gate or family.rules == wanted):
            return family
    return FAMILIES["kimi-linear"]


def demo_geometries() -> dict[str, dict[str, Any]]:
    """``synth.GEOMETRIES``: each family's demo geometry (with its ``style``) under its
    ``demo`` name, then its variants."""
    found: dict[str, dict[str, Any]] = {}
    for family in FAMILIES.values():
        base = {**family.geometry, "style": family.style}
        found[family.demo] = base
        for name, changes in family.variants.items():
            found[name] = {**base, **changes}
    return found
