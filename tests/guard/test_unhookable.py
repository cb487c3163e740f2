"""Issue 39 item 5: the plugins never break an engine they cannot hook. Stand-in engines, each
lacking one hooked target (a vLLM module without what the guard wraps; an SGLang whose
``HookRegistry`` could not apply one target): the plugin arms what it can, says in one
WARNING what it could not, and never raises into the engine; SGLang's first load of a model
with no KDA layer goes on (one WARNING), of a KDA model is refused in mode fail naming
SGLang's version, the target and ``KDA_TP_GUARD=warn``. Issue 38 F4: an SGLang hook is armed
only while the wrapper SGLang's registry put there still holds its target (or what replaced it
was seen running the guard's function). No engine is imported: the stand-ins are modules made
here (vLLM's own loaders lacking a target: tests/guard/test_vllm_hooks.py)."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from kda_tp import GuardError
from kda_tp.guard import MODE_ENV
from kda_tp.guard._record import RECORD
from kda_tp.guard.sglang import plugin as sglang_plugin
from kda_tp.guard.vllm import plugin as vllm_plugin

#: vLLM module -> what its stand-in keeps (all the installer wraps, but ``missing``).
VLLM_TARGETS = {
    "vllm.model_executor.model_loader.utils": ["process_weights_after_loading"],
    "vllm.model_executor.model_loader.reload.layerwise": ["initialize_layerwise_reload",
                                                          "finalize_layerwise_processing"],
    "vllm.model_executor.model_loader": ["register_model_loader"],
    "vllm.model_executor.model_loader.reload.inplace": ["reload_weights"],
    "vllm.model_executor.model_loader.tensorizer_loader": ["TensorizerLoader"],
    "vllm.distributed.weight_transfer.factory": ["WeightTransferEngineFactory"],
    "vllm.v1.worker.worker_base": ["WorkerBase"],
}
CASES = [(module, lacking) for module, kept in VLLM_TARGETS.items() for lacking in kept]


@pytest.fixture
def record(monkeypatch, caplog):
    """The process's guard record, restored after the test; the guard's WARNINGs captured."""
    monkeypatch.setattr(RECORD, "hooks", {})
    monkeypatch.setattr(RECORD, "installed", {})
    monkeypatch.delenv(MODE_ENV, raising=False)  # mode fail
    caplog.set_level(logging.WARNING, logger="kda_tp.guard")
    return RECORD


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "kda_tp.guard" and r.levelno == logging.WARNING]


@pytest.mark.parametrize("module,lacking", CASES)
def test_a_vllm_lacking_one_hooked_target_starts_with_one_warning(record, caplog, module,
                                                                  lacking):
    stand_in = types.ModuleType(module)
    for name in VLLM_TARGETS[module]:
        if name != lacking:
            setattr(stand_in, name, lambda *a, **k: None)
    vllm_plugin._INSTALLERS[module](stand_in)  # in mode fail: nothing raised
    missing = {t: why for t, why in record.hooks.items() if why.startswith("missing: ")}
    said = warnings_of(caplog)
    assert len(missing) == 1 and len(said) == 1, (missing, said)
    [target] = missing
    assert f"cannot hook {target} (" in said[0] and "the engine starts" in said[0]
    assert f"{MODE_ENV}=warn" in said[0]


def test_an_installer_error_never_reaches_the_engines_import(record, caplog):
    class Broken(types.ModuleType):
        def __getattr__(self, name):
            raise RuntimeError(f"{name}: a vLLM of another shape")

    vllm_plugin._INSTALLERS["vllm.v1.worker.worker_base"](Broken("vllm.v1.worker.worker_base"))
    assert record.hooks["vllm.v1.worker.worker_base"].startswith("missing: RuntimeError: ")
    assert len(warnings_of(caplog)) == 1


# -- SGLang ----------------------------------------------------------------------------------


class _Owner:
    """A stand-in class holding one of SGLang's hooked methods."""


