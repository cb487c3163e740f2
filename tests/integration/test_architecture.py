"""The package's layering (ARCHITECTURE.md): no import cycle, no module importing another's
private names, every import between rooms (folders, root modules) down the floors of
tools/layers.py's LAYERS and none of the package face, imports inside functions included, checked
on the installed package."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import kda_tp

from paths import ROOT

LAYERS_TOOL = ROOT / "tools" / "layers.py"


def test_the_package_has_no_import_cycle_and_no_private_import():
    package = Path(kda_tp.__file__).parent
    done = subprocess.run([sys.executable, str(LAYERS_TOOL), str(package)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no import cycle, no cross-module private import" in done.stdout
    assert "every import down the 8 floors of LAYERS" in done.stdout


def test_the_check_finds_a_cycle_and_a_private_import(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def helper():\n    from .high import _secret\n")
    (package / "high.py").write_text("from .low import helper\n_secret = 1\n")
    done = subprocess.run([sys.executable, str(LAYERS_TOOL), str(package)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "import cycle: pkg.high <-> pkg.low" in done.stdout
    assert "private import: pkg.low imports pkg.high._secret" in done.stdout


def _copy_of_the_package(tmp_path: Path) -> Path:
    """The installed package's Python files, in a folder named ``kda_tp`` under ``tmp_path``."""
    copy = tmp_path / "kda_tp"
    shutil.copytree(Path(kda_tp.__file__).parent, copy,
                    ignore=shutil.ignore_patterns("*.so", "*.pyi", "__pycache__", "py.typed"))
    return copy


def _layers(package: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(LAYERS_TOOL), str(package)],
                          capture_output=True, text=True, timeout=120)


def test_an_import_up_the_floors_or_of_the_face_is_refused(tmp_path):
    package = _copy_of_the_package(tmp_path)
    assert _layers(package).returncode == 0
    config = package / "model" / "config.py"
    text = config.read_text()
    # The model facts (near the ground) reaching up into the audit, inside a function.
    config.write_text(text + "\n\ndef _up():\n    from ..audit.report import AuditReport\n")
    done = _layers(package)
    assert done.returncode == 1
    assert ("against the layers: kda_tp.model.config imports kda_tp.audit.report: room model is "
            "below room audit (LAYERS)") in done.stdout
    # Two rooms of one floor are independent; the package face is imported by __main__ alone.
    config.write_text(text)
    (package / "rank" / "plan.py").write_text(
        (package / "rank" / "plan.py").read_text() + "\n\ndef _side():\n"
        "    from ..output.names import rank_dir\n    from .. import open_rank\n")
    done = _layers(package)
    assert done.returncode == 1
    assert ("against the layers: kda_tp.rank.plan imports kda_tp.output.names: room rank is on "
            "the same floor as room output (LAYERS)") in done.stdout
    assert ("against the layers: kda_tp.rank.plan imports open_rank from the package face kda_tp"
            in done.stdout)


def test_a_private_module_is_imported_from_its_own_room_only(tmp_path):
    package = _copy_of_the_package(tmp_path)
    verify = package / "shard" / "verify.py"
    verify.write_text(verify.read_text() + "\n\ndef _plumbing():\n"
                      "    from ..synth._tensors import Spec\n    from ._place import commit\n")
    done = _layers(package)
    assert done.returncode == 1
    assert ("against the layers: kda_tp.shard.verify imports kda_tp.synth._tensors, a private "
            "module of room synth") in done.stdout
    assert "kda_tp.shard._place" not in done.stdout  # its own room's
