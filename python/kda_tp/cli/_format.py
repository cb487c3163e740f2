"""What the ``kda-tp`` commands print: the plan table and its JSON, what ``shard`` will write and
wrote, ``verify``'s report and its JSON, sizes in decimal units, and refusals in command-line
terms (one ``kda-tp: error:`` line, flags instead of keyword arguments).

Every function here formats or prints; none reads a checkpoint. The command bodies are
:mod:`kda_tp.cli._commands`, the argument parsing and exit codes :mod:`kda_tp.cli`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import KdaTpError, PlanError

if TYPE_CHECKING:
    from ..model.config import KdaConfig
    from ..rank.mla import MlaTpPlan
    from ..rank.plan import KdaTpPlan
    from ..shard.writer import ShardResult, ShardSizes
    from ..shard.verify import VerifyReport

__all__ = [
    "emit_json",
    "error_line",
    "format_bytes",
    "format_mla_plan",
    "format_plan",
    "mla_plan_json",
    "format_sizes",
    "plan_json",
    "print_kept",
    "print_refusal",
    "print_shard",
    "print_verify",
    "rank_message",
    "verify_json",
    "with_hints",
    "written_line",
]


def rank_message(rank: int, tp_size: int) -> str:
    """The refusal of a rank outside ``0..tp_size-1``, with the range and the fix."""
    return (f"rank {rank} is out of range for --tp-size {tp_size}: valid ranks are "
            f"0..{tp_size - 1}; pass one of them, or the --tp-size the rank belongs to")


def emit_json(args: argparse.Namespace, document: dict[str, Any]) -> None:
    """Print ``document`` as the command's one JSON document, when ``--json`` was given."""
    if getattr(args, "json", False):
        print(json.dumps(document, indent=2))


def with_hints(args: argparse.Namespace, error: KdaTpError) -> str:
    """``error``'s message in command-line terms: flags instead of keyword arguments, and a
    plan refusal lists the TP sizes this model allows when the requested one is not among
    them (from the refusal's attributes: ``PlanError.allowed_tp_sizes``, ``head_divisors``)."""
    message = str(error).replace("pass layers=[...] (0-based)", "pass --layers (0-based)")
    if not isinstance(error, PlanError):
        return message
    if error.tp_rank is not None and error.tp_size is not None:
        message += f": {rank_message(error.tp_rank, error.tp_size)}"
    if not isinstance(getattr(args, "tp_size", None), int):
        return message
    message = message.replace("pass qk_multiple=1", "pass --qk-multiple 1")
    sizes, loose = error.allowed_tp_sizes, error.head_divisors
    if sizes is None or loose is None or args.tp_size in sizes:
        return message
    if args.tp_size not in loose and sizes == loose:
        return message  # the plan's own list of divisors is already the answer
    listed = ", ".join(map(str, sizes)) or "none"
    # Only plan and shard have --qk-multiple; demo plans with the default rule, audit, dump
    # and digests with none (the engine chose the world size): name the flag only where it is.
    if not hasattr(args, "qk_multiple"):
        return message + f"; the TP sizes that pass are {listed}"
    qk_multiple = error.qk_multiple
    default = " (the default)" if qk_multiple == 256 else ""
    message += f"; with --qk-multiple {qk_multiple}{default} the TP sizes that pass are {listed}"
    if qk_multiple != 1 and loose and loose != sizes:
        message += f" ({', '.join(map(str, loose))} with --qk-multiple 1)"
    return message


def error_line(message: str) -> str:
    """The one ``kda-tp: error: MESSAGE`` line every refusal of the command line is printed as
    (without its newline): what would break the line or the terminal in ``message`` (a path
    holding a newline, a carriage return or an escape sequence: any character Python does not
    print as itself) is written as its escape (``\\n``, ``\\x1b``), so the error stays one
    line."""
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)
    return f"kda-tp: error: {shown}"


