"""Numerical end-to-end check of a tensor-parallel split: do the shards still compute the layer?

:func:`check_tp_equivalence` runs the numpy reference forward (:mod:`kda_tp.reference`) of every
KDA layer of a checkpoint twice: once on the full weights, and once per rank on the local slices
that ``kda_tp.KdaShardedSource`` presents for that rank's ``KdaTpPlan``. The per-rank outputs are
partial sums (``o_proj`` is split by columns), so their sum, the all-reduce, must equal the full
output. A shape-preserving slicing mistake (wrong offset, wrong dimension, a swapped rank) passes
every shape check but changes this sum.

Tolerance. Float32 results differ between the full and the split computation only by
reassociation: each rank's ``o_proj`` block sums over fewer channels and the ranks' partials are
added afterwards. On the kda_small fixture (outputs up to ~0.85) that difference is ~5e-7; every
wrong plan tried there moves the output by 0.03 or more (most by 0.2-1.3). The check passes a
layer when ``max|y_sum - y| <= atol + rtol * max|y|`` with defaults ``atol = 1e-5`` and
``rtol = 1e-4``: relative to the output's scale (the rounding grows with it), ~200x above the
observed rounding and ~300x below the smallest observed mistake.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..checkpoint.description import CheckpointDescription, describe
from ..checkpoint.reader import SafetensorsSource
from ..errors import CheckpointError, PlanError, UsageError
from ..model.json_reader import ascii_int
from ..rank.plan import KdaTpPlan
from ..rank.view import KdaShardedSource
from .forward import source_layer_forward

__all__ = [
    "DEFAULT_ATOL",
    "DEFAULT_RTOL",
    "EquivalenceReport",
    "LayerEquivalence",
    "check_numeric_memory",
    "check_tp_equivalence",
    "compare_outputs",
    "layers_to_check",
    "numeric_check_bytes",
]

#: Absolute part of the pass threshold (output units).
DEFAULT_ATOL = 1e-5
#: Part of the pass threshold proportional to ``max|y|`` of the full output.
DEFAULT_RTOL = 1e-4


@dataclass(frozen=True)
class LayerEquivalence:
    """The comparison for one KDA layer.

    Attributes:
        layer: 0-based layer index (``model.layers.{layer}``).
        max_abs_error: ``max|sum_r y_r - y|`` over batch, time and hidden.
        max_rel_error: ``max_abs_error / max|y|`` (0 when both are 0, inf when only ``y`` is 0).
        y_abs_max: ``max|y|`` of the full-weight output.
        tolerance: the threshold applied, ``atol + rtol * y_abs_max``.
        passed: ``max_abs_error <= tolerance`` (False if any output is NaN or infinite).
        non_finite: which output holds NaN or inf, failing the layer: ``"full"``, the reference
            output of the full weights (the weights themselves overflow float32, e.g. a large
            ``A_log`` whose ``exp`` is inf, so the split cannot be judged), or ``"ranks"``, the
            sum of the ranks' partial outputs only; None when both are finite.
    """

    layer: int
    max_abs_error: float
    max_rel_error: float
    y_abs_max: float
    tolerance: float
    passed: bool
    non_finite: str | None = None

    def format(self) -> str:
        """One line, e.g.

        ``layer 0: max abs err 4.2e-07, rel 5.0e-07 (max|y| 0.843, tol 9.43e-05) ok``, or for
        non-finite outputs ``layer 0: the reference output of the full weights is not finite
        (NaN or inf): ... FAIL``.
        """
        if self.non_finite == "full":
            return (
                f"layer {self.layer}: the reference output of the full weights is not finite "
                "(NaN or inf), so TP equivalence cannot be judged: the stored weights overflow "
                "float32 or hold NaN/inf (e.g. a large A_log, whose exp is inf); check the "
                "input checkpoint FAIL"
            )
        if self.non_finite == "ranks":
            return (
                f"layer {self.layer}: the sum of the ranks' partial outputs is not finite (NaN "
                f"or inf), the full weights' output is (max|y| {self.y_abs_max:.3g}) FAIL"
            )
        verdict = "ok" if self.passed else "FAIL"
        return (
            f"layer {self.layer}: max abs err {self.max_abs_error:.2e}, "
            f"rel {self.max_rel_error:.2e} (max|y| {self.y_abs_max:.3g}, "
            f"tol {self.tolerance:.2e}) {verdict}"
        )


@dataclass(frozen=True)
class EquivalenceReport:
    """Result of :func:`check_tp_equivalence`: one :class:`LayerEquivalence` per layer checked."""

    tp_size: int
    seq_len: int
    seed: int
    atol: float
    rtol: float
    layers: tuple[LayerEquivalence, ...]

    @property
    def passed(self) -> bool:
        """True when every checked layer passed."""
        return all(entry.passed for entry in self.layers)

    @property
    def failed_layers(self) -> list[int]:
        """0-based indices of the layers that failed."""
        return [entry.layer for entry in self.layers if not entry.passed]

    def format(self) -> str:
        """One line per layer (see :meth:`LayerEquivalence.format`), joined by newlines."""
        return "\n".join(entry.format() for entry in self.layers)


ShardSourceFactory = Callable[[Any, Any, list[int]], Any]

#: float32 values the reference forward holds per token and per channel (``heads * head_dim``)
#: at its peak (the gated RMSNorm, with q, k, v, the gate and the recurrence's output alive),
#: and per token and per ``hidden`` element (the input, the output and the ranks' running sum):
#: an upper bound of what was measured (Kimi-Linear, 4096 channels, hidden 2304: 171 kB per
#: token of peak RSS, ``/usr/bin/time -v`` at 2048 and 4096 tokens; this bound says 233 kB).
_PER_CHANNEL, _PER_HIDDEN = 12, 4


def numeric_check_bytes(hidden: int, heads: int, head_dim: int, seq_len: int) -> int:
    """The memory the numeric check's activations take for ``seq_len`` tokens of a model of
    ``hidden`` elements and ``heads`` heads of ``head_dim``: float32 values, an upper bound of
    what was measured (on top of one layer's float32 weights). It grows linearly with
    ``seq_len``: 233 kB per token for Kimi-Linear (32 heads of 128, hidden 2304)."""
    return 4 * seq_len * (_PER_CHANNEL * heads * head_dim + _PER_HIDDEN * hidden)


def check_numeric_memory(hidden: int, heads: int, head_dim: int, seq_len: int,
                         free: int | None = None) -> None:
    """Refuse a ``seq_len`` whose activations (``numeric_check_bytes``) do not fit in the
    memory free here (``free``, default: :func:`free_memory`; nothing is refused where it is
    not known), before anything is computed.

    Raises:
        UsageError: naming ``seq_len`` (``--seq-len``), the memory it needs, the memory free
            and the largest ``seq_len`` that fits.
    """
    free = free_memory() if free is None else free
    needed = numeric_check_bytes(hidden, heads, head_dim, seq_len)
    if free is None or needed <= free:
        return
    per_token = numeric_check_bytes(hidden, heads, head_dim, 1)
    fits = free // per_token
    raise UsageError(
        f"seq_len (--seq-len) {seq_len}: the numeric check would hold about {_size(needed)} of "
        f"float32 activations ({per_token / 1e3:.0f} kB per token for {heads} heads of "
        f"{head_dim} and hidden {hidden}), more than the {_size(free)} of memory free here; "
        + (f"pass a --seq-len of at most {fits}" if fits >= 1 else
           "free some memory, or check on a machine with more")
    )


def _size(n: int) -> str:
    """``n`` bytes in GB, or MB below 1 GB, three significant digits."""
    return f"{n / 1e9:.3g} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"


def free_memory() -> int | None:
    """The bytes this process may still allocate, as far as Linux says: the least of the
    memory available (``MemAvailable``), its cgroup's room (``memory.max`` less
    ``memory.current``) and its address-space limit (``RLIMIT_AS`` less its mapped size);
    None where none of them is known."""
    import resource

    found: list[int] = []
    values = _kib_fields("/proc/meminfo")
    if "MemAvailable" in values:
        found.append(values["MemAvailable"])
    limit, current = (_read_int(f"/sys/fs/cgroup/memory.{n}") for n in ("max", "current"))
    if limit is not None and current is not None:  # memory.max "max": no limit
        found.append(max(limit - current, 0))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    mapped = _kib_fields("/proc/self/status").get("VmSize")
    if soft != resource.RLIM_INFINITY and mapped is not None:
        found.append(max(soft - mapped, 0))
    return min(found) if found else None


def _read_int(path: str) -> int | None:
    """The integer a one-line file holds, or None (unreadable, or not an integer)."""
    try:
        with open(path) as f:
            return ascii_int(f.read(64).strip())
    except (OSError, OverflowError, UnicodeDecodeError):
        return None


def _kib_fields(path: str) -> dict[str, int]:
    """The ``Name: N kB`` lines of a /proc file, in bytes ({} when it cannot be read)."""
    fields = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                value = ascii_int(parts[0]) if len(parts) == 2 and parts[1] == "kB" else None
                if value is not None:
                    fields[name] = value * 1024
    except (OSError, OverflowError, UnicodeDecodeError):
        return {}
    return fields


def check_tp_equivalence(
    checkpoint: str | os.PathLike[str] | Any,
    tp_size: int,
    layers: Iterable[int] | None = None,
    seq_len: int = 16,
    seed: int = 0,
    *,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    qk_multiple: int = 256,
    shard_source_factory: ShardSourceFactory | None = None,
    progress: Callable[[int], Callable[[int], None]] | None = None,
) -> EquivalenceReport:
    """Check that the TP shards of each KDA layer sum to the full layer's output.

    For each layer, ``y`` = reference forward on the full weights, ``y_r`` = reference forward on
    rank ``r``'s local weights (``KdaTpPlan.from_config(config, r, tp_size)``), and the layer
    passes when ``max|sum_r y_r - y| <= atol + rtol * max|y|`` (module docstring: why). Both
    go through :func:`kda_tp.reference.source_layer_forward`, the path of
    :func:`kda_tp.reference.checkpoint_layer_forward`: the forget gate and its bound
    (GLM-5.3-Flash's ``linear_lower_bound``, Kimi K3's ``gate_lower_bound``) and the
    output-gate form come from the config as the model reads it (``kda_tp.model.config``);
    block-quantized (FP8) weights are dequantized with their scale grids
    (:func:`kda_tp.model.dequantize`) before computing, on every rank with its own local grid.

    Args:
        checkpoint: a ``kda_tp.SafetensorsSource`` (or any object with ``get(name)`` returning a
            record with ``.array``, and ``config``), or a path to open as one: a ``.safetensors``
            file or a checkpoint directory, with ``config.json`` beside it.
        tp_size: number of tensor-parallel ranks.
        layers: 0-based layer indices to check; default: every KDA layer of the config
            (``linear_attn_config.kda_layers``, 1-based, or the ``"linear_attention"`` entries
            of ``layer_types``).
        seq_len: tokens in the random input.
        seed: seed of ``np.random.default_rng``; the input is one draw of standard normals,
            shape ``(1, seq_len, hidden_size)``, cast to float32 and used for every layer.
        atol: absolute part of the threshold (output units).
        rtol: part of the threshold proportional to ``max|y|``.
        qk_multiple: forwarded to ``KdaTpPlan.from_config`` (the local q|k width rule; lower it
            to check splits the default 256 refuses).
        shard_source_factory: how each rank's view is made, called as ``factory(source, plan,
            layers)`` once per rank; it must return a view (``view[name]``) or an object whose
            ``get(name)`` gives a record with ``.array`` in local shape. Default:
            ``kda_tp.KdaShardedSource``;
            ``kda_tp.shard.verify_shards`` passes one that opens the written rank directories,
            and a test can inject a wrong split.
        progress: called once with the number of layers to check; returns ``advance(n)``,
            called with 1 after each layer (a Kimi K3 layer takes tens of seconds).

    Memory: one KDA layer's weights are held as float32 at a time (the full layer's while its
    output is computed, then one rank's), and each tensor's mapped pages are dropped once it
    is converted (where the source has ``release``, as :class:`~kda_tp.SafetensorsSource` and
    :class:`~kda_tp.KdaShardedSource` do). Peak resident memory is about the largest KDA
    layer's float32 size plus 0.2 GB: on the Kimi K3 demo (one KDA layer, 0.89 GB as BF16,
    1.78 GB as float32, TP 8) ``kda-tp verify --numeric`` peaks at 2.0 GB RSS (measured with
    ``/usr/bin/time -v``; 7.9 GB before).

    Returns:
        An :class:`EquivalenceReport`; ``report.passed`` is the overall verdict.

    Raises:
        CheckpointError: no config, a config that names no KDA layers (when ``layers`` is not
            given), no layer to check, or a KDA tensor missing from the checkpoint or from a
            rank's view.
        PlanError: ``tp_size`` is not a positive integer, or ``KdaTpPlan.from_config`` refuses
            the geometry for it or ``layers`` (out of range, not KDA layers, 1-based).
        ShapeMismatchError: a tensor (full or local) whose shape does not fit the others; the
            reference forward names it.
        ValueError: ``seq_len`` is not a positive integer.
        UsageError: ``seq_len``'s activations (``numeric_check_bytes``) do not fit in the
            memory free here (``check_numeric_memory``, before anything is computed), or
            the forward ran out of memory; the message names ``seq_len`` and what it needs.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    if isinstance(tp_size, bool) or not isinstance(tp_size, (int, np.integer)) or tp_size < 1:
        raise PlanError(f"tp_size must be a positive integer, got {tp_size!r}")
    if isinstance(checkpoint, (str, os.PathLike)):
        source = SafetensorsSource(checkpoint)
    else:
        source = checkpoint
    description, layer_list, all_kda = layers_to_check(source, layers, checkpoint)
    factory = KdaShardedSource if shard_source_factory is None else shard_source_factory
    plans = [
        KdaTpPlan.from_description(
            description, rank, tp_size, qk_multiple=qk_multiple, layers=layer_list
        )
        for rank in range(tp_size)
    ]
    geometry = (plans[0].hidden, plans[0].full_heads, plans[0].head_dim)
    check_numeric_memory(*geometry, int(seq_len))
    rank_sources = [factory(source, plan, all_kda) for plan in plans]
    try:
        return _compare_layers(source, description, plans, rank_sources, layer_list, seq_len,
                               seed, atol, rtol, progress)
    except MemoryError:
        # What free_memory did not see (another process took it meanwhile, an overcommit
        # limit): named as the seq_len it is, not as one tensor.
        per_token = numeric_check_bytes(*geometry, 1)
        raise UsageError(
            f"seq_len (--seq-len) {seq_len}: out of memory in the numeric check: its "
            f"activations take up to {_size(numeric_check_bytes(*geometry, int(seq_len)))} "
            f"({per_token / 1e3:.0f} kB per token of this model), on top of one KDA layer's "
            "weights as float32; pass a smaller --seq-len, or free some memory"
        ) from None


