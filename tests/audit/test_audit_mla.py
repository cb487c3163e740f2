"""The hybrids' MLA layers in the audit, the dump and the digests (issue 41 item 5): a TP 2
dump of each family's hybrid (``kda_tp.synth``: KDA layer 0, MLA layer 1, 4 MLA heads) holds the
MLA parameters under the engine's names and passes the audit with them counted; another rank's
``kv_b_proj`` rows or ``o_proj`` columns are named as such; GLM-5.3's dump names
(``mla_attn.<name>``) and the live model's both read; the digests from the trainer's tensors
equal those from the checkpoint and those of the dump's bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import kda_tp
from kda_tp import SafetensorsSource
from kda_tp.audit import (DIGEST_KEY, audit_path, engine_digests, expected_digests,
                          param_digest, write_engine_dump)
from kda_tp.synth import write_small_checkpoint

from cli_run import run

STYLE = {"vllm-0.33-k3": "k3", "vllm-0.33-glm-5.3": "glm", "vllm-0.33-kimi-linear": "kimi",
         "sglang-0.5.23-k3": "k3", "sglang-0.5.23-glm-5.3": "glm",
         "sglang-0.5.23-kimi-linear": "kimi"}
# MLA parameters per rank of the one MLA layer, per layout
MLA_COUNT = {"vllm-0.33-k3": 6, "vllm-0.33-glm-5.3": 6, "vllm-0.33-kimi-linear": 5,
             "sglang-0.5.23-k3": 7, "sglang-0.5.23-glm-5.3": 6, "sglang-0.5.23-kimi-linear": 5}


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrids")
    return {style: write_small_checkpoint(root / style, 64, 4, 16, 4, 16, 2, [0], style=style)
            for style in ("k3", "glm", "kimi")}


def dump(hybrids, tmp_path: Path, engine: str) -> tuple[Path, list[dict[str, np.ndarray]]]:
    """A TP 2 dump of ``engine`` and each rank's tensors (raw, as read back)."""
    result = write_engine_dump(hybrids[STYLE[engine]], tmp_path / "dump", engine=engine,
                               tp_size=2)
    return result.out_dir, [read(f) for f in result.files]


def read(path: Path) -> dict[str, np.ndarray]:
    src = SafetensorsSource(path)
    return {n: src.get(n).array for n in src.names()}


def write(path: Path, tensors: dict[str, np.ndarray], rank: int) -> None:
    save_file({n: np.ascontiguousarray(a) for n, a in tensors.items()}, str(path),
              metadata={"tp_size": "2", "tp_rank": str(rank)})


@pytest.mark.parametrize("engine", sorted(STYLE))
def test_an_honest_tp2_dump_passes_with_its_mla_parameters_counted(hybrids, tmp_path, engine):
    root, ranks = dump(hybrids, tmp_path, engine)
    mla = [n for n in ranks[1] if ".layers.1.self_attn." in n]
    assert len(mla) == MLA_COUNT[engine]
    assert not any(n.endswith(("W_UK_T", "W_UV")) for n in mla)  # never in a dump
    report = audit_path(hybrids[STYLE[engine]], root)
    assert report.passed, report.format()
    kda = sum(not p.mla for p in report.params)
    assert sum(p.mla for p in report.params) == 2 * MLA_COUNT[engine]
    assert report.summary().startswith(
        f"OK: {kda} of {kda} KDA and {2 * MLA_COUNT[engine]} of {2 * MLA_COUNT[engine]} MLA "
        f"parameters exact on ranks 0, 1 of 2 ({engine}); 0 other parameters ignored")


@pytest.mark.parametrize("engine", ["vllm-0.33-k3", "sglang-0.5.23-glm-5.3"])
@pytest.mark.parametrize("param", ["kv_b_proj.weight", "o_proj.weight"])
def test_rank_1_holding_rank_0s_mla_slice_is_named(hybrids, tmp_path, capsys, engine, param):
    root, ranks = dump(hybrids, tmp_path, engine)
    name = next(n for n in ranks[1] if n.endswith(f"layers.1.self_attn.{param}")
                or n.endswith(f"layers.1.self_attn.mla_attn.{param}"))
    ranks[1][name] = ranks[0][name]  # column-parallel rows / row-parallel columns of rank 0
    write(root / "model-rank-1-part-0.safetensors", ranks[1], 1)
    status, out, _ = run(capsys, "audit", hybrids[STYLE[engine]], root)
    assert status == 1
    part = param.removesuffix(".weight")
    assert f"rank 1 {name}: values differ in {part}" in out
    assert f"equals rank 0's slice of {part}" in out
    assert f"FAIL: 0 KDA and 1 MLA parameter(s) wrong; " in out


