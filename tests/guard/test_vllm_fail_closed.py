"""The vLLM guard fails closed (issue 33, item 2), through vLLM 0.33.0's own plugin loader,
loaders and ``WorkerBase`` on CPU: a ``KDA_TP_GUARD_CHECKPOINT`` that cannot be checked
against (a URL) stops the load in mode ``fail``; the hooks are installed even when the mode is
invalid, so every load raises and a retry in the same process is guarded; a wrapper replaced
by someone else is reported "replaced by <qualname>", not armed; ``audit_llm`` reports every
rank the engine has, a silent or twice-answering rank as unguarded; ``KDA_TP_GUARD_REPAIR``
refuses an unknown value. Helpers in vllm_guard.py."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import types
import warnings

import pytest

from vllm_guard import CKPT, build, default_load, fake_llm, loaded, worker

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # vLLM's own import-time deprecations
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from kda_tp import GuardError
from kda_tp.errors import GuardModeError
from kda_tp.guard import CHECKPOINT_ENV, MODE_ENV, REPAIR_ENV
from kda_tp.guard._live import UPDATES_HOOK
from kda_tp.guard.vllm import audit_llm, status

pytestmark = [pytest.mark.engines, pytest.mark.usefixtures("guard_env_unset")]
LOADER = "vllm.model_executor.model_loader.default_loader.DefaultModelLoader.load_weights"


def test_a_checkpoint_variable_holding_a_url_stops_the_load_in_fail_and_warns_in_warn(
        vc, monkeypatch):
    monkeypatch.setenv(CHECKPOINT_ENV, f"file://{CKPT['kimi_linear']}")
    with pytest.raises(GuardError, match=f"{CHECKPOINT_ENV}='file://.*' is not a local path"):
        default_load(vc, build(vc, "kimi_linear", 2, 1), CKPT["kimi_linear"])
    monkeypatch.setenv(MODE_ENV, "warn")
    with pytest.warns(RuntimeWarning, match="is not a local path"):
        default_load(vc, build(vc, "kimi_linear", 2, 1), CKPT["kimi_linear"])


def test_an_invalid_mode_makes_every_hooked_load_raise(vc, monkeypatch):
    monkeypatch.setenv(MODE_ENV, "strict")
    with pytest.raises(GuardModeError, match="KDA_TP_GUARD='strict' is not a guard mode"):
        default_load(vc, build(vc, "kimi_linear", 2, 1), CKPT["kimi_linear"])


def test_a_bad_mode_at_registration_still_installs_the_hooks_so_a_retry_is_guarded():
    code = """
import os, warnings
warnings.simplefilter("ignore")
os.environ["KDA_TP_GUARD"] = "bogus"
from vllm.plugins import load_general_plugins
try:
    load_general_plugins()
    print("no error")
except Exception as error:
    print(type(error).__name__)
os.environ["KDA_TP_GUARD"] = "fail"
load_general_plugins()  # vLLM marked its plugins loaded: register() is not called again
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from kda_tp.guard.vllm import status
hooks = status()["hooks"]
print(getattr(DefaultModelLoader.load_weights, "__kda_tp_guard__", False), len(hooks),
      sorted(set(hooks.values())))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = done.stdout.strip().splitlines()[-2:]
    assert first == "GuardModeError"
    assert second.startswith("True ") and second.endswith(" ['armed']"), second
    assert int(second.split()[1]) >= 5


def test_a_replaced_loader_wrapper_is_reported_replaced_not_armed(vc, monkeypatch):
    ours = DefaultModelLoader.__dict__["load_weights"]
    assert LOADER not in status()["hooks"] or status()["hooks"][LOADER] == "armed"

    def load_weights(self, model, model_config):  # another plugin's, installed after kda_tp
        return None

    monkeypatch.setattr(DefaultModelLoader, "load_weights", load_weights)
    assert status()["hooks"][LOADER] == (
        f"replaced by {__name__}.test_a_replaced_loader_wrapper_is_reported_replaced_not_"
        "armed.<locals>.load_weights")

    # Issue 38 F4: functools.wraps' __wrapped__ proves nothing; the wrapper having run does.
    original = ours.__wrapped__

    @functools.wraps(ours)  # claims to wrap kda_tp's wrapper, calls vLLM's original: unguarded
    def bypass(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DefaultModelLoader, "load_weights", bypass)
    default_load(vc, build(vc, "kimi_linear", 2, 1), CKPT["kimi_linear"])
    assert status()["hooks"][LOADER].startswith("replaced by ")

    @functools.wraps(ours)  # one that calls kda_tp's wrapper: armed once it ran
    def around(self, *args, **kwargs):
        return ours(self, *args, **kwargs)

    monkeypatch.setattr(DefaultModelLoader, "load_weights", around)
    assert status()["hooks"][LOADER].startswith("replaced by ")  # not seen running yet
    runs = status()["runs"][LOADER]
    default_load(vc, build(vc, "kimi_linear", 2, 1), CKPT["kimi_linear"])
    assert status()["hooks"][LOADER] == "armed" and status()["runs"][LOADER] == runs + 1


