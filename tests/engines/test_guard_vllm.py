"""The guard inside vLLM 0.33.0 (issue 20), on CPU: installed by vLLM's own
``load_general_plugins()`` from kda_tp's ``vllm.general_plugins`` entry point, run by vLLM's own
loader classes (``DefaultModelLoader``, ``ShardedStateLoader``) and ``reload_weights`` around
the real KDA layer classes and their model class's ``load_weights``.

As in the fixtures' recipe (tests/data/engine_ranks/make/vllm_rank.py): the tensor-parallel
group is faked (``parallel_state._TP`` holding ``world_size`` and ``rank_in_group``), and a
stand-in module holding only ``layers.0.self_attn`` goes through the model class's
``load_weights`` (vLLM's full model constructors need CUDA). Every loading bug below is made
with vLLM's own classes or by wrapping one of its weight loaders, and stops the load with the
parameter named."""

from __future__ import annotations

import logging
import os
import shutil
import types
import warnings
from pathlib import Path

import pytest

pytestmark = pytest.mark.engines

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # vLLM's own import-time deprecations
    vllm = pytest.importorskip("vllm")
    import torch
    import vllm.distributed.parallel_state as ps
    from safetensors.torch import save_file
    from vllm.config import LoadConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.linear import ColumnParallelLinear
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.reload import inplace
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader
    from vllm.plugins import load_general_plugins
    from vllm.v1.worker.worker_base import WorkerBase

from kda_tp import GuardError
from kda_tp.guard import CHECKPOINT_ENV, MODE_ENV
from kda_tp.vllm_plugin import WORKER_METHOD, audit_llm

from paths import ENGINE_RANKS as DATA
from vllm_layers import kda_classes

CKPT = {"k3": DATA / "ckpt_k3", "kimi_linear": DATA / "ckpt_kl", "glm": DATA / "ckpt_glm"}
H, D, K, HIDDEN = 12, 128, 4, 64  # the fixtures' geometry (make/make_ckpt.py)
ATTN = "model.layers.0.self_attn."