def test_glm_dump_names_and_the_live_models_are_both_read(hybrids, tmp_path):
    root, ranks = dump(hybrids, tmp_path, "vllm-0.33-glm-5.3")
    dumped = sorted(n.split("self_attn.")[1] for n in ranks[0] if ".layers.1." in n)
    assert dumped == ["fused_qkv_a_proj.weight", "kv_a_layernorm.weight", "kv_b_proj.weight",
                      "mla_attn.o_proj.weight", "mla_attn.q_a_layernorm.weight",
                      "mla_attn.q_b_proj.weight"]
    live = {n.replace("self_attn.mla_attn.", "self_attn."): a for n, a in ranks[0].items()}
    report = kda_tp.audit.audit(live, hybrids["glm"], tp_rank=0, tp_size=2)
    assert report.passed and sum(p.mla for p in report.params) == 6, report.format()
    # a live state dict lists both paths of the shared modules: one judged, the other ignored
    both = {**ranks[0], **live}
    report = kda_tp.audit.audit(both, hybrids["glm"], tp_rank=0, tp_size=2)
    assert report.passed and sum(p.mla for p in report.params) == 6 and report.ignored == 3


def test_a_dump_without_mla_parameters_is_audited_for_kda_only(hybrids, tmp_path):
    root, ranks = dump(hybrids, tmp_path, "vllm-0.33-k3")
    for r, tensors in enumerate(ranks):
        write(root / f"model-rank-{r}-part-0.safetensors",
              {n: a for n, a in tensors.items() if ".layers.1." not in n}, r)
    report = audit_path(hybrids["k3"], root)
    assert report.passed and not any(p.mla for p in report.params)
    assert report.summary().startswith("OK: 14 of 14 KDA parameters exact")
    # one MLA parameter there: every other one of the layer is judged, missing
    ranks[1] = {n: a for n, a in ranks[1].items() if "fused_qkv_a_g_proj" not in n}
    write(root / "model-rank-1-part-0.safetensors", ranks[1], 1)
    failures = audit_path(hybrids["k3"], root).failures
    assert [(p.name, p.status, p.mla) for p in failures] == [(
        "language_model.model.layers.1.self_attn.fused_qkv_a_g_proj.weight", "missing", True)]


@pytest.mark.parametrize("engine", ["vllm-0.33-k3", "vllm-0.33-glm-5.3",
                                    "vllm-0.33-kimi-linear"])
def test_digests_key_mla_as_vllm_and_match_the_dump(hybrids, tmp_path, engine):
    ckpt = hybrids[STYLE[engine]]
    src = SafetensorsSource(ckpt)
    trainer = {n: src.get(n) for n in src.names()}
    expected = expected_digests(trainer, ckpt, engine=engine, tp_size=2)
    assert expected == engine_digests(ckpt, engine=engine, tp_size=2)
    _, ranks = dump(hybrids, tmp_path, engine)
    for r, tensors in enumerate(ranks):
        for name, array in tensors.items():
            live = name.replace("self_attn.mla_attn.", "self_attn.")  # named_parameters()
            assert expected[DIGEST_KEY.format(rank=r, name=live)] == param_digest(array), name
    mla = sorted(k.split("self_attn.")[1] for k in expected if k.startswith("dp0:pp0:pcp0:tp1:")
                 and ".layers.1." in k)
    absorbed = "mla_attn.mla_attn." if "glm" in engine else ""
    assert f"{absorbed}W_UK_T" in mla and f"{absorbed}W_UV" in mla
    assert len(mla) == MLA_COUNT[engine] + 2
    # KDA tensors alone: the KDA digests (what a KDA-only refit sends); part of a layer: refused
    kda_only = expected_digests({n: t for n, t in trainer.items() if ".layers.1." not in n},
                                ckpt, engine=engine, tp_size=2)
    assert kda_only == {k: v for k, v in expected.items() if ".layers.1." not in k}
    with pytest.raises(kda_tp.CheckpointError, match="do not complete MLA layer 1: it lacks "
                                                     ".*kv_b_proj.weight"):
        expected_digests({n: t for n, t in trainer.items() if "layers.1.self_attn.kv_b" not in n},
                         ckpt, engine=engine, tp_size=2)
