"""Fixtures of the vLLM guard tests (test_vllm*.py; helpers in vllm_guard.py). vLLM is
imported only when a test asks for ``vc``, so collecting without vLLM imports nothing."""

from __future__ import annotations

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
