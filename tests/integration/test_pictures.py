"""The documentation's pictures (docs/img/*.svg) are what tools/pictures.py draws from the
installed package's plan and engine tables, byte for byte."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from paths import ROOT

TOOL = ROOT / "tools" / "pictures.py"
IMG = ROOT / "docs" / "img"
COMMITTED = sorted(IMG.glob("*.svg"))


@pytest.fixture(scope="module")
def drawn(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pictures")
    done = subprocess.run([sys.executable, str(TOOL), str(out)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT / "tests")
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_the_tool_draws_exactly_the_committed_pictures(drawn):
    assert sorted(p.name for p in drawn.iterdir()) == [p.name for p in COMMITTED], (
        "docs/img/ and tools/pictures.py disagree on the pictures: run "
        "`python tools/pictures.py` and commit docs/img/")


@pytest.mark.parametrize("picture", COMMITTED, ids=lambda p: p.name)
def test_the_committed_picture_is_current(picture, drawn):
    assert (drawn / picture.name).read_bytes() == picture.read_bytes(), (
        f"docs/img/{picture.name} is out of date with the plan: run `python tools/pictures.py` "
        "(with kda_tp installed) and commit docs/img/")


def test_every_picture_is_shown_in_the_docs():
    pages = "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    for picture in COMMITTED:
        assert f"img/{picture.name}" in pages, picture.name


def test_the_pictures_carry_the_plans_numbers(drawn):
    """Spot checks against the spec's arithmetic, not the drawing code: Kimi-Linear at TP 4
    keeps 1024 channels (8 heads) a rank, K3's A_log 12 of 96 heads a rank at TP 8, vLLM's K3
    in_proj_qkvgfab 4*3072 + 128 + 24 = 12440 rows padded to 12448, K3's MLA layer 24 heads a
    rank at TP 4."""
    plan = (drawn / "plan-kimi-linear-tp4.svg").read_text()
    assert "rank r keeps rows [1024r, 1024(r+1)), its 8 heads' channels" in plan
    assert "rank r keeps rows [8r, 8(r+1))" in plan
    # CHANNEL_ROWS wraps onto the second line: its tensors there (f_b_proj, g_b_proj, dt_bias)
    # stand under their own heading, left of HEAD_ROWS' (which once looked like theirs).
    headings = {m[2]: (float(m[0]), float(m[1])) for m in re.findall(
        r'<text x="([0-9.]+)" y="([0-9.]+)"[^>]*font-weight="bold">([A-Z_]+[^<]*)</text>', plan)}
    continued, head_rows = headings["CHANNEL_ROWS (continued)"], headings[
        "HEAD_ROWS: rows are heads"]
    assert continued[1] == head_rows[1] and continued[0] < head_rows[0]
    dt_bias = re.search(r'<text x="([0-9.]+)" y="[0-9.]+"[^>]*>dt_bias</text>', plan)
    assert dt_bias and continued[0] < float(dt_bias[1]) < head_rows[0]
    a_log = (drawn / "k3-a-log.svg").read_text()
    assert "rank r keeps entries [12r, 12(r+1))" in a_log
    fused = (drawn / "vllm-k3-in-proj.svg").read_text()
    assert "(12440 -&gt; 12448 rows)" in fused and "b_proj[24:48]" in fused
    gather = (drawn / "o-proj-gather.svg").read_text()
    assert "2,304 spans of 2,048 bytes, one every 8,192" in gather
    # K3's MLA layer at TP 4: 24 of 96 heads a rank; P + Pr = 192, P + V = 256 and V = 128 rows
    # a head; o_proj's 3072 = 24 * 128 columns; BF16 bytes a rank: 2 * (S / 4 + R) of 2 * (S + R),
    # S = 18432 * 1536 + 24576 * 512 + 2 * 12288 * 7168 (q_b, kv_b, g, o: sliced),
    # R = 1536 * 7168 + 1536 + 576 * 7168 + 512 (q_a, its norm, kv_a, its norm: replicated).
    mla = (drawn / "plan-mla-kimi-k3-tp4.svg").read_text()
    assert ("rank r keeps its 24 heads' rows: q_b_proj 192 a head, kv_b_proj 256 a head, "
            "g_proj 128 a head") in mla
    assert "rank r keeps columns [3072r, 3072(r+1))" in mla
    assert "138,809,344 of 464,392,192 bytes of the layer (29.9%)" in mla