def fake_group(world_size: int, rank: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(world_size=world_size, rank_in_group=rank, rank=rank,
                                 local_rank=0, device_group=None, cpu_group=None,
                                 ranks=list(range(world_size)))


def set_rank(tp_size: int, rank: int) -> None:
    ps._TP = fake_group(tp_size, rank)
    ps._PP = fake_group(1, 0)


@pytest.fixture(scope="module")
def vc():
    """vLLM's config as the fixtures' recipe sets it, the plugins loaded by vLLM itself."""
    load_general_plugins()
    config = VllmConfig()
    config.model_config = types.SimpleNamespace(dtype=torch.float32, hf_config=None)
    return config


@pytest.fixture(autouse=True)
def _fail_mode(monkeypatch):
    monkeypatch.delenv(MODE_ENV, raising=False)
    monkeypatch.delenv(CHECKPOINT_ENV, raising=False)


def model_config(path: Path) -> types.SimpleNamespace:
    """The ModelConfig fields vLLM's loaders read."""
    return types.SimpleNamespace(
        model=str(path), model_weights="", revision=None, quantization=None,
        dtype=torch.float32, multimodal_config=None, is_moe=False, get_num_experts=lambda: 0)


def build(vc, kind: str, tp_size: int, rank: int, *, o_proj_rows: bool = False,
          decode_copies: bool = False) -> torch.nn.Module:
    """A stand-in model (``model.layers.0.self_attn``: vLLM's KDA layer of ``kind`` for
    ``rank`` of ``tp_size``), whose ``load_weights`` is the model class's. ``decode_copies``:
    K3's layer as the native decode backend builds it, with ``decode_conv1d_weight`` and
    ``decode_norm_weight`` (on CPU the Triton backend has none)."""
    set_rank(tp_size, rank)
    vc.compilation_config.static_forward_context.clear()
    with set_current_vllm_config(vc):
        cfg, Layer, Model = kda_classes(kind, heads=H, head_dim=D, kernel=K, hidden=HIDDEN)
        if decode_copies:  # the native fused decode backend (CUDA) keeps K3's decode copies
            import vllm.models.kimi_k3.nvidia.kda as k3_kda
            from unittest import mock
            with mock.patch.object(k3_kda, "is_fused_kda_decode_supported", lambda *a: True):
                layer = Layer(cfg, vc, prefix="model.layers.0.self_attn")
        else:
            layer = Layer(cfg, vc, prefix="model.layers.0.self_attn")
        if o_proj_rows:  # the bug: o_proj built column-parallel, its rows split across ranks
            layer.o_proj = ColumnParallelLinear(H * D, HIDDEN, bias=False,
                                                prefix="model.layers.0.self_attn.o_proj")
    inner = torch.nn.Module()
    inner.config = cfg
    inner.is_fused_shared_expert_enabled = False
    inner.layers = torch.nn.ModuleList([torch.nn.Module()])
    inner.layers[0].self_attn = layer
    outer = torch.nn.Module()
    outer.model = inner

    def load_weights(weights):
        with set_current_vllm_config(vc):
            loaded = Model.load_weights(inner, ((n.removeprefix("model."), w) for n, w in weights))
        return {"model." + n for n in loaded}  # names of the stand-in's parameters

    outer.load_weights = load_weights
    return outer


def default_load(vc, model, path: Path) -> None:
    with set_current_vllm_config(vc):
        DefaultModelLoader(LoadConfig()).load_weights(model, model_config(path))


def loading_as(model, tp_size: int, rank: int) -> None:
    """The bug of vllm-gguf-plugin #103 and kin: the weight loaders see rank ``rank`` while the
    worker is another rank of the group."""
    real = model.load_weights

    def load_weights(weights):
        group = ps._TP
        ps._TP = fake_group(tp_size, rank)
        try:
            return real(weights)
        finally:
            ps._TP = group

    model.load_weights = load_weights


# ------------------------------------------------------------------------------------------


def test_vllms_own_plugin_loader_installs_the_guard(vc):
    assert getattr(DefaultModelLoader.load_weights, "__kda_tp_guard__", False)
    assert getattr(ShardedStateLoader.load_weights, "__kda_tp_guard__", False)
    assert getattr(inplace.reload_weights, "__kda_tp_guard__", False)
    assert callable(getattr(WorkerBase, WORKER_METHOD))


@pytest.mark.parametrize("kind", ["k3", "kimi_linear", "glm"])
def test_every_family_passes_on_several_ranks_of_tp_2_and_4(vc, kind, caplog):
    for tp_size, ranks in ((2, (0, 1)), (4, (1, 3))):
        for rank in ranks:
            model = build(vc, kind, tp_size, rank)
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="kda_tp.guard"):
                default_load(vc, model, CKPT[kind])
            lines = [r.getMessage() for r in caplog.records if r.name == "kda_tp.guard"]
            assert len(lines) == 1, lines
            assert lines[0].startswith(
                f"kda_tp guard: vllm DefaultModelLoader: tp rank {rank}/{tp_size}: ")
            assert lines[0].endswith(" s: OK")
            print(lines[0])


def test_o_proj_row_sliced_stops_the_load(vc):
    model = build(vc, "k3", 4, 1, o_proj_rows=True)
    with pytest.raises(GuardError) as caught:
        default_load(vc, model, CKPT["k3"])
    assert f"rank 1 {ATTN}o_proj.weight: shape [16, 1536], expected [64, 384]" in str(caught.value)
    print(caught.value)


def test_every_rank_loading_rank_0s_slice_stops_the_load(vc):
    for rank in (1, 2, 3):
        model = build(vc, "kimi_linear", 4, 0)
        set_rank(4, rank)
        loading_as(model, 4, 0)
        with pytest.raises(GuardError) as caught:
            default_load(vc, model, CKPT["kimi_linear"])
        text = str(caught.value)
        assert f"rank {rank} {ATTN}in_proj_qkvgfab.weight: values differ in q_proj" in text
        assert "equals rank 0's slice of q_proj" in text
        assert f"rank {rank} {ATTN}o_proj.weight" in text
    print(text)


