"""The engine layouts' MLA tables (``EngineLayout.mla``, ``build_mla_param``,
``MLA_DERIVED``) by arithmetic and against the checkpoint's bytes read without the plan; the
engines' own classes judge them in test_mla_engines.py (``-m engines``)."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

import kda_tp
from kda_tp import EngineLayoutError
from kda_tp.engines import LAYOUTS
from kda_tp.engines.build import build_mla_param
from kda_tp.engines.derived import MLA_DERIVED
from kda_tp.rank.mla import MlaTpPlan
from kda_tp.synth import write_small_checkpoint

# Kimi K3's MLA geometry (tests/data/spec/mla.md): H 96, Q 1536, L 512, P 128, Pr 64, V 128.
K3 = dict(q_lora_rank=1536, output_gate=True)


def k3_plan(rank: int, size: int) -> MlaTpPlan:
    return MlaTpPlan(rank, size, 7168, 96, 512, 128, 64, 128, **K3)


def test_vllm_k3_fused_a_g_proj_holds_both_latents_then_this_ranks_gate_rows():
    plan = LAYOUTS["vllm-0.33-k3"].mla_param_plan("fused_qkv_a_g_proj.weight", k3_plan(3, 8),
                                                  "BF16")
    # 96 heads / 8 = 12 local heads: 12 * 128 gate rows after q_a (1536) and kv_a (512 + 64)
    assert [(r.part, r.rows) for r in plan.regions] == [
        ("q_a_proj", (0, 1536)), ("kv_a_proj_with_mqa", (1536, 2112)),
        ("g_proj", (2112, 3648))]
    assert plan.shape == (3648, 7168) and plan.dtype == "BF16" and plan.padding is None


def test_sglang_k3_keeps_the_gate_apart_and_every_layout_its_head_slices():
    sglang = LAYOUTS["sglang-0.5.23-k3"]
    plan = k3_plan(1, 4)
    assert [p.suffix for p in sglang.mla_params_for(plan)] == [
        "fused_qkv_a_proj_with_mqa.weight", "q_a_layernorm.weight", "q_b_proj.weight",
        "kv_a_layernorm.weight", "kv_b_proj.weight", "g_proj.weight", "o_proj.weight"]
    shapes = {p.suffix: sglang.mla_param_plan(p.suffix, plan, "BF16").shape
              for p in sglang.mla}
    assert shapes == {
        "fused_qkv_a_proj_with_mqa.weight": (2112, 7168), "q_a_layernorm.weight": (1536,),
        "q_b_proj.weight": (24 * 192, 1536), "kv_a_layernorm.weight": (512,),
        "kv_b_proj.weight": (24 * 256, 512), "g_proj.weight": (24 * 128, 7168),
        "o_proj.weight": (7168, 24 * 128)}


def test_a_glm_dump_name_finds_its_parameter():
    glm = LAYOUTS["vllm-0.33-glm-5.3"]
    assert {p.dump_suffix for p in glm.mla if p.dump_suffix} == {
        "mla_attn.q_a_layernorm.weight", "mla_attn.q_b_proj.weight", "mla_attn.o_proj.weight"}
    assert glm.mla_param("mla_attn.o_proj.weight") is glm.mla_param("o_proj.weight")


def test_refusals_name_the_problem():
    kimi_linear = MlaTpPlan(0, 2, 64, 4, 64, 16, 8, 16)
    with pytest.raises(EngineLayoutError, match="fused_qkv_a_g_proj.weight is made of q_a_proj, g_proj, "
                                                "which the MLA plan does not have"):
        LAYOUTS["vllm-0.33-k3"].mla_params_for(kimi_linear)
    with pytest.raises(EngineLayoutError, match="no MLA parameter 'W_UK_T'"):
        LAYOUTS["vllm-0.33-k3"].mla_param("W_UK_T")
    with pytest.raises(EngineLayoutError, match="has no MLA table"):
        LAYOUTS["transformers-5-kimi-linear"].mla_params_for(kimi_linear)


@pytest.fixture(scope="module")
def k3_hybrid(tmp_path_factory):
    """A Kimi K3 hybrid: KDA layer 0, MLA layer 1 (4 MLA heads, Q 192, L 64, P 16, Pr 8, V 16)."""
    return write_small_checkpoint(tmp_path_factory.mktemp("k3"), 64, 4, 16, 4, 16, 2, [0],
                                  style="k3")


@pytest.mark.parametrize("rank", [0, 1])
def test_built_mla_parameters_are_the_checkpoints_rows(k3_hybrid, rank):
    full = {}
    for f in sorted(k3_hybrid.glob("*.safetensors")):
        full.update(load_file(f))
    prefix = "language_model.model.layers.1.self_attn."
    t = {n[len(prefix):].removesuffix(".weight"): a for n, a in full.items()
         if n.startswith(prefix)}
    view = kda_tp.open_rank(k3_hybrid, tp_rank=rank, tp_size=2, qk_multiple=1, mla=True)
    vllm, sglang = LAYOUTS["vllm-0.33-k3"], LAYOUTS["sglang-0.5.23-k3"]
    hv = 2 * 16  # 2 local heads of V 16
    fused = build_mla_param(view, vllm, "fused_qkv_a_g_proj.weight", 1)
    want = np.concatenate([t["q_a_proj"], t["kv_a_proj_with_mqa"],
                           t["g_proj"][rank * hv:(rank + 1) * hv]])
    assert fused.tobytes() == want.tobytes()
    assert build_mla_param(view, sglang, "fused_qkv_a_proj_with_mqa.weight", 1).tobytes() == (
        np.concatenate([t["q_a_proj"], t["kv_a_proj_with_mqa"]]).tobytes())
    o_proj = build_mla_param(view, sglang, "o_proj.weight", 1)
    assert o_proj.tobytes() == np.ascontiguousarray(
        t["o_proj"][:, rank * hv:(rank + 1) * hv]).tobytes()
    kv_rows = 2 * (16 + 16)
    kv_b = build_mla_param(view, vllm, "kv_b_proj.weight", 1, model_dtype="F32")
    assert np.array_equal(kv_b, t["kv_b_proj"][rank * kv_rows:(rank + 1) * kv_rows]
                          .astype(np.float32))
    # the absorbed copies: head h's 16 k-nope rows, then its 16 value rows transposed
    w_uk_t = MLA_DERIVED["vllm-0.33-k3"]["W_UK_T"].derive(kv_b, view.mla)
    w_uv = MLA_DERIVED["sglang-0.5.23-k3"]["w_vc"].derive(kv_b, view.mla)
    assert w_uk_t.shape == (2, 16, 64) and w_uv.shape == (2, 64, 16)
    for h in range(2):
        assert np.array_equal(w_uk_t[h], kv_b[h * 32:h * 32 + 16])
        assert np.array_equal(w_uv[h], kv_b[h * 32 + 16:(h + 1) * 32].T)
    with pytest.raises(EngineLayoutError, match="layer 0 is not an MLA layer"):
        build_mla_param(view, vllm, "kv_b_proj.weight", 0)
    kda_only = kda_tp.open_rank(k3_hybrid, tp_rank=rank, tp_size=2, qk_multiple=1)
    with pytest.raises(EngineLayoutError, match=r"open_rank\(\.\.\., mla=True\)"):
        build_mla_param(kda_only, vllm, "kv_b_proj.weight", 1)
