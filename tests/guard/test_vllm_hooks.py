"""The guard inside vLLM 0.33.0 decides which model and which checkpoint it checks, and a
guard that cannot arm never stops the engine, only a KDA load in mode fail: the main model whatever the
speculative method, the checkpoint variable, a model id resolved in the engine's download
directory, ``audit_llm``'s report of a worker with and without the guard, every hook armed
after vLLM's own plugin loading. Built as test_vllm.py's (helpers: vllm_guard.py)."""

from __future__ import annotations

import types
import warnings

import pytest

from vllm_guard import CKPT, build, default_load, fake_llm, loading_as, model_config, set_rank, vllm, worker

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # vLLM's own import-time deprecations
    from vllm.config import LoadConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.reload import inplace

from kda_tp import GuardError
from kda_tp.guard import CHECKPOINT_ENV, MODE_ENV
from kda_tp.guard.vllm import audit_llm

pytestmark = [pytest.mark.engines, pytest.mark.usefixtures("guard_env_unset")]



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
        vc, monkeypatch, tmp_path, caplog, guard_log):
    monkeypatch.setenv(CHECKPOINT_ENV, str(tmp_path / "typo"))
    with pytest.raises(GuardError, match=f"{CHECKPOINT_ENV}='.*typo' does not exist"):
        default_load(vc, build(vc, "glm", 2, 1), CKPT["glm"])
    monkeypatch.setenv(MODE_ENV, "warn")
    with pytest.warns(RuntimeWarning, match="does not exist"):
        default_load(vc, build(vc, "glm", 2, 1), CKPT["glm"])
    monkeypatch.setenv(MODE_ENV, "fail")
    monkeypatch.setenv(CHECKPOINT_ENV, f" {CKPT['glm']}\n")
    with guard_log:
        default_load(vc, build(vc, "glm", 2, 1), CKPT["glm"])
    assert caplog.records[-1].getMessage().endswith(": OK")


def test_a_model_id_is_resolved_in_the_engines_download_dir(monkeypatch, tmp_path):
    import huggingface_hub
    from kda_tp.guard._modes import load_checkpoint
    seen = {}

    def snapshot_download(repo, revision=None, cache_dir=None, local_files_only=False):
        seen.update(repo=repo, cache_dir=cache_dir, local_files_only=local_files_only)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    found = load_checkpoint("org/kda-model", "DefaultModelLoader", "vllm: tp rank 0/1",
                            download_dir="/data/models")
    assert found.checkpoint == str(tmp_path) and found.check_load and not found.dummy
    assert seen == {"repo": "org/kda-model", "cache_dir": "/data/models",
                    "local_files_only": True}


def test_audit_llm_carries_the_real_reason_and_the_armed_record(vc, tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v3", "hidden_size": 64}')
    model = build(vc, "glm", 2, 0)
    default_load(vc, model, CKPT["glm"])
    report, silent = audit_llm(fake_llm([(0, worker(model, tmp_path, load_config=None))], 2))
    assert (silent["tp_rank"], silent["guarded"]) == (1, False)  # only rank 0 is asked here
    assert report["ok"] is None and report["guarded"] is True
    assert report["line"].startswith("not checked: kda_tp guard: vllm audit: tp rank 0/2: ")
    assert "describes no KDA layer" in report["line"]
    assert report["versions"]["vllm"] == vllm.__version__ and report["versions"]["kda_tp"]
    assert report["hooks"]["vllm.model_executor.model_loader.reload.inplace.reload_weights"] \
        == "armed"
    assert report["checks"]["first load"] >= 1 and report["last"].endswith(": OK")


def test_a_worker_without_the_guard_is_reported_unguarded(monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")

    def collective_rpc(method, kwargs=None):
        raise AttributeError(f"'Worker' object has no attribute '{method}'")

    with pytest.warns(RuntimeWarning, match="VLLM_PLUGINS='some_other_plugin' leaves out"):
        (report,) = audit_llm(types.SimpleNamespace(collective_rpc=collective_rpc))
    assert report["guarded"] is False and report["ok"] is None
    assert report["line"].startswith("unguarded: the workers do not answer kda_tp_audit")
    reports = audit_llm(types.SimpleNamespace(collective_rpc=lambda m, kwargs=None: [None]))
    assert reports[0]["guarded"] is False and "worker 0 answered None" in reports[0]["line"]


@pytest.fixture
def record_kept(monkeypatch):
    """The process's hook record as it was, after the test (a stand-in's missing target
    would make every later KDA load refuse)."""
    from kda_tp.guard._record import RECORD
    monkeypatch.setattr(RECORD, "hooks", dict(RECORD.hooks))
    monkeypatch.setattr(RECORD, "installed", dict(RECORD.installed))
    return RECORD


def test_a_missing_hook_target_never_stops_the_engine_and_refuses_a_kda_load(
        vc, monkeypatch, caplog, record_kept):
    """Issue 39 item 5: a vLLM whose reload module lacks ``reload_weights``: one WARNING, no
    exception (mode fail); a model with no KDA layer loads; a KDA model is refused at its
    first load naming vLLM's version, the target and KDA_TP_GUARD=warn, and loads with one
    warning in mode warn."""
    import logging
    import torch
    from kda_tp.guard.vllm import status
    from kda_tp.guard.vllm.plugin import _wrap_reload
    target = "vllm.model_executor.model_loader.reload.inplace.reload_weights"
    record_kept.installed.pop(target)  # this process's vLLM, as if it had none to wrap
    with caplog.at_level(logging.WARNING, logger="kda_tp.guard"):
        _wrap_reload(types.SimpleNamespace())  # a vLLM whose reload module lost reload_weights
    warned = [r.getMessage() for r in caplog.records if r.name == "kda_tp.guard"]
    assert len(warned) == 1 and f"cannot hook {target} (not in vLLM {vllm.__version__})" \
        in warned[0], warned
    assert status()["hooks"][target] == f"missing: not in vLLM {vllm.__version__}"
    plain = torch.nn.Linear(2, 2)  # a model with no KDA layer: loads
    plain.load_weights = lambda weights: [None for _ in weights] and {"weight", "bias"}
    with set_current_vllm_config(vc):
        DefaultModelLoader(LoadConfig()).load_weights(plain, model_config(CKPT["glm"]))
    with pytest.raises(GuardError) as refused:
        default_load(vc, build(vc, "glm", 2, 0), CKPT["glm"])
    text = str(refused.value)
    assert f"vllm {vllm.__version__}: this KDA model's weights cannot be checked" in text
    assert f"could not hook {target}" in text and f"{MODE_ENV}=warn" in text
    monkeypatch.setenv(MODE_ENV, "warn")
    with pytest.warns(RuntimeWarning, match="could not hook"):
        default_load(vc, build(vc, "glm", 2, 0), CKPT["glm"])


def test_every_hook_is_armed_after_vllms_own_plugin_loading(vc):
    from kda_tp.guard.vllm import status
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