def test_two_ranks_swapped_stop_the_load(vc):
    for rank, other in ((1, 2), (2, 1)):
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
    print(text)


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
        vc, tmp_path, monkeypatch, caplog):
    sharded_state(vc, "k3", 2, tmp_path / "dump")
    with pytest.warns(RuntimeWarning, match=f"set {CHECKPOINT_ENV} to the checkpoint"):
        sharded_load(vc, "k3", 2, 1, tmp_path / "dump")
    monkeypatch.setenv(CHECKPOINT_ENV, str(CKPT["k3"]))
    with caplog.at_level(logging.INFO, logger="kda_tp.guard"):
        sharded_load(vc, "k3", 2, 1, tmp_path / "dump")
    assert caplog.records[-1].getMessage().startswith(
        "kda_tp guard: vllm ShardedStateLoader: tp rank 1/2: 7 KDA parameters (vllm-0.33-k3)")
    os.replace(tmp_path / "dump" / "model-rank-0-part-0.safetensors",
               tmp_path / "dump" / "model-rank-1-part-0.safetensors")
    with pytest.raises(GuardError) as caught:
        sharded_load(vc, "k3", 2, 1, tmp_path / "dump")
    assert "equals rank 0's slice of dt_bias" in str(caught.value)
    assert f"rank 1 {ATTN}dt_bias: values differ in dt_bias" in str(caught.value)


def test_warn_logs_and_loads_off_checks_nothing(vc, monkeypatch, caplog):
    monkeypatch.setenv(MODE_ENV, "warn")
    model = build(vc, "k3", 2, 0)
    set_rank(2, 1)
    loading_as(model, 2, 0)
    with caplog.at_level(logging.INFO, logger="kda_tp.guard"):
        default_load(vc, model, CKPT["k3"])
    (record,) = [r for r in caplog.records if r.name == "kda_tp.guard"]
    assert record.levelno == logging.WARNING and "equals rank 0's slice" in record.getMessage()
    monkeypatch.setenv(MODE_ENV, "off")
    caplog.clear()
    model = build(vc, "k3", 2, 0)
    set_rank(2, 1)
    loading_as(model, 2, 0)
    with caplog.at_level(logging.INFO, logger="kda_tp.guard"):
        default_load(vc, model, CKPT["k3"])
    assert not [r for r in caplog.records if r.name == "kda_tp.guard"]


def test_a_reload_from_disk_is_checked_against_the_new_checkpoint(vc, tmp_path, caplog):
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
    config = VllmConfig()
    config.model_config = model_config(CKPT["kimi_linear"])
    config.load_config = LoadConfig()
    assert isinstance(get_model_loader(config.load_config), DefaultModelLoader)
    with caplog.at_level(logging.INFO, logger="kda_tp.guard"), set_current_vllm_config(vc):
        inplace.reload_weights(config, model, None, str(new), True)  # the worker's call
    assert config.model_config.model == str(new)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kda_tp.guard"]
    assert line.startswith("kda_tp guard: vllm reload_weights: tp rank 1/2: ") and line.endswith("OK")
    loading_as(model, 2, 0)  # now the reload loads rank 0's slices
    caplog.clear()
    with pytest.raises(GuardError) as caught, set_current_vllm_config(vc), caplog.at_level(logging.INFO, logger="kda_tp.guard"):
        try:
            inplace.reload_weights(config, model, None, str(new), True)
        finally:
            print("LOG", [r.getMessage()[:300] for r in caplog.records if r.name == "kda_tp.guard"])
            print("P", [(n, float(p.detach().flatten()[1])) for n, p in model.named_parameters()])
    assert f"differ from {new}:" in str(caught.value)
    assert "equals rank 0's slice of " in str(caught.value)  # the loaders asking the group
    print(caught.value)


def test_audit_llm_reports_every_worker(vc):
    workers = []
    for rank in range(2):
        model = build(vc, "glm", 2, rank)
        default_load(vc, model, CKPT["glm"])
        config = types.SimpleNamespace(model_config=model_config(CKPT["glm"]),
                                       speculative_config=None)
        workers.append((rank, types.SimpleNamespace(
            model_runner=types.SimpleNamespace(get_model=lambda m=model: m), vllm_config=config)))
    with torch.no_grad():  # rank 1's o_proj overwritten after start-up
        workers[1][1].model_runner.get_model().model.layers[0].self_attn.o_proj.weight.zero_()

    def collective_rpc(method):
        out = []
        for rank, worker in workers:
            set_rank(2, rank)
            out.append(getattr(WorkerBase, method)(worker))
        return out

    reports = audit_llm(types.SimpleNamespace(collective_rpc=collective_rpc))
    assert [r["tp_rank"] for r in reports] == [0, 1]
    assert reports[0]["ok"] is True and reports[0]["line"].endswith(": OK")
    assert reports[1]["ok"] is False and reports[1]["report"]["ok"] is False
    (wrong,) = [p for p in reports[1]["report"]["params"] if p["status"] != "exact"]
    assert wrong["name"] == f"{ATTN}o_proj.weight"
    assert wrong["differences"][0]["equals"].startswith("zeros (never loaded?)")