def _compare_layers(
    source: Any,
    description: CheckpointDescription,
    plans: list[KdaTpPlan],
    rank_sources: list[Any],
    layer_list: list[int],
    seq_len: int,
    seed: int,
    atol: float,
    rtol: float,
    progress: Callable[[int], Callable[[int], None]] | None,
) -> EquivalenceReport:
    """:func:`check_tp_equivalence`'s forwards and comparisons, layer by layer."""
    tp_size = plans[0].tp_size
    config = description.kda
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, seq_len, plans[0].hidden)).astype(np.float32)

    prefix = description.prefix
    results = []
    advance = progress(len(layer_list)) if progress else None
    for layer in layer_list:
        # Weights that overflow float32 give NaN or inf; compare_outputs reports that, so
        # numpy's RuntimeWarnings would only repeat it (on stderr, mid-output).
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            y = source_layer_forward(source, layer, x, plan=plans[0], config=config,
                                     prefix=prefix)
            partials = (
                source_layer_forward(s, layer, x, plan=plan, config=config, prefix=prefix)
                for s, plan in zip(rank_sources, plans)
            )
            y_sum = functools.reduce(np.add, partials)
            results.append(compare_outputs(layer, y, y_sum, atol, rtol))
        if advance:
            advance(1)
    return EquivalenceReport(tp_size, int(seq_len), seed, atol, rtol, tuple(results))


