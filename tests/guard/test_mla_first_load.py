"""The guard's first-load check judges a hybrid's MLA parameters as vLLM 0.33.0's and SGLang
0.5.23's own MLA classes hold them after their models' ``load_weights`` on CPU.

A hybrid of each family (``kda_tp.synth``: layer 0 KDA, layer 1 MLA, 4 MLA heads) is loaded at
TP 2 by the engine's own MLA class (tests/mla_engine_child.py, one child process per engine and
family); each rank's parameters are its MLA layer as the engine loaded it beside its KDA layer as
the engine layout builds it (the KDA layer's own loading is judged by test_vllm.py and
test_sglang.py). An honest load passes with both counts in the line; the bugs a loader makes in
an MLA layer (rank 1's ``kv_b_proj`` holding rank 0's rows, ``o_proj`` holding rank 0's
columns, the fused ``kv_a`` rows holding ``q_a``'s, a replicated norm holding something else),
put into what the engine loaded, are stopped in mode ``fail`` and reported in ``warn``, the
wrong parameter named.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kda_tp
from kda_tp.engines import LAYOUTS, build_param
from kda_tp.engines.derived import MLA_DERIVED
from kda_tp.errors import GuardError, GuardWarning
from kda_tp.guard import MODE_ENV, check
from kda_tp.synth import write_small_checkpoint
from paths import TESTS

pytestmark = pytest.mark.engines
pytest.importorskip("vllm")
pytest.importorskip("sglang")

STYLES = {"k3": "k3", "glm": "glm"}
LAYOUT = {("vllm", "k3"): "vllm-0.33-k3", ("vllm", "glm"): "vllm-0.33-glm-5.3",
          ("sglang", "k3"): "sglang-0.5.23-k3"}
MLA_LAYER, TP = 1, 2


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    """``(engine, kind) -> (checkpoint, folder)``: each hybrid loaded once at TP 2 by the
    engine's own MLA class, every rank's held parameters in ``folder/tp2_r{rank}``."""
    done: dict[tuple[str, str], tuple[Path, Path]] = {}

    def load(engine: str, kind: str) -> tuple[Path, Path]:
        if (engine, kind) not in done:
            root = tmp_path_factory.mktemp(f"{engine}-{kind}")
            ckpt = write_small_checkpoint(root / "ckpt", 64, 4, 16, 4, 16, 2, [0],
                                          style=STYLES[kind])
            out = root / "held"
            out.mkdir()
            proc = subprocess.run(
                [sys.executable, str(TESTS / "mla_engine_child.py"), engine, kind, str(ckpt),
                 str(MLA_LAYER), str(out), str(TP)],
                capture_output=True, text=True, timeout=900, check=False)
            assert proc.returncode == 0, proc.stderr[-4000:]
            done[engine, kind] = ckpt, out
        return done[engine, kind]

    return load


def rank_params(loads, engine: str, kind: str, rank: int) -> tuple[Path, dict, str]:
    """The checkpoint, rank ``rank``'s parameters (its KDA layer built, its MLA layer as the
    engine loaded it) and the prefix of the MLA layer's names."""
    ckpt, params, mla, _ = rank_held(loads, engine, kind, rank)
    return ckpt, params, mla


def rank_held(loads, engine: str, kind: str, rank: int) -> tuple[Path, dict, str, dict]:
    """:func:`rank_params` and the copies the engine derived from the MLA layer's
    ``kv_b_proj`` (vLLM's ``W_UK_T``/``W_UV`` after ``process_weights_after_loading``,
    SGLang's ``w_kc``/``w_vc`` after ``load_weights``), by full name."""
    from safetensors.torch import load_file

    ckpt, out = loads(engine, kind)
    layout = LAYOUTS[LAYOUT[engine, kind]]
    view = kda_tp.open_rank(ckpt, tp_rank=rank, tp_size=TP, qk_multiple=1, mla=True)
    base = layout.state_dict_prefix(view.prefix)
    params = {f"{base}0.self_attn.{p.suffix}": build_param(view, layout, p.suffix, 0,
                                                           model_dtype="BF16")
              for p in layout.params_for(view.plan)}
    mla = f"{base}{MLA_LAYER}.self_attn."
    held = load_file(str(out / f"tp{TP}_r{rank}.safetensors"))
    params.update({mla + n: t for n, t in held.items() if not n.startswith("derived.")})
    derived = {mla + n.removeprefix("derived."): t for n, t in held.items()
               if n.startswith("derived.")}
    return ckpt, params, mla, derived