def test_a_modelopt_block_scale_is_checked_in_the_shape_vllm_squeezes_it_to(vc):
    from kda_tp.vllm_plugin import _as_processed
    loaded = torch.arange(6, dtype=torch.float32).reshape(2, 1, 3, 1)  # [ob, 1, ib, 1]
    out = _as_processed(f"{ATTN}o_proj.weight_scale", loaded)
    assert out.shape == (2, 3) and out.data_ptr() == loaded.data_ptr()
    assert _as_processed(f"{ATTN}A_log", loaded) is loaded


def test_k3s_decode_copies_are_checked_and_a_stale_one_stops_the_guard(vc, caplog):
    from kda_tp.vllm_plugin import guard_model
    model = build(vc, "k3", 4, 2, decode_copies=True)
    layer = model.model.layers[0].self_attn
    assert layer.decode_conv1d_weight is not None and layer.decode_norm_weight is not None
    with caplog.at_level(logging.INFO, logger="kda_tp.guard"):
        default_load(vc, model, CKPT["k3"])
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kda_tp.guard"]
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
        vc, tmp_path, monkeypatch, caplog):
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
    config = VllmConfig()
    config.model_config = model_config(CKPT["kimi_linear"])
    config.load_config = LoadConfig()
    with caplog.at_level(logging.INFO, logger="kda_tp.guard"), set_current_vllm_config(vc):
        inplace.reload_weights(config, model, None, str(new), True)  # a right reload: OK
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kda_tp.guard"]
    assert line.startswith("kda_tp guard: vllm reload_weights: tp rank 1/2: ") and line.endswith("OK")
    # (Checked against the variable's ckpt_kl, this right reload failed: "differ from ...ckpt_kl".)
    loading_as(model, 2, 0)  # now the reload loads rank 0's slices of the new checkpoint
    with pytest.raises(GuardError) as caught, set_current_vllm_config(vc):
        inplace.reload_weights(config, model, None, str(new), True)
    assert f"differ from {new}:" in str(caught.value)


def test_a_kda_model_without_a_log_and_dt_bias_fails_in_fail_and_warns_in_warn(vc, monkeypatch):
    from kda_tp.vllm_plugin import guard_model
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


# -- issue 27.1/27.2: the model decides, fail fails ------------------------------------------


def spec_config(method: str, target: types.SimpleNamespace) -> types.SimpleNamespace:
    """vLLM's config with speculative decoding as ``vllm/config/speculative.py`` sets it up:
    n-gram, suffix and custom_class reuse the target's ModelConfig as ``draft_model_config``;
    EAGLE / MTP build a separate one with ``runner="draft"`` (``runner_type == "draft"``)."""
    if method in ("ngram", "suffix", "custom_class"):
        draft = target
    else:
        draft = types.SimpleNamespace(**vars(target), runner_type="draft")
    spec = types.SimpleNamespace(method=method, draft_model_config=draft,
                                 target_model_config=target)
    return types.SimpleNamespace(model_config=target, speculative_config=spec, load_config=None)


@pytest.mark.parametrize("method", ["ngram", "suffix", "custom_class", "eagle", "mtp"])
def test_the_main_model_is_checked_whatever_the_speculative_method(vc, method, monkeypatch):
    target = model_config(CKPT["kimi_linear"])
    spec = spec_config(method, target).speculative_config
    model = build(vc, "kimi_linear", 4, 0)
    draft = build(vc, "kimi_linear", 4, 0)
    set_rank(4, 3)
    loading_as(model, 4, 0)  # rank 3 loads rank 0's slices
    loading_as(draft, 4, 0)
    monkeypatch.setattr(vc, "speculative_config", spec)  # vLLM's config while it loads
    with pytest.raises(GuardError, match="equals rank 0's slice of q_proj"), \
            set_current_vllm_config(vc):
        DefaultModelLoader(LoadConfig()).load_weights(model, target)
    if spec.draft_model_config is not target:  # a separate draft (EAGLE, MTP): skipped
        with set_current_vllm_config(vc):
            DefaultModelLoader(LoadConfig()).load_weights(draft, spec.draft_model_config)


