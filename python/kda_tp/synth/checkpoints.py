"""Synthetic KDA checkpoints with real tensor names, shapes and dtypes, in Hugging Face layout.

A checkpoint directory holds ``config.json``, two or more ``model-0000N-of-0000M.safetensors``
files and ``model.safetensors.index.json``. Weights are random but finite and of a realistic
scale; there is no MLP/MoE (the sharding code never touches it, and leaving it out keeps files
small). Three config dialects are produced:

``style="kimi"`` (Kimi-Linear)
    ``linear_attn_config = {head_dim, num_heads, short_conv_kernel_size, kda_layers,
    full_attn_layers}`` with **1-based** layer numbers; non-KDA layers are MLA layers
    (``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``).
``style="glm"`` (GLM-5.3-Flash, as transformers' ``glm5_next`` writes it)
    a wrapper config (``model_type: glm5_next``) whose ``text_config`` (``glm5_next_text``) has
    ``linear_head_dim``, ``linear_num_heads``, ``linear_conv_kernel_dim``,
    ``linear_lower_bound: -5.0`` (the lower-bounded forget gate) and ``layer_types``
    (``"linear_attention"`` for KDA layers, ``"indexed_attention"`` otherwise); names under
    ``model.language_model.``; KDA layers store ``A_log`` 1-D ``[H]`` and the conv weights in
    F32; non-KDA layers are MLA (DSA) layers (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``,
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``), whose
    ``self_attn.o_proj`` has the KDA name.
``style="k3"`` (Kimi K3)
    a wrapper config (``model_type: kimi_k3``) with the Kimi dialect under ``text_config``, plus
    ``use_full_rank_gate: true`` and ``gate_lower_bound: -5.0``; every name under
    ``language_model.``; KDA layers have one full-rank ``g_proj.weight [C, d]`` instead of
    ``g_a_proj``/``g_b_proj``, ``A_log`` 1-D ``[P]`` zero-padded past the H heads (P = max(H, D)
    by default, K3's 128 for 96 heads), and F32 conv weights and ``o_norm``; non-KDA layers are
    K3's MLA layers, whose ``g_proj.weight [C, d]`` and ``o_proj.weight [d, C]`` have exactly
    the KDA names and shapes; a small vision tower
    (``vision_tower.encoder.blocks.0.self_attn.q_proj/o_proj``, 256 wide) and
    ``mm_projector.proj.0.weight [d, 256]`` are added.

All dialects name a KDA layer's tensors the Kimi-Linear way, under
``model.layers.{i}.self_attn.`` (K3: ``language_model.model.layers.``, GLM:
``model.language_model.layers.``; H heads, D = head_dim, C = H * D, hidden size d, conv kernel K,
gate rank R; W is the weight dtype, BF16 by default)::

    q_proj.weight, k_proj.weight, v_proj.weight          [C, d]         W
    q_conv1d.weight, k_conv1d.weight, v_conv1d.weight    [C, 1, K]      W  ([C, K] if flat_conv;
                                                                        F32 in K3 and GLM)
    f_a_proj.weight, g_a_proj.weight                     [R, d]         W
    f_b_proj.weight, g_b_proj.weight                     [C, R]         W
    b_proj.weight                                        [H, d]         W
    A_log                                                [1, 1, H, 1]   F32  ([H] if flat_a_log
                                                                        or GLM)
    dt_bias                                              [C]            F32
    o_norm.weight                                        [D]            W
    o_proj.weight                                        [d, C]         W

Every layer also has ``input_layernorm.weight`` and ``post_attention_layernorm.weight`` ``[d]``;
the model has ``model.embed_tokens.weight [vocab, d]``, ``model.norm.weight [d]`` and
``lm_head.weight [vocab, d]``.

Generation is streaming and fast: each tensor is produced only when the writer asks for it, and
large projection matrices are not drawn element by element. A pool of a few million N(0, 0.02)
values is drawn once per checkpoint; each row of a large matrix is a window of that pool starting
at an offset drawn, without repetition inside the tensor, by a generator seeded from
``(seed, tensor name)``. So rows differ from one another, tensors differ from one another, and a
slice taken from the wrong rows or columns has different bytes from the right one. Small tensors
are drawn directly. BF16 values are float32 values rounded to nearest-even on their bit patterns.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..checkpoint import files, writer
from ..errors import DtypeMismatchError, OutputError, PlanError
from ..model.dtypes import MODEL_DTYPES, TORCH_NAMES, cast_to
from ..model.families import demo_geometries
from ._tensors import (
    STYLES,
    Geometry,
    Spec,
    config_json,
    model_tensors,
    modelopt_config,
    quantize_attention,
)

# The tensors and config.json per dialect.

__all__ = ["GEOMETRIES", "model_config", "write_checkpoint", "write_small_checkpoint"]

#: Real KDA geometries, one per model family (``kda_tp.model.FAMILIES``: each family's
#: ``demo`` name and ``geometry``, then its variants such as ``"kimi-k3-fp8"``). ``hidden`` (d),
#: ``heads`` (H), ``head_dim`` (D), ``conv_kernel`` (K) and ``gate_rank`` (R) are element counts;
#: ``style`` is the config dialect; ``full_attn_every`` = n makes layers n, 2n, ... (1-based)
#: full-attention layers; ``None`` makes every layer KDA; ``fp8`` stores the attention
#: projections in FP8 128x128 blocks (NVIDIA's ModelOpt release of Kimi K3).
GEOMETRIES: dict[str, dict[str, Any]] = demo_geometries()

_DEFAULT_MAX_FILE_BYTES = 400 * 2**20
_PROJ_STD = 0.02
# Projection matrices with more elements than this are built from pool windows; others are drawn.
_DIRECT_LIMIT = 1 << 16
_MIN_POOL_ELEMS = 1 << 22
_POOL_STREAM = 0x706F6F6C  # second seed word of the pool's generator
# FP8 weights: N(0, 1) * this in F8_E4M3 (max 448), scales about _PROJ_STD / this.
_FP8_SPREAD = 64.0

ProgressFn = Callable[[int, int], None]


def write_checkpoint(
    out_dir: str | os.PathLike[str],
    model: str = "kimi-linear",
    num_layers: int = 4,
    seed: int = 0,
    *,
    vocab_size: int = 1024,
    max_file_bytes: int = _DEFAULT_MAX_FILE_BYTES,
    progress: ProgressFn | None = None,
) -> Path:
    """Write a synthetic checkpoint with the geometry of a real KDA model.

    Args:
        out_dir: directory to write into, as for :func:`write_small_checkpoint`.
        seed: non-negative int, as for :func:`write_small_checkpoint`.
        max_file_bytes: byte budget per file, as for :func:`write_small_checkpoint`.
        progress: optional byte-progress callback, as for :func:`write_small_checkpoint`.
        model: a key of :data:`GEOMETRIES`: ``"kimi-linear"`` (Kimi-Linear-48B-A3B attention:
            every 4th layer MLA, Kimi config), ``"glm-5.3-flash"`` (all layers KDA, listed in
            ``layer_types``; GLM config, ``style="glm"``), ``"kimi-k3"`` (Kimi K3: every 4th
            layer and, as in the real model, the last one MLA; K3 config and tensors,
            ``style="k3"``) or
            ``"kimi-k3-fp8"`` (the same with the attention projections in FP8 128x128 blocks as
            NVIDIA's ModelOpt release stores them, ``fp8=True``).
        num_layers: number of decoder layers (default 4: 0-based layer 3 is MLA for Kimi and
            K3; with K3 and 2 layers, layer 0 is KDA and layer 1 MLA).
        vocab_size: rows of ``embed_tokens`` and ``lm_head``; small by default to keep files small.

    Sizes with the defaults: Kimi-Linear 4 layers about 305 MB in 2 files, GLM-5.3-Flash 4 layers
    about 1.1 GB in 3 files, Kimi K3 2 layers (one KDA, one MLA) about 1.4 GB in 4 files.

    Returns:
        ``Path(out_dir)``.

    Raises:
        PlanError: unknown ``model`` or a non-positive size.
        OutputError: the directory or a file cannot be written.
    """
    geometry, kda_layers = _model_layers(model, num_layers)
    return write_small_checkpoint(
        out_dir,
        hidden=geometry["hidden"],
        heads=geometry["heads"],
        head_dim=geometry["head_dim"],
        conv_kernel=geometry["conv_kernel"],
        gate_rank=geometry["gate_rank"],
        num_layers=num_layers,
        kda_layers=kda_layers,
        seed=seed,
        style=geometry["style"],
        fp8=bool(geometry.get("fp8", False)),
        vocab_size=vocab_size,
        max_file_bytes=max_file_bytes,
        progress=progress,
    )


def model_config(model: str, num_layers: int = 4, vocab_size: int = 1024) -> dict[str, Any]:
    """The ``config.json`` (a dict) that :func:`write_checkpoint` writes for ``model`` (a
    :data:`GEOMETRIES` name) with ``num_layers`` decoder layers, in its family's dialect, the
    hybrid's MLA keys included: a real geometry's config without writing a byte of tensors
    (``tools/pictures.py`` plans its MLA layer from it).

    Raises:
        PlanError: unknown ``model`` or a non-positive size.
    """
    g, kda_layers = _model_layers(model, num_layers)
    _check_positive(vocab_size=vocab_size)
    geometry = Geometry(hidden=g["hidden"], heads=g["heads"], head_dim=g["head_dim"],
                        conv_kernel=g["conv_kernel"], gate_rank=g["gate_rank"], style=g["style"])
    return config_json(geometry, num_layers, set(kda_layers), vocab_size, "bfloat16")


def _model_layers(model: str, num_layers: int) -> tuple[dict[str, Any], list[int]]:
    """``model``'s :data:`GEOMETRIES` entry and its 0-based KDA layers of ``num_layers``.

    Raises:
        PlanError: unknown ``model`` or a non-positive ``num_layers``.
    """
    try:
        geometry = GEOMETRIES[model]
    except KeyError:
        raise PlanError(f"unknown model {model!r}; expected one of {sorted(GEOMETRIES)}") from None
    _check_positive(num_layers=num_layers)
    every = geometry["full_attn_every"]
    kda_layers = [i for i in range(num_layers) if every is None or (i + 1) % every != 0]
    if STYLES[geometry["style"]].last_layer_full_attention and num_layers > 1:
        kda_layers = [i for i in kda_layers if i != num_layers - 1]
    return geometry, kda_layers


def write_small_checkpoint(
    out_dir: str | os.PathLike[str],
    hidden: int,
    heads: int,
    head_dim: int,
    conv_kernel: int,
    gate_rank: int,
    num_layers: int,
    kda_layers: Sequence[int],
    seed: int = 0,
    style: str = "kimi",
    *,
    vocab_size: int = 64,
    weight_dtype: str = "BF16",
    flat_a_log: bool = False,
    flat_conv: bool = False,
    a_log_len: int | None = None,
    fp8: bool = False,
    max_file_bytes: int = _DEFAULT_MAX_FILE_BYTES,
    progress: ProgressFn | None = None,
) -> Path:
    """Write a synthetic KDA checkpoint of any geometry (see the module docstring for tensors).

    Args:
        out_dir: directory to write into (created if missing; files of the same names are
            replaced).
        hidden: the model width d, elements, >= 1.
        heads: the KDA head count H, >= 1.
        head_dim: the head dimension D, elements, >= 1.
        conv_kernel: the short-conv kernel size K, >= 1.
        gate_rank: the low-rank gate width R, elements, >= 1. The config has no key for R
            (Kimi-Linear uses R = D), so a reader of a checkpoint with R != D must take R from
            ``f_a_proj``'s shape or be told it.
        num_layers: number of decoder layers, >= 1.
        kda_layers: **0-based** indices of the KDA layers (any subset, unique, in range); the
            config stores them the way its dialect does (1-based for ``style="kimi"``).
        seed: non-negative int; the same arguments give byte-identical files.
        style: ``"kimi"``, ``"glm"`` or ``"k3"`` config dialect and tensor layout (see the
            module docstring).
        vocab_size: rows of ``embed_tokens`` and ``lm_head``.
        weight_dtype: ``"BF16"``, ``"F16"`` or ``"F32"`` for every tensor except ``A_log`` and
            ``dt_bias``, which are always F32 (and the convs of ``"k3"`` and ``"glm"``).
        flat_a_log: store ``A_log`` as ``[H]`` instead of ``[1, 1, H, 1]`` (``"glm"`` always
            does).
        flat_conv: store the conv weights as ``[C, K]`` instead of ``[C, 1, K]``.
        a_log_len: ``style="k3"`` only: stored ``A_log`` entries P >= H, the entries past the H
            heads zero (default ``max(H, D)``, as K3 pads 96 heads to 128).
        fp8: ``style="k3"`` only: store every attention projection (KDA and MLA) as NVIDIA's
            ModelOpt ``FP8_PB_WO`` does: ``<p>.weight`` F8_E4M3 plus ``<p>.weight_scale`` F32
            ``[ceil(out/128), 1, ceil(in/128), 1]``, with a ``modelopt_mixed``
            ``quantization_config`` and ``hf_quant_config.json``. Dequantized weights are
            about N(0, 0.02).
        max_file_bytes: byte budget per safetensors file (tensor data; a file exceeds it by at
            most one tensor). At least two files are always written.
        progress: optional ``progress(bytes_done, bytes_total)``, called after each tensor is
            generated, with byte counts of tensor data.

    Returns:
        ``Path(out_dir)``.

    Raises:
        PlanError: a non-positive size, a negative seed, an out-of-range or repeated
            ``kda_layers`` entry, an unknown ``style``, or an ``a_log_len`` below ``heads`` or
            without ``style="k3"``.
        DtypeMismatchError: an unsupported ``weight_dtype``.
        OutputError: the directory or a file cannot be written.
    """
    _check_positive(
        hidden=hidden,
        heads=heads,
        head_dim=head_dim,
        conv_kernel=conv_kernel,
        gate_rank=gate_rank,
        num_layers=num_layers,
        vocab_size=vocab_size,
        max_file_bytes=max_file_bytes,
    )
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise PlanError(f"seed must be a non-negative int, got {seed!r}")
    if style not in STYLES:
        raise PlanError(f"unknown config style {style!r}; expected one of {tuple(STYLES)}")
    if weight_dtype not in MODEL_DTYPES:
        raise DtypeMismatchError(
            f"weight_dtype {weight_dtype!r} is not supported; "
            f"expected one of {list(MODEL_DTYPES)}"
        )
    family = STYLES[style]
    if family.padded_a_log:
        a_log_len = max(heads, head_dim) if a_log_len is None else a_log_len
        _check_positive(a_log_len=a_log_len)
        if a_log_len < heads:
            raise PlanError(f"a_log_len {a_log_len} is below the {heads} heads")
    if (a_log_len is not None and not family.padded_a_log) or (
            fp8 and not any(v.get("fp8") for v in family.variants.values())):
        raise PlanError("a_log_len (a zero-padded A_log) and fp8 need style='k3'")
    kda = list(kda_layers)
    if (
        len(set(kda)) != len(kda)
        or any(isinstance(i, bool) or not isinstance(i, int) for i in kda)
        or any(not 0 <= i < num_layers for i in kda)
    ):
        raise PlanError(
            f"kda_layers must be unique 0-based indices below num_layers={num_layers}, "
            f"got {list(kda_layers)}"
        )

    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{out}: cannot create output directory: {exc}") from exc

    geometry = Geometry(
        hidden, heads, head_dim, conv_kernel, gate_rank, style, flat_a_log, flat_conv, a_log_len
    )
    specs = model_tensors(geometry, num_layers, set(kda), vocab_size, weight_dtype)
    config = config_json(geometry, num_layers, set(kda), vocab_size, TORCH_NAMES[weight_dtype])
    if fp8:
        specs = quantize_attention(specs)
        quant = modelopt_config([s.name for s in specs if s.name.endswith(".weight_scale")])
        config["quantization_config"] = {"quant_method": "modelopt_mixed", **quant}
        files.write_json(out / "hf_quant_config.json",
                          {"producer": {"name": "modelopt"}, "quantization": quant})
    files.write_json(out / "config.json", config)
    _write_tensor_files(out, specs, seed, max_file_bytes, progress)
    return out


def _write_tensor_files(
    out: Path, specs: list[Spec], seed: int, max_file_bytes: int, progress: ProgressFn | None
) -> None:
    """Write the safetensors files and the index, generating one tensor at a time."""
    generator = _Generator(specs, seed)
    groups = _split_into_files([s.nbytes for s in specs], max_file_bytes)
    total = sum(s.nbytes for s in specs)
    done = 0

    def producer(spec: Spec) -> Callable[[], np.ndarray]:
        def get_bytes() -> np.ndarray:
            nonlocal done
            data = generator.tensor(spec)
            done += spec.nbytes
            if progress is not None:
                progress(done, total)
            return data

        return get_bytes

    weight_map: dict[str, str] = {}
    for number, group in enumerate(groups, start=1):
        file_name = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        members = [specs[j] for j in group]
        writer.write_safetensors(
            out / file_name,
            [(s.name, s.dtype, s.shape, s.nbytes, producer(s)) for s in members],
            metadata={"format": "pt"},
        )
        weight_map.update((s.name, file_name) for s in members)
    writer.write_index(out / "model.safetensors.index.json", weight_map, total)


def _split_into_files(sizes: list[int], max_file_bytes: int) -> list[list[int]]:
    """Group tensor indices (kept in order) into >= 2 files of roughly equal byte size.

    The number of files is ``max(2, ceil(total / max_file_bytes))``; a tensor goes to the file
    whose equal share of the total contains the tensor's midpoint. Needs at least two tensors.
    """
    total = sum(sizes)
    files = max(2, -(-total // max_file_bytes))
    slots = []
    start = 0
    for size in sizes:
        slots.append(min(files - 1, (2 * start + size) * files // (2 * total)))
        start += size
    if slots[-1] == slots[0]:
        slots[-1] = slots[0] + 1
    groups: dict[int, list[int]] = {}
    for index, slot in enumerate(slots):
        groups.setdefault(slot, []).append(index)
    return [groups[slot] for slot in sorted(groups)]


class _Generator:
    """Deterministic tensor values for one checkpoint (see the module docstring)."""

    def __init__(self, specs: list[Spec], seed: int):
        self._seed = seed
        pooled = [s for s in specs if self._uses_pool(s)]
        self._pool_elems = max([_MIN_POOL_ELEMS] + [4 * (s.shape[0] + s.shape[1]) for s in pooled])
        self._pools: dict[str, np.ndarray] = {}

    @staticmethod
    def _uses_pool(spec: Spec) -> bool:
        return (
            spec.kind in ("proj", "fp8")
            and len(spec.shape) == 2
            and math.prod(spec.shape) > _DIRECT_LIMIT
        )

    def tensor(self, spec: Spec) -> np.ndarray:
        """The tensor's little-endian data as a C-contiguous array of ``spec.nbytes`` bytes."""
        rng = np.random.default_rng([self._seed, zlib.crc32(spec.name.encode("utf-8"))])
        if self._uses_pool(spec):
            rows, cols = spec.shape
            pool = self._pool(spec.dtype, spec.kind)
            starts = rng.choice(pool.size - cols + 1, size=rows, replace=False)
            return sliding_window_view(pool, cols)[starts]
        count = math.prod(spec.shape)
        if spec.kind == "proj":
            values = rng.standard_normal(count, dtype=np.float32) * np.float32(_PROJ_STD)
        elif spec.kind == "fp8":
            values = rng.standard_normal(count, dtype=np.float32) * np.float32(_FP8_SPREAD)
        elif spec.kind == "scale":
            values = rng.uniform(0.5, 1.5, count).astype(np.float32) * np.float32(
                _PROJ_STD / _FP8_SPREAD
            )
        elif spec.kind == "norm":
            values = 1 + rng.standard_normal(count, dtype=np.float32) * np.float32(_PROJ_STD)
        elif spec.kind == "conv":
            values = rng.random(count, dtype=np.float32) - np.float32(0.5)
        elif spec.kind == "a_log":
            values = np.log(rng.uniform(1.0, 16.0, count)).astype(np.float32)
        elif spec.kind.startswith("a_log_pad:"):
            heads = int(spec.kind.split(":")[1])
            values = np.zeros(count, np.float32)
            values[:heads] = np.log(rng.uniform(1.0, 16.0, heads))
        else:  # dt_bias
            dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), count))
            values = (dt + np.log(-np.expm1(-dt))).astype(np.float32)
        return _encode(values, spec.dtype)

    def _pool(self, dtype: str, kind: str) -> np.ndarray:
        """N(0, 0.02) values in ``dtype`` (N(0, 1) · 64 for FP8), drawn once per dtype per
        checkpoint."""
        if dtype not in self._pools:
            rng = np.random.default_rng([self._seed, _POOL_STREAM])
            values = rng.standard_normal(self._pool_elems, dtype=np.float32)
            values *= np.float32(_FP8_SPREAD if kind == "fp8" else _PROJ_STD)
            self._pools[dtype] = _encode(values, dtype)
        return self._pools[dtype]


def _encode(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> little-endian storage array of ``dtype`` (BF16 as '<u2' bit patterns,
    FP8 as bytes), rounded as an engine rounds (``kda_tp.model.dtypes.cast_to``)."""
    encoded = cast_to(values, dtype)
    return encoded.view({"BF16": "<u2", "F8_E4M3": "u1"}.get(dtype, encoded.dtype))


def _check_positive(**sizes: int) -> None:
    """Refuse any size that is not an int >= 1."""
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{key} must be a positive int, got {value!r}")
