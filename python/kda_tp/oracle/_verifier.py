"""The oracle's verifier: a sharded checkpoint directory against its source, byte for byte,
with nothing but the standard library (``python -m kda_tp.oracle verify CHECKPOINT OUT``).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

from kda_tp.errors import CheckpointError, PlanError, ShapeMismatchError

from ._bind import local_shape, plan_name, shard_bytes
from ._checkpoint import Checkpoint, read_safetensors_header
from ._config import KdaConfig, config_block, read_kda_config
from ._mla_plan import OracleMlaPlan, mla_plan, read_mla_geometry
from ._shard_plan import (
    FP8_ELEM_BYTES,
    FULL_RANK_GATE_TENSOR_NAMES,
    TENSOR_NAMES,
    OraclePlan,
    OracleTensor,
    plan,
)

_LAYER_ATTN = re.compile(r"(\d+)\.(self_attn\..+)")
_A_LOG = re.compile(r"((?:.*\.)?layers\.)\d+\.self_attn\.A_log")


def _decoder_prefix(names: Iterable[str]) -> str:
    """The prefix, up to the layer index, of the layers holding ``A_log`` (a KDA-only tensor):
    ``model.layers.`` for Kimi-Linear; other stacks (a vision tower) are never KDA layers."""
    prefixes = {m[1] for n in names if (m := _A_LOG.fullmatch(n))}
    return prefixes.pop() if len(prefixes) == 1 else "model.layers."


def _kda_plan_name(
    name: str, kda_layers: frozenset[int], prefix: str, names: Iterable[str]
) -> str | None:
    """The plan name (one of ``names``) of checkpoint tensor ``name`` if it belongs to a KDA
    layer, else ``None``. A block scale ``<p>.weight_scale`` / ``<p>.weight_scale_inv`` is
    named ``<p>.scale``.

    Layer type comes from the config, never from a tensor's shape: full-attention (MLA) layers
    also have ``self_attn.q_proj`` and an ``o_proj`` of the same shape.
    """
    match = _LAYER_ATTN.fullmatch(name[len(prefix) :]) if name.startswith(prefix) else None
    if match is None or int(match[1]) not in kda_layers:
        return None
    candidate = _scale_as_plan_name(plan_name(match[2]))
    return candidate if candidate in names else None


def _scale_as_plan_name(name: str) -> str:
    """A block scale ``<p>.weight_scale`` / ``<p>.weight_scale_inv`` as its plan name
    ``<p>.scale``; any other name unchanged."""
    for suffix in (".weight_scale", ".weight_scale_inv"):
        if name.endswith(suffix):
            return name.removesuffix(suffix) + ".scale"
    return name


def verify(checkpoint_dir: str | Path, out_dir: str | Path) -> list[str]:
    """Check a tensor-parallel sharded checkpoint against its source, byte for byte.

    Args:
        checkpoint_dir: the full checkpoint: ``config.json`` (see :func:`read_kda_config`) and
            ``model.safetensors.index.json`` with its shards, or a single ``*.safetensors``.
        out_dir: the sharded output: directories ``rank0`` .. ``rank{T-1}``, each a checkpoint
            directory with ``config.json``, ``model.safetensors.index.json`` and the
            ``*.safetensors`` files it lists, every file's ``__metadata__`` carrying
            ``"tp_rank": "r"`` and ``"tp_size": "T"``.

    What is checked, per rank ``r``: the same tensor names as the source, none missing or extra;
    every KDA-layer tensor ``model.layers.{i}.self_attn.<name>[.weight]`` (``i`` in the config's
    KDA layers, ``<name>`` a plan name) has the source's dtype, the shape :func:`local_shape`
    gives and exactly the bytes :func:`shard_bytes` gives for rank ``r``; every other tensor is
    identical to the source in dtype, shape and bytes. The plan uses the config's geometry,
    ``gate_rank`` = rows of the first KDA layer's ``f_a_proj`` and the dtypes of that layer's
    tensors; it is built with ``qk_multiple=1``, since the 256-channel kernel rule does not
    change which bytes a rank holds.

    A ``--kda-only`` output (``kda_tp_kda_only`` in its headers) must hold exactly the KDA
    tensors, and needs no ``config.json``. When the source config lists no KDA layers, the
    ``kda_tp_layers`` the rank headers record are used.

    A hybrid's MLA layers that rank 0's headers record sliced (``kda_tp_mla_layers``) are
    checked as the KDA layers are, by :func:`mla_plan` with the config's MLA geometry
    (:func:`read_mla_geometry`) and the first such layer's dtypes; MLA layers not recorded
    must be whole.

    Returns:
        One line per problem found, each naming the rank and the file or tensor; empty when the
        output is a correct sharding of the source.
    """
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    meta = _rank_metadata(out_dir / "rank0")
    try:
        recorded = json.loads(meta.get("kda_tp_layers", "null"))
    except ValueError:
        recorded = None
    kda_only = meta.get("kda_tp_kda_only") == "1"
    try:
        source = Checkpoint(checkpoint_dir, require_index=False)
        geometry = read_kda_config(source.config, recorded)
    except CheckpointError as exc:
        return [f"input: {exc}"]
    if not geometry.kda_layers:
        return [f"input: {checkpoint_dir}/config.json lists no KDA layer"]
    first = min(geometry.kda_layers)
    decoder = _decoder_prefix(source.tensors)
    prefix = f"{decoder}{first}.self_attn."
    f_a = source.tensors.get(prefix + "f_a_proj.weight")
    if f_a is None or not f_a.shape:
        return [f"input: {prefix}f_a_proj.weight is missing, so gate_rank is unknown"]
    names: Sequence[str] = (
        FULL_RANK_GATE_TENSOR_NAMES if geometry.full_rank_gate else TENSOR_NAMES
    )
    dtypes = {
        name: source.tensors[full].dtype
        for name in names
        for full in (prefix + name, prefix + name + ".weight")
        if full in source.tensors
    }
    a_log = source.tensors.get(prefix + "A_log")
    a_log_len = math.prod(a_log.shape) if a_log is not None else None
    fp8 = [n for n, d in dtypes.items() if d in FP8_ELEM_BYTES]
    block = config_block(source.config, checkpoint_dir) if fp8 else None
    if fp8 and block is None:
        return [f"input: {prefix}{fp8[0]}.weight is FP8 but the config declares no block size"]
    problems = _padding_problems(source, geometry, decoder)
    try:
        mla_layers = frozenset(json.loads(meta.get("kda_tp_mla_layers", "[]")))
        mla_geometry = read_mla_geometry(source.config) if mla_layers else {}
    except (ValueError, TypeError, CheckpointError) as exc:
        return [f"rank0: the MLA layers it records sliced cannot be planned: {exc}"]
    mla_first = f"{decoder}{min(mla_layers)}.self_attn." if mla_layers else ""

    if not out_dir.is_dir():
        return [f"output: {out_dir} is not a directory"]
    rank_dirs = sorted(
        (int(m[1]), p)
        for p in out_dir.iterdir()
        if p.is_dir() and (m := re.fullmatch(r"rank(\d+)", p.name))
    )
    if not rank_dirs:
        return [f"output: {out_dir} holds no rank<N> directory"]
    tp_size = _declared_tp_size(rank_dirs[0][1]) or len(rank_dirs)
    if [r for r, _ in rank_dirs] != list(range(tp_size)):
        names = [p.name for _, p in rank_dirs][:8]
        return [
            f"output: rank directories {names} are not rank0 .. rank{tp_size - 1} "
            f"(tp_size {tp_size}; incomplete run?)"
        ]

    for rank, rank_dir in rank_dirs:
        try:
            rank_plan = plan(
                rank,
                tp_size,
                geometry.hidden,
                geometry.head_dim,
                geometry.heads,
                geometry.conv_kernel,
                f_a.shape[0],
                qk_multiple=1,
                dtypes=dtypes,
                full_rank_gate=geometry.full_rank_gate,
                a_log_len=a_log_len,
                quant_block=block,
                quantized=fp8 if block else None,
            )
        except PlanError as exc:
            problems.append(f"rank{rank}: no shard plan for this geometry: {exc}")
            continue
        mla = None
        if mla_layers:
            names_tp1 = [t.name for t in mla_plan(0, 1, **mla_geometry).tensors]
            mla_dtypes = {n: source.tensors[full].dtype for n in names_tp1
                          for full in (mla_first + n, mla_first + n + ".weight")
                          if full in source.tensors}
            mla_fp8 = [n for n, d in mla_dtypes.items() if d in FP8_ELEM_BYTES]
            mla_block = config_block(source.config, checkpoint_dir) if mla_fp8 else None
            try:
                mla = (mla_layers, mla_plan(rank, tp_size, **mla_geometry, dtypes=mla_dtypes,
                                            quant_block=mla_block,
                                            quantized=mla_fp8 if mla_block else None))
            except PlanError as exc:
                problems.append(f"rank{rank}: no MLA shard plan for this geometry: {exc}")
                continue
        try:
            sharded = Checkpoint(rank_dir, require_index=True, require_config=not kda_only)
        except CheckpointError as exc:
            problems.append(f"rank{rank}: {exc}")
            continue
        problems += _check_rank(
            source, sharded, rank_plan, geometry.kda_layers, decoder, kda_only, mla
        )
        if not kda_only:
            problems += _companion_problems(checkpoint_dir, rank, rank_dir)
    return problems


#: Files beside a checkpoint that shard never copies (docs/sharding.md, "Files beside the
#: checkpoint"), restated: weights or training state in these formats of 1 MB or more, and any
#: file of 100 MB or more.
_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".h5", ".hdf5",
                    ".msgpack", ".gguf", ".ggml", ".onnx", ".npy", ".npz", ".tflite", ".ot",
                    ".distcp")


def _heavy(path: Path) -> bool:
    """Whether ``shard`` leaves the file ``path`` beside a checkpoint out of every rank."""
    size = path.stat().st_size
    return size >= 100_000_000 or (path.suffix.lower() in _WEIGHT_SUFFIXES
                                   and size >= 1_000_000)


def _companion_problems(checkpoint: Path, rank: int, rank_dir: Path) -> list[str]:
    """Each of the input's other files (``config.json``, tokenizer files: not ``*.safetensors``,
    not the index, not hidden, not heavy; for a single-file input, its ``config.json``) must be
    in the rank directory, byte for byte."""
    if checkpoint.is_dir():
        files = [
            p for p in sorted(checkpoint.iterdir())
            if p.is_file() and not p.name.startswith(".")
            and not p.name.endswith(".safetensors") and p.name != "model.safetensors.index.json"
            and not _heavy(p)
        ]
    else:
        files = [p for p in [checkpoint.parent / "config.json"] if p.is_file()]
    problems = []
    for original in files:
        copy = rank_dir / original.name
        if not copy.is_file():
            problems.append(f"rank{rank}: {original.name} is missing")
        elif copy.read_bytes() != original.read_bytes():
            problems.append(f"rank{rank}: {original.name} differs from the input's")
    return problems


def _padding_problems(source: Checkpoint, geometry: KdaConfig, decoder: str) -> list[str]:
    """One line per KDA layer whose ``A_log`` holds a non-zero entry past the heads (K3 pads
    ``A_log`` with zeros; a non-zero pad means the checkpoint is not what the plan assumes)."""
    problems = []
    for layer in sorted(geometry.kda_layers):
        name = f"{decoder}{layer}.self_attn.A_log"
        info = source.tensors.get(name)
        if info is None or info.dtype != "F32" or math.prod(info.shape) <= geometry.heads:
            continue
        values = struct.unpack(f"<{math.prod(info.shape)}f", source.read(name))
        for index in range(geometry.heads, len(values)):
            if values[index] != 0:
                problems.append(
                    f"input: {name}: padding entry {index} is {values[index]!r}, expected 0"
                )
                break
    return problems


def _rank_metadata(rank_dir: Path) -> dict[str, str]:
    """The ``__metadata__`` of the first safetensors file in ``rank_dir`` ({} if unreadable)."""
    for path in sorted(rank_dir.glob("*.safetensors")):
        try:
            return read_safetensors_header(path)[0]
        except (CheckpointError, OSError):
            return {}
    return {}


def _declared_tp_size(rank_dir: Path) -> int | None:
    """``tp_size`` from the ``__metadata__`` of the first safetensors file in ``rank_dir``."""
    for path in sorted(rank_dir.glob("*.safetensors")):
        try:
            metadata, _ = read_safetensors_header(path)
            return int(metadata["tp_size"])
        except (CheckpointError, KeyError, ValueError, OSError):
            return None
    return None


def _check_rank(
    source: Checkpoint,
    sharded: Checkpoint,
    rank_plan: OraclePlan,
    kda_layers: frozenset[int],
    decoder: str,
    kda_only: bool = False,
    mla: tuple[frozenset[int], OracleMlaPlan] | None = None,
) -> list[str]:
    """The problems of one rank's directory; see :func:`verify`. A ``--kda-only`` rank
    (``kda_tp_kda_only`` in its headers) holds the sliced tensors and nothing else. ``mla``:
    the MLA layers sliced and this rank's MLA plan (None: MLA tensors are whole)."""
    tag = f"rank{rank_plan.tp_rank}"
    entries = {t.name: t for t in rank_plan.tensors}
    entries.update({t.scale.name: t.scale for t in rank_plan.tensors if t.scale})

    def planned(name: str) -> OracleTensor | None:
        kda_name = _kda_plan_name(name, kda_layers, decoder, entries)
        if kda_name is not None:
            return entries[kda_name]
        match = _LAYER_ATTN.fullmatch(name[len(decoder):]) if name.startswith(decoder) else None
        if mla is None or match is None or int(match[1]) not in mla[0]:
            return None
        return mla[1].get(_scale_as_plan_name(plan_name(match[2])))
    problems = []
    for path, metadata in sharded.metadata.items():
        for key, want in (("tp_rank", rank_plan.tp_rank), ("tp_size", rank_plan.tp_size)):
            if metadata.get(key) != str(want):
                problems.append(
                    f"{tag}: {path.name}: __metadata__ {key} is {metadata.get(key)!r}, "
                    f"expected {str(want)!r}"
                )
    expected = {
        n for n in source.tensors
        if not kda_only or planned(n) is not None
    }
    problems += [f"{tag}: {n}: missing" for n in sorted(expected - sharded.tensors.keys())]
    problems += [
        f"{tag}: {n}: not in the input" for n in sorted(sharded.tensors.keys() - source.tensors)
    ]

    for name in sorted(source.tensors.keys() & sharded.tensors.keys()):
        src, out = source.tensors[name], sharded.tensors[name]
        if out.dtype != src.dtype:
            problems.append(f"{tag}: {name}: dtype {out.dtype}, input has {src.dtype}")
            continue
        entry = planned(name)
        if entry is None:
            want_shape = src.shape
        else:
            if src.dtype != entry.dtype:
                problems.append(
                    f"{tag}: {name}: input dtype {src.dtype} differs from the first KDA "
                    f"(or MLA) layer's {entry.dtype}"
                )
                continue
            try:
                want_shape = local_shape(entry, src.shape)
            except ShapeMismatchError as exc:
                problems.append(f"{tag}: {name}: input {exc}")
                continue
        if out.shape != want_shape:
            problems.append(f"{tag}: {name}: shape {list(out.shape)}, expected {list(want_shape)}")
            continue
        try:
            if entry is None:
                same = out.end - out.start == src.end - src.start and all(
                    a == b for a, b in zip(source.chunks(name), sharded.chunks(name), strict=True)
                )
            else:
                same = sharded.read(name) == shard_bytes(entry, source.read(name))
        except (CheckpointError, ShapeMismatchError) as exc:
            problems.append(f"{tag}: {name}: {exc}")
            continue
        if not same:
            what = "this rank's slice of the input" if entry else "the input"
            problems.append(f"{tag}: {name}: bytes differ from {what}")
    return problems