def test_a_checkpoint_variable_that_is_not_there_fails_and_one_with_spaces_works(
        vc, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(CHECKPOINT_ENV, str(tmp_path / "typo"))
    with pytest.raises(GuardError, match=f"{CHECKPOINT_ENV}='.*typo' does not exist"):
        default_load(vc, build(vc, "glm", 2, 1), CKPT["glm"])
    monkeypatch.setenv(MODE_ENV, "warn")
    with pytest.warns(RuntimeWarning, match="does not exist"):
        default_load(vc, build(vc, "glm", 2, 1), CKPT["glm"])
    monkeypatch.setenv(MODE_ENV, "fail")
    monkeypatch.setenv(CHECKPOINT_ENV, f" {CKPT['glm']}\n")
    with caplog.at_level(logging.INFO, logger="kda_tp.guard"):
        default_load(vc, build(vc, "glm", 2, 1), CKPT["glm"])
    assert caplog.records[-1].getMessage().endswith(": OK")


def test_a_model_id_is_resolved_in_the_engines_download_dir(monkeypatch, tmp_path):
    import huggingface_hub
    from kda_tp.vllm_plugin import _checkpoint
    seen = {}

    def snapshot_download(repo, revision=None, cache_dir=None, local_files_only=False):
        seen.update(repo=repo, cache_dir=cache_dir, local_files_only=local_files_only)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    config = types.SimpleNamespace(model="org/kda-model", model_weights="", revision=None)
    assert _checkpoint(config, "DefaultModelLoader", None, "/data/models") == str(tmp_path)
    assert seen == {"repo": "org/kda-model", "cache_dir": "/data/models",
                    "local_files_only": True}


def test_audit_llm_carries_the_real_reason_and_the_armed_record(vc, tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v3", "hidden_size": 64}')
    model = build(vc, "glm", 2, 0)
    default_load(vc, model, CKPT["glm"])
    config = types.SimpleNamespace(model_config=model_config(tmp_path), speculative_config=None,
                                   load_config=None)
    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(get_model=lambda: model),
                                   vllm_config=config)
    set_rank(2, 0)
    (report,) = audit_llm(types.SimpleNamespace(
        collective_rpc=lambda method: [getattr(WorkerBase, method)(worker)]))
    assert report["ok"] is None and report["guarded"] is True
    assert report["line"].startswith("not checked: kda_tp guard: vllm audit: tp rank 0/2: ")
    assert "describes no KDA layer" in report["line"]
    assert report["versions"]["vllm"] == vllm.__version__ and report["versions"]["kda_tp"]
    assert report["hooks"]["vllm.model_executor.model_loader.reload.inplace.reload_weights"] \
        == "armed"
    assert report["checks"]["first load"] >= 1 and report["last"].endswith(": OK")


def test_a_worker_without_the_guard_is_reported_unguarded(monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")

    def collective_rpc(method):
        raise AttributeError(f"'Worker' object has no attribute '{method}'")

    with pytest.warns(RuntimeWarning, match="VLLM_PLUGINS='some_other_plugin' leaves out"):
        (report,) = audit_llm(types.SimpleNamespace(collective_rpc=collective_rpc))
    assert report["guarded"] is False and report["ok"] is None
    assert report["line"].startswith("unguarded: the workers do not answer kda_tp_audit")
    reports = audit_llm(types.SimpleNamespace(collective_rpc=lambda m: [None]))
    assert reports[0]["guarded"] is False and "worker 0 answered None" in reports[0]["line"]


def test_a_missing_hook_target_fails_in_fail_and_warns_in_warn(monkeypatch):
    from kda_tp.vllm_plugin import _wrap_reload, status
    gone = types.SimpleNamespace()  # a vLLM whose reload module lost reload_weights
    with pytest.raises(GuardError, match="cannot hook .*reload.inplace.reload_weights"):
        _wrap_reload(gone)
    monkeypatch.setenv(MODE_ENV, "warn")
    with pytest.warns(RuntimeWarning, match="cannot hook"):
        _wrap_reload(gone)
    target = "vllm.model_executor.model_loader.reload.inplace.reload_weights"
    assert status()["hooks"][target].startswith("missing: ")
    _wrap_reload(inplace)  # armed again (vLLM's own module: already wrapped)
    assert status()["hooks"][target] == "armed"


def test_every_hook_is_armed_after_vllms_own_plugin_loading(vc):
    from kda_tp.vllm_plugin import status
    import vllm.distributed.weight_transfer.factory  # noqa: F401
    import vllm.model_executor.model_loader.tensorizer_loader  # noqa: F401
    hooks = status()["hooks"]
    for target in ("base_loader.BaseModelLoader", "register_model_loader",
                   "reload.inplace.reload_weights",
                   "tensorizer_loader.TensorizerLoader._load_model_serialized_cpu"):
        assert hooks[f"vllm.model_executor.model_loader.{target}"] == "armed"
    assert hooks["vllm.distributed.weight_transfer.factory.WeightTransferEngineFactory."
                 "create_engine"] == "armed"
    assert hooks["vllm.v1.worker.worker_base.WorkerBase"] == "armed"


# -- issue 26: every update path is checked against what it fed ------------------------------


def fed(kind: str, scale: float = 2.0) -> list[tuple[str, torch.Tensor]]:
    """A trainer's refit of the fixture: every tensor of the checkpoint, values x ``scale``
    (new weights), in checkpoint names and layout."""
    from safetensors.torch import load_file
    return [(n, t * scale) for n, t in sorted(load_file(str(CKPT[kind] / "model.safetensors"))
                                              .items())]


def loaded(vc, kind: str, tp_size: int, rank: int) -> torch.nn.Module:
    """A model loaded by vLLM's own loader, as a worker holds it before the first refit."""
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    model = build(vc, kind, tp_size, rank)
    record_metadata_for_reloading(model)  # as vLLM's initialize_model does
    default_load(vc, model, CKPT[kind])
    return model


def guard_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kda_tp.guard"]


def expected_after(vc, kind: str, tp_size: int, rank: int, scale: float) -> dict[str, torch.Tensor]:
    """What the rank must hold after a refit with values x ``scale``: an independent model
    loaded with the same values by the model class's own load_weights."""
    model = build(vc, kind, tp_size, rank)
    with set_current_vllm_config(vc):
        Model_load = model.load_weights
        Model_load(fed(kind, scale))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["k3", "kimi_linear", "glm"])
def test_honest_refits_in_several_buckets_pass_on_every_path(vc, kind, caplog):
    tensors = fed(kind)
    buckets = [tensors[:5], tensors[5:9], tensors[9:]]
    model = loaded(vc, kind, 4, 2)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kda_tp.guard"), set_current_vllm_config(vc):
        for bucket in buckets:  # collective_rpc straight into the model's load_weights
            model.load_weights(iter(bucket))
    lines = guard_lines(caplog)
    assert len(lines) == 3, lines
    assert all(line.startswith("kda_tp guard: vllm load_weights: tp rank 2/4: ")
               and line.endswith(": OK") for line in lines)
    want = expected_after(vc, kind, 4, 2, 2.0)
    set_rank(4, 2)
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())
    caplog.clear()
    config = VllmConfig()
    config.model_config = model_config(CKPT[kind])
    config.load_config = LoadConfig()
    with caplog.at_level(logging.INFO, logger="kda_tp.guard"), set_current_vllm_config(vc):
        inplace.reload_weights(config, model, iter(fed(kind, 3.0)), None, True)
    (line,) = guard_lines(caplog)
    assert line.startswith("kda_tp guard: vllm reload_weights: tp rank 2/4: ")
    assert line.endswith(": OK")
    caplog.clear()
    engine = transfer_engine(vc, model, kind)
    with caplog.at_level(logging.INFO, logger="kda_tp.guard"), set_current_vllm_config(vc):
        run_session(engine, [fed(kind, 4.0)[:7], fed(kind, 4.0)[7:]])
    (line,) = guard_lines(caplog)
    assert line.startswith("kda_tp guard: vllm weight transfer: tp rank 2/4: ")
    assert line.endswith(": OK")
    print(line)


