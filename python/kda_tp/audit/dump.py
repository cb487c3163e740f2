"""What a serving engine must hold for a checkpoint's KDA layers, written as its dump files.

:func:`write_engine_dump` walks the list the audit checks (``kda_tp.audit.expected_params``:
for every rank, every KDA layer and every parameter of an engine layout, the parameter's bytes
as the engine's own loader leaves them, under the name the engine's ``state_dict()`` gives it)
and writes them as an engine's ``save_sharded_state`` would (``model-rank-{r}-part-0
.safetensors``, one file per rank): a dump to try ``kda-tp audit`` on without an engine, or to
compare with a real one. The same list hashed as vLLM's weight checksums is
:func:`kda_tp.audit.engine_digests`.

Only the KDA parameters, and the hybrid's MLA parameters where their plan can be made, are
produced: the engine's other parameters (embeddings, MLP, norms outside ``self_attn``) are not.
MLA parameters are named as vLLM's own ``save_sharded_state`` would name them (GLM-5.3's
``q_a_layernorm``, ``q_b_proj``, ``o_proj`` under ``self_attn.mla_attn.``), without the
``W_UK_T`` / ``W_UV`` aliases of ``kv_b_proj`` vLLM keeps after loading (on which its own
``save_sharded_state`` raises; ``docs/audit.md``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from .._native import __version__
from ..checkpoint.reader import SafetensorsSource
from ..checkpoint.files import resolve_out
from ..checkpoint.writer import write_safetensors
from ..engines.layout import EngineLayout
from ..errors import KdaTpError, OutputError
from ..model.json_reader import parse_metadata_int
from ..output.dirs import (
    input_mode,
    make_dirs,
    refuse_other_world_size,
    remove_created,
    replace_files,
    staged_name,
)
from ..output.locks import lock_output, output_error
from ..output.marks import refuse_foreign_files
from ..output.names import FILE_MARK
from ._dump_files import DUMP_FILE, sharded_state_files
from .expected_params import ExpectedParam, expected_params

__all__ = ["DumpResult", "write_engine_dump"]

@dataclass(frozen=True)
class DumpResult:
    """What :func:`write_engine_dump` wrote.

    Attributes:
        out_dir: the output directory.
        engine: the layout's name (a ``kda_tp.engines.LAYOUTS`` key).
        tp_size: the tensor-parallel world size.
        ranks: the ranks written, sorted.
        files: one file per rank, in ``ranks`` order.
        params: KDA and MLA parameters written, over all ranks.
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


