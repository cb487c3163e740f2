"""docs/guard-cpu.md's recipe: ``examples/guard_cpu.py`` shows the guard's OK line and its FAIL
lines (ERROR, ``GuardError``, ``GuardWarning``) through vLLM 0.33's own loader and KDA layer
class, on CPU, as the page says."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from paths import ROOT

pytestmark = pytest.mark.engines

SCRIPT = ROOT / "examples" / "guard_cpu.py"
GUARD = "kda_tp guard: vllm DefaultModelLoader: tp rank 1/2: 9 KDA parameters (vllm-0.33-kimi-linear)"


def test_the_recipe_prints_ok_then_fail_then_warn():
    pytest.importorskip("vllm")
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in (done.stdout + done.stderr).splitlines()
             if "kda_tp" in line or line.startswith(("rank 1 ", "FAIL:"))]
    ok, errors, failed = (
        [line for line in lines if line.startswith(prefix)]
        for prefix in (f"INFO kda_tp.guard: {GUARD}", f"ERROR kda_tp.guard: {GUARD}",
                       f"GuardError: {GUARD}"))
    warned = [line for line in lines if f": GuardWarning: {GUARD}" in line]  # after its path
    assert len(ok) == 1 and ok[0].endswith(": OK"), lines
    # mode fail: one ERROR line naming the wrong parameters, then the GuardError; mode warn:
    # the diagnosis at ERROR and as a GuardWarning (whatever the engine's logging level)
    assert [line.split(" s: ", 1)[1] for line in errors] == [
        "FAIL (2 wrong): model.layers.0.self_attn.A_log, model.layers.0.self_attn.dt_bias",
        "FAIL (2 wrong)"], lines
    assert len(failed) == 1 and failed[0].endswith(": FAIL (2 wrong)"), lines
    assert len(warned) == 1 and warned[0].endswith(": FAIL (2 wrong)"), lines
    for part in ("A_log", "dt_bias"):
        wrong = [line for line in lines if line.startswith(f"rank 1 model.layers.0.self_attn."
                                                           f"{part}: values differ")]
        assert len(wrong) == 3, lines  # in the GuardError, the ERROR line and the GuardWarning
        assert all(line.endswith(f"equals rank 0's slice of {part}") for line in wrong)
    assert "loaded anyway (mode warn)" in done.stdout


def test_the_page_shows_the_scripts_lines():
    page = (ROOT / "docs" / "guard-cpu.md").read_text()
    assert "VLLM_TARGET_DEVICE=cpu /path/to/vllm-env/bin/python examples/guard_cpu.py" in page
    for line in (f"INFO kda_tp.guard: {GUARD}", f"GuardError: {GUARD}",
                 f"ERROR kda_tp.guard: {GUARD}", f"GuardWarning: {GUARD}",
                 "equals rank 0's slice of dt_bias",
                 "loaded anyway (mode warn)"):
        assert line in page, line
    assert re.search(r": OK\n", page)