class _Bucket:
    """What the in-process "trainer" hands the engine for one update_weights call."""

    chunks: list[list[tuple[str, torch.Tensor]]] = []


def _engine_class():
    from dataclasses import dataclass as _dataclass

    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo)
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload, initialize_layerwise_reload)

    @_dataclass
    class InitInfo(WeightTransferInitInfo):
        pass

    @_dataclass
    class UpdateInfo(WeightTransferUpdateInfo):
        chunk: int = 0

    class InProcessEngine(WeightTransferEngine):
        """Built as vLLM 0.33's ipc engine is (``ipc_engine.py``): layerwise reload from
        start to finish, each chunk through the model's own load_weights; the trainer's
        tensors come from this process instead of CUDA IPC handles."""

        init_info_cls = InitInfo
        update_info_cls = UpdateInfo

        def init_transfer_engine(self, init_info):
            pass

        def start_weight_update(self):
            initialize_layerwise_reload(self.model)

        def finish_weight_update(self):
            finalize_layerwise_reload(self.model, self.model_config)

        def receive_weights(self, update_info):
            self.model.load_weights(list(_Bucket.chunks[update_info.chunk]))

        def shutdown(self):
            pass

    return InProcessEngine


def transfer_engine(vc, model, kind: str):
    """A weight-transfer engine made by vLLM's own factory (a backend registered by a user)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    if "kda_tp_test" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("kda_tp_test", _engine_class())
    config = VllmConfig()
    config.model_config = model_config(CKPT[kind])
    return WeightTransferEngineFactory.create_engine(
        types.SimpleNamespace(backend="kda_tp_test"), config, torch.device("cpu"), model)


def run_session(engine, chunks) -> None:
    """start_weight_update, one update_weights per chunk, finish_weight_update: what
    vLLM's worker does for LLM.start_weight_update / update_weights / finish_weight_update."""
    _Bucket.chunks = chunks
    engine.start_weight_update()
    for i in range(len(chunks)):
        engine.receive_weights(engine.parse_update_info({"chunk": i}))
    engine.finish_weight_update()


