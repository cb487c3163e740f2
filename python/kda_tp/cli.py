"""The ``kda-tp`` command line (also ``python -m kda_tp``).

Subcommands: ``plan`` (the shard table), ``shard`` (write one checkpoint per rank), ``verify``
(rejoin the ranks and compare with the input), ``demo`` (all three on a generated checkpoint of
a real model's geometry), ``audit`` (check the KDA weights a serving engine loaded), ``dump``
and ``digests`` (what an engine's ranks must hold, as files or as vLLM's checksums). Exit status:
0 success, 1 verification or audit failed, 2 refused input, 130 interrupted (Ctrl-C).
``--json`` (plan, shard, verify, audit, dump, digests) prints one JSON document on stdout
instead of the text; progress and errors go to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from . import __version__
from .config import load_config, parse_config
from .errors import CheckpointError, KdaTpError, PlanError, ShardInterrupted
from .families import FAMILIES

# Each command imports what it uses (numpy with the reader, the writer and verifier only for
# shard/verify), so that `kda-tp --help` imports no numpy and `kda-tp plan` no writer.
if TYPE_CHECKING:
    from .config import KdaConfig
    from .plan import KdaTpPlan
    from .shard import ShardResult, ShardSizes, VerifyReport
    from .source import SafetensorsSource

__all__ = ["main"]

#: Exit status after Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 OK, 1 verification failed, 2 refused
    input, 130 interrupted)."""
    args = _parser().parse_args(argv)
    try:
        tp_size, rank = getattr(args, "tp_size", None), getattr(args, "rank", None)
        if isinstance(tp_size, int) and isinstance(rank, int) and rank >= tp_size:
            raise PlanError(_rank_message(rank, tp_size))
        # Every subcommand's parser sets `run` to its handler (set_defaults).
        run: Callable[[argparse.Namespace], int] = args.run
        return run(args)
    except BrokenPipeError:
        # The reader went away (`kda-tp plan ... | head`): stop quietly, as other CLIs do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except ShardInterrupted as e:
        done = ", ".join(map(str, e.completed)) or "none"
        lines = [f"kda-tp: interrupted; removed this run's partial rank directories; "
                 f"ranks completed by this run: {done}"]
        # `demo` shards too, into a directory of its own: no command to finish it.
        finish = None
        if e.remaining and args.run in (_cmd_shard, _run_shard):
            finish = _finish_command(args, e.remaining)
        if finish:
            lines.append(f"kda-tp: to finish, run: {finish}")
        elif not e.remaining:
            lines.append(f"kda-tp: every rank of {e.tp_size} is complete in {e.out_dir}")
        print("\n".join(lines), file=sys.stderr)
        _emit_json(args, {"ok": False, "interrupted": True, "tp_size": e.tp_size,
                          "completed": list(e.completed), "remaining": list(e.remaining),
                          "finish": finish})
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        print("kda-tp: interrupted", file=sys.stderr)
        _emit_json(args, {"ok": False, "interrupted": True})
        return EXIT_INTERRUPTED
    except KdaTpError as e:
        message = _with_hints(args, e)
        print(f"kda-tp: error: {type(e).__name__}: {message}", file=sys.stderr)
        _emit_json(args, {"ok": False, "error": {"type": type(e).__name__, "message": message}})
        return 2


def _rank_message(rank: int, tp_size: int) -> str:
    """The refusal of a rank outside ``0..tp_size-1``, with the range and the fix."""
    return (f"rank {rank} is out of range for --tp-size {tp_size}: valid ranks are "
            f"0..{tp_size - 1}; pass one of them, or the --tp-size the rank belongs to")


def _emit_json(args: argparse.Namespace, document: dict[str, Any]) -> None:
    """Print ``document`` as the command's one JSON document, when ``--json`` was given."""
    if getattr(args, "json", False):
        print(json.dumps(document, indent=2))