def print_refusal(args: argparse.Namespace, error: KdaTpError) -> None:
    """The one ``kda-tp: error: TYPE: message`` line on stderr (:func:`error_line`; the message
    in command-line terms: :func:`with_hints`), and with ``--json`` the refusal's JSON document
    on stdout."""
    message = with_hints(args, error)
    print(error_line(f"{type(error).__name__}: {message}"), file=sys.stderr)
    emit_json(args, {"ok": False, "error": {"type": type(error).__name__, "message": message}})


def plan_json(
    plan: KdaTpPlan,
    shapes: dict[str, tuple[int, ...]] | None = None,
    layers: Sequence[int] | None = None,
    config: KdaConfig | None = None,
) -> dict[str, Any]:
    """The shard table of ``plan`` as a JSON-ready dict (what ``kda-tp plan --json`` prints).

    Keys: the geometry (``tp_rank``, ``tp_size``, ``hidden``, ``head_dim``, ``full_heads``,
    ``local_heads``, ``conv_kernel``, ``gate_rank``, ``qk_multiple``); ``tensors``, one entry
    per tensor with ``name``, ``kind``, ``dtype``, ``full_shape`` and ``local_shape`` (on-disk
    rank, elements), ``sharded_axis`` (None when replicated), ``offset`` (this rank's first
    index on that axis, elements) and ``local_bytes``/``full_bytes``, and for a block-quantized
    weight ``block`` and ``scale`` (the same fields for its scale grid, offsets in blocks);
    ``full_rank_gate`` and ``a_log_len`` (Kimi K3); ``layer_local_bytes`` and
    ``layer_full_bytes`` per KDA layer; ``kda_layers`` (0-based, None when not known) and
    ``total_local_bytes``/``total_full_bytes`` over them (None when not known); ``all_reduce``
    (whether ``o_proj``'s output is all-reduced). With ``config`` (the parsed config the plan
    came from): ``forget_gate`` (``"lower_bound"`` or ``"softplus"``), ``gate_lower_bound``
    (None for softplus), ``gate_bound_key`` (the config key it came from, e.g.
    ``"text_config.linear_lower_bound"``) and ``config_rules`` (``"glm5_next"``, ``"kimi"`` or
    ``"generic"``: ``kda_tp.model.config``). ``shapes`` as for :func:`format_plan`. ``kda-tp plan
    --json`` adds ``"ok": true`` (``false`` with ``error`` on a refusal), and ``"mla"``
    (:func:`mla_plan_json`) for a hybrid.
    """
    shapes = shapes or {}

    def entry(t: Any) -> dict[str, Any]:
        disk = tuple(shapes.get(t.name, t.disk_shape))
        axis = t.sharded_axis(list(disk))
        row = {
            "name": t.name, "kind": t.kind.name, "dtype": t.dtype, "full_shape": list(disk),
            "local_shape": list(t.local_shape(list(disk))), "sharded_axis": axis,
            "offset": None if axis is None else t.src_row_offset or t.src_col_offset,
            "local_bytes": t.local_bytes, "full_bytes": t.full_bytes,
        }
        if t.scale is not None:
            row["block"] = list(t.block)
            row["scale"] = entry(t.scale)  # offsets in blocks
        return row

    tensors = [entry(t) for t in plan.tensors]
    out = {
        "tp_rank": plan.tp_rank, "tp_size": plan.tp_size, "hidden": plan.hidden,
        "head_dim": plan.head_dim, "full_heads": plan.full_heads,
        "local_heads": plan.local_heads, "conv_kernel": plan.conv_kernel,
        "gate_rank": plan.gate_rank, "qk_multiple": plan.qk_multiple,
        "full_rank_gate": plan.full_rank_gate, "a_log_len": plan.a_log_len, "tensors": tensors,
        "layer_local_bytes": plan.local_bytes, "layer_full_bytes": plan.full_bytes,
        "kda_layers": None if layers is None else list(layers),
        "total_local_bytes": None if layers is None else len(layers) * plan.local_bytes,
        "total_full_bytes": None if layers is None else len(layers) * plan.full_bytes,
        "all_reduce": plan.needs_output_all_reduce,
    }
    if config is not None:
        out.update(
            forget_gate=config.forget_gate,
            gate_lower_bound=config.gate_lower_bound,
            gate_bound_key=config.gate_bound_key,
            config_rules=config.rules,
        )
    return out


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
        block = quantized[0].block
        assert block is not None  # the plan sets a weight's block and scale together
        rows_, cols_ = block
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
        f"per KDA layer: {format_bytes(plan.local_bytes)} per rank of {format_bytes(plan.full_bytes)} "
        f"({share:.1%})",
    ]
    if n_layers:
        lines.append(
            f"{n_layers} KDA layer{'s' if n_layers != 1 else ''}: "
            f"{format_bytes(n_layers * plan.local_bytes)} per rank of "
            f"{format_bytes(n_layers * plan.full_bytes)}"
        )
    if plan.needs_output_all_reduce:
        lines.append(
            f"all-reduce: o_proj is row-parallel; each rank's output is a partial sum, "
            f"all-reduced (sum) over the {plan.tp_size} ranks after o_proj"
        )
    else:
        lines.append("all-reduce: none (tp_size 1)")
    return "\n".join(lines)