@pytest.fixture(autouse=True)
def _default_mode(monkeypatch):
    monkeypatch.delenv(MODE_ENV, raising=False)


@pytest.mark.parametrize(("engine", "kind"), sorted(LAYOUT), ids=lambda x: str(x))
def test_an_honest_load_passes_with_the_mla_parameters_counted(engine, kind, loads, caplog,
                                                               guard_log):
    layout = LAYOUTS[LAYOUT[engine, kind]]
    for rank in range(TP):
        ckpt, params, mla, derived = rank_held(loads, engine, kind, rank)
        view = kda_tp.open_rank(ckpt, tp_rank=rank, tp_size=TP, qk_multiple=1, mla=True)
        kda, mlas = len(layout.params_for(view.plan)), len(layout.mla_params_for(view.mla))
        assert sum(n.startswith(mla) for n in params) == mlas
        assert {n.removeprefix(mla) for n in derived} == set(MLA_DERIVED[layout.name])
        caplog.clear()
        with guard_log:
            result = check(params, ckpt, tp_rank=rank, tp_size=TP, where="test worker",
                           derived=derived)
        assert result is not None and result.passed, result.text()
        assert sum(p.mla for p in result.report.params) == mlas
        mlas += len(derived)  # the derived copies, judged as MLA parameters
        assert (result.params, result.mla, result.mla_unchecked) == (kda + mlas, mlas, "")
        assert result.bytes == sum(t.nbytes for t in [*params.values(), *derived.values()])
        assert re.fullmatch(
            rf"kda_tp guard: test worker: tp rank {rank}/{TP}: {kda} KDA and {mlas} MLA "
            rf"parameters \({layout.name}\), {result.bytes} bytes, [0-9.]+ s: OK",
            result.line()), result.line()
        assert [r.getMessage() for r in caplog.records] == [result.line()]


def _rows_of(params: dict, name: str, rank0: dict) -> None:
    params[name] = rank0[name].clone()


def kv_b_of_rank_0(params, rank0, mla, engine):
    """A column-parallel ``kv_b_proj`` loaded with rank 0's rows."""
    _rows_of(params, mla + "kv_b_proj.weight", rank0)
    return mla + "kv_b_proj.weight", "kv_b_proj"


def o_proj_of_rank_0(params, rank0, mla, engine):
    """A row-parallel ``o_proj`` loaded with rank 0's columns."""
    _rows_of(params, mla + "o_proj.weight", rank0)
    return mla + "o_proj.weight", "o_proj"


def kv_a_holding_q_a(params, rank0, mla, engine):
    """The fused ``kv_a`` rows holding ``q_a``'s first rows (the streamer class of bug)."""
    name = mla + ("fused_qkv_a_g_proj.weight" if engine == "vllm"
                  else "fused_qkv_a_proj_with_mqa.weight")
    held = params[name].clone()
    q_a, kv_a = 192, 72  # the hybrid's q_lora_rank; kv_lora_rank + qk_rope_head_dim
    held[q_a:q_a + kv_a] = held[:kv_a]
    params[name] = held
    return name, "kv_a_proj_with_mqa"


def norm_holding_another(params, rank0, mla, engine):
    """A replicated ``kv_a_layernorm`` holding something else."""
    name = mla + "kv_a_layernorm.weight"
    params[name] = params[name] + 1
    return name, "kv_a_layernorm"


BUGS = [kv_b_of_rank_0, o_proj_of_rank_0, kv_a_holding_q_a, norm_holding_another]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("bug", BUGS, ids=lambda b: b.__name__)
def test_a_wrong_mla_parameter_stops_the_load_named(engine, bug, loads):
    _, rank0, _ = rank_params(loads, engine, "k3", 0)
    ckpt, params, mla = rank_params(loads, engine, "k3", 1)
    name, part = bug(params, rank0, mla, engine)
    with pytest.raises(GuardError) as caught:
        check(params, ckpt, tp_rank=1, tp_size=TP, where="test worker")
    text = str(caught.value)
    assert text.startswith(f"kda_tp guard: test worker: tp rank 1/{TP}: ")
    assert " MLA parameters (" in text.splitlines()[0] and "FAIL (1 wrong)" in text
    assert "the KDA and MLA weights this rank loaded differ" in text
    assert f"rank 1 {name}: values differ in " in text and part in text
    if bug in (kv_b_of_rank_0, o_proj_of_rank_0):
        assert f"equals rank 0's slice of {part}" in text
    assert [p.name for p in caught.value.report.failures] == [name]
    assert caught.value.report.failures[0].mla