class _Parser(argparse.ArgumentParser):
    """argparse with kda-tp's refusals: one ``kda-tp: error:`` line after the usage of the
    (sub)command that refused; no abbreviated flags (``--tp`` is not ``--tp-size``); a misspelt
    or abbreviated flag (also with one dash, ``-tp``) or command (``shrad``) named with the
    closest real one; a bare ``kda-tp`` lists the commands."""

    #: The subcommand names, in the order ``_parser`` adds them (set on the top parser).
    commands: list[str] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # A flag's abbreviation would silently change meaning the day a longer flag is added.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        command = self.prog.removeprefix("kda-tp").strip()
        self.exit(2, f"kda-tp: error: {command + ': ' if command else ''}{message}\n")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        given = list(sys.argv[1:] if args is None else args)
        if self.prog != "kda-tp":
            # A subcommand: its own unknown flags are its own error (with its usage), and are
            # named before any "required" complaint they may cause.
            self._refuse_unknown(given)
            parsed, extras = super().parse_known_args(given, namespace)
            if extras:
                self.error(f"unrecognized arguments: {' '.join(extras)}")
            return parsed, extras
        self._refuse_bad_command(given)
        return super().parse_known_args(given, namespace)

    def _refuse_bad_command(self, given: list[str]) -> None:
        """A bare ``kda-tp`` (the help, then the refusal naming the commands, exit 2) or an
        unknown command (the closest one suggested)."""
        commands = self.commands
        command = next((t for t in given if not t.startswith("-")), None)
        self._refuse_unknown(given if command is None else given[:given.index(command)])
        if command is None:
            if not any(t in ("-h", "--help", "--version") for t in given):
                self.print_help(sys.stderr)
                self.exit(2, f"kda-tp: error: a command is required: {', '.join(commands)} "
                             "(kda-tp COMMAND --help says more)\n")
            return
        if command not in commands:
            close = difflib.get_close_matches(command, commands, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else f"choose from {', '.join(commands)}"
            self.error(f"unknown command {command!r}; {hint}")

    def _refuse_unknown(self, given: list[str]) -> None:
        known = [o for o in self._option_string_actions if o.startswith("--")]
        for token in given:
            if token == "--":
                return
            flag = token.split("=", 1)[0]
            if flag in self._option_string_actions or _is_value(token):
                continue
            # `-tp` (one dash, as some other tools spell long flags) is looked up as `--tp`.
            wanted = flag if flag.startswith("--") else "-" + flag
            close = ([k for k in known if k.startswith(wanted)]
                     or difflib.get_close_matches(wanted, known, n=1, cutoff=0.6))
            hint = f"; did you mean {close[0]}?" if close else f" (see {self.prog} --help)"
            self.error(f"unrecognized argument {flag}{hint}")


def _is_value(token: str) -> bool:
    """Whether a command-line token is not a flag: it does not start with ``-``, or it is a
    number (``--rank -1`` is argparse's to refuse, as a value)."""
    if not token.startswith("-"):
        return True
    try:
        float(token)
    except ValueError:
        return token == "-"
    return True


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kda-tp",
        description="Split KDA (Kimi Delta Attention) weights across tensor-parallel ranks.",
    )
    parser.add_argument("--version", action="version", version=f"kda-tp {__version__}")
    sub = parser.add_subparsers(required=True, metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("plan", help="print the shard table for one rank")
    p.add_argument("input", type=Path, help="checkpoint directory or config.json")
    p.add_argument("--tp-size", type=_tp_size, required=True, help="tensor-parallel world size")
    p.add_argument("--rank", type=_rank, default=0, help="rank whose offsets to show (default 0)")
    p.add_argument("--gate-rank", type=int, help="gate bottleneck width (bare config only)")
    p.add_argument("--layers", type=_int_list, help="0-based KDA layers to count and take the "
                   "shapes from (default: every KDA layer the config lists)")
    _add_qk_multiple(p)
    _add_json(p, "the plan table")
    p.set_defaults(run=_cmd_plan)

    p = sub.add_parser("shard", help="write one checkpoint directory per rank")
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--tp-size", type=_tp_size, required=True, help="tensor-parallel world size")
    p.add_argument("--out", type=_nonempty_path, required=True, help="output directory (OUT/rank{r}/)")
    p.add_argument("--ranks", type=_int_list, help="comma-separated ranks (default: all)")
    p.add_argument("--layers", type=_int_list, help="only for a config that does not list its "
                   "KDA layers: their 0-based indices (every KDA layer is always sliced)")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty output")
    p.add_argument("--backend", choices=["mmap", "pread"], help="input read path")
    p.add_argument("--allow-resharding", action="store_true",
                   help="accept an input that is already a kda-tp rank directory")
    p.add_argument("--skip-unindexed", action="store_true",
                   help="shard although the directory has .safetensors files its index does not "
                   "name (they are left out of every rank)")
    p.add_argument("--kda-only", action="store_true",
                   help="write only the sliced KDA tensors (an overlay on the input checkpoint)")
    p.add_argument("--wait", action="store_true",
                   help="when another kda-tp shard is writing some of these ranks into --out, "
                   "wait for it to finish instead of refusing")
    _add_quiet(p)
    _add_qk_multiple(p)
    _add_json(p, "what was written")
    p.set_defaults(run=_run_shard)

    p = sub.add_parser("verify", help="check a shard output against its input")
    p.add_argument("checkpoint", type=Path)
    p.add_argument("out", type=Path, help="the directory given to `shard --out`")
    _add_numeric(p)
    p.add_argument("--layers", type=_int_list, help="with --numeric: the 0-based KDA layers to "
                   "check numerically (default: all; the byte check covers every tensor)")
    _add_quiet(p)
    _add_json(p, "what was checked and the verdict")
    p.set_defaults(run=_run_verify)

    p = sub.add_parser("audit", help="check the KDA weights a serving engine loaded, rank by "
                       "rank (a save_sharded_state dump or a state_dict file)")
    p.add_argument("checkpoint", type=Path, help="the checkpoint the engine loaded")
    p.add_argument("path", type=Path, help="a save_sharded_state directory "
                   "(model-rank-{r}-part-{p}.safetensors, model-pp-{pp}-tp-{r}-part-{p}"
                   ".safetensors; every rank must be there), or one rank's .safetensors file")
    p.add_argument("--tp-size", type=_tp_size, help="the engine's tensor-parallel world size "
                   "(default: the one the dump tells: its tp_size metadata, else the highest "
                   "rank in its file names + 1)")
    p.add_argument("--rank", type=_rank, help="the rank of a single file (default: from its name, "
                   "else its tp_rank metadata); with a directory, audit only this rank")
    p.add_argument("--engine", help="the engine layout to audit against (default: recognised "
                   "from the parameter names)")
    _add_model_dtype(p)
    _add_quiet(p)
    _add_json(p, "every KDA parameter's verdict")
    p.set_defaults(run=_cmd_audit)

    p = sub.add_parser("dump", help="write the KDA parameters an engine's ranks must hold, as "
                       "its save_sharded_state would (model-rank-{r}-part-0.safetensors)")
    p.add_argument("checkpoint", type=Path)
    _add_engine_output(p)
    p.add_argument("--out", type=_nonempty_path, required=True, help="output directory")
    p.add_argument("--force", action="store_true",
                   help="replace dump files of these ranks already in the output directory, "
                   "and remove another world size's")
    _add_json(p, "what was written")
    p.set_defaults(run=_cmd_dump)

    p = sub.add_parser("digests", help="print the SHA-256 of every rank's expected KDA "
                       "parameters, keyed as vLLM's weight checksums (dp0:pp0:pcp0:tp{r}:name)")
    p.add_argument("checkpoint", type=Path)
    _add_engine_output(p)
    _add_json(p, "the digests (under checksums, as vLLM's /weight_checker returns them)")
    p.set_defaults(run=_cmd_digests)

    p = sub.add_parser("demo", help="plan, shard and verify a generated real-geometry checkpoint")
    p.add_argument("--tp-size", type=_tp_size, default=4, help="world size (default 4)")
    p.add_argument("--model", choices=[family.demo for family in FAMILIES.values()],
                   default="kimi-linear")
    p.add_argument("--num-layers", type=_demo_layers,
                   help="decoder layers to generate, 1 to 64 (default 4; kimi-k3: 2, one KDA "
                   "layer of 0.89 GB and one MLA layer)")
    p.add_argument("--keep", type=Path, help="write DIR/checkpoint and DIR/tp{N} here instead of a temporary directory (a new or empty DIR, or one an earlier demo made: what it wrote there is replaced)")
    _add_numeric(p, default_on=True)
    p.set_defaults(run=_cmd_demo)
    parser.commands = list(sub.choices)
    return parser


def _add_engine_output(p: argparse.ArgumentParser) -> None:
    """``dump``'s and ``digests``' flags: the engine layout, world size, ranks and dtype."""
    p.add_argument("--engine", required=True, help="the engine layout (kda_tp.engines.LAYOUTS, "
                   "e.g. vllm-0.33-kimi-linear; docs/engine-layouts.md)")
    p.add_argument("--tp-size", type=int, required=True, help="tensor-parallel world size")
    p.add_argument("--ranks", type=_int_list, help="comma-separated ranks (default: all)")
    _add_model_dtype(p)


def _add_model_dtype(p: argparse.ArgumentParser) -> None:
    """``audit``'s, ``dump``'s and ``digests``' ``--dtype``: the engine's model dtype."""
    p.add_argument("--dtype", type=_model_dtype, choices=["BF16", "F16", "F32"],
                   help="the engine's model dtype (its --dtype: bfloat16, float16, float32) "
                   "for the parameters it casts to it (default: the engine's auto dtype for "
                   "the checkpoint's config: its dtype/torch_dtype; an F32 or dtype-less "
                   "config runs in BF16 under vLLM, F16 under SGLang)")


def _nonempty_path(text: str) -> Path:
    """A path, refusing the empty one (``Path("")`` is the current directory)."""
    if not text:
        raise argparse.ArgumentTypeError("empty path; pass a directory ('.' for the current one)")
    return Path(text)


def _model_dtype(text: str) -> str:
    """A model dtype as safetensors names it (``bfloat16`` -> ``BF16``)."""
    names = {"bfloat16": "BF16", "float16": "F16", "half": "F16", "float32": "F32",
             "float": "F32"}
    return names.get(text.lower(), text.upper())


def _add_qk_multiple(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--qk-multiple",
        type=int,
        default=256,
        help="local q|k width must be a multiple of this (default 256; 1 = off)",
    )


def _add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true",
                   help="no progress (a bar on a terminal, else a line every few seconds)")


