"""A float32 numpy forward of one KDA (Kimi Delta Attention) layer, for checking shard plans.

This is the ground truth the tensor-parallel checks compare against: it runs one
``KimiDeltaAttention`` layer on full weights, or on one rank's local slices, in which case it
returns that rank's partial output (what the rank holds before the all-reduce). Summing the
partials of all ranks gives the full output up to float32 rounding.

The equations are fla 0.6.0's (flash-linear-attention and fla-core 0.6.0,
https://github.com/fla-org/flash-linear-attention):
``fla/layers/kda.py`` (``KimiDeltaAttention.forward``), ``fla/ops/kda/gate.py``
(``naive_kda_gate``), ``fla/ops/kda/naive.py`` (``naive_recurrent_kda``),
``fla/modules/l2norm.py`` and ``fla/modules/norm/fused_norm_gate.py`` (``FusedRMSNormGated``
with sigmoid activation). Scope: no cache, no padding mask, ``allow_neg_eigval=False``, no grouped
value heads (``num_v_heads == num_heads``, ``expand_v == 1``), no conv bias, no ``g_b_proj`` bias
(Kimi-Linear has none).

Kimi K3 (docs/models.md, "Kimi K3") is covered too: the lower-bounded forget gate
(fla ``naive_kda_lowerbound_gate``, ``gate_lower_bound``), the full-rank output gate ``g_proj``
and an ``A_log`` zero-padded past the heads.

GLM-5.3-Flash (transformers ``modeling_glm5_next.py``, ``Glm5NextTextLinearAttention``) is the
same layer with the lower-bounded forget gate (``linear_lower_bound``, -5.0 by default) and a 1-D
``A_log``; which gate a checkpoint uses is its config's business (``kda_tp.model.config``).

Everything is computed in float32; BF16/F16 weights are upcast exactly, FP8 projections are
dequantized with their block scales (:func:`kda_tp.model.dequantize`).

:func:`checkpoint_layer_forward` is the entry point for engine developers: a checkpoint, a layer
and an input in, the layer's output (or one rank's partial sum) out. :func:`kda_layer_forward`
takes the weights as arrays.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..checkpoint.description import describe
from ..checkpoint.names import kda_tensor_name, scale_tensor_name
from ..checkpoint.reader import SafetensorsSource
from ..errors import CheckpointError, DtypeMismatchError, PlanError, ShapeMismatchError
from ..model.config import CONFIG_NAME, KdaConfig
from ..model.dtypes import FLOAT_DTYPES, SPELLINGS
from ..model.quant import dequantize
from ..rank.plan import KdaTpPlan
from ..rank.view import KdaShardedSource

__all__ = [
    "WEIGHT_NAMES",
    "L2NORM_EPS",
    "checkpoint_layer_forward",
    "kda_layer_forward",
    "layer_weights",
    "source_layer_forward",
]

#: The layer's tensors but the output gate, by plan name (``self_attn`` names without
#: ``.weight``). The output gate is either ``g_a_proj`` + ``g_b_proj`` (Kimi-Linear) or
#: ``g_proj`` (Kimi K3).
WEIGHT_NAMES = (
    "q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_a_proj", "f_b_proj",
    "b_proj", "A_log", "dt_bias", "o_norm", "o_proj",
)
_LOW_RANK_GATE = ("g_a_proj", "g_b_proj")

#: Epsilon of the per-head q/k L2 normalisation (fla ``l2norm``; fixed, not a config value).
L2NORM_EPS = 1e-6

def _is_float(dtype: np.dtype) -> bool:
    """F16, F32, F64 or ``ml_dtypes.bfloat16``, in the machine's byte order (by name: nothing
    imports ``ml_dtypes`` for it, which takes longer to import than numpy)."""
    return dtype.isnative and SPELLINGS.get(dtype.name) in FLOAT_DTYPES


def kda_layer_forward(
    weights: Mapping[str, Any],
    x: np.ndarray,
    *,
    head_dim: int,
    rms_norm_eps: float = 1e-5,
    gate_lower_bound: float | None = None,
) -> np.ndarray:
    """Run one KDA layer forward in float32 and return its output (or a rank's partial output).

    Args:
        weights: plan name -> array-like, for every name in :data:`WEIGHT_NAMES` plus one
            output-gate form (``g_a_proj`` and ``g_b_proj``, or ``g_proj``; not both), in
            on-disk shapes, with ``H`` heads, ``C = H * head_dim`` channels, hidden size ``d``
            (the last dimension of ``x``), conv kernel ``W`` and gate ranks ``r_f``, ``r_g``:

            - ``q_proj``, ``k_proj``, ``v_proj``: ``(C, d)``
            - ``q_conv1d``, ``k_conv1d``, ``v_conv1d``: ``(C, 1, W)`` or ``(C, W)``
            - ``f_a_proj`` / ``f_b_proj``: ``(r_f, d)`` / ``(C, r_f)``
            - ``g_a_proj`` / ``g_b_proj``: ``(r_g, d)`` / ``(C, r_g)``, or ``g_proj``: ``(C, d)``
            - ``b_proj``: ``(H, d)``
            - ``A_log``: ``(1, 1, H, 1)``, ``(H,)`` or Kimi K3's zero-padded ``(P,)`` with
              ``P > H``, whose first ``H`` entries are the heads (the rest is not read)
            - ``dt_bias``: ``(C,)``
            - ``o_norm``: ``(head_dim,)``
            - ``o_proj``: ``(d, C)``

            ``H`` is taken from the rows of ``b_proj``, ``W`` from ``q_conv1d`` and the gate ranks
            from ``f_a_proj`` / ``g_a_proj``, so one rank's local slices (``H / tp_size`` heads,
            ``o_proj`` column block) are accepted as they are. Dtypes: BF16
            (``ml_dtypes.bfloat16``), F16, F32 or F64; all are converted to float32 (exact for
            BF16/F16/F32). Extra keys are ignored.
        x: input activations, shape ``(B, T, d)``; converted to float32.
        head_dim: per-head key/value width ``K = V``.
        rms_norm_eps: epsilon of the gated output RMSNorm (``config.rms_norm_eps``; 1e-5 in
            Kimi-Linear). It matters: 1e-6 instead of 1e-5 moves the fixture output by ~0.4.
        gate_lower_bound: Kimi K3's ``gate_lower_bound`` (< 0). With it the forget gate is
            ``lb * sigmoid(exp(A_log) * (f + dt_bias))`` (fla ``naive_kda_lowerbound_gate``);
            without it, Kimi-Linear's ``-exp(A_log) * softplus(f + dt_bias)``.

    Returns:
        float32 array ``(B, T, d)``: ``o_proj`` applied to the gated, normalised recurrence
        output of the ``H`` heads present. On local slices this is the rank's partial sum.

    Raises:
        KeyError: a name of :data:`WEIGHT_NAMES` or of the output gate is missing from
            ``weights``, or both output-gate forms are present.
        DtypeMismatchError: a weight is not a floating dtype listed above.
        ShapeMismatchError: ``x`` is not 3-D, ``head_dim`` is not positive, ``b_proj`` has no
            rows, or a weight's shape disagrees with the table above; the message names the
            tensor and gives the expected and actual shapes.
        ValueError: ``gate_lower_bound`` is not below 0.
    """
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 3:
        raise ShapeMismatchError(f"x: shape {x.shape}, expected (batch, seq_len, hidden)")
    if gate_lower_bound is not None and not gate_lower_bound < 0:
        raise ValueError(f"gate_lower_bound: {gate_lower_bound!r}, expected a number below 0")
    w = _checked_weights(weights, head_dim, x.shape[2])
    batch, seq_len, hidden = x.shape
    heads = w["b_proj"].shape[0]
    channels = heads * head_dim
    rows = x.reshape(batch * seq_len, hidden)

    def project(name: str, inp: np.ndarray) -> np.ndarray:
        return inp @ w[name].T

    def per_head(a: np.ndarray) -> np.ndarray:
        return a.reshape(batch, seq_len, heads, head_dim)

    # Steps 1-3: projections, causal depthwise conv + SiLU, split heads.
    q, k, v = (
        per_head(
            _causal_conv_silu(
                project(f"{n}_proj", rows).reshape(batch, seq_len, channels), w[f"{n}_conv1d"]
            )
        )
        for n in "qkv"
    )
    # Step 4: per-head L2 norm; the head_dim**-0.5 scale goes on q (naive_recurrent_kda).
    q = _l2norm(q) * np.float32(head_dim**-0.5)
    k = _l2norm(k)
    # Step 5: forget gate in log space, g < 0: naive_kda_gate, or with K3's lower bound
    # naive_kda_lowerbound_gate, g in (lb, 0).
    f = per_head(project("f_b_proj", project("f_a_proj", rows)))
    dt_bias = w["dt_bias"].reshape(heads, head_dim)
    decay_rate = np.exp(w["A_log"])[:, None]
    if gate_lower_bound is None:
        g = -decay_rate * _softplus(f + dt_bias)
    else:
        g = np.float32(gate_lower_bound) * _sigmoid(decay_rate * (f + dt_bias))
    # Step 6: beta.
    beta = _sigmoid(project("b_proj", rows)).reshape(batch, seq_len, heads)
    # Step 7: delta-rule recurrence.
    o = _delta_rule(q, k, v, g, beta)
    # Step 8: sigmoid-gated RMSNorm over each head's V channels.
    if "g_proj" in w:
        z = per_head(project("g_proj", rows))
    else:
        z = per_head(project("g_b_proj", project("g_a_proj", rows)))
    inv_rms = 1.0 / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + np.float32(rms_norm_eps))
    o = o * inv_rms * w["o_norm"] * _sigmoid(z)
    # Step 9: output projection (a partial sum when o_proj is a column block).
    y = project("o_proj", o.reshape(batch * seq_len, channels))
    return y.reshape(batch, seq_len, hidden).astype(np.float32, copy=False)


def checkpoint_layer_forward(
    checkpoint: str | os.PathLike[str] | SafetensorsSource,
    layer: int,
    x: np.ndarray,
    *,
    tp_rank: int | None = None,
    tp_size: int = 1,
) -> np.ndarray:
    """What your engine's layer must output: KDA layer ``layer`` of ``checkpoint`` run on ``x``.

    The layer is computed the way the model's reference implementation computes it, with
    everything read from the checkpoint: the forget gate (softplus, or lower-bounded with the
    bound its config gives: GLM-5.3-Flash's ``linear_lower_bound``, Kimi K3's
    ``gate_lower_bound``; see ``kda_tp.model.config``), the output-gate form (low-rank or K3's
    full-rank ``g_proj``), ``rms_norm_eps``, the stored dtypes (upcast exactly to float32) and
    FP8 block dequantization. Compare your engine's output of the same layer against it (the
    module input ``x``, i.e. after the layer's input norm; no cache, no padding mask).

    With ``tp_rank`` it returns rank ``tp_rank``'s partial sum of a ``tp_size``-way split
    (``o_proj`` is row-parallel): what that rank holds before the all-reduce. The partials of
    all ranks sum to the full output up to float32 rounding. Any split with ``heads`` divisible
    by ``tp_size`` is accepted (the sharder's kernel-width rule, ``qk_multiple``, is not
    applied here).

    Args:
        checkpoint: a checkpoint directory or ``.safetensors`` file with ``config.json`` beside
            it, or a :class:`kda_tp.SafetensorsSource`. A ``kda-tp shard`` rank directory holds
            only that rank's slices: run on it without ``tp_rank``, the result is that rank's
            partial sum (what the rank computes from the files it was given).
        layer: 0-based index of a KDA layer (``model.layers.{layer}``).
        x: input activations ``(B, T, hidden)``, any float dtype (converted to float32).
        tp_rank: the rank whose partial sum to return; None for the whole layer.
        tp_size: tensor-parallel world size of that split; 1 without ``tp_rank``.

    Returns:
        float32 array ``(B, T, hidden)``.

    Raises:
        CheckpointError: no config, ``layer`` is not one of the config's KDA layers (of the
            layers holding ``A_log`` when the config does not list them), or a KDA tensor (or an
            FP8 block scale) is missing.
        PlanError: ``tp_size`` other than 1 without ``tp_rank``; a ``tp_rank`` / ``tp_size``
            the plan refuses (heads not divisible, rank out of range).
        ShapeMismatchError: ``x`` is not ``(B, T, hidden)``, or a stored tensor's shape does
            not fit the config.
        TypeError: ``checkpoint`` is neither a path nor a ``SafetensorsSource``.
    """
    if isinstance(checkpoint, (str, os.PathLike)):
        checkpoint = SafetensorsSource(checkpoint)
    elif not isinstance(checkpoint, SafetensorsSource):
        raise TypeError(
            f"checkpoint: {type(checkpoint).__name__}, expected a path or a SafetensorsSource"
        )
    if checkpoint.config is None:
        raise CheckpointError(f"{checkpoint.root}: no {CONFIG_NAME} beside the checkpoint")
    description = describe(checkpoint)
    config = description.kda
    if tp_rank is None:
        if tp_size != 1:
            raise PlanError(
                f"tp_size={tp_size!r} without tp_rank: pass tp_rank for a rank's partial sum, "
                "or neither for the whole layer"
            )
        tp_rank = 0
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise CheckpointError(f"layer: {layer!r} is not a 0-based layer index")
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 3 or x.shape[2] != config.hidden:
        raise ShapeMismatchError(
            f"x: shape {x.shape}, expected (batch, seq_len, {config.hidden}) (hidden_size of "
            f"{config.source})"
        )
    # The config's KDA layers; a config that does not list them: the layers holding A_log.
    all_kda = config.kda_layers
    if all_kda is None:
        all_kda = description.a_log_layers
    if layer not in all_kda:
        raise CheckpointError(
            f"{config.source}: layer {layer} is not a KDA layer; the KDA layers are "
            f"{list(all_kda)} (0-based)"
        )
    plan = KdaTpPlan.from_description(description, tp_rank, tp_size, qk_multiple=1,
                                      layers=[layer])
    view: Any = checkpoint if tp_size == 1 else KdaShardedSource(checkpoint, plan, all_kda)
    return source_layer_forward(
        view, int(layer), x, plan=plan, config=config, prefix=description.prefix
    )


def source_layer_forward(
    source: Any, layer: int, x: np.ndarray, *, plan: KdaTpPlan, config: KdaConfig, prefix: str
) -> np.ndarray:
    """:func:`kda_layer_forward` of KDA layer ``layer`` as ``source`` holds it under ``plan``,
    with the gate and eps of ``config``: the one path :func:`checkpoint_layer_forward`,
    :func:`kda_tp.reference.check_tp_equivalence` and the distributed check compute through.

    Args:
        source: the full checkpoint or one rank's view (``kda_tp.KdaShardedSource``, a rank
            directory's source): a view, or any object whose ``get(name)`` returns a record
            with ``.array``.
        layer: 0-based KDA layer index.
        x: input ``(B, T, hidden)``.
        plan: the plan of the rank ``source`` holds (rank 0 of 1 for the full checkpoint).
        config: the checkpoint's parsed config.
        prefix: the decoder-layer prefix of the KDA tensors (the description's:
            ``kda_tp.describe(checkpoint).prefix``).

    Returns:
        float32 ``(B, T, hidden)``: the output, or the rank's partial sum.

    Raises:
        CheckpointError: a tensor or block scale is missing (:func:`layer_weights`).
        ShapeMismatchError: a weight's shape does not fit the others (:func:`kda_layer_forward`).
    """
    return kda_layer_forward(
        layer_weights(source, layer, prefix, plan),
        x,
        head_dim=plan.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        gate_lower_bound=config.gate_lower_bound,
    )


def _tensor(source: Any, name: str) -> Any:
    """``source``'s tensor ``name``, None when it has none: a rank's view is read as
    ``view[name]``, a checkpoint source (``SafetensorsSource``, a rank directory's, any object
    with ``get``) as ``source.get(name)``."""
    if isinstance(source, KdaShardedSource):
        return source[name] if name in source else None
    return source.get(name)


def layer_weights(source: Any, layer: int, prefix: str, plan: Any) -> dict[str, np.ndarray]:
    """Plan name -> float32 array of ``{prefix}{layer}.self_attn.*`` for every tensor of
    ``plan``, as ``source`` has it, in the shape :func:`kda_layer_forward` takes;
    block-quantized (FP8) weights dequantized with their scale grids
    (:func:`kda_tp.model.dequantize`).

    Each tensor is converted as it is read and its mapped pages are then dropped from this
    process (``source.release``, where the source has it), so the resident memory is the
    layer's float32 weights, not those plus the mapped input.

    Raises:
        CheckpointError: a tensor or a block scale is missing from ``source``.
    """
    release = getattr(source, "release", None)
    weights = {}
    for entry in plan.tensors:
        key = kda_tensor_name(prefix, layer, entry.name)
        record = _tensor(source, key)
        if record is None:
            raise CheckpointError(f"{key}: missing (KDA layer {layer})")
        array = _canonical(record.array, entry)
        read = [key]
        if entry.scale is not None:
            scale_key = scale_tensor_name(source, prefix, layer, entry.name)
            scale = None if scale_key is None else _tensor(source, scale_key)
            if scale is None or scale_key is None:
                raise CheckpointError(f"{key}: block scale missing (KDA layer {layer})")
            array = dequantize(array, _canonical(scale.array, entry.scale), entry.block)
            read.append(scale_key)
        weights[entry.name] = array.astype(np.float32, copy=False)
        del record, array
        if release is not None:
            for name in read:
                release(name)
    return weights


def _canonical(array: np.ndarray, entry: Any) -> np.ndarray:
    """``array`` in the layout the reference forward takes, whatever on-disk layout the plan
    accepted for it (extra unit axes, a flat conv, ``A_log`` as ``[1, 1, P, 1]`` or GLM's
    ``[H]``): the plan's canonical full shape (``entry.disk_shape``), or this rank's slice of
    it. Same bytes, same order; only the shape changes. An array of neither size is returned as
    it is."""
    full = tuple(entry.disk_shape)
    if array.size == math.prod(full):
        return array.reshape(full)
    local = entry.local_shape(list(full))
    if array.size == math.prod(local):
        return array.reshape(local)
    return array  # neither: the reference forward names what is wrong with it


def _checked_weights(
    weights: Mapping[str, Any], head_dim: int, hidden: int
) -> dict[str, np.ndarray]:
    """Return the weights as float32 arrays (convs as ``(C, W)``, ``A_log`` as ``(H,)``).

    Checks presence, dtype and shape as documented in :func:`kda_layer_forward`.
    """
    full_rank = "g_proj" in weights
    if full_rank and any(n in weights for n in _LOW_RANK_GATE):
        raise KeyError(
            "KDA reference forward: both output-gate forms given (g_proj and g_a_proj/g_b_proj)"
        )
    names = WEIGHT_NAMES + (("g_proj",) if full_rank else _LOW_RANK_GATE)
    missing = [n for n in names if n not in weights]
    if missing:
        raise KeyError(f"KDA reference forward: missing weights {missing}")
    if not isinstance(head_dim, (int, np.integer)) or head_dim <= 0:
        raise ShapeMismatchError(f"head_dim: {head_dim!r}, expected a positive integer")
    arrays = {}
    for name in names:
        a = np.asarray(weights[name])
        if not _is_float(a.dtype):
            raise DtypeMismatchError(
                f"{name}: dtype {a.dtype}, expected bfloat16, float16, float32 or float64"
            )
        arrays[name] = a

    b_proj = arrays["b_proj"]
    if b_proj.ndim != 2 or b_proj.shape[0] == 0:
        raise ShapeMismatchError(
            f"b_proj: shape {b_proj.shape}, expected (heads, {hidden}) with heads >= 1"
        )
    heads = b_proj.shape[0]
    channels = heads * head_dim
    a_log = arrays["A_log"]
    a_log_shapes = [(1, 1, heads, 1), (heads,)]
    if a_log.ndim == 1 and a_log.size > heads:
        a_log_shapes.append(a_log.shape)  # zero-padded past the heads (Kimi K3)

    def leading(name: str) -> int:
        """First dim of a 2-D low-rank factor; its second dim must be the hidden size."""
        a = arrays[name]
        if a.ndim != 2 or a.shape[0] == 0:
            raise ShapeMismatchError(
                f"{name}: shape {a.shape}, expected (gate_rank, {hidden}) with gate_rank >= 1"
            )
        return int(a.shape[0])

    conv = arrays["q_conv1d"]
    kernel = conv.shape[-1] if conv.ndim in (2, 3) and conv.shape[-1] > 0 else None
    if kernel is None:
        raise ShapeMismatchError(
            f"q_conv1d: shape {conv.shape}, expected ({channels}, 1, kernel) or "
            f"({channels}, kernel) with kernel >= 1"
        )
    f_rank = leading("f_a_proj")
    gate: dict[str, list[tuple[int, ...]]]
    if full_rank:
        gate = {"g_proj": [(channels, hidden)]}
    else:
        g_rank = leading("g_a_proj")
        gate = {"g_a_proj": [(g_rank, hidden)], "g_b_proj": [(channels, g_rank)]}
    expected: dict[str, list[tuple[int, ...]]] = {
        "q_proj": [(channels, hidden)],
        "k_proj": [(channels, hidden)],
        "v_proj": [(channels, hidden)],
        "q_conv1d": [(channels, 1, kernel), (channels, kernel)],
        "k_conv1d": [(channels, 1, kernel), (channels, kernel)],
        "v_conv1d": [(channels, 1, kernel), (channels, kernel)],
        "f_a_proj": [(f_rank, hidden)],
        "f_b_proj": [(channels, f_rank)],
        **gate,
        "b_proj": [(heads, hidden)],
        "A_log": a_log_shapes,
        "dt_bias": [(channels,)],
        "o_norm": [(head_dim,)],
        "o_proj": [(hidden, channels)],
    }
    out = {}
    for name, shapes in expected.items():
        a = arrays[name]
        if a.shape not in shapes:
            wanted = " or ".join(str(s) for s in shapes)
            raise ShapeMismatchError(
                f"{name}: shape {a.shape}, expected {wanted} "
                f"(heads {heads} from b_proj, head_dim {head_dim}, hidden {hidden})"
            )
        out[name] = a.astype(np.float32, copy=False)  # float32 weights are not copied
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        out[name] = out[name].reshape(channels, kernel)
    out["A_log"] = out["A_log"].reshape(-1)[:heads]
    return out


def _sigmoid(a: np.ndarray) -> np.ndarray:
    """Logistic sigmoid, float32 in and out; exp overflow for very negative ``a`` gives 0."""
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-a))


def _softplus(a: np.ndarray) -> np.ndarray:
    """``log(1 + e^a)`` without overflow (torch's threshold-20 shortcut differs by < 3e-9)."""
    return np.logaddexp(np.float32(0.0), a)


def _causal_conv_silu(u: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Causal depthwise conv then SiLU (fla ``ShortConvolution``, ``fla/modules/causal_conv1d``).

    ``u``: (B, T, C) float32; ``weight``: (C, W) float32. Output (B, T, C):
    ``silu(sum_j weight[c, j] * u[t - (W - 1) + j, c])`` with zeros before ``t = 0``, so the last
    tap multiplies the current token.
    """
    batch, seq_len, channels = u.shape
    kernel = weight.shape[1]
    padded = np.concatenate([np.zeros((batch, kernel - 1, channels), np.float32), u], axis=1)
    acc = np.zeros_like(u)
    for j in range(kernel):
        acc += weight[:, j] * padded[:, j : j + seq_len]
    return acc * _sigmoid(acc)


def _l2norm(a: np.ndarray) -> np.ndarray:
    """``a / sqrt(sum(a^2) + 1e-6)`` over the last axis (fla ``l2norm``)."""
    return a / np.sqrt(np.sum(a * a, axis=-1, keepdims=True) + np.float32(L2NORM_EPS))


def _delta_rule(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray
) -> np.ndarray:
    """Gated delta-rule recurrence, fla ``naive_recurrent_kda`` (``fla/ops/kda/naive.py``).

    ``q, k, v, g``: (B, T, H, D) float32 (q already scaled, g in log space); ``beta``: (B, T, H).
    State ``S``: (B, H, D_k, D_v), zero at t = 0. Per step: ``S = diag(exp(g_t)) S``;
    ``S += beta_t k_t (v_t - S^T k_t)^T``; ``o_t = S^T q_t``. Returns o: (B, T, H, D).
    """
    batch, seq_len, heads, dim = q.shape
    decay = np.exp(g)
    state = np.zeros((batch, heads, dim, v.shape[-1]), np.float32)
    out = np.empty((batch, seq_len, heads, v.shape[-1]), np.float32)
    for t in range(seq_len):
        state *= decay[:, t, :, :, None]
        k_t = k[:, t]
        residual = v[:, t] - np.matmul(k_t[:, :, None, :], state)[:, :, 0, :]
        state += (beta[:, t, :, None] * k_t)[:, :, :, None] * residual[:, :, None, :]
        out[:, t] = np.matmul(q[:, t, :, None, :], state)[:, :, 0, :]
    return out