def test_q_rows_landing_in_ks_place_are_stopped_and_named(vc):
    model = loaded(vc, "k3", 2, 1)
    param = model.model.layers[0].self_attn.in_proj_qkvgfab.weight
    original = param.weight_loader
    last_q = {}

    def swapped(p, w, shard_id=None):  # the refit's loader writes q's rows where k's go
        if shard_id == 0:
            last_q["q"] = w
        return original(p, last_q["q"] if shard_id == 1 else w, shard_id)

    param.weight_loader = swapped
    tensors = sorted(fed("k3"), key=lambda t: "q_proj" not in t[0])  # q_proj first
    with pytest.raises(GuardError) as caught, set_current_vllm_config(vc):
        model.load_weights(iter(tensors))
    text = str(caught.value)
    assert f"rank 1 {ATTN}in_proj_qkvgfab.weight: k_proj: holds what was fed as " \
           f"{ATTN}q_proj.weight (this rank's slice), not {ATTN}k_proj.weight" in text
    assert "tp rank 1/2: " in text and "FAIL (1 wrong)" in text
    print(text)


@pytest.mark.parametrize("kind", ["kimi_linear", "glm"])
def test_a_fused_part_dropped_from_a_later_bucket_is_stopped(vc, kind, caplog):
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    model = build(vc, kind, 2, 0)
    real = model.load_weights
    calls = {"n": 0}

    def drops_later_parts(weights):  # SGLang #38298's pattern, in the model's load_weights:
        calls["n"] += 1  # a fused part arriving in a later call than the first is dropped
        later = calls["n"] > 2  # the first load, then the session's first chunk
        return real((n, w) for n, w in weights if not (later and "v_proj" in n))

    model.load_weights = drops_later_parts
    record_metadata_for_reloading(model)
    default_load(vc, model, CKPT[kind])
    suffix = {"kimi_linear": "in_proj_qkvgfab", "glm": "in_proj_qkvbfg_a"}[kind]
    tensors = fed(kind)
    first = [t for t in tensors if "v_proj" not in t[0]]
    later = [t for t in tensors if "v_proj" in t[0]]
    engine = transfer_engine(vc, model, kind)
    with pytest.raises(GuardError) as caught, set_current_vllm_config(vc):
        run_session(engine, [first, later])
    text = str(caught.value)
    assert "kda_tp guard: vllm weight transfer: tp rank 0/2: " in text
    assert f"rank 0 {ATTN}{suffix}.weight: v_proj: " in text
    print(text)


