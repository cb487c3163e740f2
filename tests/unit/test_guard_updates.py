"""kda_tp.guard.updates, with no engine: the reference of an update is what was fed.

A rank's engine parameters before and after an update are built with the build API from the
fixture checkpoint and from the same tensors x2 (the "new weights" a trainer sends); what is
fed is the checkpoint-format x2 tensors. Right updates pass; a region that holds another fed
part, the values from before the update, or other values is named; only this rank's slices are
kept."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from kda_tp import KdaShardedSource, KdaTpPlan, SafetensorsSource
from kda_tp.engines import build_param, get_layout
from kda_tp.guard import UpdateCheck

from tp_fixtures import CKPT, PRE, write_one_file

LAYOUTS = {"k3": "vllm-0.33-k3", "kimi_linear": "vllm-0.33-kimi-linear", "glm": "vllm-0.33-glm-5.3"}


def tensors(kind: str, scale: float = 1.0) -> dict[str, np.ndarray]:
    with safe_open(CKPT[kind] / "model.safetensors", "np") as f:
        return {k: f.get_tensor(k) * np.float32(scale) for k in f.keys()}


def scaled(kind: str, tmp_path: Path, scale: float) -> Path:
    """The fixture checkpoint with every value x ``scale``: what an engine holds after an
    update with those values is built from it."""
    config = json.loads((CKPT[kind] / "config.json").read_text())
    return write_one_file(tmp_path / f"{kind}_x{scale}", tensors(kind, scale), config)


def held(checkpoint: Path, layout: str, rank: int, tp_size: int) -> dict[str, np.ndarray]:
    source = SafetensorsSource(checkpoint)
    shard = KdaShardedSource(source, KdaTpPlan.from_config(source, rank, tp_size, qk_multiple=1))
    lay = get_layout(layout)
    return {PRE + p.suffix: build_param(shard, lay, p.suffix, 0)
            for p in lay.params_for(shard.plan)}


@pytest.mark.parametrize("kind", LAYOUTS)
def test_a_right_update_passes_and_an_unapplied_one_holds_the_old_values(kind, tmp_path):
    before = held(CKPT[kind], LAYOUTS[kind], 1, 4)
    after = held(scaled(kind, tmp_path, 2.0), LAYOUTS[kind], 1, 4)
    session = UpdateCheck(CKPT[kind], before, tp_rank=1, tp_size=4)
    assert session.layout.name == LAYOUTS[kind]
    fed = list(session.wrap(tensors(kind, 2.0).items()))
    assert len(fed) == len(tensors(kind))  # every pair passed on
    report = session.check(after)
    assert report.passed, report.problems
    assert report.params == len(after)
    plan = KdaTpPlan.from_config(SafetensorsSource(CKPT[kind]), 1, 4, qk_multiple=1)
    lay = get_layout(LAYOUTS[kind])
    regions = [r for p in lay.params_for(plan) for r in lay.param_plan(p.suffix, plan, "F32").regions]
    assert report.regions == len(regions)
    assert report.bytes == sum(r.byte_range[1] - r.byte_range[0] for r in regions)  # no padding
    stale = session.check(before)  # the engine applied nothing
    assert not stale.passed and len(stale.problems) == report.regions
    assert all("holds the values from before the update" in p for p in stale.problems)


def test_only_this_ranks_slices_are_kept():
    kind = "kimi_linear"
    before = held(CKPT[kind], LAYOUTS[kind], 3, 4)
    session = UpdateCheck(CKPT[kind], before, tp_rank=3, tp_size=4)
    full = tensors(kind, 2.0)
    for name, value in full.items():
        session.feed(name, value)
    kept = session.kept_bytes
    local = sum(t.local_bytes for t in session.plan.tensors)
    assert kept == local and kept * 3 < sum(a.nbytes for a in full.values())


def test_a_part_in_anothers_place_is_named_with_what_was_fed_there(tmp_path):
    before = held(CKPT["k3"], LAYOUTS["k3"], 0, 2)
    after = held(scaled("k3", tmp_path, 2.0), LAYOUTS["k3"], 0, 2)
    session = UpdateCheck(CKPT["k3"], before, tp_rank=0, tp_size=2)
    for name, value in tensors("k3", 2.0).items():
        session.feed(name, value)
    plan = KdaTpPlan.from_config(SafetensorsSource(CKPT["k3"]), 0, 2, qk_multiple=1)
    regions = {r.part: r.byte_range for r in get_layout(LAYOUTS["k3"]).param_plan(
        "in_proj_qkvgfab.weight", plan, "F32").regions}
    fused = after[PRE + "in_proj_qkvgfab.weight"].copy()
    raw = fused.reshape(-1).view(np.uint8)
    (q0, q1), (k0, k1) = regions["q_proj"], regions["k_proj"]
    raw[k0:k1] = raw[q0:q1]  # q's rows in k's place
    wrong = dict(after) | {PRE + "in_proj_qkvgfab.weight": fused}
    (problem,) = session.check(wrong).problems
    assert problem == (f"{PRE}in_proj_qkvgfab.weight: k_proj: holds what was fed as "
                       f"{PRE}q_proj.weight (this rank's slice), not {PRE}k_proj.weight: parts "
                       "swapped by the update's loader")


def test_other_values_and_a_wrongly_shaped_tensor_are_named():
    torch = pytest.importorskip("torch")
    before = held(CKPT["glm"], LAYOUTS["glm"], 1, 2)
    session = UpdateCheck(CKPT["glm"], before, tp_rank=1, tp_size=2)
    fed = {n: torch.from_numpy(v) for n, v in tensors("glm", 2.0).items()}  # torch, sliced in torch
    fed[PRE + "A_log"] = fed[PRE + "A_log"][:6]  # half of A_log: no place in the plan
    for name, value in fed.items():
        session.feed(name, value)
    after = {n: v * np.float32(2.0) for n, v in before.items()}
    after[PRE + "o_norm.weight"][3] += 1
    problems = session.check(after).problems
    assert problems[0] == (f"{PRE}A_log: fed with shape [6], which does not hold the 12 "
                           "elements of A_log the plan places; the update cannot be right")
    (norm,) = [p for p in problems[1:]]
    assert norm.startswith(f"{PRE}o_norm.weight: o_norm: differs from what was fed as "
                           f"{PRE}o_norm.weight at element 3 (expected ")


def test_names_of_other_stacks_and_non_kda_tensors_are_not_kept():
    before = held(CKPT["k3"], LAYOUTS["k3"], 0, 2)
    session = UpdateCheck(CKPT["k3"], before, tp_rank=0, tp_size=2)
    session.feed("vision_tower.encoder.layers.0.self_attn.q_proj.weight", np.zeros((4, 4)))
    session.feed("model.layers.0.mlp.down_proj.weight", np.zeros((4, 4)))
    session.feed("model.layers.7.self_attn.q_proj.weight", np.zeros((4, 4)))  # not a KDA layer
    assert not session.touched
    assert session.check(before).passed


def test_wrap_verifies_each_part_as_the_engine_consumes_it_and_keeps_no_copy(tmp_path):
    before = held(CKPT["kimi_linear"], LAYOUTS["kimi_linear"], 2, 4)
    after = held(scaled("kimi_linear", tmp_path, 2.0), LAYOUTS["kimi_linear"], 2, 4)
    live = {n: a.copy() for n, a in before.items()}  # the engine's parameters
    session = UpdateCheck(CKPT["kimi_linear"], live, tp_rank=2, tp_size=4)
    for name, _ in session.wrap(tensors("kimi_linear", 2.0).items()):
        for n in live:  # the engine applies what it was fed (here: all of it at the first)
            live[n][...] = after[n]
        assert session.kept_bytes == 0  # verified on the fly: nothing kept
    report = session.check(live)
    assert report.passed and report.params == len(live)
    live[PRE + "o_norm.weight"][...] = 0  # changed after it was applied
    (problem,) = session.check(live).problems
    assert problem == (f"{PRE}o_norm.weight: o_norm: {PRE}o_norm.weight was applied, then "
                       "changed before the update ended (its sampled elements differ from what "
                       "was fed)")


def test_wrap_keeps_what_the_engine_has_not_applied_and_names_it():
    before = held(CKPT["glm"], LAYOUTS["glm"], 0, 2)
    live = {n: a.copy() for n, a in before.items()}
    session = UpdateCheck(CKPT["glm"], live, tp_rank=0, tp_size=2)
    for _ in session.wrap(tensors("glm", 2.0).items()):
        pass  # an engine that applies nothing
    assert session.kept_bytes == sum(t.local_bytes for t in session.plan.tensors)
    problems = session.check(live).problems
    assert problems and all("holds the values from before the update" in p for p in problems)
