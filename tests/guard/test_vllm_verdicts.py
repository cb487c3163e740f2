"""The guard's verdicts reach the person running vLLM whatever vLLM's logging level (issue 40,
item 2): TRL sets ``VLLM_LOGGING_LEVEL=ERROR``, which vLLM's handlers and logger obey; the
guard's lines go through its own logger and handler (``kda_tp.guard._modes``), so in a process
so set an honest load's OK line stays INFO on stderr, a wrong refit's FAIL line is ERROR (with
a GuardWarning) in mode warn, and in mode fail the ERROR line is written before the GuardError
leaves the worker (what verl's receiver masks). Run in a child process: vLLM configures its
logging as ``vllm.LLM()`` does (``configure_logging_if_needed``, from the environment); the model is vLLM 0.33's own KDA layer, loaded by its
own DefaultModelLoader and refit through the model class's own load_weights."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from paths import TESTS

if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs vLLM 0.33 (the engines venv)", allow_module_level=True)

pytestmark = pytest.mark.engines

ATTN = "model.layers.0.self_attn."
CHILD = """
import logging, os, sys, types, warnings
sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "guard")]
warnings.simplefilter("ignore")  # vLLM's own import-time deprecations
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging_if_needed
from vllm.plugins import load_general_plugins
import vllm_guard as g
from kda_tp import GuardError
configure_logging_if_needed(LoggingConfig())  # as vllm.LLM() does, from VLLM_LOGGING_LEVEL
load_general_plugins()
warnings.resetwarnings()  # Python's default filters: a UserWarning is shown
print("vllm logger:", logging.getLevelName(logging.getLogger("vllm").getEffectiveLevel()))
vc = VllmConfig()
vc.model_config = types.SimpleNamespace(dtype=torch.float32, hf_config=None)
model = g.loaded(vc, "k3", 2, 1)  # honest: OK
g.swap_q_into_k(model)  # the refit's loader writes q's rows where k's go
tensors = sorted(g.fed("k3"), key=lambda t: "q_proj" not in t[0])
os.environ["KDA_TP_GUARD"] = "warn"
with set_current_vllm_config(vc):
    model.load_weights(iter(tensors))
print("=== warn went on", file=sys.stderr, flush=True)
os.environ["KDA_TP_GUARD"] = "fail"
try:
    with set_current_vllm_config(vc):
        model.load_weights(iter(tensors))
except GuardError as error:
    print("=== raised:", str(error).splitlines()[0], file=sys.stderr, flush=True)
"""


def test_verdicts_reach_stderr_with_vllm_logging_at_error(tmp_path):
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "VLLM_TARGET_DEVICE": "cpu"}
    env.pop("KDA_TP_GUARD", None)
    env.pop("KDA_TP_GUARD_CHECKPOINT", None)
    done = subprocess.run([sys.executable, "-c", CHILD, str(TESTS)], capture_output=True,
                          text=True, timeout=600, env=env, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr[-6000:]
    assert "vllm logger: ERROR" in done.stdout  # vLLM's own lines at INFO are hidden
    lines = done.stderr.splitlines()
    guard = [line for line in lines if line.startswith(("INFO ", "ERROR "))]
    assert guard[0].startswith("INFO ") and guard[0].endswith(
        "kda_tp guard: registered in vLLM (mode fail): checks the KDA weights of every model "
        "load and weight update on every rank")
    assert guard[1].startswith("INFO ") and " kda_tp guard: vllm DefaultModelLoader: tp rank " \
        "1/2: " in guard[1] and guard[1].endswith(": OK")
    went_on, raised = lines.index("=== warn went on"), len(lines) - 1
    # mode warn: the FAIL line at ERROR with its diagnosis, and a GuardWarning; the refit goes on
    warn = [line for line in lines[:went_on] if line.startswith("ERROR ")]
    assert len(warn) == 1 and " kda_tp guard: vllm load_weights: tp rank 1/2: " in warn[0]
    assert warn[0].endswith("FAIL (1 wrong)")
    assert f"  rank 1 {ATTN}in_proj_qkvgfab.weight: k_proj: holds what was fed as " \
           f"{ATTN}q_proj.weight (this rank's slice), not {ATTN}k_proj.weight: parts swapped " \
           "by the update's loader" in lines[:went_on]
    assert [line for line in lines[:went_on]
            if "GuardWarning: kda_tp guard: vllm load_weights: tp rank 1/2: " in line]
    # mode fail: the ERROR line, naming the parameter, is written before the error is raised
    assert lines[raised].startswith("=== raised: kda_tp guard: vllm load_weights: tp rank 1/2: ")
    fail = [line for line in lines[went_on:raised] if line.startswith("ERROR ")]
    assert len(fail) == 1 and fail[0].endswith(f"FAIL (1 wrong): {ATTN}in_proj_qkvgfab.weight")
