"""kda_tp.guard.updates, with no engine: the reference of an update is what
was fed, every region of a touched parameter is checked, and nothing but report lines leaves a
session.

A rank's engine parameters before and after an update are built with the build API from the
fixture checkpoint and from the same tensors x2 (the "new weights" a trainer sends); what is
fed is the checkpoint-format x2 tensors. Right updates pass; a region that holds another fed
part (in this session or an earlier one), the values from before the update, other values,
values nobody fed, or non-zero padding is named; only this rank's slices are kept."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from kda_tp import KdaShardedSource, KdaTpPlan, SafetensorsSource, describe
from kda_tp.engines import build_param, get_layout
from kda_tp.guard import RankTarget, UpdateSession

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
    return {PRE + p.suffix: build_param(shard, lay, p.suffix, 0) for p in lay.params_for(shard.plan)}


def session_for(kind: str, params: dict[str, np.ndarray], rank: int, tp_size: int,
                memory: dict | None = None) -> UpdateSession:
    target = RankTarget.build(describe(CKPT[kind]), params, tp_rank=rank,
                              tp_size=tp_size)
    return UpdateSession(target, memory)


@pytest.mark.parametrize("kind", LAYOUTS)
def test_a_right_update_passes_and_an_unapplied_one_holds_the_old_values(kind, tmp_path):
    before = held(CKPT[kind], LAYOUTS[kind], 1, 4)
    after = held(scaled(kind, tmp_path, 2.0), LAYOUTS[kind], 1, 4)
    session = session_for(kind, before, 1, 4)
    assert session.target.layout.name == LAYOUTS[kind]
    fed = list(session.wrap(tensors(kind, 2.0).items()))
    assert len(fed) == len(tensors(kind))  # every pair passed on
    report = session.close(after)
    assert report.passed, report.problems
    assert report.params == len(after) and report.fed == len(fed)
    plan = session.target.plan
    lay = get_layout(LAYOUTS[kind])
    plans = [lay.param_plan(p.suffix, plan, "F32") for p in lay.params_for(plan)]
    parts = [r for p in plans for r in p.regions]
    padding = [p.padding for p in plans if p.padding is not None]
    assert report.regions == len(parts) + len(padding)  # every region, padding too
    assert report.bytes == sum(p.nbytes for p in plans)
    stale = session.close(before)  # the engine applied nothing
    assert not stale.passed and len(stale.problems) == len(parts)
    assert all("holds the values from before the update" in p for p in stale.problems)


def test_only_this_ranks_slices_are_kept():
    kind = "kimi_linear"
    before = held(CKPT[kind], LAYOUTS[kind], 3, 4)
    session = session_for(kind, before, 3, 4)
    full = tensors(kind, 2.0)
    for name, value in full.items():
        session.feed(name, value)
    kept = session.kept_bytes
    local = sum(t.local_bytes for t in session.target.plan.tensors)
    assert kept == local and kept * 3 < sum(a.nbytes for a in full.values())


def test_a_part_in_anothers_place_is_named_with_what_was_fed_there(tmp_path):
    before = held(CKPT["k3"], LAYOUTS["k3"], 0, 2)
    after = held(scaled("k3", tmp_path, 2.0), LAYOUTS["k3"], 0, 2)
    session = session_for("k3", before, 0, 2)
    for name, value in tensors("k3", 2.0).items():
        session.feed(name, value)
    regions = {r.part: r.byte_range for r in get_layout(LAYOUTS["k3"]).param_plan(
        "in_proj_qkvgfab.weight", session.target.plan, "F32").regions}
    fused = after[PRE + "in_proj_qkvgfab.weight"].copy()
    raw = fused.reshape(-1).view(np.uint8)
    (q0, q1), (k0, k1) = regions["q_proj"], regions["k_proj"]
    raw[k0:k1] = raw[q0:q1]  # q's rows in k's place
    wrong = dict(after) | {PRE + "in_proj_qkvgfab.weight": fused}
    (problem,) = session.close(wrong).problems
    assert problem == (f"{PRE}in_proj_qkvgfab.weight: k_proj: holds what was fed as "
                       f"{PRE}q_proj.weight (this rank's slice), not {PRE}k_proj.weight: parts "
                       "swapped by the update's loader")


def test_what_an_earlier_call_fed_for_another_part_is_named(tmp_path):
    """Per-tensor refits (OpenRLHF, TRL): q's tensor in one call, k's in the next; k's rows
    hold q's slice. The memory the plugin keeps across calls names it."""
    before = held(CKPT["k3"], LAYOUTS["k3"], 1, 2)
    after = held(scaled("k3", tmp_path, 2.0), LAYOUTS["k3"], 1, 2)
    memory: dict = {}
    full = tensors("k3", 2.0)
    first = session_for("k3", before, 1, 2, memory)
    for _ in first.wrap([(PRE + "q_proj.weight", full[PRE + "q_proj.weight"])]):
        pass
    q_applied = dict(before)
    regions = {r.part: r.byte_range for r in get_layout(LAYOUTS["k3"]).param_plan(
        "in_proj_qkvgfab.weight", first.target.plan, "F32").regions}
    (q0, q1), (k0, k1) = regions["q_proj"], regions["k_proj"]
    fused = before[PRE + "in_proj_qkvgfab.weight"].copy()
    fused.reshape(-1).view(np.uint8)[q0:q1] = after[PRE + "in_proj_qkvgfab.weight"].reshape(
        -1).view(np.uint8)[q0:q1]
    q_applied[PRE + "in_proj_qkvgfab.weight"] = fused
    assert first.close(q_applied).passed
    second = session_for("k3", q_applied, 1, 2, memory)
    second.feed(PRE + "k_proj.weight", full[PRE + "k_proj.weight"])
    wrong = fused.copy()
    raw = wrong.reshape(-1).view(np.uint8)
    raw[k0:k1] = raw[q0:q1]
    (problem,) = second.close(dict(q_applied) | {PRE + "in_proj_qkvgfab.weight": wrong}).problems
    assert problem == (f"{PRE}in_proj_qkvgfab.weight: k_proj: holds what was fed as "
                       f"{PRE}q_proj.weight in an earlier call of this refit (this rank's slice), "
                       f"not {PRE}k_proj.weight: parts swapped by the update's loader")