def test_a_sent_parameter_the_engine_never_applied_is_named(vc):
    model = loaded(vc, "glm", 4, 3)
    layer = model.model.layers[0].self_attn
    layer.dt_bias.weight_loader = lambda p, w, *a: None  # the refit drops dt_bias
    with pytest.raises(GuardError) as caught, set_current_vllm_config(vc):
        model.load_weights(iter(fed("glm")))
    text = str(caught.value)
    assert (f"rank 3 {ATTN}dt_bias: dt_bias: holds the values from before the update: "
            f"{ATTN}dt_bias was fed but the engine never applied it") in text
    print(text)


def merged_conv(layer) -> torch.Tensor:
    """The statement of vLLM 0.33's ``Glm5NextLinearAttention._forward`` that builds
    ``_merged_conv_weight`` on the first forward (the forward itself needs a GPU kernel)."""
    def _w(m):
        return m.weight.view(m.weight.size(0), m.weight.size(2))
    return torch.cat([_w(layer.q_conv1d), _w(layer.k_conv1d), _w(layer.v_conv1d)], dim=0).contiguous()


def test_glm_merged_conv_weight_stale_after_a_reload_is_named_and_the_repair_switch_fixes_it(
        vc, monkeypatch, caplog):
    from kda_tp.vllm_plugin import REPAIR_ENV
    model = loaded(vc, "glm", 2, 1)
    layer = model.model.layers[0].self_attn
    assert layer._merged_conv_weight is None  # vLLM builds it on the first forward
    layer._merged_conv_weight = merged_conv(layer)
    config = VllmConfig()
    config.model_config = model_config(CKPT["glm"])
    config.load_config = LoadConfig()
    with pytest.raises(GuardError) as caught, set_current_vllm_config(vc):
        inplace.reload_weights(config, model, iter(fed("glm")), None, True)
    text = str(caught.value)
    assert (f"rank 1 {ATTN}_merged_conv_weight: differs from what q_conv1d.weight and "
            "k_conv1d.weight and v_conv1d.weight makes of it at [0, 0]") in text
    assert "stale (built before the last update and never rebuilt: " \
           "https://github.com/vllm-project/vllm/issues/55087)" in text
    print(text)
    monkeypatch.setenv(REPAIR_ENV, "1")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kda_tp.guard"), set_current_vllm_config(vc):
        inplace.reload_weights(config, model, iter(fed("glm", 3.0)), None, True)
    assert layer._merged_conv_weight is None  # vLLM rebuilds it from the new convs
    assert guard_lines(caplog)[-1].endswith(": OK")


def test_a_kernel_format_reload_warns_that_it_is_not_checked(vc):
    model = loaded(vc, "k3", 2, 0)
    config = VllmConfig()
    config.model_config = model_config(CKPT["k3"])
    config.load_config = LoadConfig()
    state = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    with pytest.warns(RuntimeWarning, match="is_checkpoint_format=False feeds kernel-format"), \
            set_current_vllm_config(vc), torch.no_grad():
        inplace.reload_weights(config, model, iter(state), None, False)


def test_k3s_decode_copies_are_checked_after_every_update(vc, caplog):
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    model = build(vc, "k3", 4, 1, decode_copies=True)
    record_metadata_for_reloading(model)
    default_load(vc, model, CKPT["k3"])
    layer = model.model.layers[0].self_attn
    old = layer.decode_conv1d_weight.detach().clone()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kda_tp.guard"), set_current_vllm_config(vc):
        model.load_weights(iter(fed("k3")))  # vLLM's decode loaders refresh the copies
    assert guard_lines(caplog)[-1].endswith(": OK")
    assert not torch.equal(layer.decode_conv1d_weight, old)
    with torch.no_grad():
        layer.decode_conv1d_weight.copy_(old)  # a copy an update path left stale
    dt_bias = [(n, t) for n, t in fed("k3") if n.endswith("dt_bias")]
    with pytest.raises(GuardError) as caught, set_current_vllm_config(vc):
        model.load_weights(iter(dt_bias))  # the next update, of dt_bias alone
    assert (f"rank 1 {ATTN}decode_conv1d_weight: differs from what conv1d.weight makes of it "
            "at [0, 0, 0]") in str(caught.value)
