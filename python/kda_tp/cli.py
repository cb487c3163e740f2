"""The ``kda-tp`` command line (also ``python -m kda_tp``).

Subcommands: ``plan`` (the shard table), ``shard`` (write one checkpoint per rank), ``verify``
(rejoin the ranks and compare with the input), ``demo`` (all three on a generated checkpoint of
a real model's geometry). Exit status: 0 success, 1 verification failed, 2 refused input.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from . import __version__
from .errors import KdaTpError
from .plan import KdaTpPlan
from .shard import ShardResult, shard_checkpoint, verify_shards
from .source import (
    SafetensorsSource,
    decoder_prefix,
    kda_layer_indices,
    kda_tensor_name,
    scale_tensor_name,
)

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except KdaTpError as e:
        print(f"kda-tp: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kda-tp",
        description="Split KDA (Kimi Delta Attention) weights across tensor-parallel ranks.",
    )
    parser.add_argument("--version", action="version", version=f"kda-tp {__version__}")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    p = sub.add_parser("plan", help="print the shard table for one rank")
    p.add_argument("input", type=Path, help="checkpoint directory or config.json")
    p.add_argument("--tp-size", type=int, required=True, help="tensor-parallel world size")
    p.add_argument("--rank", type=int, default=0, help="rank whose offsets to show (default 0)")
    p.add_argument("--gate-rank", type=int, help="gate bottleneck width (bare config only)")
    _add_qk_multiple(p)
    p.set_defaults(run=_cmd_plan)

    p = sub.add_parser("shard", help="write one checkpoint directory per rank")
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--tp-size", type=int, required=True, help="tensor-parallel world size")
    p.add_argument("--out", type=Path, required=True, help="output directory (OUT/rank{r}/)")
    p.add_argument("--ranks", type=_int_list, help="comma-separated ranks (default: all)")
    p.add_argument("--layers", type=_int_list, help="0-based KDA layer indices (default: the config's, which Kimi-Linear numbers from 1)")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty output")
    p.add_argument("--backend", choices=["mmap", "pread"], help="input read path")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_qk_multiple(p)
    p.set_defaults(run=_cmd_shard)

    p = sub.add_parser("verify", help="check a shard output against its input")
    p.add_argument("checkpoint", type=Path)
    p.add_argument("out", type=Path, help="the directory given to `shard --out`")
    _add_numeric(p)
    p.set_defaults(run=_cmd_verify)

    p = sub.add_parser("demo", help="plan, shard and verify a generated real-geometry checkpoint")
    p.add_argument("--tp-size", type=int, default=4, help="world size (default 4)")
    p.add_argument("--model", choices=["kimi-linear", "glm-5.3-flash", "kimi-k3"],
                   default="kimi-linear")
    p.add_argument("--num-layers", type=int,
                   help="decoder layers to generate (default 4; kimi-k3: 2, one KDA layer of "
                   "0.89 GB and one MLA layer)")
    p.add_argument("--keep", type=Path, help="write DIR/checkpoint and DIR/tp{N} here (replacing them) instead of a temporary directory")
    _add_numeric(p, default_on=True)
    p.set_defaults(run=_cmd_demo)
    return parser


def _add_qk_multiple(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--qk-multiple",
        type=int,
        default=256,
        help="local q|k width must be a multiple of this (default 256; 1 = off)",
    )


def _add_numeric(p: argparse.ArgumentParser, default_on: bool = False) -> None:
    if default_on:
        p.add_argument("--no-numeric", dest="numeric", action="store_false",
                       help="skip the numerical TP equivalence check")
    else:
        p.add_argument("--numeric", action="store_true",
                       help="also check numerically that the ranks' partial outputs sum to "
                       "the full layer's output")
    p.add_argument("--seq-len", type=int, default=16, help="tokens for --numeric (default 16)")
    p.add_argument("--seed", type=int, default=0, help="input seed for --numeric")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _cmd_plan(args: argparse.Namespace) -> int:
    plan = KdaTpPlan.from_config(
        args.input, args.rank, args.tp_size, gate_rank=args.gate_rank, qk_multiple=args.qk_multiple
    )
    shapes, n_layers = {}, None
    if args.input.is_dir() and any(args.input.glob("*.safetensors")):
        source = SafetensorsSource(args.input)
        layers = kda_layer_indices(source, None)
        n_layers = len(layers)
        prefix = decoder_prefix(source)
        shapes = {
            t.name: source.info(kda_tensor_name(prefix, layers[0], t.name))[1]
            for t in plan.tensors
        }
        for t in plan.tensors:
            scale = t.scale and scale_tensor_name(source, prefix, layers[0], t.name)
            if scale:
                shapes[t.scale.name] = source.info(scale)[1]
    print(format_plan(plan, shapes, n_layers))
    return 0


def format_plan(
    plan: KdaTpPlan, shapes: dict[str, tuple[int, ...]] | None = None, n_layers: int | None = None
) -> str:
    """The shard table of ``plan``: one line per tensor, then totals and the all-reduce.

    ``shapes`` gives on-disk shapes by plan name (default: the canonical Kimi-Linear shapes).
    A block-quantized weight is followed by its scale grid's row (``q_proj.scale``, offsets in
    blocks).
    """
    shapes = shapes or {}
    rows = [("tensor", "kind", "dtype", "full shape", f"rank {plan.tp_rank} shape", "offset",
             "bytes/rank")]
    for t in (e for tensor in plan.tensors for e in (tensor, tensor.scale) if e is not None):
        disk = tuple(shapes.get(t.name, t.disk_shape))
        axis = t.sharded_axis(list(disk))
        offset = "-" if axis is None else f"dim {axis} @ {t.src_row_offset or t.src_col_offset}"
        rows.append((t.name, t.kind.name, t.dtype, _shape(disk), _shape(t.local_shape(list(disk))),
                     offset, f"{t.local_bytes:,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        f"KDA tensor-parallel plan: tp_size={plan.tp_size}, heads {plan.full_heads} -> "
        f"{plan.local_heads} per rank, head_dim {plan.head_dim}, hidden {plan.hidden}, "
        f"conv kernel {plan.conv_kernel}, gate rank {plan.gate_rank}",
        "",
    ]
    for i, row in enumerate(rows):
        lines.append("  ".join(c.rjust(w) if j == 6 else c.ljust(w)
                               for j, (c, w) in enumerate(zip(row, widths))).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    quantized = [t for t in plan.tensors if t.scale is not None]
    if quantized:
        rows_, cols_ = quantized[0].block
        lines += [
            "",
            f"block-quantized FP8 ({rows_}x{cols_} blocks): each rank keeps the scale blocks "
            "covering its weight range (offsets in blocks)",
        ]
    a_log = plan["A_log"]
    if a_log.full_rows > plan.full_heads:
        lines += [
            "",
            f"A_log stores {a_log.full_rows} entries for {plan.full_heads} heads: entries "
            f"{plan.full_heads}..{a_log.full_rows - 1} are zero padding (checked), held by no rank",
        ]
    share = plan.local_bytes / plan.full_bytes
    lines += [
        "",
        f"per KDA layer: {_mib(plan.local_bytes)} per rank of {_mib(plan.full_bytes)} "
        f"({share:.1%})",
    ]
    if n_layers:
        lines.append(
            f"{n_layers} KDA layers: {_mib(n_layers * plan.local_bytes)} per rank of "
            f"{_mib(n_layers * plan.full_bytes)}"
        )
    if plan.needs_output_all_reduce:
        lines.append(
            f"all-reduce: o_proj is row-parallel; each rank's output is a partial sum, "
            f"all-reduced (sum) over the {plan.tp_size} ranks after o_proj"
        )
    else:
        lines.append("all-reduce: none (tp_size 1)")
    return "\n".join(lines)


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _progress(quiet: bool):
    if quiet or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    def start(total: int):
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="shard", file=sys.stderr)
        def advance(n: int) -> None:
            bar.update(n)
            if bar.n >= total:
                bar.close()
        return advance

    return start


def _cmd_shard(args: argparse.Namespace) -> int:
    result = shard_checkpoint(
        args.checkpoint,
        args.out,
        args.tp_size,
        ranks=args.ranks,
        layers=args.layers,
        qk_multiple=args.qk_multiple,
        force=args.force,
        backend=args.backend,
        progress=_progress(args.quiet),
    )
    print(_written_line(result))
    return 0


def _print_verify(report) -> None:
    for problem in report.problems[:20]:
        print(f"  {problem}")
    if len(report.problems) > 20:
        print(f"  ... and {len(report.problems) - 20} more")
    if report.numeric is not None:
        print(report.numeric.format())
    print(report.summary())


def _cmd_verify(args: argparse.Namespace) -> int:
    report = verify_shards(args.checkpoint, args.out, numeric=args.numeric,
                           seq_len=args.seq_len, seed=args.seed)
    _print_verify(report)
    return 0 if report.ok else 1


def _written_line(result: ShardResult) -> str:
    rate = result.bytes_written / result.seconds / 1e9 if result.seconds else 0.0
    return (
        f"wrote ranks {list(result.ranks)} of {result.tp_size} to {result.out_dir}: "
        f"{result.bytes_written / 1e9:.3f} GB of tensors in {result.seconds:.2f} s "
        f"({rate:.2f} GB/s written)"
    )


def _cmd_demo(args: argparse.Namespace) -> int:
    from .synth import GEOMETRIES, write_checkpoint

    g = GEOMETRIES[args.model]
    if args.num_layers is None:
        args.num_layers = 2 if g["style"] == "k3" else 4
    # Refuse a tp_size the model cannot split before generating anything.
    KdaTpPlan(0, args.tp_size, g["hidden"], g["head_dim"], g["heads"], g["conv_kernel"],
              g["gate_rank"])
    with tempfile.TemporaryDirectory(prefix="kda-tp-demo-") as tmp:
        base = args.keep or Path(tmp)
        checkpoint, out = base / "checkpoint", base / f"tp{args.tp_size}"
        t0 = time.perf_counter()
        write_checkpoint(checkpoint, args.model, args.num_layers)
        size = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))
        print(f"generated a {args.num_layers}-layer {args.model} checkpoint "
              f"({size / 1e9:.3f} GB) in {time.perf_counter() - t0:.1f} s: {checkpoint}")
        kda = set(kda_layer_indices(SafetensorsSource(checkpoint), None))
        mla = [i for i in range(args.num_layers) if i not in kda]
        if mla:
            print(f"layers {mla} (0-based) are full attention (MLA): passed through unsliced")
        print()
        status = _cmd_plan(argparse.Namespace(input=checkpoint, rank=0, tp_size=args.tp_size,
                                              gate_rank=None, qk_multiple=256))
        print()
        result = shard_checkpoint(checkpoint, out, args.tp_size, force=args.keep is not None,
                                  progress=_progress(False))
        print(f"shard: {_written_line(result)}; input read at "
              f"{size / result.seconds / 1e9:.2f} GB/s")
        t0 = time.perf_counter()
        report = verify_shards(checkpoint, out, numeric=args.numeric, seq_len=args.seq_len,
                               seed=args.seed)
        print(f"verify: {time.perf_counter() - t0:.2f} s")
        _print_verify(report)
        return status if report.ok else 1