def test_regions_nobody_fed_must_keep_their_values_and_padding_stays_zero(tmp_path):
    """vLLM's layerwise reload rebuilds a partly fed parameter from torch.empty_strided: the
    parts the update did not feed change too."""
    before = held(CKPT["k3"], LAYOUTS["k3"], 0, 2)
    after = held(scaled("k3", tmp_path, 2.0), LAYOUTS["k3"], 0, 2)
    session = session_for("k3", before, 0, 2)
    fed = {n: v for n, v in tensors("k3", 2.0).items()
           if not n.endswith((".b_proj.weight", ".f_a_proj.weight"))}
    for name, value in fed.items():
        session.feed(name, value)
    plan = get_layout(LAYOUTS["k3"]).param_plan("in_proj_qkvgfab.weight", session.target.plan,
                                                "F32")
    regions = {r.part: r.byte_range for r in plan.regions}
    fused = after[PRE + "in_proj_qkvgfab.weight"].copy()
    raw, old = fused.reshape(-1).view(np.uint8), before[PRE + "in_proj_qkvgfab.weight"].reshape(
        -1).view(np.uint8)
    for part in ("b_proj", "f_a_proj"):  # what the unfed rows held before, as an engine keeps
        raw[slice(*regions[part])] = old[slice(*regions[part])]
    report = session.close(dict(after) | {PRE + "in_proj_qkvgfab.weight": fused})
    assert report.passed, report.problems
    raw[slice(*regions["b_proj"])] = 0  # rebuilt uninitialised
    assert plan.padding is not None
    raw[plan.padding[0]] = 1  # a padding row not zero
    problems = session.close(dict(after) | {PRE + "in_proj_qkvgfab.weight": fused}).problems
    assert problems == [
        f"{PRE}in_proj_qkvgfab.weight: b_proj: not fed by this update and no longer holds its "
        "values from before it (rebuilt uninitialised?)",
        f"{PRE}in_proj_qkvgfab.weight: padding: not zero after the update (the engine zeroes "
        "its padding rows at every load)"]


