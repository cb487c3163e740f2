"""The files of an engine's ``save_sharded_state`` dump: their names, ranks and metadata.

vLLM and SGLang write one rank's ``state_dict()`` as ``model-rank-{r}-part-{p}.safetensors``
(vLLM with pipeline stages: ``model-pp-{pp}-tp-{r}-part-{p}.safetensors``); ``kda-tp dump``
writes :data:`DUMP_FILE`. The audit (``kda_tp.audit.auditor``) reads dumps with these names and
the writer (``kda_tp.audit.dump``) names and replaces its files with them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..checkpoint.reader import SafetensorsSource, Tensor, checked_get
from ..checkpoint.files import open_files_error
from ..errors import CheckpointError
from ..model.json_reader import ascii_int, parse_metadata_int

__all__ = ["DUMP_FILE", "RankFiles", "dump_world_size", "meta_int", "open_files",
           "rank_of_file", "rank_of_name", "sharded_state_files"]

#: The file ``kda-tp dump`` writes for one rank (vLLM's and SGLang's default pattern, part 0).
DUMP_FILE = "model-rank-{rank}-part-0.safetensors"

# vLLM's and SGLang's save_sharded_state file names (vLLM's default pattern, and its pattern
# with the pipeline stage).
# ASCII digits only: \d also matches other scripts' digits, which int() reads.
_RANK_FILE = re.compile(r"^model-rank-([0-9]+)-part-([0-9]+)\.safetensors$")
_PP_TP_FILE = re.compile(r"^model-pp-([0-9]+)-tp-([0-9]+)-part-([0-9]+)\.safetensors$")


def sharded_state_files(
    path: str | os.PathLike[str], *, allow_empty: bool = False
) -> dict[int, list[Path]]:
    """The ``save_sharded_state`` files of a directory, by tensor-parallel rank.

    vLLM and SGLang write ``model-rank-{r}-part-{p}.safetensors``; vLLM with pipeline stages
    ``model-pp-{pp}-tp-{r}-part-{p}.safetensors``. A rank's files (every part, every pipeline
    stage) together hold its ``state_dict()``. Other files (``config.json``, tokenizer files)
    are ignored.

    Args:
        path: the directory.
        allow_empty: return ``{}`` for a directory without such a file (a writer's output
            directory) instead of refusing it (an audit's input).

    Returns:
        ``{rank: [files, sorted]}``, ranks sorted.

    Raises:
        CheckpointError: ``path`` cannot be listed, holds no such file (unless
            ``allow_empty``), or a file name's rank has more digits than
            ``kda_tp.model.json_reader.MAX_INT_DIGITS``.
    """
    root = Path(path)
    try:
        entries = sorted(root.iterdir())
    except OSError as e:
        raise CheckpointError(f"{root}: cannot list the sharded_state directory: {e}") from e
    files: dict[int, list[Path]] = {}
    for p in entries:
        rank = rank_of_name(p.name)
        if rank is not None:
            files.setdefault(rank, []).append(p)
    if not files and not allow_empty:
        raise CheckpointError(
            f"{root}: no sharded_state file (model-rank-{{r}}-part-{{p}}.safetensors or "
            "model-pp-{pp}-tp-{r}-part-{p}.safetensors) in it; pass the directory given to "
            "save_sharded_state, or one rank's .safetensors file with --rank"
        )
    return dict(sorted(files.items()))


def rank_of_name(name: str) -> int | None:
    """The tensor-parallel rank a ``save_sharded_state`` file name carries, or None."""
    if m := _RANK_FILE.match(name):
        return parse_metadata_int(m.group(1), "rank in the file name", name)
    if m := _PP_TP_FILE.match(name):
        return parse_metadata_int(m.group(2), "rank in the file name", name)
    return None


def meta_int(meta: Mapping[str, Any], key: str, path: Path) -> int | None:
    """A file header's metadata ``key`` as a rank or size; None when absent or not ASCII
    digits (``str.isdigit`` is also true for ``"²"``, which ``int`` refuses).

    Raises:
        CheckpointError: ASCII digits, but more than ``kda_tp.model.json_reader.MAX_INT_DIGITS``.
    """
    value = meta.get(key)
    try:
        return ascii_int(value)
    except OverflowError:
        return parse_metadata_int(value, key, str(path))  # refused, naming the digits


def open_files(files: Sequence[Path]) -> list[SafetensorsSource]:
    """One rank's dumped files, each opened (and its header validated) once, for
    :func:`dump_world_size`, :func:`rank_of_file` and :class:`RankFiles` alike.

    Raises:
        CheckpointError: a file cannot be read, or opening them all would pass the process's
            open-files limit (every part stays open: said so rather than blame one part).
    """
    limit = open_files_error(len(files), files[0].parent if files else ".")
    if limit is not None:
        raise limit
    return [SafetensorsSource(f) for f in files]


class RankFiles(Mapping[str, Tensor]):
    """One rank's tensors across its ``save_sharded_state`` files (parts, pipeline stages),
    opened by ``open_files``."""

    def __init__(self, sources: Sequence[SafetensorsSource]):
        self.sources = list(sources)
        self.where: dict[str, SafetensorsSource] = {}
        for source in self.sources:
            for name in source.names():
                if name in self.where:
                    raise CheckpointError(
                        f"{name} is in both {self.where[name].path} and {source.path}; "
                        "a rank's sharded_state files hold each parameter once"
                    )
                self.where[name] = source

    def __getitem__(self, name: str) -> Tensor:
        if name not in self.where:
            raise KeyError(name)
        return checked_get(self.where[name], name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


def rank_of_file(source: SafetensorsSource) -> int:
    """The rank of one dumped file (opened): from its ``save_sharded_state`` name, else its
    header's ``tp_rank`` metadata.

    Raises:
        CheckpointError: neither says, or the metadata's ``tp_rank`` is not a rank.
    """
    path = source.path
    found = rank_of_name(path.name)
    if found is not None:
        return found
    meta = source.files()[0][1] or {}
    found = meta_int(meta, "tp_rank", path)
    if found is not None:
        return found
    if "tp_rank" in meta:
        raise CheckpointError(
            f"{path}: its metadata's tp_rank {meta['tp_rank']!r} is not a rank (0, 1, ...); "
            "pass --rank (rank=)"
        )
    raise CheckpointError(
        f"{path}: its rank is not in its name (model-rank-{{r}}-part-{{p}}.safetensors) nor in "
        "its metadata (tp_rank); pass --rank (rank=)"
    )


def dump_world_size(files: Mapping[int, Sequence[SafetensorsSource]], *, by_names: bool
                    ) -> tuple[int, Path | None] | None:
    """The tensor-parallel world size a dump tells, and how it tells it; None when it does not.

    The files' header metadata ``tp_size`` (``kda-tp dump`` writes it) says it; else, with
    ``by_names`` (a ``save_sharded_state`` directory), the highest rank in the file names plus
    one (``model-rank-3-part-0.safetensors`` means at least 4 ranks; a missing rank below it is
    the audit's problem to report). One file without metadata does not tell it.

    Args:
        files: the dump's files by rank, opened (``open_files`` of
            :func:`sharded_state_files`'s, or one file's).
        by_names: whether the ranks in ``files`` are every rank the dump has (a directory).

    Returns:
        ``(tp_size, file)``: ``file`` the one whose metadata says it (exact), or None when the
        names say it (a lower bound).

    Raises:
        CheckpointError: two files' metadata name different world sizes.
    """
    told: dict[int, Path] = {}
    for sources in files.values():
        for source in sources:
            size = meta_int(source.files()[0][1] or {}, "tp_size", source.path)
            if size is not None:
                told.setdefault(size, source.path)
    if len(told) > 1:
        (a, pa), (b, pb) = sorted(told.items())[:2]
        raise CheckpointError(f"{pa} says tp_size {a} and {pb} says tp_size {b} in their "
                              "metadata; the files are of two dumps: audit one at a time")
    if told:
        ((size, path),) = told.items()
        return size, path
    if by_names and files:
        top = max(files)
        return top + 1, None
    return None
