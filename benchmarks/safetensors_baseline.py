"""Baseline for ``benchmarks/bench.py``: shard a KDA checkpoint with plain safetensors.

This is the straightforward way to do the job today without kda_tp: for every rank and every
checkpoint file, open it with ``safe_open(..., framework="np")``, take each KDA tensor's slice
with ``get_slice(name)[...]`` (every other tensor with ``get_tensor``), and write the rank's
file with ``safetensors.numpy.save_file``. kda_tp is used only for the plan *arithmetic* (which
axis, offset and length each rank keeps), never to read, slice or write data.

Usage::

    python benchmarks/safetensors_baseline.py CHECKPOINT --tp-size N --out DIR

Writes ``DIR/rank{r}/`` for every rank (the layout ``kda-tp shard`` writes): the rank's
``*.safetensors`` files (same names and tensor-to-file assignment as the input),
``model.safetensors.index.json`` and ``config.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers numpy's "bfloat16" so the np framework can read BF16)
from safetensors import safe_open
from safetensors.numpy import save_file

from kda_tp import KdaTpPlan
from kda_tp import SafetensorsSource
from kda_tp.checkpoint import checkpoint_suffix, describe

_LAYER_TENSOR = re.compile(r"^(?:.*\.)?layers\.(\d+)\.self_attn\.(.+)$")
INDEX = "model.safetensors.index.json"


def _files(checkpoint: Path) -> list[str]:
    index = checkpoint / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted(set(weight_map.values()))
    return sorted(p.name for p in checkpoint.glob("*.safetensors"))


def _slicer(entry, full_shape: tuple[int, ...]):
    """The index tuple that selects this rank's part of a tensor, or None for the whole tensor."""
    local = tuple(entry.local_shape(list(full_shape)))
    for axis, (full, part) in enumerate(zip(full_shape, local)):
        if full != part:
            cols = entry.kind.name == "CHANNEL_COLS"
            start = entry.src_col_offset if cols else entry.src_row_offset
            return (slice(None),) * axis + (slice(start, start + part),)
    return None


def shard(checkpoint: Path, tp_size: int, out: Path) -> None:
    source = SafetensorsSource(checkpoint)  # header/config reading only (which layers are KDA)
    layers = set(describe(source).kda_layers())
    files = _files(checkpoint)
    for rank in range(tp_size):
        plan = KdaTpPlan.from_config(source, rank, tp_size)
        by_suffix = {checkpoint_suffix(t.name): t for t in plan.tensors}
        rank_dir = out / f"rank{rank}"
        rank_dir.mkdir(parents=True)
        weight_map: dict[str, str] = {}
        total = 0
        for file_name in files:
            tensors = {}
            with safe_open(checkpoint / file_name, framework="np") as f:
                metadata = f.metadata()
                for name in f.keys():
                    match = _LAYER_TENSOR.match(name)
                    entry = None
                    if match is not None and int(match.group(1)) in layers:
                        entry = by_suffix.get(match.group(2))
                    if entry is None:
                        tensors[name] = f.get_tensor(name)
                        continue
                    view = f.get_slice(name)
                    index = _slicer(entry, tuple(view.get_shape()))
                    tensors[name] = view[index] if index is not None else f.get_tensor(name)
            for name, array in tensors.items():
                weight_map[name] = file_name
                total += array.nbytes
            save_file(tensors, rank_dir / file_name, metadata=metadata)
            del tensors
        (rank_dir / INDEX).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
        if (checkpoint / "config.json").is_file():
            shutil.copyfile(checkpoint / "config.json", rank_dir / "config.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--tp-size", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} is not empty")
    shard(args.checkpoint, args.tp_size, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