def _k3_without(tmp_path, left_out: tuple[str, ...]):
    """Rank 0 of 2 of K3 before and after an update x2 fed without ``left_out`` (suffixes),
    each part applied as the engine consumes it (wrap); the fused weight's regions by part."""
    before = held(CKPT["k3"], LAYOUTS["k3"], 0, 2)
    after = held(scaled("k3", tmp_path, 2.0), LAYOUTS["k3"], 0, 2)
    live = {n: a.copy() for n, a in before.items()}
    session = session_for("k3", live, 0, 2)
    plan = get_layout(LAYOUTS["k3"]).param_plan("in_proj_qkvgfab.weight", session.target.plan,
                                                "F32")
    size = np.dtype(np.float32).itemsize
    regions = {r.part: slice(r.byte_range[0] // size, r.byte_range[1] // size)
               for r in plan.regions}
    fused = PRE + "in_proj_qkvgfab.weight"
    for _ in session.wrap([(n, v) for n, v in tensors("k3", 2.0).items()
                           if not n.endswith(left_out)]):
        for n in live:  # the engine applies what it was fed (here: all of it at the first)
            live[n][...] = after[n]
        for suffix in left_out:  # ... but what was left out keeps its values
            region = regions[suffix.removeprefix(".").removesuffix(".weight")]
            live[fused].reshape(-1)[region] = before[fused].reshape(-1)[region]
    return session, live, fused, regions


@pytest.mark.parametrize("harm", ["negated row", "two rows swapped", "one element"])
def test_every_element_of_a_region_nobody_fed_is_judged(tmp_path, harm):
    """No sample: a harm anywhere in an unfed region is named (issue 38, F6)."""
    session, live, fused, regions = _k3_without(tmp_path, (".b_proj.weight",))
    rows = live[fused].reshape(-1)[regions["b_proj"]].reshape(-1, live[fused].shape[1])
    assert rows.shape[0] >= 3
    if harm == "negated row":
        rows[1] = -rows[1]
    elif harm == "two rows swapped":
        rows[[0, 2]] = rows[[2, 0]]
    else:
        rows[1, 5] = np.nextafter(rows[1, 5], np.float32(np.inf))
    assert session.close().problems == [
        f"{fused}: b_proj: not fed by this update and no longer holds its values from before "
        "it (rebuilt uninitialised?)"]


def test_a_later_write_over_a_verified_row_is_named(tmp_path):
    """A part verified as the engine consumed it, then one of its rows overwritten by a later
    loader of the same call: named at the end, every element judged (issue 38, F6)."""
    session, live, fused, regions = _k3_without(tmp_path, ())
    assert session.kept_bytes == 0  # every part verified as fed
    rows = live[fused].reshape(-1)[regions["k_proj"]].reshape(-1, live[fused].shape[1])
    rows[-1] = rows[0]  # a later loader's write over k_proj's last row
    assert session.close().problems == [
        f"{fused}: k_proj: {PRE}k_proj.weight was applied, then changed before the update "
        "ended (a later write over the verified region)"]


def test_other_values_and_a_wrongly_shaped_tensor_are_named():
    torch = pytest.importorskip("torch")
    before = held(CKPT["glm"], LAYOUTS["glm"], 1, 2)
    session = session_for("glm", before, 1, 2)
    fed = {n: torch.from_numpy(v) for n, v in tensors("glm", 2.0).items()}  # torch, sliced in torch
    fed[PRE + "A_log"] = fed[PRE + "A_log"][:6]  # half of A_log: no place in the plan
    for name, value in fed.items():
        session.feed(name, value)
    after = {n: v * np.float32(2.0) for n, v in before.items()}
    after[PRE + "o_norm.weight"][3] += 1
    problems = session.close(after).problems
    assert problems[0] == (f"{PRE}A_log: fed with shape [6], which does not hold the 12 "
                           "elements of A_log the plan places; the update cannot be right")
    (norm,) = [p for p in problems[1:] if "o_norm" in p]
    assert norm.startswith(f"{PRE}o_norm.weight: o_norm: differs from what was fed as "
                           f"{PRE}o_norm.weight at [3] (its [3]; expected ")


def test_a_wrong_element_is_named_by_its_index_in_the_parameter_and_the_part(tmp_path):
    """As the first load names it (``at [768, 0] (its [0, 0]; ...``), never a flat index:
    k_proj's rows start at row 768 of in_proj_qkvgfab (q's 768 rows above), k_conv1d's at row
    768 of the 3-D conv1d."""
    before = held(CKPT["kimi_linear"], LAYOUTS["kimi_linear"], 1, 2)
    after = held(scaled("kimi_linear", tmp_path, 2.0), LAYOUTS["kimi_linear"], 1, 2)
    session = session_for("kimi_linear", before, 1, 2)
    list(session.wrap(tensors("kimi_linear", 2.0).items()))
    after[PRE + "in_proj_qkvgfab.weight"][770, 7] += 1
    after[PRE + "conv1d.weight"][770, 0, 3] += 1
    problems = session.close(after).problems
    assert len(problems) == 2
    conv, fused = sorted(problems)
    assert fused.startswith(f"{PRE}in_proj_qkvgfab.weight: k_proj: differs from what was fed "
                            f"as {PRE}k_proj.weight at [770, 7] (its [2, 7]; expected ")
    assert conv.startswith(f"{PRE}conv1d.weight: k_conv1d: differs from what was fed as "
                           f"{PRE}k_conv1d.weight at [770, 0, 3] (its [2, 0, 3]; expected ")


def test_names_of_other_stacks_and_non_kda_tensors_touch_nothing():
    before = held(CKPT["k3"], LAYOUTS["k3"], 0, 2)
    session = session_for("k3", before, 0, 2)
    for _ in session.wrap([("vision_tower.encoder.layers.0.self_attn.q_proj.weight",
                            np.zeros((4, 4))),
                           ("model.layers.0.mlp.down_proj.weight", np.zeros((4, 4))),
                           ("model.layers.7.self_attn.q_proj.weight", np.zeros((4, 4))),
                           (3, np.zeros(1))]):  # not KDA layers, not a name
        pass
    assert not session.touched and session.kept_bytes == 0
    report = session.close()
    assert report.passed and report.params == report.regions == 0


def test_wrap_verifies_each_part_as_the_engine_consumes_it_and_keeps_no_copy(tmp_path):
    before = held(CKPT["kimi_linear"], LAYOUTS["kimi_linear"], 2, 4)
    after = held(scaled("kimi_linear", tmp_path, 2.0), LAYOUTS["kimi_linear"], 2, 4)
    live = {n: a.copy() for n, a in before.items()}  # the engine's parameters
    session = session_for("kimi_linear", live, 2, 4)
    for name, _ in session.wrap(tensors("kimi_linear", 2.0).items()):
        for n in live:  # the engine applies what it was fed (here: all of it at the first)
            live[n][...] = after[n]
        assert session.kept_bytes == 0  # verified on the fly: nothing kept
    report = session.close()
    assert report.passed and report.params == len(live)
    live[PRE + "o_norm.weight"][...] = 0  # changed after it was applied
    (problem,) = session.close().problems
    assert problem == (f"{PRE}o_norm.weight: o_norm: {PRE}o_norm.weight was applied, then "
                       "changed before the update ended (a later write over the verified region)")


def test_wrap_keeps_what_the_engine_has_not_applied_and_names_it():
    before = held(CKPT["glm"], LAYOUTS["glm"], 0, 2)
    live = {n: a.copy() for n, a in before.items()}
    session = session_for("glm", live, 0, 2)
    for _ in session.wrap(tensors("glm", 2.0).items()):
        pass  # an engine that applies nothing
    session.end_call()
    assert session.kept_bytes == sum(t.local_bytes for t in session.target.plan.tensors)
    problems = session.close().problems
    assert problems and all("holds the values from before the update" in p for p in problems)


def test_a_nan_cast_to_another_payload_matches_as_in_the_audit():
    """The audit's rule: a NaN matches a NaN of any bit pattern (torch and ml_dtypes cast a NaN
    to different ones)."""
    torch = pytest.importorskip("torch")
    before = {n: torch.from_numpy(a.copy()) for n, a in
              held(CKPT["kimi_linear"], LAYOUTS["kimi_linear"], 0, 2).items()}
    name = PRE + "o_norm.weight"
    fed = torch.full((128,), float("nan"))
    session = session_for("kimi_linear", before, 0, 2)
    for _ in session.wrap([(name, fed)]):
        before[name].view(torch.int32)[...] = 0x7FC00001  # another NaN payload
    assert session.close().passed


def test_an_error_of_the_check_itself_is_a_line_never_an_exception():
    before = held(CKPT["glm"], LAYOUTS["glm"], 0, 2)
    session = session_for("glm", before, 0, 2)

    class Unreadable:
        shape = (4,)

        def reshape(self, *shape):
            raise OverflowError("cannot be read")

    for _ in session.wrap([(PRE + "o_norm.weight", Unreadable())]):
        pass
    report = session.close()
    assert not report.passed and not report.problems
    assert report.unchecked == [f"{PRE}o_norm.weight: the check failed: OverflowError: cannot "
                                "be read"]


def test_the_target_is_built_once_and_knows_the_parts_a_rank_holds():
    before = held(CKPT["k3"], LAYOUTS["k3"], 1, 4)
    target = RankTarget.build(describe(CKPT["k3"]), before, tp_rank=1,
                              tp_size=4)
    assert target.layout.name == LAYOUTS["k3"] and (target.tp_rank, target.tp_size) == (1, 4)
    assert set(target.params) == set(before)
    assert {n.removeprefix(PRE) for n in target.fed} >= {"q_proj.weight", "A_log", "o_proj.weight"}
    assert target.nbytes == sum(a.nbytes for a in before.values())
    assert target.holds(object())  # built without a model: nothing to compare
