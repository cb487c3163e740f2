"""The bodies of the ``kda-tp`` commands: each takes the parsed arguments and returns the exit
status (0 OK, 1 verification or audit failed; a refusal raises a ``KdaTpError``, which
:func:`kda_tp.cli.main` turns into exit 2).

``plan``, ``shard`` (and its input checks: ``--layers``, ``--skip-unindexed``), ``verify``,
``audit``, ``dump``, ``digests``, ``demo``; ``shard`` and ``verify`` as torchrun jobs
(:mod:`kda_tp.shard.torchrun`). Each command imports what it uses (numpy with the reader, the writer
and verifier only for shard/verify), so that ``kda-tp --help`` imports no numpy and ``kda-tp
plan`` no writer. What they print is :mod:`kda_tp.cli._format`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CheckpointError, KdaTpError, PlanError
from ..model.config import load_config
from ._format import (
    emit_json,
    error_line,
    format_bytes,
    format_mla_plan,
    format_plan,
    format_sizes,
    mla_plan_json,
    plan_json,
    print_kept,
    print_refusal,
    print_shard,
    print_verify,
    verify_json,
    written_line,
)
from ._progress import make_progress

if TYPE_CHECKING:
    from ..checkpoint.description import CheckpointDescription
    from ..checkpoint.reader import SafetensorsSource
    from ..shard.writer import ShardResult, ShardSizes

__all__ = [
    "cmd_audit",
    "cmd_demo",
    "cmd_digests",
    "cmd_dump",
    "cmd_plan",
    "finish_command_for",
    "run_shard",
    "run_verify",
]


def cmd_plan(args: argparse.Namespace) -> int:
    """``plan``: the shard table of one rank (``--json``:
    :func:`~kda_tp.cli._format.plan_json`), read from a checkpoint directory or a bare
    config."""
    from ..checkpoint.description import (
        CheckpointDescription,
        assumed_layout,
        describe,
        open_checkpoint,
    )
    from ..checkpoint.layers import check_layers, config_layer_count
    from ..checkpoint.names import kda_tensor_name, scale_tensor_name
    from ..model.mla import parse_mla_config
    from ..rank.mla import MlaTpPlan
    from ..rank.plan import KdaTpPlan

    # `demo` calls this with a namespace that has no --layers or --json.
    requested, as_json = getattr(args, "layers", None), getattr(args, "json", False)
    layers: tuple[int, ...] | None = None
    # The checkpoint (or config) is read once: its description (kda_tp.checkpoint.description).
    source = open_checkpoint(args.input)
    if source is not None:
        description = describe(source)
        layers = _selected_layers(description, requested)
    else:
        # A bare config: its own list of KDA layers (or --layers, checked against it).
        description = CheckpointDescription(None, load_config(args.input), str(args.input))
        listed = description.kda.kda_layers
        layers = listed if requested is None else check_layers(
            requested, listed, config_layer_count(description.config)
        )
    plan = KdaTpPlan.from_description(
        description, args.rank, args.tp_size, gate_rank=args.gate_rank,
        qk_multiple=args.qk_multiple, layers=layers if source is not None else None,
    )
    kda = description.kda
    # The hybrid's MLA layers, from the config only (None: every layer KDA, or not listed).
    # What keeps them from being planned is said after the KDA table, which stands as before;
    # only an MLA head count this --tp-size cannot split refuses the command.
    mla_config, mla = None, None
    mla_problem: KdaTpError | None = None
    try:
        mla_config = parse_mla_config(description.config, kda)
        if mla_config is not None:
            mla = MlaTpPlan.from_description(description, args.rank, args.tp_size, mla_config)
    except PlanError as e:
        if e.allowed_tp_sizes is not None:
            raise
        mla_problem = e
    except CheckpointError as e:
        mla_problem = e
    shapes, n_layers = {}, None
    if source is not None and layers:
        n_layers = len(layers)
        prefix = description.prefix
        shapes = {
            t.name: _disk_shape(source, kda_tensor_name(prefix, layers[0], t.name), layers[0])
            for t in plan.tensors
        }
        for t in plan.tensors:
            if t.scale is None:
                continue
            scale = scale_tensor_name(source, prefix, layers[0], t.name)
            if scale:
                shapes[t.scale.name] = _disk_shape(source, scale, layers[0])
    elif layers is not None:
        n_layers = len(layers)
    if source is None:
        _, shapes, family = assumed_layout(kda)
    if as_json:
        document = {"ok": True, **plan_json(plan, shapes, layers, kda)}
        if mla is not None and mla_config is not None:
            document["mla"] = mla_plan_json(mla, mla_config.layers)
        elif mla_problem is not None:
            document["mla"] = {"mla_layers": None if mla_config is None
                               else list(mla_config.layers),
                               "error": {"type": type(mla_problem).__name__,
                                         "message": str(mla_problem)}}
        print(json.dumps(document, indent=2))
    else:
        print(format_plan(plan, shapes, n_layers))
        print(kda.describe_gate())
        if mla is not None and mla_config is not None:
            print(format_mla_plan(mla, mla_config.layers))
        elif mla_problem is not None:
            print(f"\nMLA layers: not planned: {type(mla_problem).__name__}: {mla_problem}")
        if source is None:
            print(f"(from the config alone: on-disk shapes and dtypes are assumed, {family} "
                  "defaults; pass the checkpoint directory to read its own, e.g. Kimi K3's "
                  "padded A_log and F32 convs)")
    return 0


def _disk_shape(source: SafetensorsSource, name: str, layer: int) -> tuple[int, ...]:
    """The on-disk shape of tensor ``name`` of KDA layer ``layer``.

    Raises:
        CheckpointError: the checkpoint has no tensor ``name``.
    """
    info = source.info(name)
    if info is None:
        raise CheckpointError(f"{source.root}: KDA layer {layer} lacks {name}")
    return info[1]


def _selected_layers(description: CheckpointDescription,
                     requested: list[int] | None) -> tuple[int, ...]:
    """The KDA layers to show or check: ``requested`` (``--layers``, a subset of the config's
    KDA layers, or of the layers holding KDA tensors when the config does not list them), else
    every KDA layer the config lists."""
    from ..checkpoint.layers import check_layers

    try:
        listed = description.kda_layers()
    except CheckpointError:
        if requested is None:
            raise
        return check_layers(requested, description.a_log_layers or None,
                            description.layer_count)
    if requested is None:
        return listed
    return check_layers(requested, listed, description.layer_count)


def _shard_layers(description: CheckpointDescription,
                  requested: list[int] | None) -> list[int] | None:
    """``shard --layers``: the KDA layers of a config that does not list them (returned, for
    ``shard_checkpoint``); with a config that lists them only that same list is accepted
    (None is returned: the config's list is used), since every KDA layer is always sliced.

    Raises:
        PlanError: see :func:`~kda_tp.checkpoint.check_layers`, or a list that is not the config's.
    """
    if requested is None:
        return None
    try:
        listed = description.kda_layers()
    except CheckpointError:
        return list(_selected_layers(description, requested))
    chosen = _selected_layers(description, requested)
    if chosen != tuple(listed):
        raise PlanError(
            f"--layers {','.join(map(str, chosen))}: shard slices every KDA layer the config "
            f"lists ({','.join(map(str, listed))}); --layers is only for a config that does not "
            "list them (to check or show some layers: verify --numeric --layers, plan --layers)"
        )
    return None


def _shard_input(
    args: argparse.Namespace, warn: bool = True
) -> tuple[list[int] | None, list[Path], list[Path]]:
    """``shard``'s checks of its input before anything is written: the ``--layers`` to pass on
    (see :func:`_shard_layers`), the files ``--skip-unindexed`` leaves out and the heavy files
    ``--skip-heavy-files`` leaves out (a warning each on stderr when ``warn``, and one when a
    hybrid's MLA layers cannot be planned and pass through whole)."""
    from ..checkpoint.reader import INDEX_NAME, refuse_index_member
    from ..checkpoint.description import describe
    from ..checkpoint.reader import SafetensorsSource
    from ..rank.mla import rank_mla_plan
    from ..shard.rankdir import heavy_files, unindexed_files

    refuse_index_member(args.checkpoint)
    source = SafetensorsSource(args.checkpoint, args.backend)
    description = describe(source)
    layers = _shard_layers(description, args.layers)
    try:
        mla_note = rank_mla_plan(description, 0, args.tp_size)[1] if args.tp_size > 0 else None
    except PlanError:
        mla_note = None  # the writer refuses this split, after the KDA plan's own checks
    if mla_note and warn:
        print(f"kda-tp: warning: {mla_note}", file=sys.stderr)
    skipped = unindexed_files(source) if args.skip_unindexed else []
    for path in skipped if warn else ():
        print(f"kda-tp: warning: {path} is not named by {INDEX_NAME}; it is left out of every "
              "rank (--skip-unindexed)", file=sys.stderr)
    heavy = heavy_files(source) if args.skip_heavy_files and not args.kda_only else []
    for path, size, why in heavy if warn else ():
        print(f"kda-tp: warning: {path} ({format_bytes(size)}: {why}) is left out of every "
              "rank (--skip-heavy-files)", file=sys.stderr)
    return layers, skipped, [path for path, _, _ in heavy]


def _size_reporter(
    args: argparse.Namespace, seen: list[ShardSizes]
) -> Callable[[ShardSizes], None]:
    """``shard``'s ``report_sizes``: keeps the sizes (for ``--json``) and, unless ``--quiet``,
    prints them on stderr before anything is written (:func:`format_sizes`)."""

    def report(sizes: ShardSizes) -> None:
        seen.append(sizes)
        if not args.quiet:
            print(format_sizes(sizes), file=sys.stderr, flush=True)

    return report


def _write_shards(
    args: argparse.Namespace, shard: Callable[..., ShardResult], warn: bool = True
) -> tuple[ShardResult, tuple[list[Path], list[Path]], list[ShardSizes]]:
    """``shard``'s input checked (:func:`_shard_input`), then the ranks written with ``shard``
    (``shard_checkpoint``, or a torchrun job's ``shard``) and ``shard``'s flags: the result,
    the files ``--skip-unindexed`` and ``--skip-heavy-files`` left out, and the sizes reported
    before writing."""
    layers, skipped, heavy = _shard_input(args, warn=warn)
    sizes: list[ShardSizes] = []
    result = shard(
        args.checkpoint,
        args.out,
        args.tp_size,
        ranks=args.ranks,
        layers=layers,
        qk_multiple=args.qk_multiple,
        force=args.force,
        backend=args.backend,
        progress=make_progress(args.quiet),
        allow_resharding=args.allow_resharding,
        skip_unindexed=args.skip_unindexed,
        kda_only=args.kda_only,
        wait=args.wait,
        report_sizes=_size_reporter(args, sizes),
        skip_heavy_files=args.skip_heavy_files,
    )
    return result, (skipped, heavy), sizes


def run_shard(args: argparse.Namespace) -> int:
    """``shard``; under torchrun with several processes, the ranks are split over them
    (:mod:`kda_tp.shard.torchrun`), and process 0 alone prints."""
    from ..shard.writer import shard_checkpoint
    from ..shard.torchrun import torchrun_job, torchrun_processes

    if torchrun_processes() == 1:
        result, skipped, sizes = _write_shards(args, shard_checkpoint)
        print_shard(args, result, skipped, sizes=sizes)
        return 0
    with torchrun_job() as job:
        try:
            # Every process checks its input the same way; process 0 alone says so.
            result, skipped, sizes = _write_shards(args, job.shard, warn=job.speaks)
        except KdaTpError as e:
            if job.speaks:
                print_refusal(args, e)
            return 2
        if job.speaks:
            print_shard(args, result, skipped, job.processes, sizes)
        return 0


def finish_command_for(args: argparse.Namespace, ranks: Sequence[int]) -> str:
    """The ``kda-tp shard`` command that writes ``ranks`` with this run's other options."""
    from ..shard.rankdir import finish_command

    command = finish_command(args.checkpoint, args.out, args.tp_size, ranks, args.qk_multiple)
    if args.layers is not None:
        command += f" --layers {','.join(map(str, args.layers))}"
    for flag in ("allow_resharding", "skip_unindexed", "skip_heavy_files"):
        if getattr(args, flag):
            command += " --" + flag.replace("_", "-")
    if args.backend:
        command += f" --backend {args.backend}"
    return command


def _cmd_verify(args: argparse.Namespace) -> int:
    from ..checkpoint.reader import INDEX_NAME, refuse_index_member
    from ..shard.rankdir import unindexed_files
    from ..shard.verify import verify_shards
    from ..checkpoint.reader import SafetensorsSource

    if args.layers is not None and not args.numeric:
        raise PlanError("--layers picks the KDA layers of the numeric check; pass --numeric too "
                        "(the byte check always covers every tensor)")
    refuse_index_member(args.checkpoint)
    unindexed = unindexed_files(SafetensorsSource(args.checkpoint))
    for path in unindexed:
        print(f"kda-tp: warning: {path} is not named by {INDEX_NAME}; no rank holds it and it "
              "is not checked", file=sys.stderr)
    report = verify_shards(args.checkpoint, args.out, numeric=args.numeric,
                           seq_len=args.seq_len, seed=args.seed, layers=args.layers,
                           progress=make_progress(args.quiet, "verify", "tensors"),
                           numeric_progress=make_progress(args.quiet, "verify --numeric",
                                                      "KDA layers", every=0.0))
    if report.mla_note:
        print(f"kda-tp: warning: {report.mla_note}", file=sys.stderr)
    if args.json:
        emit_json(args, verify_json(report, unindexed))
    else:
        print_verify(report)
    return 0 if report.ok else 1


def run_verify(args: argparse.Namespace) -> int:
    """``verify``; under torchrun with several processes, process 0 checks the bytes and
    ``--numeric`` spreads the ranks' forwards over the processes with a real all-reduce
    (:mod:`kda_tp.shard.torchrun`); process 0 alone prints, every process exits the same."""
    from ..shard.torchrun import torchrun_job, torchrun_processes

    if torchrun_processes() == 1:
        return _cmd_verify(args)
    with torchrun_job() as job:
        outcome = job.verify(args.checkpoint, args.out, numeric=args.numeric,
                             seq_len=args.seq_len, seed=args.seed)
        if outcome.error is not None:
            print(error_line(f"{type(outcome.error).__name__}: {outcome.error}"),
                  file=sys.stderr)
        elif outcome.report is not None:
            print_verify(outcome.report)
        return 2 if outcome.refused else 0 if outcome.passed else 1


def cmd_audit(args: argparse.Namespace) -> int:
    """``audit``: every KDA parameter an engine loaded against the plan; 1 when one is
    wrong."""
    from ..audit.auditor import audit_path

    report = audit_path(args.checkpoint, args.path, tp_size=args.tp_size, tp_rank=args.rank,
                        engine=args.engine, model_dtype=args.dtype,
                        progress=make_progress(args.quiet, "audit", "parameters"))
    if args.json:
        emit_json(args, report.to_dict())
    else:
        print(report.format())
    return 0 if report.passed else 1


def cmd_dump(args: argparse.Namespace) -> int:
    """``dump``: write what the engine's ranks must hold as ``save_sharded_state`` files."""
    from ..audit.dump import write_engine_dump

    result = write_engine_dump(args.checkpoint, args.out, engine=args.engine,
                               tp_size=args.tp_size, ranks=args.ranks, model_dtype=args.dtype,
                               force=args.force, wait=args.wait)
    if args.json:
        emit_json(args, result.to_dict())
    else:
        print(f"wrote {result.params} KDA and MLA parameters of ranks {list(result.ranks)} of "
              f"{result.tp_size} ({result.engine}, {result.bytes_written / 1e9:.3f} GB) to "
              f"{result.out_dir} in {result.seconds:.2f} s; check it with: kda-tp audit "
              f"{args.checkpoint} {result.out_dir} --tp-size {result.tp_size}"
              + ("" if args.dtype is None else f" --dtype {args.dtype}")
              + ("" if args.ranks is None else f" --rank R (R in {list(result.ranks)})"))
    return 0


def cmd_digests(args: argparse.Namespace) -> int:
    """``digests``: the SHA-256 of every rank's expected KDA parameters, keyed as vLLM's
    weight checksums."""
    from ..audit.digests import engine_digests

    digests = engine_digests(args.checkpoint, engine=args.engine, tp_size=args.tp_size,
                             ranks=args.ranks, model_dtype=args.dtype)
    if args.json:
        ranks = sorted(range(args.tp_size) if args.ranks is None else args.ranks)
        emit_json(args, {"ok": True, "engine": args.engine, "tp_size": args.tp_size,
                          "ranks": ranks, "checksums": digests})
    else:
        for key, digest in digests.items():
            print(f"{digest}  {key}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """``demo``: generate a real-geometry checkpoint, then plan, shard and verify it; 1 when
    the verification fails."""
    from ..output.demo import claim_demo_dir
    from ..output.dirs import remove_created
    from ..rank.plan import KdaTpPlan
    from ..synth.checkpoints import GEOMETRIES

    g = GEOMETRIES[args.model]
    if args.num_layers is None:
        args.num_layers = 2 if g["style"] == "k3" else 4
    # Refuse a tp_size the model cannot split, and a --seq-len whose activations do not fit,
    # before generating anything.
    KdaTpPlan(0, args.tp_size, g["hidden"], g["head_dim"], g["heads"], g["conv_kernel"],
              g["gate_rank"])
    if args.numeric:
        from ..reference.equivalence import check_numeric_memory

        check_numeric_memory(g["hidden"], g["heads"], g["head_dim"], args.seq_len)
    entries = ["checkpoint", f"tp{args.tp_size}"]
    # With --keep: DIR claimed (refused when it holds what kda-tp did not write, changing
    # nothing), the demo built in DIR/.kda-tp-demo-*, then swapped in (replace_demo_dir); a
    # demo that fails leaves no directory it made.
    created = claim_demo_dir(args.keep, entries) if args.keep else []
    try:
        return _demo(args, entries, created)
    except BaseException:
        remove_created(created)
        raise


def _demo(args: argparse.Namespace, entries: list[str], created: list[Path]) -> int:
    """:func:`cmd_demo` once ``--keep DIR`` is claimed (``created``: the directories that made)."""
    from ..output.demo import demo_staging, replace_demo_dir
    from ..shard.verify import verify_shards
    from ..shard.writer import shard_checkpoint
    from ..checkpoint.reader import SafetensorsSource
    from ..checkpoint.description import describe
    from ..synth.checkpoints import write_checkpoint
    from ..rank.mla import rank_mla_plan

    with demo_staging(args.keep) as tmp:
        base = Path(tmp)
        checkpoint, out = base / entries[0], base / entries[1]
        t0 = time.perf_counter()
        write_checkpoint(checkpoint, args.model, args.num_layers)
        size = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))
        print(f"generated a {args.num_layers}-layer {args.model} checkpoint "
              f"({size / 1e9:.3f} GB) in {time.perf_counter() - t0:.1f} s: "
              f"{(args.keep or base) / checkpoint.name}"
              + ("" if args.keep else " (deleted on exit; --keep DIR keeps it)"))
        generated = SafetensorsSource(checkpoint)  # kept open while described
        description = describe(generated)
        kda = set(description.kda_layers())
        mla = [i for i in range(args.num_layers) if i not in kda]
        if mla:
            note = rank_mla_plan(description, 0, args.tp_size)[1]
            print(f"layers {mla} (0-based) are full attention (MLA): "
                  + (note or "sliced per rank by their own plan (MlaTpPlan)"))
        print()
        status = cmd_plan(argparse.Namespace(input=checkpoint, rank=0, tp_size=args.tp_size,
                                              gate_rank=None, qk_multiple=256))
        print()
        result = shard_checkpoint(checkpoint, out, args.tp_size, progress=make_progress(False))
        if args.keep:
            for kept in replace_demo_dir(args.keep, base, entries):
                print_kept(kept, "replaced")
            checkpoint, out = args.keep / entries[0], args.keep / entries[1]
        print(f"shard: {written_line(dataclasses.replace(result, out_dir=out))}")
        report = verify_shards(checkpoint, out, numeric=args.numeric, seq_len=args.seq_len,
                               seed=args.seed, numeric_progress=make_progress(
                                   False, "verify --numeric", "KDA layers", every=0.0))
        print_verify(report)
        return status if report.ok else 1
