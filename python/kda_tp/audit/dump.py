"""What a serving engine must hold for a checkpoint's KDA layers, as files or as digests.

Both functions walk the same list, the one ``kda_tp.audit`` checks: for every rank, every KDA
layer and every parameter of an engine layout (:mod:`kda_tp.engines`;
``KdaShardedSource.engine_params``), the parameter's bytes as the engine's own loader leaves
them (``KdaShardedSource.build_param``), under the name the engine's ``state_dict()`` gives it
(``EngineLayout.state_dict_prefix``: ``model.layers.{i}.self_attn.<param>``, or
``language_model.model.layers.`` for a checkpoint in a multimodal wrapper). One parameter is
built at a time.

* :func:`write_engine_dump` writes them as an engine's ``save_sharded_state`` would
  (``model-rank-{r}-part-0.safetensors``, one file per rank): a dump to try ``kda-tp audit``
  on without an engine, or to compare with a real one.
* :func:`engine_digests` hashes them as vLLM's ``Worker.compute_weight_checksums`` does: the
  SHA-256 of each parameter's raw bytes, keyed ``dp0:pp0:pcp0:tp{r}:<name>``, to compare with
  the checksums a running vLLM reports (``POST /weight_checker`` with ``"action":
  "checksum"``) with nothing installed in the engine.

Only the KDA parameters are produced: the engine's other parameters (embeddings, MLP,
full-attention layers, norms outside ``self_attn``) are not.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint.writer import resolve_out, write_safetensors
from .values import cast_overflow
from .._native import __version__
from ..checkpoint.reader import SafetensorsSource
from ..checkpoint.description import describe
from ..engines.registry import (
    LAYOUTS,
    EngineLayout,
    EngineParamPlan,
    get_layout,
    layouts_for,
    param_name,
)
from ..errors import (
    CheckpointError,
    DtypeMismatchError,
    EngineLayoutError,
    KdaTpError,
    OutputError,
    PlanError,
)
from ..checkpoint.names import kda_tensor_name
from ..output.marks import refuse_foreign_files
from ..output.dirs import input_mode, replace_files, staged_name
from ..rank.plan import KdaTpPlan
from ..shard.rankdir import FILE_MARK
from ..model.config import parse_metadata_int
from .dump_files import DUMP_FILE, sharded_state_files
from ..engines.dtype import engine_model_dtype
from ..rank.view import KdaShardedSource, checked_get

__all__ = [
    "DIGEST_KEY",
    "DumpResult",
    "build_checked",
    "checked_ranks",
    "engine_digests",
    "param_digest",
    "vllm_layout",
    "write_engine_dump",
]

#: vLLM 0.33's key of one parameter's checksum (``Worker._weight_checksum_prefix`` + the
#: parameter's name): data-parallel index, pipeline, prefill-context-parallel and
#: tensor-parallel rank. A KDA model served with tensor parallelism alone has ``dp0:pp0:pcp0``.
DIGEST_KEY = "dp0:pp0:pcp0:tp{rank}:{name}"

@dataclass(frozen=True)
class DumpResult:
    """What :func:`write_engine_dump` wrote.

    Attributes:
        out_dir: the output directory.
        engine: the layout's name (a ``kda_tp.engines.LAYOUTS`` key).
        tp_size: the tensor-parallel world size.
        ranks: the ranks written, sorted.
        files: one file per rank, in ``ranks`` order.
        params: KDA parameters written, over all ranks.
        bytes_written: their data in bytes (headers not counted).
        seconds: wall time.
    """

    out_dir: Path
    engine: str
    tp_size: int
    ranks: tuple[int, ...]
    files: tuple[Path, ...]
    params: int
    bytes_written: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what ``kda-tp dump --json`` prints): ``ok`` (True: a refused
        dump raises), ``out_dir``, ``engine``, ``tp_size``, ``ranks``, ``files``, ``params``,
        ``bytes_written``, ``seconds``."""
        return {
            "ok": True, "out_dir": str(self.out_dir), "engine": self.engine,
            "tp_size": self.tp_size, "ranks": list(self.ranks),
            "files": [str(f) for f in self.files], "params": self.params,
            "bytes_written": self.bytes_written, "seconds": self.seconds,
        }


