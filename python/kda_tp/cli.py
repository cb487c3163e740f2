"""The ``kda-tp`` command line (also ``python -m kda_tp``).

Subcommands: ``plan`` (the shard table), ``shard`` (write one checkpoint per rank), ``verify``
(rejoin the ranks and compare with the input), ``demo`` (all three on a generated checkpoint of
a real model's geometry). Exit status: 0 success, 1 verification failed, 2 refused input.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from . import __version__
from .errors import KdaTpError
from .plan import KdaTpPlan
from .shard import ShardResult, shard_checkpoint, verify_shards
from .source import SafetensorsSource, decoder_prefix, kda_layer_indices, kda_tensor_name

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
    p.add_argument("--kda-only", action="store_true", help="write only the sliced KDA tensors (an overlay on the input checkpoint)")
    _add_qk_multiple(p)
    p.set_defaults(run=_run_shard)

    p = sub.add_parser("verify", help="check a shard output against its input")
    p.add_argument("checkpoint", type=Path)
    p.add_argument("out", type=Path, help="the directory given to `shard --out`")
    _add_numeric(p)
    p.set_defaults(run=_run_verify)

    p = sub.add_parser("demo", help="plan, shard and verify a generated real-geometry checkpoint")
    p.add_argument("--tp-size", type=int, default=4, help="world size (default 4)")
    p.add_argument("--model", choices=["kimi-linear", "glm-5.3-flash"], default="kimi-linear")
    p.add_argument("--num-layers", type=int, default=4)
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
    print(format_plan(plan, shapes, n_layers))
    return 0


def format_plan(
    plan: KdaTpPlan, shapes: dict[str, tuple[int, ...]] | None = None, n_layers: int | None = None
) -> str:
    """The shard table of ``plan``: one line per tensor, then totals and the all-reduce.

    ``shapes`` gives on-disk shapes by plan name (default: the canonical Kimi-Linear shapes).
    """
    shapes = shapes or {}
    rows = [("tensor", "kind", "dtype", "full shape", f"rank {plan.tp_rank} shape", "offset",
             "bytes/rank")]
    for t in plan.tensors:
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
        kda_only=args.kda_only,
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
        mla = [i for i in range(args.num_layers)
               if g["full_attn_every"] and (i + 1) % g["full_attn_every"] == 0]
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


def _torchrun_processes() -> int:
    """The number of processes of the torchrun job this process is part of; 1 outside torchrun."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return 1
    return int(os.environ.get("WORLD_SIZE", "1"))


def _run_shard(args: argparse.Namespace) -> int:
    """``shard``; under torchrun with several processes, the ranks are split over them."""
    if _torchrun_processes() == 1:
        return _cmd_shard(args)
    from .torch import shard_checkpoint_distributed, torchrun_group

    with torchrun_group() as (process, processes):
        try:
            result = shard_checkpoint_distributed(
                args.checkpoint,
                args.out,
                args.tp_size,
                ranks=args.ranks,
                layers=args.layers,
                qk_multiple=args.qk_multiple,
                force=args.force,
                backend=args.backend,
                progress=_progress(args.quiet) if process == 0 else None,
                kda_only=args.kda_only,
            )
        except KdaTpError as e:
            if process == 0:
                print(f"kda-tp: error: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        if process == 0:
            print(f"{_written_line(result)}; {processes} torchrun processes")
        return 0


def _run_verify(args: argparse.Namespace) -> int:
    """``verify``; under torchrun with several processes, process 0 checks the bytes and
    ``--numeric`` spreads the ranks' forwards over the processes with a real all-reduce."""
    if _torchrun_processes() == 1:
        return _cmd_verify(args)
    import torch.distributed as dist

    from .torch import check_tp_equivalence_distributed, rank_dir_metadata, torchrun_group

    with torchrun_group() as (process, _):
        report, failure = None, None
        if process == 0:
            try:
                report = verify_shards(args.checkpoint, args.out)
            except KdaTpError as e:
                failure = f"kda-tp: error: {type(e).__name__}: {e}"
        state = [report is not None and report.ok, failure]
        dist.broadcast_object_list(state, src=0)
        if state[0] and args.numeric:
            meta = rank_dir_metadata(args.out)
            numeric = check_tp_equivalence_distributed(
                args.checkpoint,
                meta["tp_size"],
                shard_dir=args.out,
                layers=meta["layers"],
                seq_len=args.seq_len,
                seed=args.seed,
                qk_multiple=meta["qk_multiple"],
            )
            if report is not None:
                report.numeric = numeric
        if process != 0:
            status = [0]
            dist.broadcast_object_list(status, src=0)
            return status[0]
        if failure is not None:
            print(failure, file=sys.stderr)
            status = [2]
        else:
            _print_verify(report)
            status = [0 if report.ok else 1]
        dist.broadcast_object_list(status, src=0)
        return status[0]