def _add_json(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--json", action="store_true",
                   help=f"print {what} as one JSON document on stdout")


def _add_numeric(p: argparse.ArgumentParser, default_on: bool = False) -> None:
    if default_on:
        p.add_argument("--no-numeric", dest="numeric", action="store_false",
                       help="skip the numerical TP equivalence check")
    else:
        p.add_argument("--numeric", action="store_true",
                       help="also check numerically that the ranks' partial outputs sum to "
                       "the full layer's output")
    p.add_argument("--seq-len", type=_seq_len, default=16, help="tokens for --numeric (default 16)")
    p.add_argument("--seed", type=_seed, default=0, help="input seed for --numeric")


#: The largest --tp-size: a world size divides the KDA head count, which kda_tp reads as an
#: integer below 2**31 (kda_tp.config); a larger one cannot be valid for any checkpoint.
MAX_TP_SIZE = 2**31 - 1
#: The largest --seq-len of the numeric check (tokens): its activations grow with it.
MAX_SEQ_LEN = 2**20


def _bounded_int(text: str, low: int, high: int, what: str) -> int:
    """``text`` as an integer in ``[low, high]``, or an argparse error saying which."""
    digits = text.strip().removeprefix("-").removeprefix("+")
    if not digits.isascii() or not digits.isdigit() or len(digits) > 32:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text[:40]!r}")
    value = int(text)
    if value < low:
        raise argparse.ArgumentTypeError(
            f"must be {'a positive integer' if low == 1 else f'an integer >= {low}'}, got {value}"
        )
    if value > high:
        raise argparse.ArgumentTypeError(f"{value} is more than {high}: {what}")
    return value


