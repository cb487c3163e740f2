"""Issue 38 F1: the guard sees every name the engine accepts. vLLM 0.33.0's served model
classes map the names an update feeds through their own ``hf_to_vllm_mapper``: Kimi K3's
``KimiK3ForConditionalGeneration`` takes ``language_model.layers.`` for its checkpoint's
``language_model.model.layers.``; GLM-5.3-Flash's ``Glm5NextForConditionalGeneration`` maps
its checkpoint's ``model.language_model.`` to ``language_model.model.`` and takes that internal
spelling as it is. A refit sent under the other spelling is placed and checked (a loader bug
putting rank 0's ``dt_bias`` on rank 1 is stopped); a call that changed a KDA parameter under a
name the guard cannot place is "not checked", which mode fail refuses.

The served classes' own ``load_weights`` (``AutoWeightsLoader`` with their mapper) run on a
stand-in holding vLLM's KDA layer for a faked rank (vllm_guard.build), loaded first by vLLM's
``DefaultModelLoader`` from a checkpoint in the published spelling."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest

from vllm_guard import CKPT, build, default_load, fed

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # vLLM's own import-time deprecations
    import torch
    import vllm.distributed.parallel_state as ps
    from safetensors.torch import load_file, save_file
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    from vllm.models.glm5next.common.model import Glm5NextForConditionalGeneration
    from vllm.models.kimi_k3.nvidia.model import KimiK3ForConditionalGeneration

from kda_tp import GuardError
from kda_tp.errors import GuardWarning
from kda_tp.guard import MODE_ENV
from vllm_layers import fake_group

pytestmark = [pytest.mark.engines, pytest.mark.usefixtures("guard_env_unset")]

#: kind -> (the served class, the checkpoint's decoder prefix, the other spelling it accepts).
SERVED = {
    "k3": (KimiK3ForConditionalGeneration, "language_model.model.layers.",
           "language_model.layers."),
    "glm": (Glm5NextForConditionalGeneration, "model.language_model.layers.",
            "language_model.model.layers."),
}


def published(tmp_path: Path, kind: str) -> Path:
    """The fixture checkpoint of ``kind`` with its tensors under the published prefix."""
    out = tmp_path / f"ckpt_{kind}"
    out.mkdir()
    shutil.copy(CKPT[kind] / "config.json", out / "config.json")
    prefix = SERVED[kind][1]
    tensors = load_file(str(CKPT[kind] / "model.safetensors"))
    save_file({prefix + n.removeprefix("model.layers."): t for n, t in tensors.items()},
              str(out / "model.safetensors"))
    return out


def served(vc, kind: str, tp_size: int, rank: int, cls: type | None = None):
    """vLLM's served model class of ``kind`` (its ``load_weights`` and ``hf_to_vllm_mapper``)
    holding the stand-in language model of one KDA layer as ``language_model``."""
    cls = cls or SERVED[kind][0]
    top = cls.__new__(cls)
    torch.nn.Module.__init__(top)
    top.language_model = build(vc, kind, tp_size, rank)
    record_metadata_for_reloading(top)
    return top


def refit(kind: str, spelling: str, scale: float = 2.0) -> list[tuple[str, torch.Tensor]]:
    """The fixture's tensors x ``scale`` under decoder prefix ``spelling``."""
    return [(spelling + n.removeprefix("model.layers."), t) for n, t in fed(kind, scale)]


def dt_bias_of_rank_0(model, tp_size: int) -> None:
    """The loader bug: ``dt_bias``'s weight loader reads the group as rank 0 (rank 0's slice
    lands on this rank)."""
    param = dict(model.named_parameters())[
        "language_model.model.layers.0.self_attn.dt_bias"]
    original = param.weight_loader

    def as_rank_0(p, w, *args):
        group, ps._TP = ps._TP, fake_group(tp_size, 0)
        try:
            return original(p, w, *args)
        finally:
            ps._TP = group

    param.weight_loader = as_rank_0


@pytest.mark.parametrize("kind", sorted(SERVED))
def test_a_refit_under_the_other_spelling_is_placed_and_checked(vc, vllm_log, tmp_path, kind):
    checkpoint = published(tmp_path, kind)
    model = served(vc, kind, 2, 1)
    with vllm_log:
        default_load(vc, model, checkpoint)
        vllm_log.clear()
        model.load_weights(refit(kind, SERVED[kind][2]))
    updates = [line for line in vllm_log.lines if " load_weights: tp rank 1/2: " in line]
    assert len(updates) == 1 and updates[0].endswith(": OK"), vllm_log.lines
    assert " 0 KDA parameters updated" not in updates[0]


@pytest.mark.parametrize("kind", sorted(SERVED))
def test_rank_0s_dt_bias_on_rank_1_under_the_other_spelling_fails(vc, vllm_log, tmp_path,
                                                                   kind):
    checkpoint = published(tmp_path, kind)
    model = served(vc, kind, 2, 1)
    with vllm_log:
        default_load(vc, model, checkpoint)
        dt_bias_of_rank_0(model, 2)
        with pytest.raises(GuardError) as raised:
            model.load_weights(refit(kind, SERVED[kind][2]))
    text = str(raised.value)
    assert "FAIL" in text.splitlines()[0]
    assert "language_model.model.layers.0.self_attn.dt_bias" in text
    assert f"{SERVED[kind][2]}0.self_attn.dt_bias" in text  # the name it was fed under


class _Renaming(KimiK3ForConditionalGeneration):
    """A served class whose ``load_weights`` also takes a prefix its mapper does not know
    (``lm.layers.``, a plugin's or a stack's own renaming), before vLLM's own mapping."""

    def load_weights(self, weights):
        return super().load_weights(
            (n.replace("lm.layers.", "language_model.layers.", 1), w) for n, w in weights)


def test_a_kda_change_under_a_name_the_guard_cannot_place_is_not_checked(
        vc, vllm_log, tmp_path, monkeypatch):
    checkpoint = published(tmp_path, "k3")
    model = served(vc, "k3", 2, 1, _Renaming)
    with vllm_log:
        default_load(vc, model, checkpoint)
        with pytest.raises(GuardError) as raised:
            model.load_weights(refit("k3", "lm.layers."))
    text = str(raised.value)
    assert "NOT CHECKED" in text.splitlines()[0]
    assert "language_model.model.layers.0.self_attn.dt_bias: changed by an update that fed " \
        "'lm.layers.0.self_attn" in text
    # mode warn: the same call goes on, one ERROR line and a warning say what was not checked
    monkeypatch.setenv(MODE_ENV, "warn")
    with vllm_log, pytest.warns(GuardWarning, match="NOT CHECKED"):
        vllm_log.clear()
        model.load_weights(refit("k3", "lm.layers.", 3.0))
    warned = [r for r in vllm_log.records if r.levelname == "ERROR"]
    assert len(warned) == 1 and "NOT CHECKED" in warned[0].getMessage()
