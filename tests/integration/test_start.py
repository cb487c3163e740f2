"""Start-up: what ``import kda_tp`` and the ``kda-tp`` commands import, and Ctrl-C during it.

The start-up time itself is a benchmark row (``benchmarks/bench.py``: ``kda-tp --help`` and
``kda-tp plan CONFIG`` against ``python -c "import numpy"``); these tests check what makes it
short, and that a Ctrl-C at any moment of the start exits 130 with one line. The Ctrl-C tests
deliver SIGINT from an import hook in the child, at the import the test names, so they do not
depend on when a signal sent from outside would land.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from children import kda_tp_child
from paths import DATA

CONFIG = DATA / "k3_small" / "config.json"

#: Imported on first use only: a typed BF16/FP8 array (ml_dtypes, slower to import than numpy),
#: a progress bar on a terminal (tqdm), the writer and verifier (kda_tp.shard and what it needs).
HEAVY = ("ml_dtypes", "tqdm", "kda_tp.shard", "concurrent.futures", "torch")

# Runs the command, then prints which of the modules named in $MODULES it imported.
_REPORT_IMPORTS = """
import atexit, os, sys
atexit.register(lambda: print(sorted(set(os.environ["MODULES"].split()) & set(sys.modules)),
                              file=sys.stderr))
"""


def _imported(*args: object) -> list[str]:
    """The modules of HEAVY (and numpy) that ``python -m kda_tp ARGS`` imports."""
    run = subprocess.run(kda_tp_child(_REPORT_IMPORTS, *args), capture_output=True, text=True,
                         env={**os.environ, "MODULES": " ".join(HEAVY + ("numpy",))},
                         check=False, timeout=120)
    assert run.returncode == 0, run.stderr
    return ast.literal_eval(run.stderr.splitlines()[-1])


def test_import_kda_tp_loads_neither_numpy_nor_the_rust_users():
    code = ("import sys, kda_tp\n"
            f"print(sorted(m for m in {HEAVY + ('numpy', 'kda_tp.rank.plan')!r} "
            "if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120)
    assert run.stdout == "[]\n"
    # The public names are there on first use, the tools behind their folders' faces.
    code = ("import kda_tp; print(kda_tp.KdaTpPlan.__module__, "
            "kda_tp.reference.check_tp_equivalence.__name__)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120)
    assert run.stdout == "kda_tp.rank.plan check_tp_equivalence\n"
    # `kda_tp.audit` is the audit's folder, whose face gives the function, also when its module
    # is imported first (as the CLI does).
    code = ("import kda_tp.audit.auditor, kda_tp; "
            "print(callable(kda_tp.audit.audit), kda_tp.audit.audit.__module__)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120)
    assert run.stdout == "True kda_tp.audit.auditor\n"


def test_open_rank_imports_no_engine_table_and_no_tool():
    """A loader's path: opening a view and reading a tensor imports the reader, the plan and
    the view, nothing of the engines' layouts, the audit, the writer, the guard or torch."""
    code = ("import sys, kda_tp\n"
            f"with kda_tp.open_rank({str(DATA / 'k3_small')!r}, tp_rank=1, tp_size=2,\n"
            "                      qk_multiple=1) as view:\n"
            "    view[next(iter(view.keys()))]\n"
            "print(sorted(m for m in sys.modules if m.startswith('kda_tp')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120)
    loaded = ast.literal_eval(run.stdout)
    assert "kda_tp.rank.view" in loaded and "kda_tp.checkpoint.reader" in loaded
    assert [m for m in loaded if m.split(".")[1:2] and m.split(".")[1] in (
        "engines", "audit", "shard", "guard", "output", "reference", "synth", "cli", "torch")
    ] == []


def test_help_and_plan_import_nothing_heavy():
    assert _imported("--help") == []
    assert _imported("plan", "--help") == []
    assert _imported("plan", CONFIG, "--tp-size", 2) == ["numpy"]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A one-layer checkpoint and its TP=2 shards."""
    from kda_tp.shard import shard_checkpoint
    from kda_tp.synth import write_small_checkpoint

    base = tmp_path_factory.mktemp("start")
    ckpt = write_small_checkpoint(base / "ckpt", hidden=64, heads=4, head_dim=64, conv_kernel=4,
                                  gate_rank=16, num_layers=1, kda_layers=[0])
    shard_checkpoint(ckpt, base / "out", 2)
    return ckpt, base / "out"


# SIGINT to itself when the child is about to import the module named by the first argument.
_INTERRUPT_AT_IMPORT = """
import os, signal, sys
at = sys.argv.pop(1)
class InterruptAt:
    def find_spec(self, name, path=None, target=None):
        if name == at:
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, InterruptAt())
"""


@pytest.mark.parametrize("at", [
    "numpy",  # the first import of the command line
    "datetime",  # imported by numpy's C initialisation, which turns exceptions into ImportError
    "kda_tp._native",  # the Rust core, imported through kda_tp.rank.plan
    "argparse",
    "kda_tp.shard",  # imported by `verify` after its arguments are parsed
    "kda_tp.reference.equivalence",  # verify --numeric
])
def test_ctrl_c_during_the_start_exits_130_with_one_line(at, sharded):
    ckpt, out = sharded
    run = subprocess.run(
        kda_tp_child(_INTERRUPT_AT_IMPORT, at, "verify", ckpt, out, "--numeric", "--quiet"),
        capture_output=True, text=True, check=False, timeout=120,
    )
    assert (run.returncode, run.stderr, run.stdout) == (130, "kda-tp: interrupted\n", "")


def test_ctrl_c_ignored_by_the_parent_stays_ignored():
    """A background job's kda-tp (SIGINT ignored, as the shell starts it) runs to the end."""
    ignored = "signal.signal(signal.SIGINT, signal.SIG_IGN)\n" + _INTERRUPT_AT_IMPORT
    run = subprocess.run(kda_tp_child(ignored, "numpy", "plan", CONFIG, "--tp-size", 2),
                         capture_output=True, text=True, check=False, timeout=120)
    assert run.returncode == 0 and "KDA tensor-parallel plan" in run.stdout, run.stderr


def test_ctrl_c_after_the_command_finished_changes_nothing():
    """A SIGINT once the command has returned (its output printed) keeps its exit status."""
    code = (
        "import os, signal, sys\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "import kda_tp.__main__ as entry, kda_tp.cli as cli\n"
        "cli.main = lambda: print('done') or 0\n"
        "status = entry.main()\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "print('status', status)\n"
        "sys.exit(status)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False, timeout=120)
    assert (run.returncode, run.stdout, run.stderr) == (0, "done\nstatus 0\n", "")