def _tp_size(text: str) -> int:
    return _bounded_int(text, 1, MAX_TP_SIZE, "a world size divides the KDA head count, which is "
                        "below 2**31")


def _demo_layers(text: str) -> int:
    from .outdir import DEMO_MAX_LAYERS

    return _bounded_int(text, 1, DEMO_MAX_LAYERS, "the demo stays small (kda_tp.outdir."
                        "DEMO_MAX_LAYERS); shard a checkpoint of your own for more")


def _rank(text: str) -> int:
    return _bounded_int(text, 0, MAX_TP_SIZE - 1, "a rank is below --tp-size")


def _seq_len(text: str) -> int:
    return _bounded_int(text, 1, MAX_SEQ_LEN, f"--seq-len is at most {MAX_SEQ_LEN} tokens")


def _seed(text: str) -> int:
    return _bounded_int(text, 0, 2**32 - 1, "a seed is below 2**32")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _cmd_plan(args: argparse.Namespace) -> int:
    from .checkpoint import refuse_index_member
    from .description import CheckpointDescription, describe
    from .layers import check_layers, config_layer_count
    from .plan import KdaTpPlan, assumed_layout
    from .source import SafetensorsSource, kda_tensor_name, scale_tensor_name

    # `demo` calls this with a namespace that has no --layers or --json.
    requested, as_json = getattr(args, "layers", None), getattr(args, "json", False)
    refuse_index_member(args.input)
    source: SafetensorsSource | None = None
    layers: tuple[int, ...] | None = None
    # The checkpoint (or config) is read once: its description (kda_tp.description).
    if args.input.is_dir() and any(args.input.glob("*.safetensors")):
        source = SafetensorsSource(args.input)
        description = describe(source)
        layers = _selected_layers(source, requested)
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
        print(json.dumps({"ok": True, **plan_json(plan, shapes, layers, kda)}, indent=2))
    else:
        print(format_plan(plan, shapes, n_layers))
        print(kda.describe_gate())
        if source is None:
            print(f"(from the config alone: on-disk shapes and dtypes are assumed, {family} "
                  "defaults; pass the checkpoint directory to read its own, e.g. Kimi K3's "
                  "padded A_log and F32 convs)")
    return 0


def _config_location(path: Path) -> Path:
    """What :func:`~kda_tp.config.load_config` reads for a ``plan``/``verify`` input: the
    directory of a ``.safetensors`` file, else the path itself (a directory or a config)."""
    return path.parent if path.is_file() and path.suffix == ".safetensors" else path


def _disk_shape(source: SafetensorsSource, name: str, layer: int) -> tuple[int, ...]:
    """The on-disk shape of tensor ``name`` of KDA layer ``layer``.

    Raises:
        CheckpointError: the checkpoint has no tensor ``name``.
    """
    info = source.info(name)
    if info is None:
        raise CheckpointError(f"{source.root}: KDA layer {layer} lacks {name}")
    return info[1]


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
    ``"generic"``: ``kda_tp.config``). ``shapes`` as for :func:`format_plan`. ``kda-tp plan
    --json`` adds ``"ok": true`` (``false`` with ``error`` on a refusal).
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


def _selected_layers(source: SafetensorsSource, requested: list[int] | None) -> tuple[int, ...]:
    """The KDA layers to show or check: ``requested`` (``--layers``, a subset of the config's
    KDA layers, or of the layers holding KDA tensors when the config does not list them), else
    every KDA layer the config lists."""
    from .layers import check_layers, layer_count, layers_with_kda_tensors
    from .source import kda_layer_indices

    try:
        listed = kda_layer_indices(source, None)
    except CheckpointError:
        if requested is None:
            raise
        return check_layers(requested, layers_with_kda_tensors(source) or None,
                            layer_count(source))
    if requested is None:
        return listed
    return check_layers(requested, listed, layer_count(source))


