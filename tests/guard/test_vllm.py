"""The guard inside vLLM 0.33.0, on CPU: installed by vLLM's own
``load_general_plugins()`` from kda_tp's ``vllm.general_plugins`` entry point, run by vLLM's own
loader classes (``DefaultModelLoader``, ``ShardedStateLoader``) and ``reload_weights`` around
the real KDA layer classes and their model class's ``load_weights``.

As in the fixtures' recipe (tests/data/engine_ranks/make/vllm_rank.py): the tensor-parallel
group is faked (``parallel_state._TP`` holding ``world_size`` and ``rank_in_group``), and a
stand-in module holding only ``layers.0.self_attn`` goes through the model class's
``load_weights`` (vLLM's full model constructors need CUDA). Every loading bug below is made
with vLLM's own classes or by wrapping one of its weight loaders, and stops the load with the
parameter named. The helpers are in vllm_guard.py; the checks of which model,
which checkpoint, every hook armed are in test_vllm_hooks.py, those of every update
path) in test_vllm_updates.py."""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path

import pytest

from vllm_guard import (ATTN, CKPT, D, build, default_load, fake_llm, loading_as, model_config,
                        reload_config, set_rank, worker)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # vLLM's own import-time deprecations
    import torch
    from safetensors.torch import save_file
    from vllm.config import LoadConfig, set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.reload import inplace
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader
    from vllm.v1.worker.worker_base import WorkerBase

from kda_tp import GuardError
from kda_tp.errors import GuardWarning
from kda_tp.guard import CHECKPOINT_ENV, MODE_ENV
from kda_tp.guard.vllm import WORKER_METHOD, audit_llm

pytestmark = [pytest.mark.engines, pytest.mark.usefixtures("guard_env_unset")]



def test_vllms_own_plugin_loader_installs_the_guard(vc):
    assert getattr(DefaultModelLoader.load_weights, "__kda_tp_guard__", False)
    assert getattr(ShardedStateLoader.load_weights, "__kda_tp_guard__", False)
    assert getattr(inplace.reload_weights, "__kda_tp_guard__", False)
    assert callable(getattr(WorkerBase, WORKER_METHOD))


@pytest.mark.parametrize("tp_size, rank", [(2, 0), (2, 1), (4, 1), (4, 3)])
@pytest.mark.parametrize("kind", ["k3", "kimi_linear", "glm"])
def test_every_family_passes_on_several_ranks_of_tp_2_and_4(vc, kind, tp_size, rank, guard_log):
    model = build(vc, kind, tp_size, rank)
    with guard_log:
        default_load(vc, model, CKPT[kind])
    lines = guard_log.lines
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        f"kda_tp guard: vllm DefaultModelLoader: tp rank {rank}/{tp_size}: ")
    assert lines[0].endswith(" s: OK")


def test_o_proj_row_sliced_stops_the_load(vc):
    model = build(vc, "k3", 4, 1, o_proj_rows=True)
    with pytest.raises(GuardError) as caught:
        default_load(vc, model, CKPT["k3"])
    assert f"rank 1 {ATTN}o_proj.weight: shape [16, 1536], expected [64, 384]" in str(caught.value)


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_every_rank_loading_rank_0s_slice_stops_the_load(vc, rank):
    model = build(vc, "kimi_linear", 4, 0)
    set_rank(4, rank)
    loading_as(model, 4, 0)
    with pytest.raises(GuardError) as caught:
        default_load(vc, model, CKPT["kimi_linear"])
    text = str(caught.value)
    assert f"rank {rank} {ATTN}in_proj_qkvgfab.weight: values differ in q_proj" in text
    assert "equals rank 0's slice of q_proj" in text
    assert f"rank {rank} {ATTN}o_proj.weight" in text