def test_a_wraps_replacement_of_model_load_weights_calling_the_original_is_not_armed(vc):
    model = loaded(vc, "kimi_linear", 2, 1)
    ours = model.load_weights
    original = ours.__wrapped__

    @functools.wraps(ours)  # an RL stack's own, after the first load: bypasses the guard
    def bypass(weights):
        return original(weights)

    model.load_weights = bypass
    model.load_weights([])
    assert status()["hooks"][UPDATES_HOOK].startswith("replaced by ")

    @functools.wraps(ours)
    def around(weights):
        return ours(weights)

    model.load_weights = around
    model.load_weights([])
    assert status()["hooks"][UPDATES_HOOK] == "armed"


def test_a_followed_models_hook_goes_with_it(vc):
    """Issue 38 F3: the followed model garbage-collected, its hook state goes too: a later
    model that is not followed does not inherit "armed"."""
    import gc
    from kda_tp.guard._record import RECORD

    def followed_models() -> int:
        status()
        return len(RECORD.installed.get(UPDATES_HOOK, []))

    gc.collect()
    others = followed_models()  # models other tests still hold
    model = loaded(vc, "kimi_linear", 2, 1)
    assert followed_models() == others + 1 and status()["hooks"][UPDATES_HOOK] == "armed"
    del model
    gc.collect()
    assert followed_models() == others
    unfollowed = build(vc, "kimi_linear", 2, 1)  # never loaded through a guarded loader
    assert unfollowed is not None
    if not others:
        assert UPDATES_HOOK not in status()["hooks"]


def test_a_replaced_model_load_weights_is_reported_by_the_live_audit(vc):
    model = loaded(vc, "kimi_linear", 2, 1)
    assert status()["hooks"][UPDATES_HOOK] == "armed"
    model.load_weights = lambda weights: None  # an RL framework's own, after the first load
    assert status()["hooks"][UPDATES_HOOK].startswith("replaced by ")
    [report] = audit_llm(_llm([(1, worker(model, CKPT["kimi_linear"]))], 2))[1:]
    assert report["hooks"][UPDATES_HOOK].startswith("replaced by ")


def _llm(workers, tp_size: int, engine_tp: int | None = None):
    llm = fake_llm(workers, tp_size)
    if engine_tp is not None:
        llm.llm_engine = types.SimpleNamespace(vllm_config=types.SimpleNamespace(
            parallel_config=types.SimpleNamespace(tensor_parallel_size=engine_tp,
                                                  pipeline_parallel_size=1,
                                                  data_parallel_rank=0)))
    return llm


def test_audit_llm_reports_every_rank_a_silent_one_and_a_duplicate_unguarded(vc):
    one = worker(loaded(vc, "kimi_linear", 2, 1), CKPT["kimi_linear"])
    # TP 2, rank 0 silent: two entries, rank 0 unguarded
    silent, answered = audit_llm(_llm([(1, one)], 2))
    assert (silent["tp_rank"], silent["guarded"], silent["ok"]) == (0, False, None)
    assert "tp rank 0/2: unguarded: did not answer" in silent["line"]
    assert (answered["tp_rank"], answered["ok"]) == (1, True)
    # the engine says TP 4: every missing rank named
    reports = audit_llm(_llm([(1, one)], 2, engine_tp=4))
    assert [(r["tp_rank"], r["guarded"]) for r in reports] == [
        (0, False), (1, True), (2, False), (3, False)]
    # one rank twice: that rank unguarded
    (rank_0, twice) = audit_llm(_llm([(1, one), (1, one)], 2))
    assert (twice["tp_rank"], twice["guarded"]) == (1, False)
    assert "answered 2 times in one audit" in twice["line"]
    # nobody answers: never []
    (nobody,) = audit_llm(types.SimpleNamespace(collective_rpc=lambda method, kwargs=None: []))
    assert nobody["guarded"] is False and "no worker answered" in nobody["line"]


@pytest.mark.parametrize("value,on", [("1", True), ("ON", True), (" Yes ", True),
                                      ("", False), ("0", False), ("Off", False)])
def test_the_repair_switch_ignores_case_and_refuses_an_unknown_value(vc, monkeypatch, value, on):
    from kda_tp.guard._modes import repair_on

    monkeypatch.setenv(REPAIR_ENV, value)
    assert repair_on() is on
    monkeypatch.setenv(REPAIR_ENV, "maybe")
    monkeypatch.setenv(MODE_ENV, "fail")
    from kda_tp.guard._live import repair
    model = _holding_a_derived_copy(loaded(vc, "glm", 2, 1))
    with pytest.raises(GuardModeError, match="KDA_TP_GUARD_REPAIR='maybe' is not a repair"):
        repair(model)  # where the repair acts, mode fail refuses the unknown value


def _holding_a_derived_copy(model):
    """GLM's model as after ``process_weights_after_loading``: its merged conv copy held (what
    the repair drops)."""
    import torch
    model.model.layers[0].self_attn._merged_conv_weight = torch.zeros(1)
    return model