def _shard_layers(source: SafetensorsSource, requested: list[int] | None) -> list[int] | None:
    """``shard --layers``: the KDA layers of a config that does not list them (returned, for
    ``shard_checkpoint``); with a config that lists them only that same list is accepted
    (None is returned: the config's list is used), since every KDA layer is always sliced.

    Raises:
        PlanError: see :func:`~kda_tp.layers.check_layers`, or a list that is not the config's.
    """
    from .layers import check_layers, layer_count, layers_with_kda_tensors
    from .source import kda_layer_indices

    if requested is None:
        return None
    try:
        listed = kda_layer_indices(source, None)
    except CheckpointError:
        return list(check_layers(requested, layers_with_kda_tensors(source) or None,
                                 layer_count(source)))
    chosen = check_layers(requested, listed, layer_count(source))
    if chosen != tuple(listed):
        raise PlanError(
            f"--layers {','.join(map(str, chosen))}: shard slices every KDA layer the config "
            f"lists ({','.join(map(str, listed))}); --layers is only for a config that does not "
            "list them (to check or show some layers: verify --numeric --layers, plan --layers)"
        )
    return None


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
        f"per KDA layer: {_bytes(plan.local_bytes)} per rank of {_bytes(plan.full_bytes)} "
        f"({share:.1%})",
    ]
    if n_layers:
        lines.append(
            f"{n_layers} KDA layer{'s' if n_layers != 1 else ''}: "
            f"{_bytes(n_layers * plan.local_bytes)} per rank of "
            f"{_bytes(n_layers * plan.full_bytes)}"
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


def _progress(
    quiet: bool, what: str = "shard", unit: str = "B", every: float = 2.0
) -> Callable[[int], Callable[[int], None]] | None:
    """A progress factory for ``shard_checkpoint``/``verify_shards``: ``None`` when ``quiet``;
    a tqdm bar on a terminal; else plain lines on stderr (see :class:`_ProgressLines`), at
    most one every ``every`` seconds (0: one per step and one at the start).
    ``unit`` is ``"B"`` (bytes) or a count's unit (``"tensors"``, ``"KDA layers"``)."""
    if quiet:
        return None
    if not sys.stderr.isatty():
        return lambda total: _ProgressLines(what, total, unit, every)
    from tqdm import tqdm

    def start(total: int) -> Callable[[int], None]:
        bar = tqdm(total=total, unit=unit, unit_scale=unit == "B", desc=what, file=sys.stderr)
        def advance(n: int) -> None:
            bar.update(n)
            if bar.n >= total:
                bar.close()
        return advance

    return start


class _ProgressLines:
    """Progress for logs and pipes: a line on stderr at most every ``every`` seconds and one
    when ``total`` is reached, e.g. ``shard: 0.61 of 1.12 GB (54%), 2.0 s``. Thread-safe (the
    shard writers call it from several threads)."""

    def __init__(self, what: str, total: int, unit: str, every: float = 2.0) -> None:
        self.what, self.total, self.unit, self.every = what, total, unit, every
        self.done = 0
        self.start = self.last = time.monotonic()
        self.lock = threading.Lock()
        if every == 0:
            # Steps are slow (a Kimi K3 layer takes tens of seconds): say what starts now.
            self._print(self.start)

    def _print(self, now: float) -> None:
        if self.unit == "B":
            amount = f"{_in_unit(self.done, self.total).split()[0]} of {_bytes(self.total)}"
        else:
            amount = f"{self.done:,} of {self.total:,} {self.unit}"
        share = self.done / self.total if self.total else 1.0
        print(f"{self.what}: {amount} ({share:.0%}), {now - self.start:.1f} s",
              file=sys.stderr, flush=True)

    def __call__(self, n: int) -> None:
        with self.lock:
            self.done += n
            now = time.monotonic()
            if self.done < self.total and now - self.last < self.every:
                return
            self.last = now
            self._print(now)


def _shard_input(
    args: argparse.Namespace, warn: bool = True
) -> tuple[list[int] | None, list[Path]]:
    """``shard``'s checks of its input before anything is written: the ``--layers`` to pass on
    (see :func:`_shard_layers`) and the files ``--skip-unindexed`` leaves out (a warning each
    on stderr when ``warn``)."""
    from .checkpoint import INDEX_NAME, refuse_index_member
    from .shard import unindexed_files
    from .source import SafetensorsSource

    refuse_index_member(args.checkpoint)
    source = SafetensorsSource(args.checkpoint, args.backend)
    layers = _shard_layers(source, args.layers)
    skipped = unindexed_files(source) if args.skip_unindexed else []
    for path in skipped if warn else ():
        print(f"kda-tp: warning: {path} is not named by {INDEX_NAME}; it is left out of every "
              "rank (--skip-unindexed)", file=sys.stderr)
    return layers, skipped


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


def format_sizes(sizes: ShardSizes) -> str:
    """What ``shard`` will write, e.g. ``shard: writing 4.60 GB of tensors for 8 ranks (0.58 GB
    per rank: 0.11 GB of KDA slices, 0.46 GB of other tensors) from a 1.30 GB input``, and a
    second line suggesting ``--kda-only`` when the other tensors, copied whole into every rank,
    outweigh the KDA slices."""
    per_rank = sorted(set(sizes.rank_bytes))
    each = _bytes(per_rank[0]) if len(per_rank) == 1 else (
        f"{_bytes(per_rank[0])} to {_bytes(per_rank[-1])}")
    n = len(sizes.ranks)
    line = (
        f"shard: writing {_bytes(sizes.total_bytes)} of tensors for {n} rank{'s' * (n != 1)} "
        f"({each} per rank: {_bytes(sum(sizes.kda_bytes) // n)} of KDA slices, "
        f"{_bytes(sum(sizes.other_bytes) // n)} of other tensors) from a "
        f"{_bytes(sizes.input_bytes)} input"
    )
    if sizes.suggest_kda_only:
        line += (
            f"\nshard: hint: {_bytes(sum(sizes.other_bytes))} of it is non-KDA tensors copied "
            f"whole into every rank; --kda-only writes only the KDA slices "
            f"({_bytes(sum(sizes.kda_bytes))}), an overlay on the input checkpoint"
        )
    return line


def _bytes(n: int) -> str:
    """``n`` bytes in decimal units, 3 significant digits: ``512 B``, ``12.3 kB``, ``4.60 GB``.
    Every size the command line prints is in these units (kB = 10^3 bytes, MB = 10^6, GB =
    10^9), the unit of the writer's and verifier's GB figures and of tqdm's byte counts."""
    return _in_unit(n, n)


def _in_unit(n: float, size: int) -> str:
    """``n`` bytes in the unit and with the decimals :func:`_bytes` writes ``size`` in (a
    progress count and a rate in the unit of the total they go with)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            x = size / scale
            digits = 2 if x < 10 else 1 if x < 100 else 0
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n:.0f} B"


def _print_shard(
    args: argparse.Namespace,
    result: ShardResult,
    skipped: Sequence[Path],
    processes: int = 1,
    sizes: Sequence[ShardSizes] = (),
) -> None:
    """What ``shard`` wrote: the JSON document with ``--json``, else one line."""
    from .shard import rank_dir

    if args.json:
        _emit_json(args, {
            "ok": True, "out_dir": str(result.out_dir), "tp_size": result.tp_size,
            "ranks": list(result.ranks),
            "rank_dirs": [str(rank_dir(result.out_dir, r)) for r in result.ranks],
            "bytes_written": result.bytes_written, "seconds": result.seconds,
            "skipped_unindexed": [str(p) for p in skipped], "processes": processes,
            "sizes": sizes[0].to_dict() if sizes else None,
        })
    elif processes > 1:
        print(f"{_written_line(result)}; {processes} torchrun processes")
    else:
        print(_written_line(result))


def _cmd_shard(args: argparse.Namespace) -> int:
    from .shard import shard_checkpoint

    layers, skipped = _shard_input(args)
    sizes: list[ShardSizes] = []
    result = shard_checkpoint(
        args.checkpoint,
        args.out,
        args.tp_size,
        ranks=args.ranks,
        layers=layers,
        qk_multiple=args.qk_multiple,
        force=args.force,
        backend=args.backend,
        progress=_progress(args.quiet),
        allow_resharding=args.allow_resharding,
        skip_unindexed=args.skip_unindexed,
        kda_only=args.kda_only,
        wait=args.wait,
        report_sizes=_size_reporter(args, sizes),
    )
    _print_shard(args, result, skipped, sizes=sizes)
    return 0


def _finish_command(args: argparse.Namespace, ranks: Sequence[int]) -> str:
    """The ``kda-tp shard`` command that writes ``ranks`` with this run's other options."""
    from .shard import finish_command

    command = finish_command(args.checkpoint, args.out, args.tp_size, ranks, args.qk_multiple)
    if args.layers is not None:
        command += f" --layers {','.join(map(str, args.layers))}"
    for flag in ("allow_resharding", "skip_unindexed"):
        if getattr(args, flag):
            command += " --" + flag.replace("_", "-")
    if args.backend:
        command += f" --backend {args.backend}"
    return command


def _with_hints(args: argparse.Namespace, error: KdaTpError) -> str:
    """``error``'s message in command-line terms: flags instead of keyword arguments, and a
    plan refusal lists the TP sizes this model allows when the requested one is not among
    them (from the refusal's attributes: ``PlanError.allowed_tp_sizes``, ``head_divisors``)."""
    message = str(error).replace("pass layers=[...] (0-based)", "pass --layers (0-based)")
    if not isinstance(error, PlanError):
        return message
    if error.tp_rank is not None and error.tp_size is not None:
        message += f": {_rank_message(error.tp_rank, error.tp_size)}"
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


def _print_verify(report: VerifyReport) -> None:
    # One problem is the summary line itself; several are listed above a count.
    for problem in report.problems[:20] if len(report.problems) > 1 else ():
        print(f"  {problem}")
    if len(report.problems) > 20:
        print(f"  ... and {len(report.problems) - 20} more")
    if report.numeric is not None:
        print(report.numeric.format())
    print(report.summary())


def _cmd_verify(args: argparse.Namespace) -> int:
    from .checkpoint import INDEX_NAME, refuse_index_member
    from .shard import unindexed_files, verify_shards
    from .source import SafetensorsSource

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
                           progress=_progress(args.quiet, "verify", "tensors"),
                           numeric_progress=_progress(args.quiet, "verify --numeric",
                                                      "KDA layers", every=0.0))
    if args.json:
        _emit_json(args, verify_json(report, unindexed))
    else:
        _print_verify(report)
    return 0 if report.ok else 1


