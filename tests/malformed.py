"""A corpus of malformed checkpoints, generated (never committed as binaries).

Each *kind* (``KINDS``) is a function ``kind(root) -> Case`` that writes its input under
``root/<kind>/`` and says what must happen: the :mod:`kda_tp.errors` class expected, and
substrings the message must contain (the file's path and, where there is one, the tensor's
name). One kind (``misaligned_offset``) is valid and must load correctly.

Usage as a script, to dump the corpus for manual fuzzing or as a libFuzzer seed corpus::

    python tests/malformed.py OUTDIR        # one directory per kind, plus valid seed files

``Case.action`` tells how the input is fed to kda_tp:

``open``
    ``SafetensorsSource(path, backend)`` on both backends, then every tensor read.
``shard``
    ``shard_checkpoint(path, out, tp_size=2)`` (the whole ``kda-tp shard`` path: config, plan,
    per-tensor checks, then writing).

Geometry of the base checkpoint: Kimi-Linear style, hidden 64, 4 heads of 64, conv kernel 4,
gate rank 16, two KDA layers; at tp_size 2 the local q|k width is 256, so the default plan
rule holds.

The kinds are written by the modules of ``malformed_kinds/``, one a kind of input: ``files``,
``index``, ``config``, ``kda`` and ``cli`` (``CLI_KINDS``: hostile ``kda-tp`` command lines);
this module gathers them and writes the corpus.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from malformed_kinds import cli, config, files, index, kda
from malformed_kinds.core import (
    ATTN,
    GEOMETRY,
    INDEX,
    Case,
    CliCase,
    base_checkpoint,
    pack,
    pattern,
    read_tensors,
    rewritten,
    small_file,
    write_raw,
)

__all__ = [
    "ATTN", "CLI_KINDS", "GEOMETRY", "INDEX", "CliCase", "KINDS", "Case", "build", "build_all",
    "base_checkpoint", "pack", "pattern", "read_tensors", "rewritten", "write_raw",
]

KINDS: dict[str, Callable[[Path], Case]] = {
    **files.KINDS, **index.KINDS, **config.KINDS, **kda.KINDS
}
CLI_KINDS: dict[str, Callable[[Path], CliCase]] = dict(cli.CLI_KINDS)


def build(kind: str, root: str | os.PathLike[str]) -> Case:
    """Write one kind under ``root`` and return its case."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return KINDS[kind](root)


def build_all(root: str | os.PathLike[str]) -> list[Case]:
    """Write every kind under ``root`` (plus valid seed files under ``root/_valid``)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    small_file(root / "_valid" / "small.safetensors")
    write_raw(root / "_valid" / "empty_header.safetensors", b"{}      ")
    # Tensors of the byte sizes of the fuzz target open_read's tiny KDA plan (hidden 4, head_dim
    # 2, 2 heads, conv 2, gate 2), so that slicing is reached from a seed.
    header, data = pack(
        [
            ("q_proj.weight", "BF16", [4, 4], pattern(32)),
            ("q_conv1d.weight", "BF16", [4, 1, 2], pattern(16, 1)),
            ("A_log", "F32", [1, 1, 2, 1], pattern(8, 2)),
            ("o_norm.weight", "BF16", [2], pattern(4, 3)),
        ]
    )
    write_raw(root / "_valid" / "kda_tiny.safetensors", header, data)
    return [KINDS[k](root) for k in KINDS]


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print(f"usage: python {Path(__file__).name} OUTDIR", file=sys.stderr)
        return 2
    cases = build_all(argv[0])
    for case in cases:
        expected = case.error.__name__ if case.error else "loads"
        print(f"{case.kind:32} {case.action:6} {expected:20} {case.path}")
    print(f"{len(cases)} kinds written to {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