def layers_to_check(source: Any, layers: Iterable[int] | None, checkpoint: object
                    ) -> tuple[CheckpointDescription, list[int], list[int]]:
    """``(description, checked, sharded)`` of a numeric check of ``source``: its description
    (``kda_tp.describe``), the KDA layers it computes (``layers``, else the config's KDA
    layers) and those every rank's view shards (the config's KDA layers, which a view refuses
    to leave out; ``checked`` when the config does not list them). ``checkpoint`` is how
    messages name it.

    Raises:
        CheckpointError: ``source`` has no config; ``layers`` is None and the config does not
            list the KDA layers; no layer to check.
    """
    if source.config is None:
        raise CheckpointError(f"{checkpoint}: no config.json beside the checkpoint")
    description = describe(source)
    checked = list(description.kda_layers(layers))
    if not checked:
        raise CheckpointError(f"{checkpoint}: no KDA layer to check")
    try:
        return description, checked, list(description.kda_layers())
    except CheckpointError:
        return description, checked, checked


def compare_outputs(
    layer: int, y: np.ndarray, y_sum: np.ndarray, atol: float, rtol: float
) -> LayerEquivalence:
    """Build the layer's verdict from the full output ``y`` and the sum of partials; a NaN or
    inf in either fails it (``LayerEquivalence.non_finite``)."""
    non_finite = (
        "full" if not np.isfinite(y).all() else "ranks" if not np.isfinite(y_sum).all() else None
    )
    abs_err = float(np.max(np.abs(y_sum - y)))
    y_max = float(np.max(np.abs(y)))
    if y_max > 0:
        rel_err = abs_err / y_max
    else:
        rel_err = 0.0 if abs_err == 0 else float("inf")
    tolerance = atol + rtol * y_max
    passed = non_finite is None and bool(abs_err <= tolerance)
    return LayerEquivalence(layer, abs_err, rel_err, y_max, tolerance, passed, non_finite)
