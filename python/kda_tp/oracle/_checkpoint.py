"""Safetensors checkpoints as the oracle reads them: headers parsed with ``struct`` and
``json``, tensors read as raw bytes. Independent of ``kda_tp.checkpoint`` and the Rust reader.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kda_tp.errors import CheckpointError

@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, dtype, shape and absolute byte range in the file."""

    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_safetensors_header(path: Path) -> tuple[dict[str, str], dict[str, TensorInfo]]:
    """Parse one safetensors file's header: (``__metadata__``, tensor name -> info).

    Format: an 8-byte little-endian header length ``n``, ``n`` bytes of JSON, then the data
    region; each tensor's ``data_offsets`` are relative to the data region.

    Raises:
        CheckpointError: unreadable file, bad header, or offsets outside the file.
    """
    try:
        with path.open("rb") as f:
            size = path.stat().st_size
            prefix = f.read(8)
            if len(prefix) != 8:
                raise CheckpointError(f"{path}: shorter than the 8-byte safetensors prefix")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > size - 8:
                raise CheckpointError(f"{path}: header length {header_len} exceeds the file")
            header = json.loads(f.read(header_len))
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: __metadata__ is not a JSON object")
    data_start = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        try:
            begin, end = entry["data_offsets"]
            info = TensorInfo(
                path, entry["dtype"], tuple(entry["shape"]), data_start + begin, data_start + end
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: {name}: malformed header entry") from exc
        if not data_start <= info.start <= info.end <= size:
            raise CheckpointError(f"{path}: {name}: data_offsets [{begin}, {end}) outside the file")
        tensors[name] = info
    return metadata, tensors


class Checkpoint:
    """A Hugging Face checkpoint directory, read lazily: ``config.json`` plus either
    ``model.safetensors.index.json`` with its shards or a single ``*.safetensors`` file."""

    def __init__(
        self, directory: Path, *, require_index: bool, require_config: bool = True
    ) -> None:
        """Read the config (optional when not ``require_config``: a ``--kda-only`` rank has
        none) and every safetensors header.

        Raises:
            CheckpointError: missing (when required) or invalid ``config.json``; missing index when
                ``require_index``; no or several safetensors files without an index; an index
                whose ``weight_map`` disagrees with the files' headers; a tensor in two files.
        """
        self.directory = directory
        config_path = directory / "config.json"
        try:
            if require_config or config_path.exists():
                self.config = json.loads(config_path.read_text())
            else:
                self.config = {}
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{config_path}: {exc}") from exc
        if not isinstance(self.config, dict):
            raise CheckpointError(f"{config_path}: not a JSON object")

        index_path = directory / "model.safetensors.index.json"
        weight_map = None
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
                files = sorted({directory / f for f in weight_map.values()})
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(f"{index_path}: no readable weight_map: {exc}") from exc
        elif require_index:
            raise CheckpointError(f"{index_path}: missing")
        else:
            files = sorted(directory.glob("*.safetensors"))
            if len(files) != 1:
                raise CheckpointError(
                    f"{directory}: expected model.safetensors.index.json or exactly one "
                    f"*.safetensors file, found {len(files)} safetensors files"
                )

        self.metadata: dict[Path, dict[str, str]] = {}
        self.tensors: dict[str, TensorInfo] = {}
        for path in files:
            self.metadata[path], tensors = read_safetensors_header(path)
            for name, info in tensors.items():
                if name in self.tensors:
                    raise CheckpointError(f"{directory}: {name} is in two files")
                self.tensors[name] = info
        if weight_map is not None:
            for name in sorted(set(weight_map) | set(self.tensors)):
                listed = weight_map.get(name)
                actual = self.tensors[name].path.name if name in self.tensors else None
                if listed != actual:
                    raise CheckpointError(
                        f"{index_path}: {name} is mapped to {listed}, found in {actual}"
                    )

    def read(self, name: str) -> bytes:
        """The raw bytes of tensor ``name``."""
        info = self.tensors[name]
        with info.path.open("rb") as f:
            f.seek(info.start)
            return f.read(info.end - info.start)

    def chunks(self, name: str, chunk: int = 64 << 20) -> Iterator[bytes]:
        """The raw bytes of tensor ``name``, in pieces of at most ``chunk`` bytes."""
        info = self.tensors[name]
        with info.path.open("rb") as f:
            f.seek(info.start)
            left = info.end - info.start
            while left:
                piece = f.read(min(chunk, left))
                if not piece:
                    raise CheckpointError(f"{info.path}: {name}: file ends inside the tensor")
                left -= len(piece)
                yield piece