@pytest.mark.parametrize("guard_mode", ["off", "warn"])
@pytest.mark.parametrize("kind", ["glm", "kimi_linear"])
def test_an_invalid_repair_value_stops_no_honest_load_in_modes_off_and_warn(
        vc, monkeypatch, guard_mode, kind):
    """F19: ``KDA_TP_GUARD_REPAIR=maybe`` is read only where the repair acts, and in modes
    off and warn it stops no honest load (GLM's derived copies: one warning, no repair; a
    model without derived copies never reads it)."""
    monkeypatch.setenv(MODE_ENV, guard_mode)
    monkeypatch.setenv(REPAIR_ENV, "maybe")
    from kda_tp.guard._live import repair
    model = build(vc, kind, 2, 1)
    default_load(vc, model, CKPT[kind])  # no derived copy held: the variable is never read
    if kind != "glm":
        return
    _holding_a_derived_copy(model)
    with pytest.warns(RuntimeWarning, match="'maybe' is not a repair setting.*no repair"):
        repair(model)  # where it acts: one warning, no repair, no refusal
    assert model.model.layers[0].self_attn._merged_conv_weight is not None


def test_audit_llm_audits_an_rl_refit_against_the_checkpoint_given(vc, tmp_path):
    """F16: after an honest refit (values x 2), ``audit_llm(llm)`` audits against the model
    path (every refitted parameter differs: said, not judged, issue 40 item 3);
    ``audit_llm(llm, checkpoint=...)`` against the refit's source, as SGLang's
    ``audit_engine`` does: OK."""
    import shutil

    from safetensors.torch import save_file

    from vllm_guard import fed
    model = loaded(vc, "kimi_linear", 2, 1)
    with vllm_config_of(vc):
        model.load_weights(fed("kimi_linear", 2.0))
    refit = tmp_path / "refit"
    shutil.copytree(CKPT["kimi_linear"], refit)
    save_file({n: t.contiguous() for n, t in fed("kimi_linear", 2.0)},
              str(refit / "model.safetensors"))
    llm = _llm([(1, worker(model, CKPT["kimi_linear"]))], 2)
    [stale] = audit_llm(llm)[1:]  # against the start-up checkpoint: named, not judged
    assert stale["ok"] is None and "differences after a refit are expected" in stale["line"]
    [report] = audit_llm(llm, checkpoint=refit)[1:]
    assert report["ok"] is True, report["line"]


def vllm_config_of(vc):
    from vllm.config import set_current_vllm_config
    return set_current_vllm_config(vc)


@pytest.mark.parametrize("answer,named", [
    ({"tp_size": 10**7, "tp_rank": 0}, "tp_size 10000000 is not a size"),
    ({"tp_size": "two", "tp_rank": 0}, "tp_size 'two' is not a size"),
    ({"tp_size": 2, "tp_rank": 10**400}, "tp_rank <an integer of 1329 bits> is not a rank"),
    ({"tp_size": True, "tp_rank": 0}, "tp_size True is not a size"),
])
def test_audit_llm_refuses_sizes_in_workers_answers_by_name_fast(answer, named):
    """F17: a worker's ``tp_size`` of 10**7 or ``"two"`` (or a huge rank) is a named,
    unguarded entry at once: no 10**7-entry list, no raw ValueError."""
    import time
    start = time.perf_counter()
    reports = audit_llm(types.SimpleNamespace(collective_rpc=lambda method, kwargs=None: [answer]))
    assert time.perf_counter() - start < 1.0
    [refused] = reports
    assert refused["guarded"] is False and refused["ok"] is None
    assert named in refused["line"], refused["line"]


def test_audit_llm_refuses_an_engine_config_of_too_many_ranks():
    llm = types.SimpleNamespace(collective_rpc=lambda method, kwargs=None: [], llm_engine=types.SimpleNamespace(
        vllm_config=types.SimpleNamespace(parallel_config=types.SimpleNamespace(
            tensor_parallel_size=60000, pipeline_parallel_size=60000, data_parallel_rank=0))))
    [refused] = audit_llm(llm)
    assert refused["guarded"] is False and "more than 65536: refused" in refused["line"]


def test_mode_off_at_first_load_then_fail_checks_the_later_refit_and_off_is_not_guarded(
        vc, monkeypatch):
    """F3: the model is followed in every mode, the mode read at each call: off at the first
    load, fail later => the later wrong refit is refused. F4: in mode off the live audit
    answers ``guarded: False``."""
    from vllm_guard import fed, loading_as
    monkeypatch.setenv(MODE_ENV, "off")
    model = loaded(vc, "kimi_linear", 2, 1)
    [off] = audit_llm(_llm([(1, worker(model, CKPT["kimi_linear"]))], 2))[1:]
    assert off["guarded"] is False and off["mode"] == "off"
    monkeypatch.setenv(MODE_ENV, "fail")
    loading_as(model, 2, 0)  # the refit's loader writes rank 0's shards on rank 1
    with vllm_config_of(vc), pytest.raises(GuardError):
        model.load_weights(fed("kimi_linear", 2.0))
    [on] = audit_llm(_llm([(1, worker(model, CKPT["kimi_linear"]))], 2))[1:]
    assert on["guarded"] is True