def verify_json(report: VerifyReport, unindexed: Sequence[Path] = ()) -> dict[str, Any]:
    """``report`` as a JSON-ready dict (what ``kda-tp verify --json`` prints).

    Keys: ``ok`` (the verdict), ``tp_size``, ``tensors`` and ``bytes_checked`` (input tensor
    bytes), ``problems`` (one string each), ``numeric`` (None when not run, else ``passed``,
    ``seq_len``, ``seed``, ``atol``, ``rtol`` and ``layers``: per layer ``layer``,
    ``max_abs_error``, ``max_rel_error`` (None when infinite), ``y_abs_max``, ``tolerance``,
    ``passed``, ``non_finite``: ``"full"`` when the full weights' reference output holds NaN
    or inf, ``"ranks"`` when only the ranks' summed output does, else None), ``unindexed``
    (input files the index does not name, unchecked),
    ``byte_seconds`` and ``numeric_seconds`` (each phase's wall time; 0 when not run).
    """
    numeric = None
    if report.numeric is not None:
        n = report.numeric
        numeric = {
            "passed": n.passed, "seq_len": n.seq_len, "seed": n.seed, "atol": n.atol,
            "rtol": n.rtol,
            "layers": [
                {"layer": e.layer, "max_abs_error": _finite(e.max_abs_error),
                 "max_rel_error": _finite(e.max_rel_error), "y_abs_max": _finite(e.y_abs_max),
                 "tolerance": _finite(e.tolerance), "passed": e.passed,
                 "non_finite": e.non_finite}
                for e in n.layers
            ],
        }
    return {
        "ok": report.ok, "tp_size": report.tp_size, "tensors": report.tensors,
        "bytes_checked": report.bytes_checked, "problems": list(report.problems),
        "numeric": numeric, "unindexed": [str(p) for p in unindexed],
        "byte_seconds": report.byte_seconds, "numeric_seconds": report.numeric_seconds,
    }