@pytest.fixture
def sglang(monkeypatch, record):
    """A stand-in SGLang 9.9.9: a module for every hooked target's owner (a class holding the
    method, wrapped as SGLang's ``HookRegistry`` wraps it), and a ``HookRegistry`` whose
    ``_patched`` names what it applied (every target unless a test takes one out)."""
    root = types.ModuleType("sglang")
    root.__version__ = "9.9.9"
    modules = {"sglang": root}
    owners = {}
    for target in sglang_plugin.TARGETS:
        path, attr = target.rsplit(".", 1)
        module_path, cls = path.rsplit(".", 1)
        parts = module_path.split(".")
        for i in range(2, len(parts) + 1):
            modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        owner = getattr(modules[module_path], cls, None)
        if owner is None:
            owner = type(cls, (_Owner,), {})
            setattr(modules[module_path], cls, owner)
        setattr(owner, attr, lambda *a, **k: None)  # SGLang's wrapper in place
        owners[target] = (owner, attr)
    registry = types.ModuleType("sglang.srt.plugins.hook_registry")
    registry.HookRegistry = types.SimpleNamespace(_patched=set(sglang_plugin.TARGETS))
    modules["sglang.srt.plugins.hook_registry"] = registry
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return types.SimpleNamespace(registry=registry.HookRegistry, owners=owners)


def runner(*names: str) -> types.SimpleNamespace:
    """A model runner whose model holds parameters ``names``."""
    model = types.SimpleNamespace(named_parameters=lambda: [(n, None) for n in names])
    return types.SimpleNamespace(model=model, is_draft_worker=False)


PLAIN = runner("model.layers.0.mlp.down_proj.weight")
KDA = runner("model.layers.0.self_attn.A_log", "model.layers.0.self_attn.dt_bias")


@pytest.mark.parametrize("lacking", sglang_plugin.TARGETS)
def test_an_sglang_lacking_one_target_starts_a_model_with_no_kda_layer_with_one_warning(
        sglang, record, caplog, lacking):
    sglang.registry._patched.discard(lacking)
    sglang_plugin._check_armed(PLAIN)  # mode fail: nothing raised
    said = warnings_of(caplog)
    assert len(said) == 1 and f"{lacking}: missing: not applied" in said[0], said
    assert "sglang 9.9.9" in said[0] and "the engine starts" in said[0]
    assert [t for t, why in record.hooks.items() if why != "armed"] == [lacking]


def test_an_sglang_lacking_a_target_refuses_a_kda_model_naming_what_proceeds(sglang, record,
                                                                             monkeypatch):
    lacking = sglang_plugin.TARGETS[6]  # begin_weight_update
    sglang.registry._patched.discard(lacking)
    with pytest.raises(GuardError) as refused:
        sglang_plugin._check_armed(KDA)
    text = str(refused.value)
    assert "sglang 9.9.9" in text and lacking in text and f"{MODE_ENV}=warn" in text
    monkeypatch.setenv(MODE_ENV, "warn")
    with pytest.warns(RuntimeWarning, match="cannot be checked on every path"):
        sglang_plugin._check_armed(KDA)


def test_an_sglang_hook_is_armed_only_while_its_wrapper_holds_the_target(sglang, record):
    """F4: ``HookRegistry._patched`` is taken once, for what holds the target then."""
    assert set(sglang_plugin.hooks().values()) == {"armed"}
    target = sglang_plugin.TARGETS[2]  # update_weights_from_disk
    owner, attr = sglang.owners[target]
    applied = owner.__dict__[attr]

    def replacement(*args, **kwargs):  # another plugin's, calling SGLang's original directly
        return None

    setattr(owner, attr, replacement)
    assert sglang_plugin.hooks()[target].startswith("replaced by ")
    assert target in sglang.registry._patched  # the registry still says applied
    setattr(owner, attr, applied)
    assert sglang_plugin.hooks()[target] == "armed"