@dataclass(frozen=True)
class _Param:
    """One expected parameter of one rank: its engine name, plan, and how to build it."""

    name: str
    plan: EngineParamPlan
    build: Callable[[], np.ndarray]


def _ranks_of(
    checkpoint: str | os.PathLike[str] | SafetensorsSource,
    engine: str | EngineLayout,
    tp_size: int,
    ranks: Sequence[int] | None,
    model_dtype: str | None,
) -> tuple[EngineLayout, list[tuple[int, list[_Param]]]]:
    """The layout and, per rank, its expected KDA parameters in order (nothing built yet).

    Raises:
        PlanError: ``tp_size`` not a positive integer or not a split the heads allow; a rank
            out of range or repeated; an empty rank list.
        EngineLayoutError: an unknown layout, one of another model family than the
            checkpoint's, or one that does not fit the checkpoint.
        CheckpointError: the checkpoint cannot be read or has no config.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise PlanError(f"tp_size must be a positive integer, got {tp_size!r}")
    source = (checkpoint if isinstance(checkpoint, SafetensorsSource)
              else SafetensorsSource(checkpoint))
    layout = get_layout(engine)
    model_dtype = engine_model_dtype(source, layout.engine, model_dtype)
    # Any split the heads allow (no q|k width rule: the engine chose the world size); checked
    # before anything is sized by tp_size.
    plan0 = KdaTpPlan.from_config(source, 0, tp_size, qk_multiple=1)
    family = describe(source).family.name  # the description from_config read
    if layout.family != family:
        fitting = ", ".join(lay.name for lay in layouts_for(family, plan0)) or "none"
        raise EngineLayoutError(
            f"{layout.name}: this layout is for {layout.family}, but the checkpoint "
            f"{source.path} is {family}; layouts that fit it: {fitting}"
        )
    out = []
    for r in checked_ranks(ranks, tp_size):
        shard = KdaShardedSource(source, KdaTpPlan.from_config(source, r, tp_size,
                                                               qk_multiple=1))
        prefix = layout.state_dict_prefix(shard.prefix)
        params = []
        for layer, param in shard.engine_params(layout):
            plan = shard.param_plan(layout, param.suffix, model_dtype=model_dtype)

            name = param_name(prefix, layer, param.suffix)
            build = functools.partial(
                build_checked, shard, layout, layer, plan, name, model_dtype,
                "pass another --dtype (model_dtype=), the one the engine runs in")
            params.append(_Param(name, plan, build))
        out.append((r, params))
    return layout, out


def write_engine_dump(
    checkpoint: str | os.PathLike[str] | SafetensorsSource,
    out: str | os.PathLike[str],
    *,
    engine: str | EngineLayout,
    tp_size: int,
    ranks: Sequence[int] | None = None,
    model_dtype: str | None = None,
    force: bool = False,
) -> DumpResult:
    """Write the KDA parameters an engine's ranks must hold, as its ``save_sharded_state`` would.

    For each rank ``r`` in ``ranks``, ``out/model-rank-{r}-part-0.safetensors`` holds every KDA
    parameter of every KDA layer in ``engine``'s layout, named as the engine's ``state_dict()``
    names it (``model.layers.{i}.self_attn.in_proj_qkvgfab.weight``; a wrapped checkpoint's
    under ``language_model.model.layers.``), with the bytes the engine's loader leaves in it
    (``KdaShardedSource.build_param``: the rank's slices in the layout's order, zero padding
    rows, the engine's casts). Nothing else is written: no embeddings, MLP or full-attention
    parameters. The header metadata carries ``tp_size``, ``tp_rank`` and ``engine``, which
    ``kda-tp audit`` checks. ``kda-tp audit checkpoint out --tp-size T`` passes on it; a
    dump whose bytes are then changed fails there, naming the parameter.

    Each file is written to a hidden temporary file and renamed into place (a reader never
    sees half a file; two writers of one file leave one whole file), one parameter's bytes in
    memory at a time.

    Args:
        checkpoint: the checkpoint (directory or ``.safetensors`` file, with ``config.json``).
        out: the output directory (created if missing).
        engine: an engine layout or its name (``kda_tp.engines.LAYOUTS``, e.g.
            ``"vllm-0.33-kimi-linear"``).
        tp_size: the tensor-parallel world size.
        ranks: the ranks to write (default: all).
        model_dtype: the engine's model dtype (its ``--dtype``: ``"BF16"``, ``"F16"``,
            ``"F32"``) for the parameters it casts to it; None: the engine's default for this
            checkpoint (``kda_tp.model_dtype.engine_model_dtype``: the config's
            ``dtype``/``torch_dtype`` as the engine reads it; an F32 or dtype-less config runs
            in BF16 under vLLM, F16 under SGLang), the one ``kda_tp.audit`` expects.
            Parameters with a fixed dtype (F32 ``A_log``) and FP8 weights are unaffected.
        force: replace dump files of these ranks already in ``out`` (otherwise refused: it
            may be a real engine's dump): every file of those ranks, in both of
            ``save_sharded_state``'s name patterns (``sharded_state_files``), is removed, and
            so are another world size's dump files, once the new files are complete; only
            files kda-tp wrote (:data:`kda_tp.rankdir.FILE_MARK` in their header, which every
            dump file carries) are removed or replaced, anything else is refused.

    Returns:
        A :class:`DumpResult`.

    Raises:
        OutputError: ``out`` is empty, cannot be resolved (a symlink loop) or lies inside the
            checkpoint; without ``force``, it holds dump files of another world size (a rank
            ``>= tp_size``, or other ``tp_size`` metadata) or a file of a rank being written;
            a write fails (the message names the file and the OS error); with ``force``, such a
            file kda-tp did not write (an engine's own dump).
        DtypeMismatchError: ``model_dtype`` is not a model dtype; casting a parameter to
            the model dtype overflows (a finite value
            becomes inf; ``kda_tp.audit_values.cast_overflow``): the message names the rank,
            the parameter and the value; no file of this call is left, and what ``out`` held
            before is untouched.
        PlanError: ``tp_size`` or a rank is not valid for the model (range, repeats), or
            ``ranks`` is empty.
        EngineLayoutError: an unknown layout, one of another model family, or one that does
            not fit the checkpoint.
        CheckpointError: the checkpoint cannot be read or has no config; a dump-file name in
            ``out`` whose rank has more than ``kda_tp.config.MAX_INT_DIGITS`` digits.
    """
    start = time.perf_counter()
    if str(out) == "":
        raise OutputError("the output directory is an empty path; pass a directory (--out DIR, "
                          "out=; '.' for the current one)")
    layout, by_rank = _ranks_of(checkpoint, engine, tp_size, ranks, model_dtype)
    root = Path(out)
    source_root = Path(checkpoint.path if isinstance(checkpoint, SafetensorsSource)
                       else checkpoint)
    source_dir = resolve_out(source_root if source_root.is_dir() else source_root.parent)
    resolved = resolve_out(root)
    if resolved == source_dir or source_dir in resolved.parents:
        raise OutputError(f"{root}: the output directory lies inside the checkpoint "
                          f"{source_dir}; choose another --out (out=)")
    try:
        root.mkdir(parents=True, exist_ok=True)
        next(root.iterdir(), None)
    except OSError as e:
        raise OutputError(f"{root}: cannot create or list the output directory: {e}") from e
    # Both of save_sharded_state's name patterns, every part: the audit's reading. A name
    # whose rank cannot be read is refused, never taken for "no dump file there".
    found = sharded_state_files(root, allow_empty=True)
    written = {r for r, _ in by_rank}
    # Files of another world size: a rank >= tp_size, or a tp_size of their own.
    foreign = [(p, why) for rank, paths in found.items() for p in paths
               if (why := _other_world_size(p, rank, tp_size)) is not None]
    if foreign and not force:
        path, why = foreign[0]
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise OutputError(f"{path}: {why}, so of another world size than tp_size {tp_size}"
                          f"{more}; pass --force (force=True) to remove them, or choose another "
                          "--out (out=)")
    ours = [p for r in sorted(written) for p in found.get(r, [])]
    if ours and not force:
        raise OutputError(f"{ours[0]} already exists (it may be an engine's own dump); "
                          "pass --force (force=True) to replace it, or choose another --out")
    # --force: every file of another world size, and every file (any part, any pipeline
    # stage) of the ranks written, so that what is left is this dump's; each only when kda-tp
    # wrote it, and only once the new files are complete (kda_tp.outdir).
    stale = list(dict.fromkeys([p for p, _ in foreign] + ours))
    refuse_foreign_files(stale)
    mode = input_mode(source_root)
    staged: dict[Path, Path] = {}
    total, count = 0, 0
    try:
        for r, params in by_rank:
            path = root / DUMP_FILE.format(rank=r)
            meta = {"tp_size": str(tp_size), "tp_rank": str(r), "engine": layout.name,
                    FILE_MARK: __version__}
            specs = [(p.name, p.plan.dtype, p.plan.shape, p.plan.nbytes, p.build) for p in params]
            staged[path] = staged_name(path)
            total += write_safetensors(staged[path], specs, meta, sync=False, mode=mode)
            count += len(params)
    except BaseException:
        for path in staged.values():  # no half dump, and the previous one untouched
            path.unlink(missing_ok=True)
        raise
    replace_files(staged, stale)
    files = list(staged)
    return DumpResult(root, layout.name, tp_size, tuple(r for r, _ in by_rank), tuple(files),
                      count, total, time.perf_counter() - start)


def _other_world_size(path: Path, rank: int, tp_size: int) -> str | None:
    """Why the dump file ``path`` of ``rank`` belongs to another world size than ``tp_size``
    (its rank is out of range, or its ``tp_size`` metadata differs), else None."""
    if rank >= tp_size:
        return f"a dump file of rank {rank}"
    try:
        files = SafetensorsSource(path).files()
        recorded = (files[0][1] or {}).get("tp_size") if files else None
        theirs = None if recorded is None else parse_metadata_int(recorded, "tp_size", str(path))
    except (KdaTpError, ValueError, OSError):
        return None  # unreadable: judged by its name only
    if theirs is not None and theirs != tp_size:
        return f"a dump file of tp_size {theirs} (its metadata)"
    return None


def engine_digests(
    checkpoint: str | os.PathLike[str] | SafetensorsSource,
    *,
    engine: str | EngineLayout,
    tp_size: int,
    ranks: Sequence[int] | None = None,
    model_dtype: str | None = None,
) -> dict[str, str]:
    """The SHA-256 of every KDA parameter an engine's ranks must hold, keyed as vLLM keys its
    weight checksums.

    vLLM 0.33's ``Worker.compute_weight_checksums`` returns, for every parameter of the model
    (``named_parameters()``; buffers are not included), ``sha256(p.detach().cpu().contiguous()
    .view(-1).view(torch.uint8).numpy()).hexdigest()`` (``vllm/model_executor/model_loader/
    weight_checksum.py``: ``compute_tensor_digests``), keyed ``dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:``
    + the name. This computes the same for the parameters of :func:`write_engine_dump`: the
    hash of the row-major raw bytes, in the parameter's dtype, of what the engine's loader
    leaves in each KDA parameter, keyed with :data:`DIGEST_KEY`. A digest can only match
    where the engine keeps the parameter as loaded: see ``docs/audit.md`` for the parameters
    vLLM rewrites after loading.

    Args:
        checkpoint: the checkpoint the engine loads (as for :func:`write_engine_dump`).
        engine: a vLLM layout or its name (``"vllm-0.33-k3"``, ``"vllm-0.33-kimi-linear"``,
            ``"vllm-0.33-glm-5.3"``).
        tp_size: the engine's tensor-parallel world size.
        ranks: the ranks (default: all).
        model_dtype: the engine's model dtype, as for :func:`write_engine_dump`.

    Returns:
        ``{key: hex digest}``, ranks in order, then layers, then the layout's parameters.

    Raises:
        EngineLayoutError: a layout of another engine than vLLM (its checksums, where it has
            any, are keyed otherwise), and as :func:`write_engine_dump`.
        PlanError, CheckpointError, DtypeMismatchError: as :func:`write_engine_dump`.
    """
    _, by_rank = _ranks_of(checkpoint, vllm_layout(engine), tp_size, ranks, model_dtype)
    return {DIGEST_KEY.format(rank=r, name=p.name): param_digest(p.build())
            for r, params in by_rank for p in params}


def vllm_layout(engine: str | EngineLayout) -> EngineLayout:
    """``engine``'s layout, which must be a vLLM one: digests are vLLM's weight checksums
    (``engine_digests`` and ``kda_tp.expected.expected_digests``).

    Raises:
        EngineLayoutError: an unknown layout, or one of another engine (the message lists the
            vLLM layouts).
    """
    layout = get_layout(engine)
    if layout.engine != "vllm":
        vllm = ", ".join(n for n, lay in LAYOUTS.items() if lay.engine == "vllm")
        raise EngineLayoutError(
            f"{layout.name}: digests are vLLM's weight checksums (compute_weight_checksums); "
            f"{layout.engine} computes none of its own keyed so. Pass a vLLM layout: {vllm}"
        )
    return layout


def checked_ranks(ranks: Sequence[int] | None, tp_size: int) -> list[int]:
    """The engine ranks asked for, sorted (None: all ``tp_size`` of them).

    Raises:
        PlanError: an empty list, a rank that is not an integer in ``0..tp_size-1``, or a rank
            named twice.
    """
    wanted = list(range(tp_size)) if ranks is None else list(ranks)
    if not wanted:
        raise PlanError("no ranks to write: --ranks is empty (ranks=[]); pass at least one rank, "
                        "or none for all")
    for r in wanted:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < tp_size:
            raise PlanError(f"rank {r!r} is out of range for tp_size {tp_size}: valid ranks "
                            f"are 0..{tp_size - 1}; pass ranks of that world size")
    if len(set(wanted)) != len(wanted):
        raise PlanError(f"ranks {sorted(wanted)} name a rank twice; pass each rank once")
    return sorted(wanted)


def build_checked(shard: KdaShardedSource, layout: EngineLayout, layer: int,
                  plan: EngineParamPlan, name: str, model_dtype: str | None,
                  fix: str) -> np.ndarray:
    """Engine parameter ``plan.suffix`` of KDA layer ``layer`` on ``shard``'s rank, as the
    engine's loader leaves it (``KdaShardedSource.build_param``), refused when a cast to the
    model dtype overflows.

    Args:
        plan: the parameter's plan (``KdaShardedSource.param_plan``, for ``model_dtype``).
        name: the parameter's engine name, for the message.
        fix: what the refusal tells the caller to do.

    Raises:
        DtypeMismatchError: a finite value becomes inf in the cast
            (``kda_tp.audit_values.cast_overflow``): the rank, the parameter and the value.
    """
    with np.errstate(over="ignore"):  # an overflow is refused below
        built: np.ndarray = shard.build_param(layout, plan.suffix, layer,
                                              model_dtype=model_dtype)
    overflow = cast_overflow(plan, built.reshape(-1), lambda part: checked_get(
        shard, kda_tensor_name(shard.prefix, layer, part)).array.reshape(-1))
    if overflow is not None:
        raise DtypeMismatchError(f"rank {shard.plan.tp_rank} {name}: {overflow}; {fix}")
    return built


def param_digest(built: np.ndarray) -> str:
    """The SHA-256 (hex) of a parameter's row-major raw bytes, as vLLM's
    ``compute_tensor_digests`` hashes them."""
    data = np.ascontiguousarray(built).reshape(-1).view(np.uint8)
    return hashlib.sha256(data.data).hexdigest()