def write_engine_dump(
    checkpoint: str | os.PathLike[str] | SafetensorsSource,
    out: str | os.PathLike[str],
    *,
    engine: str | EngineLayout,
    tp_size: int,
    ranks: Sequence[int] | None = None,
    model_dtype: str | None = None,
    force: bool = False,
    wait: bool = False,
) -> DumpResult:
    """Write the KDA parameters an engine's ranks must hold, as its ``save_sharded_state`` would.

    For each rank ``r`` in ``ranks``, ``out/model-rank-{r}-part-0.safetensors`` holds every KDA
    parameter of every KDA layer in ``engine``'s layout, named as the engine's ``state_dict()``
    names it (``model.layers.{i}.self_attn.in_proj_qkvgfab.weight``; a wrapped checkpoint's
    under ``language_model.model.layers.``), with the bytes the engine's loader leaves in it
    (``kda_tp.engines.build_param``: the rank's slices in the layout's order, zero padding
    rows, the engine's casts), then, where the hybrid's MLA layers can be planned, every MLA
    parameter of the layout's MLA table under the name vLLM's ``save_sharded_state`` gives it
    (``EngineParam.dump_suffix``), without vLLM's ``W_UK_T`` / ``W_UV`` aliases of
    ``kv_b_proj``. Nothing else is written: no embeddings, MLP or full-attention
    parameters. The header metadata carries ``tp_size``, ``tp_rank`` and ``engine``, which
    ``kda-tp audit`` checks. ``kda-tp audit checkpoint out --tp-size T`` passes on it; a
    dump whose bytes are then changed fails there, naming the parameter.

    Each file is written to a hidden temporary file and renamed into place once every file is
    complete (a reader never sees half a file), one parameter's bytes in memory at a time. A
    dump holds the locks of its output as ``shard`` does (:func:`kda_tp.output.lock_output`):
    one world size per output directory, one writer per rank.

    Args:
        checkpoint: the checkpoint (directory or ``.safetensors`` file, with ``config.json``).
        out: the output directory (created if missing).
        engine: an engine layout or its name (``kda_tp.engines.LAYOUTS``, e.g.
            ``"vllm-0.33-kimi-linear"``).
        tp_size: the tensor-parallel world size.
        ranks: the ranks to write (default: all).
        model_dtype: the engine's model dtype (its ``--dtype``: ``"BF16"``, ``"F16"``,
            ``"F32"``) for the parameters it casts to it; None: the engine's default for this
            checkpoint (``kda_tp.engines.engine_model_dtype``: the config's
            ``dtype``/``torch_dtype`` as the engine reads it; an F32 or dtype-less config runs
            in BF16 under vLLM, F16 under SGLang), the one ``kda_tp.audit`` expects.
            Parameters with a fixed dtype (F32 ``A_log``) and FP8 weights are unaffected.
        force: replace dump files of these ranks already in ``out`` (otherwise refused: it
            may be a real engine's dump): every file of those ranks, in both of
            ``save_sharded_state``'s name patterns (``sharded_state_files``), is removed, and
            so are another world size's dump files, once the new files are complete; only
            files kda-tp wrote (:data:`kda_tp.output.FILE_MARK` in their header, which every
            dump file carries) are removed or replaced, anything else is refused; each file
            is judged again just before it is replaced, and a name that was free when the
            dump started is taken only while still free.
        wait: when another kda-tp run writes one of ``ranks``, or another world size, into
            ``out``, wait until it is done instead of refusing (``--wait``).

    Returns:
        A :class:`DumpResult`.

    Raises:
        OutputError: ``out`` is empty, cannot be resolved (a symlink loop) or lies inside the
            checkpoint; it holds a ``shard`` output of another world size (one world size per
            output; ``force`` or not); without ``force``, it holds dump files of another world
            size (a rank ``>= tp_size``, or other ``tp_size`` metadata) or a file of a rank
            being written;
            a write fails (the message names the file and the OS error); with ``force``, such a
            file kda-tp did not write (an engine's own dump); a file appeared under one of its
            names while it was writing; another run writes one of ``ranks`` or another world
            size there (without ``wait``). Nothing of this call is left (no directory it
            made either).
        OpenFilesLimitError: the process has no file descriptor left for a lock or a file.
        DtypeMismatchError: ``model_dtype`` is not a model dtype; casting a parameter to
            the model dtype overflows (a finite value
            becomes inf; ``kda_tp.audit._diagnosis.cast_overflow``): the message names the rank,
            the parameter and the value; no file of this call is left, and what ``out`` held
            before is untouched.
        PlanError: ``tp_size`` or a rank is not valid for the model (range, repeats), or
            ``ranks`` is empty.
        EngineLayoutError: an unknown layout, one of another model family, or one that does
            not fit the checkpoint.
        CheckpointError: the checkpoint cannot be read or has no config; a dump-file name in
            ``out`` whose rank has more than ``kda_tp.model.json_reader.MAX_INT_DIGITS`` digits.
    """
    start = time.perf_counter()
    if str(out) == "":
        raise OutputError("the output directory is an empty path; pass a directory (--out DIR, "
                          "out=; '.' for the current one)")
    layout, by_rank = expected_params(checkpoint, engine, tp_size, ranks, model_dtype)
    root = Path(out)
    source_root = Path(checkpoint.path if isinstance(checkpoint, SafetensorsSource)
                       else checkpoint)
    source_dir = resolve_out(source_root if source_root.is_dir() else source_root.parent)
    resolved = resolve_out(root)
    if resolved == source_dir or source_dir in resolved.parents:
        raise OutputError(f"{root}: the output directory lies inside the checkpoint "
                          f"{source_dir}; choose another --out (out=)")
    created = make_dirs(root)
    try:
        # Held from before OUT is looked at until the new files are in place (or removed).
        locks = lock_output(root, tp_size, [r for r, _ in by_rank], wait)
        try:
            files, count, total = _write_files(root, source_root, layout.name, tp_size,
                                               by_rank, force)
        finally:
            locks.release()
    except BaseException:
        remove_created(created)  # a refused or failed dump leaves no directory it made
        raise
    return DumpResult(root, layout.name, tp_size, tuple(r for r, _ in by_rank), files,
                      count, total, time.perf_counter() - start)


def _write_files(root: Path, source_root: Path, engine: str, tp_size: int,
                 by_rank: list[tuple[int, list[ExpectedParam]]], force: bool
                 ) -> tuple[tuple[Path, ...], int, int]:
    """:func:`write_engine_dump`'s check of ``root``, then its files built under hidden names
    and moved into place (:func:`~kda_tp.output.dirs.replace_files`); returns the files, the
    parameters and the bytes written."""
    try:
        next(root.iterdir(), None)
    except OSError as e:
        raise output_error(root, "list the output directory", e) from e
    refuse_other_world_size(root, tp_size, "dump")
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
    # wrote it (its own mark, judged now and again as it is moved), and only once the new
    # files are complete (kda_tp.output.dirs.replace_files).
    stale = list(dict.fromkeys([p for p, _ in foreign] + ours))
    refuse_foreign_files(stale)
    mode = input_mode(source_root)
    staged: dict[Path, Path] = {}
    total, count = 0, 0
    try:
        for r, params in by_rank:
            path = root / DUMP_FILE.format(rank=r)
            meta = {"tp_size": str(tp_size), "tp_rank": str(r), "engine": engine,
                    FILE_MARK: __version__}
            specs = [(p.dump_name or p.name, p.plan.dtype, p.plan.shape, p.plan.nbytes, p.build)
                     for p in params if not p.derived]
            staged[path] = staged_name(path)
            total += write_safetensors(staged[path], specs, meta, sync=False, mode=mode)
            count += len(params)
        replace_files(staged, stale)
    except BaseException:
        for path in staged.values():  # no half dump, and the previous one untouched
            try:
                path.unlink(missing_ok=True)
            except OSError:
                continue  # never created there (a read-only directory, say)
        raise
    return tuple(staged), count, total


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


