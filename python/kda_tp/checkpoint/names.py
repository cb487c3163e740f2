"""Where a checkpoint keeps its KDA tensors: the names of each model family's layout.

The one place that knows checkpoint names (the plan in ``rust/plan.rs`` knows shapes and
offsets): the decoder prefix of the KDA layers (``model.layers.`` for Kimi-Linear,
``language_model.model.layers.`` for Kimi K3's wrapper), the ``self_attn.`` suffix of each plan
tensor (``q_proj.weight``, but bare ``A_log`` and ``dt_bias``), the two output-gate forms
(Kimi-Linear's ``g_a_proj``/``g_b_proj``, K3's full-rank ``g_proj``), the two spellings of a
block scale (``weight_scale``, ``weight_scale_inv``), and which layers are KDA (from the
config, never from tensor shapes: K3's MLA layers hold ``g_proj``/``o_proj`` with the KDA names
and shapes).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from ..errors import CheckpointError
from ..model.quant import SCALE_SUFFIXES

__all__ = [
    "BARE_PARAMETERS",
    "DEFAULT_PREFIX",
    "FULL_RANK_GATE",
    "LAYER_NUMBER",
    "LAYER_TENSOR",
    "layer_number_problem",
    "LOW_RANK_GATE",
    "check_gate_form",
    "checkpoint_suffix",
    "decoder_prefix",
    "gate_form_problem",
    "kda_tensor_name",
    "location",
    "param_location",
    "param_name",
    "scale_tensor_name",
]

def location(source: Any, name: str | None = None) -> str:
    """Where ``name`` (or the checkpoint) lives, for error messages: the tensor's file, else the
    source's root directory, else the source's repr."""
    file_of = getattr(source, "file_of", None)
    if name is not None and file_of is not None:
        found = file_of(name)
        if found is not None:
            return str(found)
    root = getattr(source, "root", None)
    return str(root) if root is not None else repr(source)


#: A layer number in a tensor name, as a regular expression: ASCII digits, at most 10 (a layer
#: index is below ``2**31``); ``\d`` would also match other scripts' digits (``"١"``), which
#: ``int`` reads but no loader does. Every pattern over layer numbers is built from it.
LAYER_NUMBER = r"[0-9]{1,10}"
#: After the decoder prefix: ``12.self_attn.q_proj.weight`` -> ``("12", "q_proj.weight")``.
LAYER_TENSOR = re.compile(rf"^({LAYER_NUMBER})\.self_attn\.(.+)$")
# After the decoder prefix, a layer number as Python's \d reads it (any script's digits, any
# length): a name this matches but _ASCII_LAYER does not is refused (layer_number_problem).
_ANY_DIGITS = re.compile(r"^(\d+)\.")
_ASCII_LAYER = re.compile(rf"^{LAYER_NUMBER}\.")
# A decoder layer's attention parameter: (prefix up to the layer number, layer, suffix).
_PARAM_NAME = re.compile(rf"^((?:.*\.)?layers\.)({LAYER_NUMBER})\.self_attn\.(.+)$")
#: A_log and dt_bias are bare parameters; every other KDA tensor is a module's ``.weight``.
BARE_PARAMETERS = {"A_log", "dt_bias"}
DEFAULT_PREFIX = "model.layers."


def layer_number_problem(rest: str) -> str | None:
    """Why the layer number at the start of ``rest`` (a tensor name after the decoder prefix,
    ``"3.self_attn.q_proj.weight"``) cannot be a layer, or None when it can or there is none.

    ``"١.self_attn.q_proj.weight"`` (Arabic-Indic digits): ``int`` reads 1, no loader does; a
    number of more than 10 digits is no layer index (they are below ``2**31``).
    """
    match = _ANY_DIGITS.match(rest)
    if match is None or _ASCII_LAYER.match(rest):
        return None
    digits = match.group(1)
    if not digits.isascii():
        return (f"its layer number {digits[:12]!r} is not written in ASCII digits 0-9; "
                "loaders read layer numbers as ASCII, so no layer holds this tensor: rename it")
    return f"its layer number has {len(digits)} digits; a layer index is below 2**31"


def decoder_prefix(source: Any, names: Iterable[str] | None = None) -> str:
    """The name prefix of the decoder layers holding the KDA tensors, up to the layer index.

    It is the prefix of the ``...layers.{i}.self_attn.A_log`` tensors (``"model.layers."`` in
    Kimi-Linear, ``"language_model.model.layers."`` in some multimodal checkpoints), so other
    stacks with ``layers.{i}.self_attn`` tensors (a vision tower, a draft model) are never taken
    for KDA layers. Without any ``A_log``, ``"model.layers."``.

    Args:
        source: the checkpoint (named in messages; its ``names()`` are read unless ``names``
            is given).
        names: the source's names, when the caller has listed them already.

    Raises:
        CheckpointError: ``A_log`` tensors appear under more than one prefix.
    """
    listed = source.names() if names is None else names
    # A_log exists only in KDA layers.
    prefixes = {found[0] for n in listed
                if n.endswith(".self_attn.A_log") and (found := param_location(n))
                and found[2] == "A_log"}
    if len(prefixes) > 1:
        raise CheckpointError(
            f"{location(source)}: KDA tensors (A_log) under several prefixes {sorted(prefixes)}; "
            "cannot tell which stack to shard"
        )
    return prefixes.pop() if prefixes else DEFAULT_PREFIX


def param_name(prefix: str, layer: int, suffix: str) -> str:
    """The name of a decoder layer's attention tensor or parameter, the inverse of
    :func:`param_location` (the one place that writes ``{prefix}{layer}.self_attn.``):
    ``param_name("model.layers.", 3, "A_log")`` -> ``"model.layers.3.self_attn.A_log"``."""
    return f"{prefix}{layer}.self_attn.{suffix}"


def param_location(name: str) -> tuple[str, int, str] | None:
    """Split a parameter name of a decoder layer's attention into ``(prefix, layer, suffix)``.

    ``"language_model.model.layers.3.self_attn.in_proj_qkvgfab.weight"`` ->
    ``("language_model.model.layers.", 3, "in_proj_qkvgfab.weight")``; any model prefix works
    (``model.``, ``language_model.model.``, none); the layer number is ``LAYER_NUMBER``'s.
    None for a name outside ``self_attn``. Whether layer 3 is a KDA layer is the config's
    business, never the name's.
    """
    match = _PARAM_NAME.match(name)
    if match is None:
        return None
    return match.group(1), int(match.group(2)), match.group(3)


def kda_tensor_name(prefix: str, layer: int, plan_name: str) -> str:
    """The checkpoint name of a plan tensor: ``model.layers.0.self_attn.q_proj.weight``."""
    return param_name(prefix, layer, checkpoint_suffix(plan_name))


def checkpoint_suffix(plan_name: str) -> str:
    """The name after ``self_attn.`` of a plan tensor: ``q_proj.weight``, but ``A_log``."""
    return plan_name if plan_name in BARE_PARAMETERS else f"{plan_name}.weight"


#: Kimi-Linear's low-rank output gate, as names after ``self_attn.``.
LOW_RANK_GATE = ("g_a_proj.weight", "g_b_proj.weight")
#: Kimi K3's full-rank output gate (``use_full_rank_gate``), as names after ``self_attn.``.
FULL_RANK_GATE = ("g_proj.weight",)


def check_gate_form(source: Any, prefix: str, layer: int, full_rank_gate: bool) -> None:
    """Refuse a KDA layer whose output gate is not the form the config says.

    Kimi K3 (``use_full_rank_gate: true``) has one ``g_proj.weight``; Kimi-Linear has
    ``g_a_proj.weight`` and ``g_b_proj.weight``. A layer holding the other form (or both) cannot
    be sharded by this plan.

    Raises:
        CheckpointError: naming the file, the tensor found and the config key.
    """
    wrong = LOW_RANK_GATE if full_rank_gate else FULL_RANK_GATE
    for suffix in wrong:
        name = param_name(prefix, layer, suffix)
        if _holds(source, name):
            raise CheckpointError(
                f"{location(source, name)}: {name}: {gate_form_problem(full_rank_gate)}"
            )


def _holds(source: Any, name: str) -> bool:
    """Whether ``source`` has a tensor ``name``: from its header when it can say
    (``info``), else from its ``get``."""
    info = getattr(source, "info", None)
    found = info(name) if info is not None else source.get(name)
    return found is not None


def gate_form_problem(full_rank_gate: bool) -> str:
    """Why a KDA layer's output gate does not match the config (for error messages):
    ``full_rank_gate`` is what the config says."""
    if full_rank_gate:
        return (
            "the config sets linear_attn_config.use_full_rank_gate (one full-rank g_proj per KDA "
            "layer), but this KDA layer holds the low-rank g_a_proj/g_b_proj"
        )
    return (
        "this KDA layer holds a full-rank g_proj, but the config does not set "
        "linear_attn_config.use_full_rank_gate (it expects the low-rank g_a_proj/g_b_proj)"
    )


def scale_tensor_name(source: Any, prefix: str, layer: int, plan_name: str) -> str | None:
    """The checkpoint name of a block-quantized weight's scale grid in ``source``:
    ``...{plan_name}.weight_scale`` (ModelOpt, compressed-tensors) or ``.weight_scale_inv``
    (DeepSeek), whichever ``source`` holds (its ``info``, else its ``get``); None if neither."""
    for suffix in SCALE_SUFFIXES:
        name = param_name(prefix, layer, f"{plan_name}.{suffix}")
        if _holds(source, name):
            return name
    return None