@pytest.mark.parametrize("bug", BUGS, ids=lambda b: b.__name__)
def test_warn_reports_the_same_wrong_mla_parameter(bug, loads, monkeypatch, caplog, guard_log):
    monkeypatch.setenv(MODE_ENV, "warn")
    _, rank0, _ = rank_params(loads, "vllm", "k3", 0)
    ckpt, params, mla = rank_params(loads, "vllm", "k3", 1)
    name, _ = bug(params, rank0, mla, "vllm")
    with guard_log, pytest.warns(GuardWarning) as warned:
        result = check(params, ckpt, tp_rank=1, tp_size=TP)
    assert result is not None and not result.passed and result.mla == 6
    (record,) = caplog.records
    assert record.levelno == logging.ERROR
    assert f"rank 1 {name}: values differ" in record.getMessage()
    assert [str(w.message) for w in warned] == [record.getMessage()]


def test_mla_layers_the_plan_refuses_are_reported_not_refused(tmp_path, caplog, guard_log):
    import json

    ckpt = write_small_checkpoint(tmp_path / "ckpt", 64, 4, 16, 4, 16, 2, [0], style="k3")
    config = json.loads((ckpt / "config.json").read_text())
    text = config.get("text_config", config)
    del text["kv_lora_rank"]  # an MLA size the config lacks: the MLA plan is refused
    (ckpt / "config.json").write_text(json.dumps(config))
    layout = LAYOUTS["vllm-0.33-k3"]
    view = kda_tp.open_rank(ckpt, tp_rank=1, tp_size=TP, qk_multiple=1)
    base = layout.state_dict_prefix(view.prefix)
    params = {f"{base}0.self_attn.{p.suffix}": build_param(view, layout, p.suffix, 0,
                                                           model_dtype="BF16")
              for p in layout.params_for(view.plan)}
    with guard_log:
        result = check(params, ckpt, tp_rank=1, tp_size=TP, model_dtype="BF16")
    assert result is not None and result.passed and result.mla == 0
    assert result.mla_unchecked.startswith(f"MLA layers [{MLA_LAYER}]: ")
    assert "kv_lora_rank" in result.mla_unchecked
    line = result.line()
    assert f": 7 KDA parameters ({layout.name})" in line
    assert line.endswith(f", MLA not checked: {result.mla_unchecked}: OK")
    assert [r.getMessage() for r in caplog.records] == [line]


@pytest.mark.parametrize(("engine", "copy"), [("vllm", "W_UK_T"), ("vllm", "W_UV"),
                                              ("sglang", "w_kc"), ("sglang", "w_vc")])
def test_a_derived_copy_of_another_ranks_kv_b_proj_is_named_as_itself(engine, copy, loads):
    _, _, _, rank0 = rank_held(loads, engine, "k3", 0)
    ckpt, params, mla, derived = rank_held(loads, engine, "k3", 1)
    derived[mla + copy] = rank0[mla + copy]  # built from rank 0's kv_b_proj rows
    with pytest.raises(GuardError) as caught:
        check(params, ckpt, tp_rank=1, tp_size=TP, derived=derived)
    text = str(caught.value)
    assert f"rank 1 {mla}{copy}: differs from what kv_b_proj.weight makes of it at " in text
    assert caught.value.report.failures == []  # every parameter exact: only the copy is wrong
    assert caught.value.result.mla == (6 if engine == "vllm" else 7) + 2


def test_the_adapters_find_the_mla_copies_once_built():
    import torch

    from kda_tp.guard._derived import mla_copies

    model = torch.nn.Module()
    model.attn = torch.nn.Module()
    model.attn.w_kc = None  # SGLang's, before post_load_weights builds it
    assert mla_copies(model) == {}
    model.attn.w_kc = torch.ones(2, 3, 4)
    model.attn.register_parameter("W_UK_T", torch.nn.Parameter(torch.ones(2, 3, 4)))
    assert sorted(mla_copies(model)) == ["attn.W_UK_T", "attn.w_kc"]