@pytest.mark.parametrize("rank, other", [(1, 2), (2, 1)])
def test_two_ranks_swapped_stop_the_load(vc, rank, other):
    model = build(vc, "glm", 4, other)
    set_rank(4, rank)
    loading_as(model, 4, other)
    with pytest.raises(GuardError) as caught:
        default_load(vc, model, CKPT["glm"])
    text = str(caught.value)
    assert f"rank {rank} {ATTN}in_proj_qkvbfg_a.weight" in text
    assert f"equals rank {other}'s slice of v_proj" in text
    assert f"rank {rank} {ATTN}q_conv1d.weight" in text


def test_a_fused_sub_block_shifted_by_a_head_stops_the_load(vc):
    model = build(vc, "k3", 2, 1)
    param = model.model.layers[0].self_attn.in_proj_qkvgfab.weight
    original = param.weight_loader

    def shifted(p, loaded, shard_id=None):  # k_proj's rows taken one head late
        if shard_id == 1:
            loaded = torch.roll(loaded, -D, 0)
        return original(p, loaded, shard_id)

    param.weight_loader = shifted
    with pytest.raises(GuardError) as caught:
        default_load(vc, model, CKPT["k3"])
    text = str(caught.value)
    assert f"rank 1 {ATTN}in_proj_qkvgfab.weight: values differ in k_proj" in text
    assert "(its [0, 0]; expected 10768.0, got 10896.0)" in text


def sharded_state(vc, kind: str, tp_size: int, out: Path) -> None:
    """``save_sharded_state`` of each rank (its ``state_dict()``), as vLLM writes it."""
    out.mkdir()
    shutil.copy(CKPT[kind] / "config.json", out)
    for rank in range(tp_size):
        model = build(vc, kind, tp_size, rank)
        default_load(vc, model, CKPT[kind])
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  str(out / f"model-rank-{rank}-part-0.safetensors"))


def sharded_load(vc, kind: str, tp_size: int, rank: int, path: Path) -> None:
    model = build(vc, kind, tp_size, rank)
    with set_current_vllm_config(vc):
        ShardedStateLoader(LoadConfig(load_format="sharded_state")).load_weights(
            model, model_config(path))


def test_sharded_state_checked_against_the_checkpoint_and_a_part_of_another_rank_stops_it(
        vc, tmp_path, monkeypatch, caplog, guard_log):
    sharded_state(vc, "k3", 2, tmp_path / "dump")
    with pytest.warns(RuntimeWarning, match=f"set {CHECKPOINT_ENV} to the checkpoint"):
        sharded_load(vc, "k3", 2, 1, tmp_path / "dump")
    monkeypatch.setenv(CHECKPOINT_ENV, str(CKPT["k3"]))
    with guard_log:
        sharded_load(vc, "k3", 2, 1, tmp_path / "dump")
    assert caplog.records[-1].getMessage().startswith(
        "kda_tp guard: vllm ShardedStateLoader: tp rank 1/2: 7 KDA parameters (vllm-0.33-k3)")
    os.replace(tmp_path / "dump" / "model-rank-0-part-0.safetensors",
               tmp_path / "dump" / "model-rank-1-part-0.safetensors")
    with pytest.raises(GuardError) as caught:
        sharded_load(vc, "k3", 2, 1, tmp_path / "dump")
    assert "equals rank 0's slice of dt_bias" in str(caught.value)
    assert f"rank 1 {ATTN}dt_bias: values differ in dt_bias" in str(caught.value)


def test_warn_logs_and_loads_off_checks_nothing(vc, monkeypatch, guard_log):
    monkeypatch.setenv(MODE_ENV, "warn")
    model = build(vc, "k3", 2, 0)
    set_rank(2, 1)
    loading_as(model, 2, 0)
    with guard_log, pytest.warns(GuardWarning, match="FAIL"):
        default_load(vc, model, CKPT["k3"])
    (record,) = guard_log.records
    assert record.levelno == logging.ERROR and "equals rank 0's slice" in record.getMessage()
    monkeypatch.setenv(MODE_ENV, "off")
    guard_log.clear()
    model = build(vc, "k3", 2, 0)
    set_rank(2, 1)
    loading_as(model, 2, 0)
    with guard_log:
        default_load(vc, model, CKPT["k3"])
    assert not guard_log.records


