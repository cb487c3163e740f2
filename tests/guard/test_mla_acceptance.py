"""Issue 41's acceptance matrix: the guard through vLLM 0.33.0's and SGLang 0.5.23's own MLA
classes and model ``load_weights`` on CPU, for Kimi K3, Kimi-Linear and GLM-5.3-Flash at TP 1,
2 and 4, at the first load and on an update (tests/mla_bugs_child.py, one child process per
engine running every case; each case a fresh layer of rank ``T-1``, every rank for the honest
first load).

An honest load and an honest refit of the whole MLA layer pass with the MLA parameters and
the derived copies counted. Each realistic MLA loader bug, injected into the engine's own
loader, is stopped in mode ``fail`` and named as itself: a column-parallel ``kv_b_proj``
narrowed at rank 0, a row-parallel ``o_proj`` narrowed at rank 0, the fused ``kv_a`` rows
holding ``q_a``'s (a loader keeping a view of a streamer's reused buffer: SGLang GLM-5.3's own
``cached_a_proj``), ``kv_a_proj_with_mqa`` fed and never copied, the derived copies
(``W_UK_T``/``W_UV``, ``w_kc``/``w_vc``) stale after a ``kv_b_proj`` refit whose post-load step
was not forwarded, a replicated ``kv_a_layernorm`` holding something else. Rank 0's slice is
rank ``T-1``'s at TP 1 and Kimi-Linear has no fused a-projection: those cells do not exist.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from kda_tp.synth import write_small_checkpoint
from mla_bugs_child import LAYOUT, cases
from paths import TESTS

pytestmark = pytest.mark.engines
pytest.importorskip("vllm")
pytest.importorskip("sglang")

STYLES = {"k3": "k3", "kimi_linear": "kimi", "glm": "glm"}
# the MLA layer's parameters per rank in each layout (the table's), and its derived copies
MLA_PARAMS = {"vllm-0.33-k3": 6, "vllm-0.33-kimi-linear": 5, "vllm-0.33-glm-5.3": 6,
              "sglang-0.5.23-k3": 7, "sglang-0.5.23-kimi-linear": 5,
              "sglang-0.5.23-glm-5.3": 6}
COPIES = {"vllm": ("W_UK_T", "W_UV"), "sglang": ("w_kc", "w_vc")}
FUSED_A = {("vllm", "k3"): "fused_qkv_a_g_proj", ("vllm", "glm"): "fused_qkv_a_proj",
           ("sglang", "k3"): "fused_qkv_a_proj_with_mqa",
           ("sglang", "glm"): "fused_qkv_a_proj_with_mqa"}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """``engine -> {case: what the guard said}``, each engine's child run once."""
    root = tmp_path_factory.mktemp("mla-matrix")
    for kind, style in STYLES.items():
        write_small_checkpoint(root / kind, 64, 4, 16, 4, 16, 2, [0], style=style)
    done: dict[str, dict] = {}

    def run(engine: str) -> dict:
        if engine not in done:
            out = root / f"{engine}.json"
            proc = subprocess.run(
                [sys.executable, str(TESTS / "mla_bugs_child.py"), engine, str(root), str(out)],
                capture_output=True, text=True, timeout=900, check=False)
            assert proc.returncode == 0, proc.stderr[-4000:]
            done[engine] = json.loads(out.read_text())
        return done[engine]

    return run


def wrong_param(engine: str, kind: str, bug: str) -> tuple[str, str]:
    """The parameter a bug leaves wrong and the plan part named in it."""
    if bug == "kv_b_rank0":
        return "kv_b_proj.weight", "kv_b_proj"
    if bug == "o_proj_rank0":
        return "o_proj.weight", "o_proj"
    if bug == "norm_other":
        return "kv_a_layernorm.weight", "kv_a_layernorm"
    fused = FUSED_A.get((engine, kind), "kv_a_proj_with_mqa")
    return f"{fused}.weight", "kv_a_proj_with_mqa"


