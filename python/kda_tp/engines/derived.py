"""The copies an engine derives from KDA parameters and keeps outside ``state_dict()``, by
engine layout: which parameters each is derived from and how (numpy, the engine's own
derivation), and finding them on a ``torch.nn.Module``. The guard (:mod:`kda_tp.guard`) checks
each against what its parameters make of it, at the first load, after every update and in every
live audit. The MLA layers' absorbed copies of the local ``kv_b_proj`` (vLLM's ``W_UK_T`` /
``W_UV``, SGLang's ``w_kc`` / ``w_vc``) are :data:`MLA_DERIVED`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..model.dtypes import cast_to

__all__ = ["DERIVED", "DERIVED_ATTRIBUTES", "DERIVED_NAMES", "Derived", "MLA_DERIVED",
           "MlaDerived", "derived_copies"]


def _conv_decode(conv1d: np.ndarray) -> np.ndarray:
    """vLLM K3's ``decode_conv1d_weight`` from its ``conv1d.weight`` ``[3 * Cl, 1, K]``:
    ``[3, K, Cl]``, each of q, k, v transposed (``_make_decode_conv1d_weight_loader``)."""
    cl3, _, k = conv1d.shape
    return np.ascontiguousarray(conv1d.reshape(3, cl3 // 3, k).transpose(0, 2, 1))


def _norm_decode(o_norm: np.ndarray) -> np.ndarray:
    """vLLM K3's ``decode_norm_weight`` from its ``o_norm.weight`` ``[D]``: the same values in
    F32 (``_make_decode_norm_weight_loader`` copies the loaded parameter into an F32 buffer)."""
    return cast_to(o_norm, "F32")


def _merged_conv(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """vLLM GLM-5.3's ``_merged_conv_weight`` from ``q/k/v_conv1d.weight`` (each ``[Cl, 1, K]``):
    ``[3 * Cl, K]``, the three viewed ``[Cl, K]`` and concatenated (``Glm5NextLinearAttention
    ._forward``, built on the first forward)."""
    return np.ascontiguousarray(np.concatenate(
        [w.reshape(w.shape[0], w.shape[-1]) for w in (q, k, v)], axis=0))


@dataclass(frozen=True)
class Derived:
    """One copy an engine derives from KDA parameters and keeps outside ``state_dict()``.

    Attributes:
        sources: the parameters it is derived from (names after ``...self_attn.``).
        derive: the derivation, from the sources' values (numpy, in their dtypes).
        attribute: True for a plain attribute of the layer (not a buffer: no
            ``named_buffers()`` lists it); None in it means "not built yet".
        issue: the engine issue about it going stale, if any.
    """

    sources: tuple[str, ...]
    derive: Callable[..., np.ndarray]
    attribute: bool = False
    issue: str = ""


#: The derived copies an engine keeps outside ``state_dict()``, by layout name: the copy's
#: name after ``...self_attn.`` -> ``Derived``. A copy is checked against the
#: derivation of its parameters once those are exact, at the first load, after every update
#: and in every live audit. Sources: vllm 0.33.0 ``vllm/models/kimi_k3/nvidia/kda.py``
#: (``KimiK3DeltaAttention``: the buffers exist only with a non-Triton decode backend) and
#: ``vllm/models/glm5next/common/kda.py`` (``_merged_conv_weight``, never invalidated: vLLM
#: #55087).
DERIVED: Mapping[str, Mapping[str, Derived]] = {
    "vllm-0.33-k3": {
        "decode_conv1d_weight": Derived(("conv1d.weight",), _conv_decode),
        "decode_norm_weight": Derived(("o_norm.weight",), _norm_decode),
    },
    "vllm-0.33-glm-5.3": {
        "_merged_conv_weight": Derived(
            ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"), _merged_conv,
            attribute=True, issue="https://github.com/vllm-project/vllm/issues/55087"),
    },
}

def _kv_heads(kv_b: np.ndarray, plan: Any) -> np.ndarray:
    """This rank's ``kv_b_proj.weight`` ``[Hl*(P+V), L]`` viewed ``[Hl, P+V, L]``."""
    return kv_b.reshape(plan.local_heads, plan.qk_nope_head_dim + plan.v_head_dim, -1)


def _absorbed_k(kv_b: np.ndarray, plan: Any) -> np.ndarray:
    """``W_UK_T`` / ``w_kc`` ``[Hl, P, L]``: each local head's ``P`` k-nope rows of
    ``kv_b_proj`` (vLLM ``split_kv_b_proj`` then ``W_UK.permute(1, 2, 0)``; SGLang
    ``w_kc``)."""
    return np.ascontiguousarray(_kv_heads(kv_b, plan)[:, : plan.qk_nope_head_dim, :])


