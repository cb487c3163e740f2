"""The engines' cast without torch: an F64 checkpoint value rounds to F32 first, then to BF16 or
F16 (torch's ``copy_``, what every engine loader does; tests/integration/test_casts.py proves
the rule against torch itself), through the audit, the guard's audit and the digests; a NaN
an engine casts matches any NaN and is never hashed."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import kda_tp
from kda_tp.errors import CheckpointError
from kda_tp.guard import check
from kda_tp.model.dtypes import cast_to

from audit_helpers import rank_params
from tp_fixtures import CKPT, PRE, f64_near_ties

BF16 = np.dtype(ml_dtypes.bfloat16)
# The parameters a layout fixes in F32 (not cast to the model dtype).
FIXED = ("A_log", "dt_bias", "conv1d.weight")


@pytest.mark.parametrize(("f64", "dtype", "torchs", "once"), [
    # torch 2.14's and 2.15's copy_ and .to() on the CPU (test_casts.py checks every value)
    (0xC131EFFFFFFFFFFF, "BF16", 0xC990, 0xC98F),  # just below a tie: F32 rounds onto it
    (0x3C2D500000000001, "BF16", 0x216A, 0x216B),  # just above a tie: F32 rounds onto it
    (0x3F7D65FFFFFFFFFF, "F16", 0x1F5A, 0x1F59),
    (0x40EB8A0000000001, "F16", 0x7AE2, 0x7AE3),
])
def test_an_f64_value_rounds_through_f32_as_torch(f64, dtype, torchs, once):
    value = np.array([f64], np.uint64).view(np.float64)
    assert int(cast_to(value, dtype).view(np.uint16)[0]) == torchs
    target = BF16 if dtype == "BF16" else np.dtype(np.float16)
    assert int(value.astype(target).view(np.uint16)[0]) == once  # numpy's single rounding


def _engine_params(ckpt, layout, rank, tp_size):
    """What an engine holds of an F64 checkpoint in a BF16 model: each part rounded as torch
    does (F64 -> F32 -> BF16), the F32-fixed parameters in F32."""
    f32 = rank_params(ckpt, layout, rank, tp_size)
    return {k: v if k.endswith(FIXED) else cast_to(v, "BF16") for k, v in f32.items()}


def test_an_f64_checkpoint_in_a_bf16_engine_passes_the_audit_and_the_guard(tmp_path):
    ckpt = f64_near_ties(CKPT["kimi_linear"], tmp_path / "ckpt")
    stored = load_file(str(ckpt / "model.safetensors"))[PRE + "q_proj.weight"]
    once = stored.astype(BF16).view(np.uint16)
    twice = stored.astype(np.float32).astype(BF16).view(np.uint16)
    assert (once != twice).sum() > 100  # the checkpoint is one where the two rules part
    held = _engine_params(ckpt, "vllm-0.33-kimi-linear", 1, 4)
    assert kda_tp.audit.audit(held, ckpt, tp_rank=1, tp_size=4, model_dtype="BF16").passed
    result = check(held, ckpt, tp_rank=1, tp_size=4, model_dtype="BF16")
    assert result is not None and result.passed
    # numpy's single rounding is not what the engine holds
    wrong = dict(held)
    wrong[PRE + "o_proj.weight"] = rank_params(ckpt, "vllm-0.33-kimi-linear", 1, 4)[
        PRE + "o_proj.weight"].astype(BF16)
    report = kda_tp.audit.audit(wrong, ckpt, tp_rank=1, tp_size=4, model_dtype="BF16")
    assert [f.name for f in report.failures] == [PRE + "o_proj.weight"]


def test_digests_of_an_f64_checkpoint_hash_torchs_bytes(tmp_path):
    ckpt = f64_near_ties(CKPT["kimi_linear"], tmp_path / "ckpt")
    digests = kda_tp.audit.engine_digests(ckpt, engine="vllm-0.33-kimi-linear", tp_size=4,
                                          ranks=[1], model_dtype="BF16")
    held = _engine_params(ckpt, "vllm-0.33-kimi-linear", 1, 4)
    key = kda_tp.audit.DIGEST_KEY.format(rank=1, name=PRE + "o_proj.weight")
    assert digests[key] == kda_tp.audit.param_digest(held[PRE + "o_proj.weight"])


def _with_nan(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    tensors = load_file(str(CKPT["kimi_linear"] / "model.safetensors"))
    tensors[PRE + "q_proj.weight"][2 * 384 + 5, 3] = np.nan  # rank 2's q_proj row 5
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text((CKPT["kimi_linear"] / "config.json").read_text())
    return out


def test_a_nan_the_engine_casts_is_never_hashed(tmp_path):
    ckpt = _with_nan(tmp_path)
    with pytest.raises(CheckpointError) as caught:
        kda_tp.audit.engine_digests(ckpt, engine="vllm-0.33-kimi-linear", tp_size=4,
                                    model_dtype="BF16")
    assert ("rank 2 model.layers.0.self_attn.in_proj_qkvgfab.weight: q_proj holds NaN at [5, 3] "
            "(1 of its ") in str(caught.value)
    assert "which the engine casts from F32 to BF16" in str(caught.value)
    # uncast (an F32 engine), the NaN is copied bit for bit and hashed as stored
    assert kda_tp.audit.engine_digests(ckpt, engine="vllm-0.33-kimi-linear", tp_size=4,
                                       model_dtype="F32")
    # and any NaN the engine's cast writes passes the audit
    held = {k: v if k.endswith(FIXED) else cast_to(v, "BF16")
            for k, v in rank_params(ckpt, "vllm-0.33-kimi-linear", 2, 4).items()}
    for bits in (0xFFFF, 0x7FC0, 0x7FFF):
        held[PRE + "in_proj_qkvgfab.weight"].view(np.uint16)[5, 3] = bits
        assert kda_tp.audit.audit(held, ckpt, tp_rank=2, tp_size=4, model_dtype="BF16").passed
