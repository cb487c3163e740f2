"""Fixtures of the guard's tests: ``vc`` (vLLM's config) and ``guard_env_unset`` for the vLLM
guard tests (test_vllm*.py; helpers in vllm_guard.py), and the guard's log lines captured
(``guard_log``; ``vllm_log`` inside vLLM's config). vLLM is imported only when a test asks
for ``vc``, so collecting without vLLM imports nothing."""

from __future__ import annotations

import contextlib
import logging
import types

import pytest


@pytest.fixture(scope="module")
def vc():
    """vLLM's config as the fixtures' recipe sets it, the plugins loaded by vLLM itself."""
    import torch
    from vllm.config import VllmConfig
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    config = VllmConfig()
    config.model_config = types.SimpleNamespace(dtype=torch.float32, hf_config=None)
    return config


@pytest.fixture
def guard_env_unset(monkeypatch):
    """The guard in its default mode (fail), no checkpoint variable: whatever the caller's
    environment says (``pytestmark = pytest.mark.usefixtures("guard_env_unset")``)."""
    from kda_tp.guard import CHECKPOINT_ENV, MODE_ENV

    monkeypatch.delenv(MODE_ENV, raising=False)
    monkeypatch.delenv(CHECKPOINT_ENV, raising=False)


class _Collect(logging.Handler):
    def __init__(self, into: list[logging.LogRecord]):
        super().__init__(logging.NOTSET)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record)


class GuardLog:
    """What the guard logs (the ``kda_tp.guard`` logger), captured at INFO inside
    ``with log:`` only (and inside vLLM's config ``vc`` when given, as the engine's calls
    run): the guard's logger is at INFO everywhere, so what it logs outside is not taken.

    Attributes:
        lines: the messages captured so far; ``records``: their log records.
    """

    def __init__(self, caplog: pytest.LogCaptureFixture, vc=None):
        self._caplog, self._vc = caplog, vc
        self._open: list[contextlib.ExitStack] = []
        self._records: list[logging.LogRecord] = []

    def __enter__(self) -> GuardLog:
        stack = contextlib.ExitStack()
        stack.enter_context(self._caplog.at_level(logging.INFO, logger="kda_tp.guard"))
        guard, handler = logging.getLogger("kda_tp.guard"), _Collect(self._records)
        guard.addHandler(handler)
        stack.callback(guard.removeHandler, handler)
        if self._vc is not None:
            from vllm.config import set_current_vllm_config

            stack.enter_context(set_current_vllm_config(self._vc))
        self._open.append(stack)
        return self

    def __exit__(self, *exc) -> None:
        self._open.pop().__exit__(*exc)

    @property
    def records(self) -> list[logging.LogRecord]:
        return list(self._records)

    @property
    def lines(self) -> list[str]:
        return [r.getMessage() for r in self.records]

    def clear(self) -> None:
        """Forget what was captured (and ``caplog.clear()``)."""
        self._records.clear()
        self._caplog.clear()


@pytest.fixture
def guard_log(caplog):
    """The guard's log lines: ``with guard_log:`` captures them, ``guard_log.lines`` reads
    them."""
    return GuardLog(caplog)


@pytest.fixture
def vllm_log(vc, caplog):
    """:func:`guard_log` inside vLLM's config (``set_current_vllm_config(vc)``), where vLLM's
    loaders and the model's ``load_weights`` run."""
    return GuardLog(caplog, vc)
