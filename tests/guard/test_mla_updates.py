"""The MLA layers' derived copies after an update, through SGLang 0.5.23's own K3 MLA class and
model ``load_weights`` on CPU (tests/mla_engine_child.py ``sglang-refits``, rank 1 of 2). An
update that feeds MLA tensors is judged for them as for the KDA ones (one tensor per call:
each MLA parameter, SGLang's fused ``fused_qkv_a_proj_with_mqa`` included, counted as MLA).
SGLang rebuilds ``w_kc`` / ``w_vc`` at the end of every ``load_weights`` (``post_load_weights``),
so the guard judges them after every update against what the local ``kv_b_proj`` derives. An
honest ``kv_b_proj`` refit passes with the copies counted; one whose ``post_load_weights`` is not
forwarded (SGLang #26744) leaves them stale: stopped, each named as itself.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from kda_tp.synth import write_small_checkpoint
from paths import TESTS

pytestmark = pytest.mark.engines
pytest.importorskip("sglang")

MLA_LAYER, TP, RANK = 1, 2, 1


@pytest.fixture(scope="module")
def refits(tmp_path_factory):
    """What the child found: the honest refit's guard lines, the stale one's error."""
    root = tmp_path_factory.mktemp("sglang-refits")
    ckpt = write_small_checkpoint(root / "ckpt", 64, 4, 16, 4, 16, 2, [0], style="k3")
    proc = subprocess.run(
        [sys.executable, str(TESTS / "mla_engine_child.py"), "sglang-refits", "k3", str(ckpt),
         str(MLA_LAYER), str(root), str(TP)],
        capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((root / "refits.json").read_text())


def update_line(params: int, verdict: str) -> str:
    return (rf"kda_tp guard: sglang load_weights: tp rank {RANK}/{TP}: 0 KDA and {params} MLA "
            rf"parameters updated \(sglang-0.5.23-k3\), [1-9][0-9]* bytes, [0-9.]+ s: {verdict}")


def test_an_honest_kv_b_proj_refit_passes_with_the_copies_counted(refits):
    update, line = refits["honest"]
    assert re.fullmatch(update_line(1, "OK"), update), update
    assert re.fullmatch(
        rf"kda_tp guard: sglang load_weights: tp rank {RANK}/{TP}: 2 MLA derived copies "
        r"\(sglang-0.5.23-k3\), [1-9][0-9]* bytes, [0-9.]+ s: OK", line), line


def test_copies_a_refit_left_stale_are_stopped_each_named(refits):
    text = refits["stale"]
    assert re.fullmatch(
        rf"kda_tp guard: sglang load_weights: tp rank {RANK}/{TP}: 2 MLA derived copies "
        r"\(sglang-0.5.23-k3\), [0-9]+ bytes, [0-9.]+ s: FAIL \(2 wrong\)", text.splitlines()[0])
    for copy in ("w_kc", "w_vc"):
        assert (f"  rank {RANK} model.layers.{MLA_LAYER}.self_attn.{copy}: differs from what "
                "kv_b_proj.weight makes of it at ") in text
    assert ("the engine's copy is stale (built before the last update and never rebuilt: "
            "https://github.com/sgl-project/sglang/issues/26744)") in text


def test_an_honest_refit_one_tensor_per_call_judges_every_mla_parameter(refits):
    lines = refits["per_tensor"]
    updates = [line for line in lines if " MLA parameters updated " in line]
    assert len(updates) == 8 and len(lines) == 16, lines  # K3's 8 MLA tensors, each a call
    assert all(re.fullmatch(update_line(1, "OK"), line) for line in updates), updates
    assert all(line.endswith(": OK") for line in lines)