def _finite(x: float) -> float | None:
    """``x``, or None for NaN and infinities (which JSON cannot hold)."""
    return x if math.isfinite(x) else None


def _written_line(result: ShardResult) -> str:
    rate = result.bytes_written / result.seconds if result.seconds else 0.0
    return (  # one unit, the one the "writing" line and the progress use (_bytes)
        f"wrote ranks {list(result.ranks)} of {result.tp_size} to {result.out_dir}: "
        f"{_bytes(result.bytes_written)} of tensors in {result.seconds:.2f} s "
        f"({_in_unit(rate, result.bytes_written)}/s written)"
    )


def _cmd_audit(args: argparse.Namespace) -> int:
    from .engine_audit import audit_path

    report = audit_path(args.checkpoint, args.path, tp_size=args.tp_size, rank=args.rank,
                        engine=args.engine, model_dtype=args.dtype,
                        progress=_progress(args.quiet, "audit", "parameters"))
    if args.json:
        _emit_json(args, report.to_dict())
    else:
        print(report.format())
    return 0 if report.passed else 1


def _cmd_dump(args: argparse.Namespace) -> int:
    from .engine_dump import write_engine_dump

    result = write_engine_dump(args.checkpoint, args.out, engine=args.engine,
                               tp_size=args.tp_size, ranks=args.ranks, model_dtype=args.dtype,
                               force=args.force)
    if args.json:
        _emit_json(args, result.to_dict())
    else:
        print(f"wrote {result.params} KDA parameters of ranks {list(result.ranks)} of "
              f"{result.tp_size} ({result.engine}, {result.bytes_written / 1e9:.3f} GB) to "
              f"{result.out_dir} in {result.seconds:.2f} s; check it with: kda-tp audit "
              f"{args.checkpoint} {result.out_dir} --tp-size {result.tp_size}"
              + ("" if args.dtype is None else f" --dtype {args.dtype}")
              + ("" if args.ranks is None else f" --rank R (R in {list(result.ranks)})"))
    return 0