def _absorbed_v(kv_b: np.ndarray, plan: Any) -> np.ndarray:
    """``W_UV`` / ``w_vc`` ``[Hl, L, V]``: each local head's ``V`` value rows of ``kv_b_proj``,
    transposed (vLLM ``W_UV.transpose(0, 1)``; SGLang ``w_vc``)."""
    return np.ascontiguousarray(
        _kv_heads(kv_b, plan)[:, plan.qk_nope_head_dim :, :].transpose(0, 2, 1))


@dataclass(frozen=True)
class MlaDerived:
    """One copy an engine derives from an MLA layer's local ``kv_b_proj`` (its absorbed
    up-projections), kept beside the loaded parameters.

    Attributes:
        derive: ``derive(kv_b, plan)``: the copy from this rank's ``kv_b_proj.weight``
            ``[Hl*(P+V), L]`` and its :class:`~kda_tp.rank.MlaTpPlan` (numpy, in
            ``kv_b``'s dtype): ``[Hl, P, L]`` or ``[Hl, L, V]``.
        shape: its shape in the spec's symbols (``"[Hl, P, L]"``, ``"[Hl, L, V]"``).
        attribute: True for a plain attribute of the attention module (SGLang's, None until
            built), False for an ``nn.Parameter`` (vLLM's, in ``named_parameters()`` once
            built).
        built: when the engine (re)builds it.
        issue: the engine issue about it going stale, if any.
        source: the parameter it is derived from (name after ``...self_attn.``).
    """

    derive: Callable[[np.ndarray, Any], np.ndarray]
    shape: str
    attribute: bool
    built: str
    issue: str = ""
    source: str = "kv_b_proj.weight"


_VLLM_BUILT = ("by process_weights_after_loading (vllm 0.33.0 vllm/models/kimi_k3/nvidia/mla.py "
               "MultiHeadLatentAttention, vllm/model_executor/layers/attention/mla_attention.py "
               "MLAAttention): views of an unquantized kv_b_proj")
_SGLANG_BUILT = ("at the end of every load_weights (post_load_weights: sglang 0.5.23 "
                 "kimi_linear.py, kimi_k3.py, deepseek_common/deepseek_weight_loader.py)")
_SGLANG_STALE = "https://github.com/sgl-project/sglang/issues/26744"
_K, _V = "[Hl, P, L]", "[Hl, L, V]"
_VLLM_MLA = {"W_UK_T": MlaDerived(_absorbed_k, _K, False, _VLLM_BUILT),
             "W_UV": MlaDerived(_absorbed_v, _V, False, _VLLM_BUILT)}
_SGLANG_MLA = {"w_kc": MlaDerived(_absorbed_k, _K, True, _SGLANG_BUILT, _SGLANG_STALE),
               "w_vc": MlaDerived(_absorbed_v, _V, True, _SGLANG_BUILT, _SGLANG_STALE)}

#: The copies an engine derives from each MLA layer's local ``kv_b_proj``, by layout name: the
#: copy's name after ``...self_attn.`` -> :class:`MlaDerived`. vLLM 0.33's GLM-5.3 keeps them
#: on the wrapped ``MLAAttention`` (``mla_attn.mla_attn.``).
MLA_DERIVED: Mapping[str, Mapping[str, MlaDerived]] = {
    "vllm-0.33-k3": _VLLM_MLA,
    "vllm-0.33-kimi-linear": _VLLM_MLA,
    "vllm-0.33-glm-5.3": {f"mla_attn.mla_attn.{n}": d for n, d in _VLLM_MLA.items()},
    "sglang-0.5.23-k3": _SGLANG_MLA,
    "sglang-0.5.23-kimi-linear": _SGLANG_MLA,
    "sglang-0.5.23-kimi-linear-unfused": _SGLANG_MLA,
    "sglang-0.5.23-glm-5.3": _SGLANG_MLA,
}

#: The derived copies that are plain attributes of a layer (not buffers), by name.
DERIVED_ATTRIBUTES = frozenset(n for copies in DERIVED.values() for n, d in copies.items()
                               if d.attribute)
#: Every derived copy's name (after ``...self_attn.``), of any layout.
DERIVED_NAMES = frozenset(n for copies in DERIVED.values() for n in copies)


def derived_copies(model: Any) -> dict[str, Any]:
    """The derived copies (:data:`DERIVED`) a ``torch.nn.Module`` holds, by full name: its
    buffers of those names, and the plain attributes once built (not None)."""
    found = {n: b for n, b in model.named_buffers()
             if b is not None and n.rpartition(".")[2] in DERIVED_NAMES}
    for name, module in model.named_modules():
        for attribute in DERIVED_ATTRIBUTES:
            value = module.__dict__.get(attribute)
            if value is not None:
                found[f"{name}.{attribute}" if name else attribute] = value
    return found