def test_a_reload_from_disk_is_checked_against_the_new_checkpoint(vc, tmp_path, vllm_log):
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    model = build(vc, "kimi_linear", 2, 1)
    record_metadata_for_reloading(model)  # as vLLM's initialize_model does
    default_load(vc, model, CKPT["kimi_linear"])
    # The "new" checkpoint, elsewhere: the same weights.
    new = tmp_path / "new"
    new.mkdir()
    shutil.copy(CKPT["kimi_linear"] / "config.json", new)
    save_file(load_file(str(CKPT["kimi_linear"] / "model.safetensors")), str(new / "model.safetensors"))
    config = reload_config("kimi_linear")
    assert isinstance(get_model_loader(config.load_config), DefaultModelLoader)
    with vllm_log:
        inplace.reload_weights(config, model, None, str(new), True)  # the worker's call
    assert config.model_config.model == str(new)
    (line,) = vllm_log.lines
    assert line.startswith("kda_tp guard: vllm reload_weights: tp rank 1/2: ") and line.endswith("OK")
    loading_as(model, 2, 0)  # now the reload loads rank 0's slices
    vllm_log.clear()
    with pytest.raises(GuardError) as caught, vllm_log:
        inplace.reload_weights(config, model, None, str(new), True)
    assert f"differ from {new}:" in str(caught.value)
    assert "equals rank 0's slice of " in str(caught.value)  # the loaders asking the group


def test_audit_llm_reports_every_worker(vc):
    workers = []
    for rank in range(2):
        model = build(vc, "glm", 2, rank)
        default_load(vc, model, CKPT["glm"])
        workers.append((rank, worker(model, CKPT["glm"])))
    with torch.no_grad():  # rank 1's o_proj overwritten after start-up
        workers[1][1].model_runner.get_model().model.layers[0].self_attn.o_proj.weight.zero_()

    reports = audit_llm(fake_llm(workers, 2))
    assert [r["tp_rank"] for r in reports] == [0, 1]
    assert reports[0]["ok"] is True and reports[0]["line"].endswith(": OK")
    assert reports[1]["ok"] is False and reports[1]["report"]["ok"] is False
    (wrong,) = [p for p in reports[1]["report"]["params"] if p["status"] != "exact"]
    assert wrong["name"] == f"{ATTN}o_proj.weight"
    assert wrong["differences"][0]["equals"].startswith("zeros (never loaded?)")


def test_a_modelopt_block_scale_is_checked_in_the_shape_vllm_squeezes_it_to(vc):
    from kda_tp.guard.vllm.repacked import as_described
    loaded = torch.arange(6, dtype=torch.float32).reshape(2, 1, 3, 1)  # [ob, 1, ib, 1]
    out = as_described(f"{ATTN}o_proj.weight_scale", loaded)
    assert out.shape == (2, 3) and out.data_ptr() == loaded.data_ptr()
    assert as_described(f"{ATTN}A_log", loaded) is loaded


def test_k3s_decode_copies_are_checked_and_a_stale_one_stops_the_guard(vc, guard_log):
    from kda_tp.guard.vllm import guard_model
    model = build(vc, "k3", 4, 2, decode_copies=True)
    layer = model.model.layers[0].self_attn
    assert layer.decode_conv1d_weight is not None and layer.decode_norm_weight is not None
    with guard_log:
        default_load(vc, model, CKPT["k3"])
    (line,) = guard_log.lines
    assert "tp rank 2/4: 9 KDA parameters (vllm-0.33-k3)" in line and line.endswith("OK")
    other = build(vc, "k3", 4, 1, decode_copies=True)
    default_load(vc, other, CKPT["k3"])
    with torch.no_grad():  # rank 2 keeps rank 1's decode conv copy (e.g. a reload that skips it)
        layer.decode_conv1d_weight.copy_(other.model.layers[0].self_attn.decode_conv1d_weight)
    set_rank(4, 2)
    with pytest.raises(GuardError) as caught, set_current_vllm_config(vc):
        guard_model(model, model_config(CKPT["k3"]))
    assert (f"rank 2 {ATTN}decode_conv1d_weight: differs from what conv1d.weight makes of it "
            "at [0, 0, 0] (expected 768.0, got 384.0)") in str(caught.value)


