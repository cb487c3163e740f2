"""The package's layering (ARCHITECTURE.md): no import cycle and no module importing another's
private names, imports inside functions included, checked on the installed package."""

from __future__ import annotations

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
