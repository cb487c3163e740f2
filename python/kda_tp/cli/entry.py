"""The ``kda-tp`` command line (also ``python -m kda_tp``).

Subcommands: ``plan`` (the shard table), ``shard`` (write one checkpoint per rank), ``verify``
(rejoin the ranks and compare with the input), ``demo`` (all three on a generated checkpoint of
a real model's geometry), ``audit`` (check the KDA weights a serving engine loaded), ``dump``
and ``digests`` (what an engine's ranks must hold, as files or as vLLM's checksums). Exit status:
0 success, 1 verification or audit failed, 2 refused input, 130 interrupted (Ctrl-C), 141 the
reader of stdout went away (``kda-tp demo | head -1``).
``--json`` (plan, shard, verify, audit, dump, digests) prints one JSON document on stdout
instead of the text; progress and errors go to stderr.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from .._native import __version__
from ..errors import KdaTpError, PlanError, ShardInterrupted
from ..model.dtypes import MODEL_DTYPES, SPELLINGS
from ..model.families import FAMILIES
from ..model.json_reader import ascii_int
from ._commands import (
    cmd_audit,
    cmd_demo,
    cmd_digests,
    cmd_dump,
    cmd_plan,
    finish_command_for,
    run_shard,
    run_verify,
)
from ._format import emit_json, error_line, print_refusal, rank_message

__all__ = ["main"]

#: Exit status after Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130
#: Exit status when stdout's reader went away (128 + SIGPIPE), as shells report ``yes | head``.
EXIT_PIPE_CLOSED = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 OK, 1 verification failed, 2 refused
    input or not enough memory for a tensor, 130 interrupted, 141 stdout's reader went away)."""
    args = _parser().parse_args(argv)
    try:
        tp_size, rank = getattr(args, "tp_size", None), getattr(args, "rank", None)
        if isinstance(tp_size, int) and isinstance(rank, int) and rank >= tp_size:
            raise PlanError(rank_message(rank, tp_size))
        # Every subcommand's parser sets `run` to its handler (set_defaults).
        run: Callable[[argparse.Namespace], int] = args.run
        return run(args)
    except BrokenPipeError:
        # The reader went away (`kda-tp plan ... | head`): stop quietly with the status a
        # process killed by SIGPIPE has, as other CLIs do; not 1, which says "verification
        # failed". stdout goes to /dev/null so that the interpreter's flush at exit is quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_PIPE_CLOSED
    except ShardInterrupted as e:
        done = ", ".join(map(str, e.completed)) or "none"
        lines = [f"kda-tp: interrupted; removed this run's partial rank directories; "
                 f"ranks completed by this run: {done}"]
        # `demo` shards too, into a directory of its own: no command to finish it.
        finish = None
        if e.remaining and args.run is run_shard:
            finish = finish_command_for(args, e.remaining)
        if finish:
            lines.append(f"kda-tp: to finish, run: {finish}")
        elif not e.remaining:
            lines.append(f"kda-tp: every rank of {e.tp_size} is complete in {e.out_dir}")
        print("\n".join(lines), file=sys.stderr)
        emit_json(args, {"ok": False, "interrupted": True, "tp_size": e.tp_size,
                          "completed": list(e.completed), "remaining": list(e.remaining),
                          "finish": finish})
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        print("kda-tp: interrupted", file=sys.stderr)
        emit_json(args, {"ok": False, "interrupted": True})
        return EXIT_INTERRUPTED
    except KdaTpError as e:
        print_refusal(args, e)
        return 2
    except MemoryError as e:
        # numpy's "Unable to allocate 1.00 TiB for an array with shape (...)": a tensor or an
        # engine parameter (a declared size, perhaps a hostile one) that cannot be held.
        message = (f"{e or 'out of memory'}; kda-tp holds one tensor or engine parameter in "
                   "memory at a time (and the numeric check the activations of --seq-len "
                   "tokens), and this does not fit in the memory free here")
        print(error_line(f"MemoryError: {message}"), file=sys.stderr)
        emit_json(args, {"ok": False, "error": {"type": "MemoryError", "message": message}})
        return 2


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
        self.exit(2, error_line(f"{command + ': ' if command else ''}{message}") + "\n")

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
                self.exit(2, error_line(f"a command is required: {', '.join(commands)} "
                                        "(kda-tp COMMAND --help says more)") + "\n")
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
    p.add_argument("--gate-rank", type=_gate_rank,
                   help="gate bottleneck width (bare config only)")
    p.add_argument("--layers", type=_int_list, help="0-based KDA layers to count and take the "
                   "shapes from (default: every KDA layer the config lists)")
    _add_qk_multiple(p)
    _add_json(p, "the plan table")
    p.set_defaults(run=cmd_plan)

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
    p.add_argument("--skip-heavy-files", action="store_true",
                   help="shard although the directory holds heavy files beside its safetensors "
                   "files (weights or training state in other formats, e.g. optimizer.pt or "
                   "pytorch_model.bin, or any file of 100 MB or more): they are left out of "
                   "every rank")
    p.add_argument("--kda-only", action="store_true",
                   help="write only the sliced KDA tensors (an overlay on the input checkpoint)")
    p.add_argument("--wait", action="store_true",
                   help="when another kda-tp run is writing some of these ranks, or another "
                   "world size, into --out, wait for it to finish instead of refusing")
    _add_quiet(p)
    _add_qk_multiple(p)
    _add_json(p, "what was written")
    p.set_defaults(run=run_shard)

    p = sub.add_parser("verify", help="check a shard output against its input")
    p.add_argument("checkpoint", type=Path)
    p.add_argument("out", type=Path, help="the directory given to `shard --out`")
    _add_numeric(p)
    p.add_argument("--layers", type=_int_list, help="with --numeric: the 0-based KDA layers to "
                   "check numerically (default: all; the byte check covers every tensor)")
    _add_quiet(p)
    _add_json(p, "what was checked and the verdict")
    p.set_defaults(run=run_verify)

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
    p.set_defaults(run=cmd_audit)

    p = sub.add_parser("dump", help="write the KDA parameters an engine's ranks must hold, as "
                       "its save_sharded_state would (model-rank-{r}-part-0.safetensors)")
    _add_engine_output(p)
    p.add_argument("--out", type=_nonempty_path, required=True, help="output directory")
    p.add_argument("--force", action="store_true",
                   help="replace dump files of these ranks already in the output directory, "
                   "and remove another world size's")
    p.add_argument("--wait", action="store_true",
                   help="when another kda-tp run is writing these ranks, or another world "
                   "size, into --out, wait for it to finish instead of refusing")
    _add_json(p, "what was written")
    p.set_defaults(run=cmd_dump)

    p = sub.add_parser("digests", help="print the SHA-256 of every rank's expected KDA "
                       "parameters, keyed as vLLM's weight checksums (dp0:pp0:pcp0:tp{r}:name)")
    _add_engine_output(p)
    _add_json(p, "the digests (under checksums, as vLLM's /weight_checker returns them)")
    p.set_defaults(run=cmd_digests)

    p = sub.add_parser("demo", help="plan, shard and verify a generated real-geometry checkpoint")
    p.add_argument("--tp-size", type=_tp_size, default=4, help="world size (default 4)")
    p.add_argument("--model", choices=[family.demo for family in FAMILIES.values()],
                   default="kimi-linear")
    p.add_argument("--num-layers", type=_demo_layers,
                   help="decoder layers to generate, 1 to 64 (default 4; kimi-k3: 2, one KDA "
                   "layer of 0.89 GB and one MLA layer)")
    p.add_argument("--keep", type=Path, help="write DIR/checkpoint and DIR/tp{N} here instead "
                   "of a temporary directory (a new DIR, whose parent exists, an empty one, or "
                   "one an earlier demo made: what its mark names is replaced)")
    _add_numeric(p, default_on=True)
    p.set_defaults(run=cmd_demo)
    parser.commands = list(sub.choices)
    return parser