def test_register_imports_nothing_and_installs_when_vllm_imports_its_loaders():
    import subprocess
    import sys
    code = """
import logging, sys, warnings
warnings.simplefilter("ignore")
logging.basicConfig(level=logging.INFO)
from vllm.plugins import load_general_plugins
load_general_plugins()
late = [m for m in ("vllm.model_executor.model_loader", "vllm.v1.worker.worker_base") if m in sys.modules]
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader
from vllm.model_executor.model_loader.reload import inplace
from vllm.v1.worker.worker_base import WorkerBase
print(late, [getattr(f, "__kda_tp_guard__", False) for f in (
    DefaultModelLoader.load_weights, ShardedStateLoader.load_weights, inplace.reload_weights)],
    hasattr(WorkerBase, "kda_tp_audit"))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[] [True, True, True] True"
    (line,) = [x for x in done.stderr.splitlines() if "kda_tp guard: registered" in x]
    assert line.endswith("kda_tp guard: registered in vLLM (mode fail): checks the KDA weights "
                         "of every model load and weight update on every rank")


def test_a_reload_from_a_path_is_checked_against_that_path_not_the_variable(
        vc, tmp_path, monkeypatch, vllm_log):
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    monkeypatch.setenv(CHECKPOINT_ENV, str(CKPT["kimi_linear"]))
    model = build(vc, "kimi_linear", 2, 1)
    record_metadata_for_reloading(model)
    default_load(vc, model, CKPT["kimi_linear"])
    # A new checkpoint: every value x2.
    new = tmp_path / "new"
    new.mkdir()
    shutil.copy(CKPT["kimi_linear"] / "config.json", new)
    save_file({k: v * 2 for k, v in load_file(str(CKPT["kimi_linear"] / "model.safetensors")).items()},
              str(new / "model.safetensors"))
    config = reload_config("kimi_linear")
    with vllm_log:
        inplace.reload_weights(config, model, None, str(new), True)  # a right reload: OK
    (line,) = vllm_log.lines
    assert line.startswith("kda_tp guard: vllm reload_weights: tp rank 1/2: ") and line.endswith("OK")
    # (Checked against the variable's ckpt_kl, this right reload failed: "differ from ...ckpt_kl".)
    loading_as(model, 2, 0)  # now the reload loads rank 0's slices of the new checkpoint
    with pytest.raises(GuardError) as caught, set_current_vllm_config(vc):
        inplace.reload_weights(config, model, None, str(new), True)
    assert f"differ from {new}:" in str(caught.value)


def test_a_kda_model_without_a_log_and_dt_bias_fails_in_fail_and_warns_in_warn(vc, monkeypatch):
    from kda_tp.guard.vllm import guard_model
    model = build(vc, "k3", 2, 0)
    layer = model.model.layers[0].self_attn
    del layer.A_log, layer.dt_bias
    with pytest.raises(GuardError, match="no ...self_attn.A_log or ...self_attn.dt_bias"), \
            set_current_vllm_config(vc):
        guard_model(model, model_config(CKPT["k3"]))
    monkeypatch.setenv(MODE_ENV, "warn")
    with pytest.warns(RuntimeWarning, match="no ...self_attn.A_log or ...self_attn.dt_bias"), \
            set_current_vllm_config(vc):
        assert guard_model(model, model_config(CKPT["k3"])) is None

