"""The copies an engine derives from KDA parameters and keeps outside ``state_dict()``, by
engine layout: which parameters each is derived from and how (numpy, the engine's own
derivation), and finding them on a ``torch.nn.Module``. The guard (:mod:`kda_tp.guard`) checks
each against what its parameters make of it, at the first load, after every update and in every
live audit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..model.dtypes import cast_to

__all__ = ["DERIVED", "DERIVED_ATTRIBUTES", "DERIVED_NAMES", "Derived", "derived_copies"]


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