def mla_plan_json(plan: MlaTpPlan, layers: Sequence[int]) -> dict[str, Any]:
    """The shard table of a hybrid's MLA layers as a JSON-ready dict (``kda-tp plan --json``'s
    ``"mla"``, present only when the config has MLA layers).

    Keys: ``mla_layers`` (0-based, from the config); the geometry (``heads``, the MLA head
    count ``num_attention_heads``, ``local_heads``, ``hidden``, ``q_lora_rank`` (None:
    a full-rank ``q_proj``), ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
    ``v_head_dim``, ``output_gate``, ``indexer`` as ``[index_n_heads, index_head_dim,
    index_kpool]`` or None); ``tensors`` with the fields of :func:`plan_json`'s (shapes from
    the config); ``layer_local_bytes``/``layer_full_bytes`` per MLA layer and
    ``total_local_bytes``/``total_full_bytes`` over them.
    """
    def entry(t: Any) -> dict[str, Any]:
        disk = list(t.disk_shape)
        axis = t.sharded_axis(disk)
        return {
            "name": t.name, "kind": t.kind.name, "dtype": t.dtype, "full_shape": disk,
            "local_shape": list(t.local_shape(disk)), "sharded_axis": axis,
            "offset": None if axis is None else t.src_row_offset or t.src_col_offset,
            "local_bytes": t.local_bytes, "full_bytes": t.full_bytes,
        }

    return {
        "mla_layers": list(layers), "heads": plan.heads, "local_heads": plan.local_heads,
        "hidden": plan.hidden, "q_lora_rank": plan.q_lora_rank,
        "kv_lora_rank": plan.kv_lora_rank, "qk_nope_head_dim": plan.qk_nope_head_dim,
        "qk_rope_head_dim": plan.qk_rope_head_dim, "v_head_dim": plan.v_head_dim,
        "output_gate": plan.output_gate,
        "indexer": None if plan.indexer is None else list(plan.indexer),
        "tensors": [entry(t) for t in plan.tensors],
        "layer_local_bytes": plan.local_bytes, "layer_full_bytes": plan.full_bytes,
        "total_local_bytes": len(layers) * plan.local_bytes,
        "total_full_bytes": len(layers) * plan.full_bytes,
    }


