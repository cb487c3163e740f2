"""What the malformed kinds share: the cases, the registries that name a kind after its
function, the stdlib safetensors writers and readers, and the base checkpoint every directory
kind starts from."""

from __future__ import annotations

import functools
import json
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from kda_tp import synth
from kda_tp.errors import KdaTpError

INDEX = "model.safetensors.index.json"
GEOMETRY = dict(
    hidden=64, heads=4, head_dim=64, conv_kernel=4, gate_rank=16, num_layers=2, kda_layers=[0, 1]
)
ATTN = "model.layers.{}.self_attn."
SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

#: One tensor as the stdlib helpers see it: (name, dtype, shape, raw bytes).
Tensor = tuple[str, str, list[int], bytes]


@dataclass(frozen=True)
class Case:
    """One malformed input and what kda_tp must do with it.

    Attributes:
        kind: the kind's name (a key of ``malformed.KINDS``).
        path: the input: a ``.safetensors`` file or a checkpoint directory.
        error: the exception class expected, or None when the input must load correctly.
        contains: substrings the message must contain (the file, and the tensor if any).
        action: ``"open"`` or ``"shard"`` (see ``malformed``'s docstring).
        blocking: the input could block a naive reader forever (a FIFO); test it in a
            subprocess with a timeout.
        expected: for a valid input, tensor name -> numpy array it must read back as.
    """

    kind: str
    path: Path
    error: type[KdaTpError] | None
    contains: tuple[str, ...]
    action: str = "open"
    blocking: bool = False
    expected: dict[str, np.ndarray] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class CliCase:
    """One hostile command line: ``argv`` after ``kda-tp``, extra environment ``env``, and a
    substring the error line must contain."""

    kind: str
    argv: tuple[str, ...]
    contains: str
    env: dict[str, str] = field(default_factory=dict, compare=False)


class Kinds(dict[str, Callable[[Path], Case]]):
    """Kinds by name, in the order they are registered; each builds its case under a root."""

    def add(
        self,
        kind: str,
        write: Callable[[Path, str], Path],
        error: type[KdaTpError],
        contains: tuple[str, ...],
        action: str = "open",
        subject: str = "",
        blocking: bool = False,
    ) -> Callable[[Path], Case]:
        """Register ``kind``: ``write(root, kind)`` writes the input and returns its path; the
        message must name that path (joined with ``subject``, the file inside a directory that
        is at fault) and contain ``contains``."""

        def build(root: Path) -> Case:
            path = write(root, kind)
            return Case(kind, path, error, (str(path / subject), *contains), action, blocking)

        self[kind] = build
        return build

    def kind(
        self, error: type[KdaTpError], *contains: str, **how: str | bool
    ) -> Callable[[Callable[[Path, str], Path]], Callable[[Path], Case]]:
        """Decorator: register the decorated writer (see :meth:`add`) as the kind named after
        it; ``how`` is ``add``'s ``action``, ``subject`` and ``blocking``."""

        def register(write: Callable[[Path, str], Path]) -> Callable[[Path], Case]:
            build = self.add(
                write.__name__, write, error, contains, **how)  # type: ignore[arg-type]
            return functools.update_wrapper(build, write)

        return register


class CliKinds(dict[str, Callable[[Path], CliCase]]):
    """Hostile command lines by name, in the order they are registered."""

    def kind(
        self, contains: str, env: dict[str, str] | None = None
    ) -> Callable[[Callable[[Path, str], tuple[str, ...]]], Callable[[Path], CliCase]]:
        """Decorator: the decorated ``argv(root, kind)`` (writing what it needs under ``root``)
        is the kind named after it, refused with an error line holding ``contains``."""

        def register(argv: Callable[[Path, str], tuple[str, ...]]) -> Callable[[Path], CliCase]:
            kind = argv.__name__

            def build(root: Path) -> CliCase:
                return CliCase(kind, argv(root, kind), contains, dict(env or {}))

            self[kind] = functools.update_wrapper(build, argv)
            return build

        return register


# ----------------------------------------------------------------------------------------------
# writers