def _cmd_digests(args: argparse.Namespace) -> int:
    from .engine_dump import engine_digests

    digests = engine_digests(args.checkpoint, engine=args.engine, tp_size=args.tp_size,
                             ranks=args.ranks, model_dtype=args.dtype)
    if args.json:
        ranks = sorted(range(args.tp_size) if args.ranks is None else args.ranks)
        _emit_json(args, {"ok": True, "engine": args.engine, "tp_size": args.tp_size,
                          "ranks": ranks, "checksums": digests})
    else:
        for key, digest in digests.items():
            print(f"{digest}  {key}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    import tempfile

    from .outdir import DEMO_STAGING_PREFIX, claim_demo_dir, replace_demo_dir
    from .plan import KdaTpPlan
    from .shard import shard_checkpoint, verify_shards
    from .source import SafetensorsSource, kda_layer_indices
    from .synth import GEOMETRIES, write_checkpoint

    g = GEOMETRIES[args.model]
    if args.num_layers is None:
        args.num_layers = 2 if g["style"] == "k3" else 4
    # Refuse a tp_size the model cannot split before generating anything.
    KdaTpPlan(0, args.tp_size, g["hidden"], g["head_dim"], g["heads"], g["conv_kernel"],
              g["gate_rank"])
    entries = ["checkpoint", f"tp{args.tp_size}"]
    if args.keep:  # refuses a DIR holding what kda-tp did not write, changing nothing
        claim_demo_dir(args.keep, entries)
    # With --keep, built in DIR/.kda-tp-demo-*, then swapped in (replace_demo_dir).
    prefix = DEMO_STAGING_PREFIX if args.keep else "kda-tp-demo-"
    with tempfile.TemporaryDirectory(prefix=prefix, dir=args.keep) as tmp:
        base = Path(tmp)
        checkpoint, out = base / entries[0], base / entries[1]
        t0 = time.perf_counter()
        write_checkpoint(checkpoint, args.model, args.num_layers)
        size = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))
        print(f"generated a {args.num_layers}-layer {args.model} checkpoint "
              f"({size / 1e9:.3f} GB) in {time.perf_counter() - t0:.1f} s: "
              f"{(args.keep or base) / checkpoint.name}"
              + ("" if args.keep else " (deleted on exit; --keep DIR keeps it)"))
        kda = set(kda_layer_indices(SafetensorsSource(checkpoint), None))
        mla = [i for i in range(args.num_layers) if i not in kda]
        if mla:
            print(f"layers {mla} (0-based) are full attention (MLA): passed through unsliced")
        print()
        status = _cmd_plan(argparse.Namespace(input=checkpoint, rank=0, tp_size=args.tp_size,
                                              gate_rank=None, qk_multiple=256))
        print()
        result = shard_checkpoint(checkpoint, out, args.tp_size, progress=_progress(False))
        if args.keep:
            replace_demo_dir(args.keep, base, entries)
            checkpoint, out = args.keep / entries[0], args.keep / entries[1]
        print(f"shard: {_written_line(dataclasses.replace(result, out_dir=out))}")
        report = verify_shards(checkpoint, out, numeric=args.numeric, seq_len=args.seq_len,
                               seed=args.seed, numeric_progress=_progress(
                                   False, "verify --numeric", "KDA layers", every=0.0))
        _print_verify(report)
        return status if report.ok else 1


def _run_shard(args: argparse.Namespace) -> int:
    """``shard``; under torchrun with several processes, the ranks are split over them
    (:mod:`kda_tp.torchrun`), and process 0 alone prints."""
    from .torchrun import torchrun_job, torchrun_processes

    if torchrun_processes() == 1:
        return _cmd_shard(args)
    with torchrun_job() as job:
        try:
            # Every process checks its input the same way; process 0 alone says so.
            layers, skipped = _shard_input(args, warn=job.speaks)
            sizes: list[ShardSizes] = []
            result = job.shard(
                args.checkpoint,
                args.out,
                args.tp_size,
                ranks=args.ranks,
                layers=layers,
                qk_multiple=args.qk_multiple,
                force=args.force,
                backend=args.backend,
                progress=_progress(args.quiet),
                allow_resharding=args.allow_resharding,
                skip_unindexed=args.skip_unindexed,
                kda_only=args.kda_only,
                wait=args.wait,
                report_sizes=_size_reporter(args, sizes),
            )
        except KdaTpError as e:
            if job.speaks:
                message = _with_hints(args, e)
                print(f"kda-tp: error: {type(e).__name__}: {message}", file=sys.stderr)
                _emit_json(args, {"ok": False,
                                  "error": {"type": type(e).__name__, "message": message}})
            return 2
        if job.speaks:
            _print_shard(args, result, skipped, job.processes, sizes)
        return 0


def _run_verify(args: argparse.Namespace) -> int:
    """``verify``; under torchrun with several processes, process 0 checks the bytes and
    ``--numeric`` spreads the ranks' forwards over the processes with a real all-reduce
    (:mod:`kda_tp.torchrun`); process 0 alone prints, every process exits the same."""
    from .torchrun import torchrun_job, torchrun_processes

    if torchrun_processes() == 1:
        return _cmd_verify(args)
    with torchrun_job() as job:
        outcome = job.verify(args.checkpoint, args.out, numeric=args.numeric,
                             seq_len=args.seq_len, seed=args.seed)
        if outcome.error is not None:
            print(f"kda-tp: error: {type(outcome.error).__name__}: {outcome.error}",
                  file=sys.stderr)
        elif outcome.report is not None:
            _print_verify(outcome.report)
        return 2 if outcome.refused else 0 if outcome.passed else 1
