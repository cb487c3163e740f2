"""What a rank directory written by ``kda-tp shard`` holds: names, files, marks, fingerprint.

Shared by the writer (:mod:`kda_tp.shard.writer`), the verifier (:mod:`kda_tp.shard.verify`) and
the torchrun jobs (:mod:`kda_tp.shard.torchrun`), which all must agree on it; the directory and
mark names are :mod:`kda_tp.output.names`'s:

* every rank directory holds the input's safetensors file names (:func:`names_by_file`, or
  :func:`kda_only_files` for ``--kda-only``), ``model.safetensors.index.json``, the input's
  companion files (:func:`companion_files`: config, tokenizer, code; never its heavy files,
  :func:`heavy_files`) and kda-tp's mark (:data:`~kda_tp.output.names.MARK_NAME`);
* every safetensors file's ``__metadata__`` carries :data:`~kda_tp.output.names.FILE_MARK` (the
  kda-tp version) and ``kda_tp_input`` (:func:`input_fingerprint`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..checkpoint.reader import INDEX_NAME, SafetensorsSource, checked_info, missing_tensor
from ..errors import CheckpointError
from ..model.json_reader import parse_json, parse_metadata_int
from ..output.names import rank_dir
from ..rank.view import KdaShardedSource

__all__ = [
    "HEAVY_FILE_BYTES",
    "WEIGHT_FILE_BYTES",
    "WEIGHT_SUFFIXES",
    "companion_files",
    "finish_command",
    "heavy_files",
    "input_fingerprint",
    "kda_only_files",
    "names_by_file",
    "rank_dir_metadata",
    "unindexed_files",
]

#: Bytes read from the start and the end of each file's data for :func:`input_fingerprint`.
_FINGERPRINT_SAMPLE = 4096

#: A file beside the checkpoint this large (100 MB) or larger is heavy (:func:`heavy_files`),
#: whatever it holds: a rank directory is a checkpoint, and its config, tokenizer and code are
#: a few MB (the largest tokenizer files of current models are tens of MB).
HEAVY_FILE_BYTES = 100_000_000
#: Weights and training state in formats other than safetensors, which ``shard`` cannot slice:
#: PyTorch's pickles (``pytorch_model.bin``, ``optimizer.pt``, ``*.pth``, ``*.ckpt``), TF and
#: Flax (``*.h5``, ``*.msgpack``), GGUF, ONNX, numpy, torch.distributed checkpoints.
WEIGHT_SUFFIXES = frozenset({
    ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".h5", ".hdf5", ".msgpack", ".gguf",
    ".ggml", ".onnx", ".npy", ".npz", ".tflite", ".ot", ".distcp",
})
#: A file of a :data:`WEIGHT_SUFFIXES` format this large (1 MB) or larger is heavy; a smaller
#: one (``training_args.bin``, a few kB) is copied like any other companion file.
WEIGHT_FILE_BYTES = 1_000_000


def names_by_file(source: SafetensorsSource) -> dict[str, list[str]]:
    """Input file name -> its tensor names in data order (every rank mirrors the input's files).

    Raises:
        CheckpointError: a tensor the index names is in no file.
    """
    files: dict[str, list[str]] = {}
    for name in source.names():
        path = source.file_of(name)
        if path is None:
            raise missing_tensor(source, name)
        files.setdefault(path.name, []).append(name)
    return files


def kda_only_files(
    files: dict[str, list[str]], shard: KdaShardedSource
) -> dict[str, list[str]]:
    """``files`` (input file name -> tensor names) cut down to the KDA tensors ``shard`` slices;
    files left without one are dropped, so a KDA-only rank mirrors the input's file names."""
    kept = {f: [n for n in names if shard.is_sharded(n)] for f, names in files.items()}
    return {f: names for f, names in kept.items() if names}


def companion_files(source: SafetensorsSource) -> list[Path]:
    """The input's small non-weight files (config, tokenizer, the model's code) that ``shard``
    copies into each rank: every regular file of the input directory that is not hidden, not a
    ``.safetensors`` file, not the index and not heavy (:func:`heavy_files`); for a
    single-file input, its ``config.json``."""
    if not source.path.is_dir():
        config = source.root / "config.json"
        return [config] if config.is_file() else []
    return [p for p, size in _beside(source) if _heavy(p, size) is None]


def heavy_files(source: SafetensorsSource) -> list[tuple[Path, int, str]]:
    """The files beside the input's safetensors files that ``shard`` never copies into a rank,
    each with its size and why: weights or training state in another format than
    safetensors (:data:`WEIGHT_SUFFIXES`) of :data:`WEIGHT_FILE_BYTES` or more
    (``pytorch_model.bin``, ``optimizer.pt``), which no loader of a rank should read and which
    ``shard`` cannot slice, and any file of :data:`HEAVY_FILE_BYTES` or more. Copied whole into
    every rank they would multiply by the world size; ``shard`` refuses an input holding
    them unless told to leave them out (``--skip-heavy-files``). Sorted by name; empty for a
    single-file input."""
    if not source.path.is_dir():
        return []
    return [(p, size, why) for p, size in _beside(source)
            if (why := _heavy(p, size)) is not None]


def _beside(source: SafetensorsSource) -> list[tuple[Path, int]]:
    """Every regular file of the input directory (a link followed) that is not hidden, not a
    ``.safetensors`` file and not the index, sorted, with its size."""
    found = []
    for p in sorted(source.root.iterdir()):
        if p.name.startswith(".") or p.name.endswith(".safetensors") or p.name == INDEX_NAME:
            continue
        try:
            info = p.stat()
        except OSError:
            continue  # a dangling link: nothing to copy, as before
        if stat.S_ISREG(info.st_mode):
            found.append((p, info.st_size))
    return found


def _heavy(path: Path, size: int) -> str | None:
    """Why the file ``path`` of ``size`` bytes beside a checkpoint is heavy, or None."""
    if path.suffix.lower() in WEIGHT_SUFFIXES and size >= WEIGHT_FILE_BYTES:
        return "weights or training state in another format than safetensors"
    if size >= HEAVY_FILE_BYTES:
        return f"a file of {HEAVY_FILE_BYTES // 1_000_000} MB or more"
    return None


def unindexed_files(source: SafetensorsSource) -> list[Path]:
    """The ``.safetensors`` files in an indexed checkpoint directory that its index does not
    name (e.g. a multi-token-prediction head shipped beside the index), sorted; empty for a
    single-file checkpoint. Loaders that follow the index never read them, and neither does
    the shard writer."""
    if not source.path.is_dir() or not (source.root / INDEX_NAME).is_file():
        return []
    indexed = {path.name for path, _ in source.files()}
    return sorted(p for p in source.root.glob("*.safetensors") if p.name not in indexed)


def input_fingerprint(source: SafetensorsSource) -> str:
    """A hex digest (32 characters) of the checkpoint's tensor names, dtypes and full shapes,
    and of the first and last 4 KiB of each file's data (a fine-tune has the base model's
    names and shapes).

    ``shard`` records it in every rank's header (``kda_tp_input``) so that ``verify`` can tell
    output made from another checkpoint from a damaged output.

    Raises:
        CheckpointError: a file cannot be read.
    """
    entries = sorted((name, *checked_info(source, name)) for name in source.names())
    digest = hashlib.sha256(json.dumps(entries).encode())
    for path, _ in source.files():
        try:
            with open(path, "rb") as f:
                data_start = 8 + int.from_bytes(f.read(8), "little")
                f.seek(data_start)
                digest.update(f.read(_FINGERPRINT_SAMPLE))
                end = os.fstat(f.fileno()).st_size
                f.seek(max(data_start, end - _FINGERPRINT_SAMPLE))
                digest.update(f.read(_FINGERPRINT_SAMPLE))
        except OSError as e:
            raise CheckpointError(f"{path}: cannot be read: {e}") from e
    return digest.hexdigest()[:32]


def finish_command(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    tp_size: int,
    ranks: Iterable[int],
    qk_multiple: int = 256,
) -> str:
    """The ``kda-tp shard`` command line that writes ``ranks`` (shell-quoted paths)."""
    command = (
        f"kda-tp shard {shlex.quote(str(checkpoint))} --tp-size {tp_size} "
        f"--out {shlex.quote(str(out_dir))} --ranks {','.join(map(str, ranks))}"
    )
    return command + (f" --qk-multiple {qk_multiple}" if qk_multiple != 256 else "")


def rank_dir_metadata(out_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """``tp_size``, ``qk_multiple`` and ``layers`` recorded in ``out_dir/rank0``'s first file.

    Raises:
        CheckpointError: no readable rank0 file with kda-tp metadata.
    """
    first = rank_dir(out_dir, 0)
    files = SafetensorsSource(first).files()
    meta = (files[0][1] if files else None) or {}
    try:
        return {
            "tp_size": parse_metadata_int(meta["tp_size"], "tp_size", str(first)),
            "qk_multiple": parse_metadata_int(meta.get("kda_tp_qk_multiple", "256"),
                                              "kda_tp_qk_multiple", str(first)),
            "layers": (parse_json(meta["kda_tp_layers"], f"{first}: metadata kda_tp_layers")
                       if "kda_tp_layers" in meta else None),
        }
    except KeyError as e:
        raise CheckpointError(f"{first}: no valid kda-tp metadata ({e})") from None