ALL = [(engine, *case) for engine in ("vllm", "sglang") for case in cases()]


def _id(case: tuple) -> str:
    engine, kind, t, r, when, bug = case
    return f"{engine}-{kind}-tp{t}-r{r}-{when}-{bug}"


@pytest.mark.parametrize("case", [c for c in ALL if c[-1] == "honest"], ids=_id)
def test_honest_loads_and_refits_pass_with_the_mla_parameters_counted(case, matrix):
    engine, kind, t, r, when, _ = case
    layout = LAYOUT[engine, kind]
    found = matrix(engine)[_id(case).split("-", 1)[1].replace("-", "/")]
    assert found["error"] is None, found["error"]
    lines = found["lines"]
    assert lines and all(line.endswith(": OK") for line in lines), lines
    mla = MLA_PARAMS[layout] + (2 if engine == "sglang" else 0)  # SGLang's copies built
    assert re.fullmatch(rf"kda_tp guard: tp rank {r}/{t}: \d+ KDA and {mla} MLA parameters "
                        rf"\({layout}\), \d+ bytes, [0-9.]+ s: OK", lines[0]), lines[0]
    copies = [line for line in lines if " 2 MLA derived copies " in line]
    assert len(copies) == (1 if engine == "vllm" else 0) + (when == "update"), lines
    if when == "update":
        (update,) = [line for line in lines if " parameters updated " in line]
        assert re.fullmatch(
            rf"kda_tp guard: {engine} load_weights: tp rank {r}/{t}: 0 KDA and "
            rf"{MLA_PARAMS[layout]} MLA parameters updated \({layout}\), [1-9]\d* bytes, "
            r"[0-9.]+ s: OK", update), update


@pytest.mark.parametrize("case", [c for c in ALL if c[-1] != "honest"], ids=_id)
def test_each_mla_loader_bug_is_stopped_and_named(case, matrix):
    engine, kind, t, r, when, bug = case
    layout = LAYOUT[engine, kind]
    found = matrix(engine)[_id(case).split("-", 1)[1].replace("-", "/")]
    text = found["error"]
    assert text is not None, found["lines"]  # stopped (mode fail)
    head = text.splitlines()[0]
    assert head.startswith("kda_tp guard: ") and f"tp rank {r}/{t}: " in head, head
    if bug == "copies_stale":
        assert found["stale"], "the refit rebuilt every copy: no stale copy to name"
        assert re.search(r": 2 MLA derived copies .*: FAIL \(\d wrong\)$", head), head
        named = sorted(c for c in COPIES[engine] if f".{c}: differs from what "
                       "kv_b_proj.weight makes of it at " in text)
        assert named == found["stale"], text
        return
    param, part = wrong_param(engine, kind, bug)
    if when == "first":
        assert head.endswith("FAIL (1 wrong)"), head
        assert f"MLA parameters ({layout})" in head
        assert [n.rpartition("self_attn.")[2] for n in found["failures"]] == [param], text
        # SGLang GLM-5.3 fuses q_a and kv_a only once both came: both parts differ
        assert re.search(rf"\.self_attn\.{re.escape(param)}: values differ in [^;]*\b{part}\b",
                         text), text
        if bug in ("kv_b_rank0", "o_proj_rank0"):
            assert f"equals rank 0's slice of {part}" in text, text
    else:
        assert f": 0 KDA and {MLA_PARAMS[layout]} MLA parameters updated ({layout})" in head
        assert "the KDA and MLA weights this rank holds after the update are not what the " \
               "update fed" in text, text
        wrong = [line for line in text.splitlines() if line.startswith(f"  rank {r} ")]
        assert any(f".self_attn.{param}: {part}: " in line for line in wrong), text
        # SGLang GLM-5.3 fuses q_a and kv_a only once both came: both parts stay old
        assert all(f".self_attn.{param}: " in line for line in wrong), text
        both = (engine, kind, bug) == ("sglang", "glm", "kv_a_dropped")
        assert len(wrong) == (2 if both else 1), text