def _add_engine_output(p: argparse.ArgumentParser) -> None:
    """``dump``'s and ``digests``' arguments: the checkpoint, the engine layout, world size,
    ranks and dtype."""
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--engine", required=True, help="the engine layout (kda_tp.engines.LAYOUTS, "
                   "e.g. vllm-0.33-kimi-linear; docs/engine-layouts.md)")
    p.add_argument("--tp-size", type=_tp_size, required=True, help="tensor-parallel world size")
    p.add_argument("--ranks", type=_int_list, help="comma-separated ranks (default: all)")
    _add_model_dtype(p)


def _add_model_dtype(p: argparse.ArgumentParser) -> None:
    """``audit``'s, ``dump``'s and ``digests``' ``--dtype``: the engine's model dtype."""
    p.add_argument("--dtype", type=_model_dtype, choices=MODEL_DTYPES,
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
    return SPELLINGS.get(text.lower(), text.upper())


def _add_qk_multiple(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--qk-multiple",
        type=_qk_multiple,
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
#: integer below 2**31 (kda_tp.model.config); a larger one cannot be valid for any checkpoint.
MAX_TP_SIZE = 2**31 - 1
#: The largest --seq-len of the numeric check (tokens): its activations grow with it.
MAX_SEQ_LEN = 2**20


def _bounded_int(text: str, low: int, high: int, what: str) -> int:
    """``text`` as an integer in ``[low, high]``, or an argparse error saying which."""
    try:
        value = ascii_int(text.strip(), signed=True)
    except OverflowError:
        value = None
    if value is None:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text[:40]!r}")
    if value < low:
        raise argparse.ArgumentTypeError(
            f"must be {'a positive integer' if low == 1 else f'an integer >= {low}'}, got {value}"
        )
    if value > high:
        raise argparse.ArgumentTypeError(f"{value} is more than {high}: {what}")
    return value


def _demo_layers(text: str) -> int:
    from ..output.demo import DEMO_MAX_LAYERS

    return _bounded_int(text, 1, DEMO_MAX_LAYERS, "the demo stays small (kda_tp.output."
                        "DEMO_MAX_LAYERS); shard a checkpoint of your own for more")


def _tp_size(text: str) -> int:
    return _bounded_int(text, 1, MAX_TP_SIZE, "a world size divides the KDA head count, which is "
                        "below 2**31")


def _qk_multiple(text: str) -> int:
    return _bounded_int(text, 1, MAX_TP_SIZE, "a local q|k width is below 2**31 elements")


def _gate_rank(text: str) -> int:
    return _bounded_int(text, 1, MAX_TP_SIZE, "a gate rank is below 2**31, as a config's "
                        "integers are")


def _rank(text: str) -> int:
    return _bounded_int(text, 0, MAX_TP_SIZE - 1, "a rank is below --tp-size")


def _seq_len(text: str) -> int:
    return _bounded_int(text, 1, MAX_SEQ_LEN, f"--seq-len is at most {MAX_SEQ_LEN} tokens")


def _seed(text: str) -> int:
    return _bounded_int(text, 0, 2**32 - 1, "a seed is below 2**32")


def _int_list(text: str) -> list[int]:
    """Comma-separated ASCII integers (ranks, layers), each as :func:`_bounded_int` reads one;
    the plan refuses what is out of range, naming the rank or layer."""
    try:
        return [_bounded_int(x, -MAX_TP_SIZE, MAX_TP_SIZE, "more than any rank or layer")
                for x in text.split(",") if x.strip()]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text[:40]!r}") from None