def format_mla_plan(plan: MlaTpPlan, layers: Sequence[int]) -> str:
    """The shard table of a hybrid's MLA layers ``layers`` (0-based): a heading with the MLA
    geometry, one line per tensor (shapes from the config), then the totals."""
    rows = [("tensor", "kind", "dtype", "full shape", f"rank {plan.tp_rank} shape", "offset",
             "bytes/rank")]
    for t in plan.tensors:
        disk = list(t.disk_shape)
        axis = t.sharded_axis(disk)
        offset = "-" if axis is None else f"dim {axis} @ {t.src_row_offset or t.src_col_offset}"
        rows.append((t.name, t.kind.name, t.dtype, _shape(disk), _shape(t.local_shape(disk)),
                     offset, f"{t.local_bytes:,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    shown = ", ".join(map(str, layers[:8])) + (f", ... ({len(layers) - 8} more)"
                                               if len(layers) > 8 else "")
    q = "no q-LoRA" if plan.q_lora_rank is None else f"q_lora_rank {plan.q_lora_rank}"
    extras = [" output gate"] if plan.output_gate else []
    if plan.indexer is not None:
        n, h, kpool = plan.indexer
        extras.append(f" DSA indexer {n} heads of {h}, kpool {kpool} (replicated)")
    lines = [
        "",
        f"MLA tensor-parallel plan (layers {shown}): tp_size={plan.tp_size}, "
        f"num_attention_heads {plan.heads} -> {plan.local_heads} per rank, {q}, kv_lora_rank "
        f"{plan.kv_lora_rank}, qk_nope {plan.qk_nope_head_dim}, qk_rope "
        f"{plan.qk_rope_head_dim}, v {plan.v_head_dim}, hidden {plan.hidden}"
        + ("," if extras else "") + ",".join(extras),
        "",
    ]
    for i, row in enumerate(rows):
        lines.append("  ".join(c.rjust(w) if j == 6 else c.ljust(w)
                               for j, (c, w) in enumerate(zip(row, widths))).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    n_layers = len(layers)
    share = plan.local_bytes / plan.full_bytes
    lines += [
        "",
        f"per MLA layer: {format_bytes(plan.local_bytes)} per rank of "
        f"{format_bytes(plan.full_bytes)} ({share:.1%})",
        f"{n_layers} MLA layer{'s' if n_layers != 1 else ''}: "
        f"{format_bytes(n_layers * plan.local_bytes)} per rank of "
        f"{format_bytes(n_layers * plan.full_bytes)}",
        "(MLA layers and shapes from the config; shard, verify, load_rank and "
        "open_rank(..., mla=True) slice them so)",
    ]
    return "\n".join(lines)


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def format_sizes(sizes: ShardSizes) -> str:
    """What ``shard`` will write, e.g. ``shard: writing 4.60 GB of tensors for 8 ranks (0.58 GB
    per rank: 0.11 GB of KDA slices, 0.46 GB of other tensors) from a 1.30 GB input, and
    copying 3 other files into every rank (config.json, tokenizer.json, tokenizer_config.json:
    7.43 MB per rank)``, and a second line suggesting ``--kda-only`` when the other tensors,
    copied whole into every rank, outweigh the KDA slices."""
    per_rank = sorted(set(sizes.rank_bytes))
    each = format_bytes(per_rank[0]) if len(per_rank) == 1 else (
        f"{format_bytes(per_rank[0])} to {format_bytes(per_rank[-1])}")
    n = len(sizes.ranks)
    line = (
        f"shard: writing {format_bytes(sizes.total_bytes)} of tensors for {n} rank{'s' * (n != 1)} "
        f"({each} per rank: {format_bytes(sum(sizes.kda_bytes) // n)} of KDA slices, "
        f"{format_bytes(sum(sizes.other_bytes) // n)} of other tensors) from a "
        f"{format_bytes(sizes.input_bytes)} input"
    )
    if sizes.companions:
        k = len(sizes.companions)
        names = ", ".join(sizes.companions[:3]) + (f" and {k - 3} more" if k > 3 else "")
        line += (f", and copying {k} other file{'s' * (k != 1)} into every rank ({names}: "
                 f"{format_bytes(sizes.companion_bytes)} per rank)")
    if sizes.suggest_kda_only:
        line += (
            f"\nshard: hint: {format_bytes(sum(sizes.other_bytes))} of it is non-KDA tensors copied "
            f"whole into every rank; --kda-only writes only the KDA slices "
            f"({format_bytes(sum(sizes.kda_bytes))}), an overlay on the input checkpoint"
        )
    return line


def format_bytes(n: int) -> str:
    """``n`` bytes in decimal units, 3 significant digits: ``512 B``, ``12.3 kB``, ``4.60 GB``.
    Every size the command line prints is in these units (kB = 10^3 bytes, MB = 10^6, GB =
    10^9), the unit of the writer's and verifier's GB figures and of tqdm's byte counts."""
    return in_unit(n, n)


def in_unit(n: float, size: int) -> str:
    """``n`` bytes in the unit and with the decimals :func:`format_bytes` writes ``size`` in
    (a progress count and a rate in the unit of the total they go with)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            x = size / scale
            digits = 2 if x < 10 else 1 if x < 100 else 0
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n:.0f} B"


def written_line(result: ShardResult) -> str:
    """The line saying what ``shard`` wrote: ranks, output directory, bytes of tensors,
    seconds and the write rate, in one unit (the one the "writing" line and the progress use:
    :func:`format_bytes`)."""
    rate = result.bytes_written / result.seconds if result.seconds else 0.0
    return (
        f"wrote ranks {list(result.ranks)} of {result.tp_size} to {result.out_dir}: "
        f"{format_bytes(result.bytes_written)} of tensors in {result.seconds:.2f} s "
        f"({in_unit(rate, result.bytes_written)}/s written)"
    )


def print_shard(
    args: argparse.Namespace,
    result: ShardResult,
    skipped: tuple[Sequence[Path], Sequence[Path]],
    processes: int = 1,
    sizes: Sequence[ShardSizes] = (),
) -> None:
    """What ``shard`` wrote: the JSON document with ``--json`` (``skipped``: the files
    ``--skip-unindexed`` and ``--skip-heavy-files`` left out, as ``skipped_unindexed`` and
    ``skipped_heavy``), else one line; on stderr, a warning for each directory kept because
    another process put files into a rank directory while it was replaced
    (:func:`print_kept`)."""
    for kept in result.kept:
        print_kept(kept, "replaced or removed")
    if args.json:
        unindexed, heavy = skipped
        emit_json(args, {
            **result.to_dict(), "skipped_unindexed": [str(p) for p in unindexed],
            "skipped_heavy": [str(p) for p in heavy],
            "processes": processes, "sizes": sizes[0].to_dict() if sizes else None,
        })
    elif processes > 1:
        print(f"{written_line(result)}; {processes} torchrun processes")
    else:
        print(written_line(result))


def print_kept(path: Path, done: str) -> None:
    """The warning (stderr) for ``path``, a directory kda-tp kept because it holds files another
    process put there while kda-tp ``done`` it: kda-tp removed only its own files."""
    print(f"kda-tp: warning: {path} holds files another process put there while kda-tp "
          f"{done} it; kda-tp removed only what it wrote and kept the rest there",
          file=sys.stderr)


def print_verify(report: VerifyReport) -> None:
    """``verify``'s text report on stdout: its problems (at most 20 listed), the numeric
    check's table when it ran, and the summary line."""
    # One problem is the summary line itself; several are listed above a count.
    for problem in report.problems[:20] if len(report.problems) > 1 else ():
        print(f"  {problem}")
    if len(report.problems) > 20:
        print(f"  ... and {len(report.problems) - 20} more")
    if report.numeric is not None:
        print(report.numeric.format())
    print(report.summary())


def verify_json(report: VerifyReport, unindexed: Sequence[Path] = ()) -> dict[str, Any]:
    """``report`` as a JSON-ready dict (what ``kda-tp verify --json`` prints):
    ``report.to_dict(unindexed)`` (see :meth:`kda_tp.shard.VerifyReport.to_dict`)."""
    return report.to_dict(unindexed)


