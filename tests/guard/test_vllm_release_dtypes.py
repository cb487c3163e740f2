"""The guard inside vLLM 0.33.0's own loader on checkpoints in the dtypes the releases store
(BF16 projections; F32 convs, ``A_log``, ``dt_bias`` and ``o_norm``; ``torch_dtype: bfloat16``:
``tp_fixtures.release_dtypes``), loaded into a BF16 model, vLLM's default for such a config:
what the guard expects is what vLLM's KDA layers really hold there (F32 on disk, BF16 in the
layer), not only in the all-F32 fixtures of test_vllm.py; and an F64 checkpoint, whose
values torch rounds through F32 (``tp_fixtures.f64_near_ties``). Helpers in vllm_guard.py."""

from __future__ import annotations

import warnings

import pytest

from tp_fixtures import f64_near_ties, release_dtypes
from vllm_guard import ATTN, CKPT, build, loading_as, model_config, set_rank

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # vLLM's own import-time deprecations
    import torch
    from vllm.config import LoadConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from kda_tp import GuardError

pytestmark = [pytest.mark.engines, pytest.mark.usefixtures("guard_env_unset")]


@pytest.fixture
def bf16(vc, monkeypatch):
    """vLLM building and loading a BF16 model (its parameters made in the default dtype)."""
    monkeypatch.setattr(vc.model_config, "dtype", torch.bfloat16)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    yield vc
    torch.set_default_dtype(default)


def bf16_load(vc, model, path) -> None:
    config = model_config(path)
    config.dtype = torch.bfloat16
    with set_current_vllm_config(vc):
        DefaultModelLoader(LoadConfig()).load_weights(model, config)


# The releases' dtypes; and F64, whose values vLLM's loader rounds to F32, then to BF16 (torch's
# copy_): values just off a BF16 tie round the other way when rounded once.
@pytest.mark.parametrize("stored", [release_dtypes, f64_near_ties], ids=["release", "f64"])
@pytest.mark.parametrize("kind", ["k3", "kimi_linear", "glm"])
def test_a_release_dtype_checkpoint_in_a_bf16_model_passes(bf16, kind, stored, tmp_path, guard_log):
    ckpt = stored(CKPT[kind], tmp_path / "ckpt")
    for tp_size, rank in ((2, 1), (4, 3)):
        model = build(bf16, kind, tp_size, rank)
        held = dict(model.named_parameters())
        guard_log.clear()
        with guard_log:
            bf16_load(bf16, model, ckpt)
        # mixed, as vLLM holds a release: o_norm F32 on disk, BF16 held; the convs F32
        assert held[f"{ATTN}o_proj.weight"].dtype == torch.bfloat16
        assert held[f"{ATTN}o_norm.weight"].dtype == torch.bfloat16
        assert {p.dtype for n, p in held.items() if "conv1d" in n} == {torch.float32}
        lines = guard_log.lines
        assert len(lines) == 1 and lines[0].endswith(" s: OK"), lines
        assert f"tp rank {rank}/{tp_size}: " in lines[0]


def test_a_rank_loading_rank_0s_slice_stops_a_bf16_load(bf16, tmp_path):
    ckpt = release_dtypes(CKPT["kimi_linear"], tmp_path / "ckpt")
    model = build(bf16, "kimi_linear", 4, 0)
    set_rank(4, 2)
    loading_as(model, 4, 0)
    with pytest.raises(GuardError) as caught:
        bf16_load(bf16, model, ckpt)
    text = str(caught.value)
    assert f"rank 2 {ATTN}in_proj_qkvgfab.weight: values differ in q_proj" in text
    assert "equals rank 0's slice of q_proj" in text