def framed(header: dict | bytes, data: bytes = b"", header_len: int | None = None) -> bytes:
    """``[u64 header_len][header][data]``; ``header`` is a dict (JSON-encoded) or raw bytes;
    ``header_len`` overrides the length field (default: the header's real length)."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    length = len(raw) if header_len is None else header_len
    return struct.pack("<Q", length) + raw + data


def write_raw(
    path: Path, header: dict | bytes, data: bytes = b"", header_len: int | None = None
) -> Path:
    """Write :func:`framed` ``(header, data, header_len)`` to ``path`` (its folder made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(framed(header, data, header_len))
    return path


def pack(tensors: list[Tensor], metadata: dict | None = None) -> tuple[dict, bytes]:
    """(header dict, data) of tensors laid back to back in the order given."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    chunks = []
    for name, dtype, shape, data in tensors:
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
        chunks.append(data)
    return header, b"".join(chunks)


def pattern(n: int, seed: int = 0) -> bytes:
    """``n`` bytes of a fixed pattern (different for each ``seed``)."""
    return bytes((i * 7 + seed) % 251 for i in range(n))


def small_file(path: Path) -> Path:
    """A valid two-tensor file (F32 [2, 3] and BF16 [4])."""
    header, data = pack([("w", "F32", [2, 3], pattern(24)), ("b", "BF16", [4], pattern(8, 3))])
    return write_raw(path, header, data)


def file_path(root: Path, kind: str) -> Path:
    """Where a one-file kind writes its file."""
    return root / kind / "model.safetensors"


def parse(raw: bytes) -> tuple[dict, list[tuple[str, dict]], bytes]:
    """A safetensors file's (header, its tensors' (name, entry) in data order, data section)."""
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    entries = sorted(
        ((n, i) for n, i in header.items() if n != "__metadata__"),
        key=lambda kv: kv[1]["data_offsets"],
    )
    return header, entries, raw[8 + length :]


def read_tensors(directory: Path) -> list[Tensor]:
    """Every tensor of a checkpoint directory, file by file in data order (a stdlib parser)."""
    index = json.loads((directory / INDEX).read_text())
    out = []
    for file_name in sorted(set(index["weight_map"].values())):
        _, entries, data = parse((directory / file_name).read_bytes())
        for name, info in entries:
            b, e = info["data_offsets"]
            out.append((name, info["dtype"], info["shape"], data[b:e]))
    return out


# ----------------------------------------------------------------------------------------------
# the base checkpoint and edited copies of it

_BASE_CACHE: dict[Path, Path] = {}


def base_checkpoint(root: Path) -> Path:
    """The valid small checkpoint every directory kind starts from (written once per root)."""
    base = root / "_base"
    if root not in _BASE_CACHE or not (base / INDEX).exists():
        synth.write_small_checkpoint(base, **GEOMETRY)
        _BASE_CACHE[root] = base
    return base


def fresh(target: Path) -> Path:
    """``target``, removed first if it exists (a kind is rewritten on every build)."""
    if target.exists():
        shutil.rmtree(target)
    return target


def copy_base(root: Path, kind: str) -> Path:
    """A copy of the base checkpoint at ``root/kind``."""
    target = fresh(root / kind)
    shutil.copytree(base_checkpoint(root), target)
    return target


def rewritten(root: Path, kind: str, edit: Callable[[list[Tensor]], list[Tensor]]) -> Path:
    """The base checkpoint with its tensors passed through ``edit`` and written back as one
    ``model.safetensors`` (no index), beside the base's ``config.json``."""
    target = fresh(root / kind)
    target.mkdir(parents=True)
    base = base_checkpoint(root)
    shutil.copy(base / "config.json", target / "config.json")
    header, data = pack(edit(read_tensors(base)), {"format": "pt"})
    write_raw(target / "model.safetensors", header, data)
    return target


def edited_json(root: Path, kind: str, file_name: str, edit: Callable[[dict], object]) -> Path:
    """A copy of the base checkpoint with its JSON file ``file_name`` passed through ``edit``
    (which changes the dict in place)."""
    target = copy_base(root, kind)
    content = json.loads((target / file_name).read_text())
    edit(content)
    (target / file_name).write_text(json.dumps(content))
    return target


def edit_config(root: Path, kind: str, edit: Callable[[dict], object]) -> Path:
    """A copy of the base checkpoint with its ``config.json`` changed by ``edit``."""
    return edited_json(root, kind, "config.json", edit)


def edit_index(root: Path, kind: str, edit: Callable[[dict], object]) -> Path:
    """A copy of the base checkpoint with its index changed by ``edit``."""
    return edited_json(root, kind, INDEX, edit)


def config_text(text: str) -> Callable[[Path, str], Path]:
    """A writer ``(root, kind) -> folder``: a copy of the base checkpoint at ``root/kind``
    whose ``config.json`` is ``text``."""

    def write(root: Path, kind: str) -> Path:
        target = copy_base(root, kind)
        (target / "config.json").write_text(text)
        return target

    return write
