"""Engine layouts (kda_tp.engines) and KdaShardedSource.build_param against parameters that
vLLM 0.33.0 and SGLang 0.5.23 loaded with their own code (tests/data/engine_ranks)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from kda_tp import EngineLayoutError, KdaShardedSource, KdaTpPlan, SafetensorsSource
from kda_tp.engines import LAYOUTS, get_layout, layouts_for, model_family, recognise

DATA = Path(__file__).parent / "data" / "engine_ranks"
CKPT = {"k3": "ckpt_k3", "kimi_linear": "ckpt_kl", "glm": "ckpt_glm"}
DUMPS = sorted(DATA.glob("*_tp*_r*.safetensors"))
EXPECTED = {
    "vllm_k3": "vllm-0.33-k3",
    "vllm_kimi_linear": "vllm-0.33-kimi-linear",
    "vllm_glm": "vllm-0.33-glm-5.3",
    "sglang_k3": "sglang-0.5.23-k3",
    "sglang_kimi_linear": "sglang-0.5.23-kimi-linear",
    "sglang_glm": "sglang-0.5.23-glm-5.3",
}


def open_dump(path: Path) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """A fixture's header metadata and its tensors by name after ``self_attn.``."""
    with safe_open(path, "np") as f:
        meta = f.metadata()
        prefix = meta["prefix"]
        return meta, {k[len(prefix):]: f.get_tensor(k) for k in f.keys()}


def adapter(meta: dict[str, str]) -> KdaShardedSource:
    src = SafetensorsSource(DATA / CKPT[meta["model"]])
    plan = KdaTpPlan.from_config(src, int(meta["tp_rank"]), int(meta["tp_size"]))
    return KdaShardedSource(src, plan)


def test_every_engine_dump_is_there():
    assert {p.name.split("_tp")[0] for p in DUMPS} == set(EXPECTED)


@pytest.mark.parametrize("path", DUMPS, ids=lambda p: p.stem)
def test_build_param_equals_the_engine_dump(path):
    meta, dump = open_dump(path)
    shard = adapter(meta)
    family = model_family(shard.config)
    assert [lay.name for lay in recognise(dump, family)] == [EXPECTED[path.name.split("_tp")[0]]]
    layout = get_layout(EXPECTED[path.name.split("_tp")[0]])
    params = layout.params_for(shard.plan)
    assert {p.suffix for p in params} == set(dump)
    for p in params:
        want = dump[p.suffix]
        got = shard.build_param(layout, p.suffix, 0)
        assert got.shape == want.shape and got.dtype == want.dtype, p.suffix
        assert got.tobytes() == want.tobytes(), p.suffix
        # into a caller's buffer (a flat byte view, as of a torch parameter), dirty beforehand
        buf = np.full(want.nbytes, 0xAB, np.uint8)
        assert shard.build_param(layout, p.suffix, 0, buf) is buf
        assert buf.tobytes() == want.tobytes(), p.suffix


def test_vllm_k3_padding_rows_are_zero_and_sized_by_16():
    meta, dump = open_dump(DATA / "vllm_k3_tp4_r1.safetensors")
    shard = adapter(meta)
    plan = shard.param_plan("vllm-0.33-k3", "in_proj_qkvgfab.weight")
    # 4 x 384 (q, k, v, g) + 128 (f_a, whole) + 3 (b) = 1667 rows, padded to 1680
    assert [(r.part, r.rows) for r in plan.regions] == [
        ("q_proj", (0, 384)), ("k_proj", (384, 768)), ("v_proj", (768, 1152)),
        ("g_proj", (1152, 1536)), ("f_a_proj", (1536, 1664)), ("b_proj", (1664, 1667)),
    ]
    assert plan.shape == (1680, 64) and plan.padding == (1667 * 64 * 4, 1680 * 64 * 4)
    assert not dump["in_proj_qkvgfab.weight"][1667:].any()
    # row i of b_proj holds 80000 + i: rank 1 of 4 has heads 3..5
    assert dump["in_proj_qkvgfab.weight"][1664:1667, 0].tolist() == [80003, 80004, 80005]


def test_recognise_needs_the_family_when_names_agree():
    _, dump = open_dump(DATA / "sglang_glm_tp4_r3.safetensors")
    assert sorted(lay.name for lay in recognise(dump)) == [
        "sglang-0.5.23-glm-5.3", "sglang-0.5.23-kimi-linear"]
    assert recognise({"no_such.weight"}) == []


def test_recognise_a_dump_missing_a_parameter():
    _, dump = open_dump(DATA / "vllm_k3_tp4_r1.safetensors")
    del dump["f_b_proj.weight"]
    assert [lay.name for lay in recognise(dump, "kimi-k3")] == ["vllm-0.33-k3"]


def test_layouts_for_family_and_plan():
    assert {lay.name for lay in layouts_for("kimi-k3")} == {"vllm-0.33-k3", "sglang-0.5.23-k3"}
    k3 = KdaTpPlan(0, 2, 64, 128, 12, 4, 128, full_rank_gate=True, dtypes={"A_log": "F32"})
    assert {lay.name for lay in layouts_for(plan=k3)} == {"vllm-0.33-k3", "sglang-0.5.23-k3"}
    kl = KdaTpPlan(0, 1, 64, 128, 12, 4, 128)
    assert "transformers-5-kimi-linear" in {lay.name for lay in layouts_for(plan=kl)}
    with pytest.raises(EngineLayoutError, match="unknown model family"):
        layouts_for("llama")


def test_refusals_name_the_problem():
    with pytest.raises(EngineLayoutError, match="no engine layout 'vllm-9'"):
        get_layout("vllm-9")
    with pytest.raises(EngineLayoutError, match="no parameter 'in_proj.weight'"):
        LAYOUTS["vllm-0.33-k3"].param("in_proj.weight")
    kl = KdaTpPlan(0, 2, 64, 128, 12, 4, 128)
    with pytest.raises(EngineLayoutError, match="g_proj, which the plan does not have"):
        LAYOUTS["vllm-0.33-k3"].param_plan("in_proj_qkvgfab.weight", kl)
    with pytest.raises(EngineLayoutError, match="replicated"):
        LAYOUTS["transformers-5-kimi-linear"].param_plan("conv1d.weight", kl)
