"""A Kimi K3-style hybrid whose MLA projections are block FP8 (``kda_tp.synth``'s ``fp8=True``):
its MLA layers are planned and sliced per rank (tests/rank/test_mla_fp8_view.py), but the engine
layouts' MLA tables describe no scale grids (``kda_tp.engines.layout.mla_unjudged``): the
expected parameters a dump and the digests are judged by hold the KDA ones only, and the guard's
first-load line says why the MLA layers were not checked, failing nothing (an honest FP8 engine
is never judged as if it held BF16 MLA weights)."""

from __future__ import annotations

import pytest

from kda_tp.audit.expected_params import expected_params
from kda_tp.guard import check
from kda_tp.synth import write_small_checkpoint

GEOMETRY = dict(hidden=256, heads=8, head_dim=128, conv_kernel=4, gate_rank=128, num_layers=2,
                kda_layers=[0], seed=7, style="k3")
WHY = ("block-FP8 MLA weights (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, g_proj, "
       "o_proj) are not judged yet: the engine layouts' MLA tables describe no scale grids")


@pytest.fixture(scope="module")
def fp8_hybrid(tmp_path_factory):
    return write_small_checkpoint(tmp_path_factory.mktemp("fp8") / "ckpt", **GEOMETRY, fp8=True)


def test_the_expected_parameters_hold_the_kda_layer_only(fp8_hybrid):
    _, ranks = expected_params(fp8_hybrid, "vllm-0.33-k3", 2, None, None)
    for _, params in ranks:
        assert params and not any(p.mla or p.derived for p in params)
        assert {p.name.split(".layers.")[1].split(".")[0] for p in params} == {"0"}


@pytest.mark.parametrize("rank", [0, 1])
def test_the_first_load_says_the_mla_layers_are_not_checked_and_passes(fp8_hybrid, rank):
    _, ranks = expected_params(fp8_hybrid, "vllm-0.33-k3", 2, [rank], None)
    params = {p.name: p.build() for p in ranks[0][1]}
    result = check(params, fp8_hybrid, tp_rank=rank, tp_size=2, engine="vllm-0.33-k3",
                   guard_mode="fail")
    assert result is not None and result.passed
    assert result.mla_plan is None and result.mla_unchecked == WHY
    assert f", MLA not checked: {WHY}" in result.line()
