"""`kda-tp audit` on the bug classes, each made by editing a fixture dump (vLLM 0.33.0 and
SGLang 0.5.23 as they loaded it): exit 1, with the parameter named and what it equals instead
(another rank's slice or part, an even split of a padded A_log, parts in another order, non-zero
padding, a missing parameter, zeros); the diagnosis stays within its budget."""

from __future__ import annotations

import sys

import numpy as np

import kda_tp
from kda_tp import SafetensorsSource

from audit_helpers import audit_file, fixture, only_failure, rank_params
from tp_fixtures import PRE  # the engine_ranks fixtures


# ------------------------------------------------------------------------------------------
# Bug classes, each made by editing a fixture dump: exit 1, the parameter and what it equals


def test_another_ranks_slice(tmp_path, capsys):
    meta, tensors, ckpt = fixture("vllm_glm_tp4_r3")
    rank0 = rank_params(ckpt, "vllm-0.33-glm-5.3", 0, 4)
    tensors[PRE + "o_proj.weight"] = rank0[PRE + "o_proj.weight"]
    status, out, doc = audit_file(tmp_path, capsys, "vllm_glm_tp4_r3", tensors)
    assert status == 1 and not doc["ok"]
    line = next(line for line in out.splitlines() if "o_proj" in line)
    assert line.startswith(f"rank 3 {PRE}o_proj.weight: values differ in o_proj")
    assert "equals rank 0's slice of o_proj" in line
    failure = only_failure(doc)
    assert failure["name"] == PRE + "o_proj.weight"
    [diff] = failure["differences"]
    # column j of o_proj holds 110000 + j: rank 3 starts at column 1152, rank 0 at 0
    assert diff == {"part": "o_proj", "index": [0, 0], "part_index": [0, 0],
                    "expected": 111152.0, "actual": 110000.0,
                    "equals": "rank 0's slice of o_proj", "untried": 0}
    assert out.splitlines()[-1].startswith("FAIL: 1 KDA parameter(s) wrong; 9 of 10")


def test_another_ranks_part_inside_a_fused_parameter(tmp_path, capsys):
    meta, tensors, ckpt = fixture("vllm_k3_tp4_r1")
    rank2 = rank_params(ckpt, "vllm-0.33-k3", 2, 4)
    name = PRE + "in_proj_qkvgfab.weight"
    w = tensors[name].copy()
    w[768:1152] = rank2[name][768:1152]  # v_proj's rows, from rank 2
    tensors[name] = w
    status, out, doc = audit_file(tmp_path, capsys, "vllm_k3_tp4_r1", tensors)
    assert status == 1
    [diff] = only_failure(doc)["differences"]
    assert (diff["part"], diff["index"], diff["equals"]) == (
        "v_proj", [768, 0], "rank 2's slice of v_proj")
    assert "part v_proj differs at [768, 0]" in out


def test_even_split_of_a_padded_a_log(tmp_path, capsys):
    meta, tensors, ckpt = fixture("vllm_k3_tp4_r1")
    full = SafetensorsSource(ckpt).get(PRE + "A_log").array  # 128 stored, 12 heads
    # the [h] parameter narrowed at rank x 128/4 = 32 instead of rank x 12/4 = 3
    tensors[PRE + "A_log"] = full[32:35].copy()
    status, out, doc = audit_file(tmp_path, capsys, "vllm_k3_tp4_r1", tensors)
    assert status == 1
    failure = only_failure(doc)
    assert failure["name"] == PRE + "A_log"
    # entries 32..34 are padding: zero, like a parameter never loaded; both are said
    assert failure["differences"][0]["equals"] == (
        "zeros (never loaded?), or the even split of the padded A_log: entries 32..34 of the "
        "128 stored (padding included, 32 per rank), instead of heads 3..5 of 12: both are "
        "all zero")
    # the even split by shape: 128/4 = 32 entries per rank
    tensors[PRE + "A_log"] = full[32:64].copy()
    status, out, doc = audit_file(tmp_path, capsys, "vllm_k3_tp4_r1", tensors)
    failure = only_failure(doc)
    assert status == 1 and failure["problem"] == "shape [32], expected [3]"
    assert failure["equals"].startswith(
        "zeros (never loaded?), or the even split of the padded A_log: entries 32..63")
    assert f"rank 1 {PRE}A_log: shape [32], expected [3]; equals zeros (never loaded?), or " \
           "the even split" in out
    # rank 0's even split holds real heads (entries 0..31: heads 0..11, then padding)
    tensors[PRE + "A_log"] = full[0:32].copy()
    status, out, doc = audit_file(tmp_path, capsys, "vllm_k3_tp4_r1", tensors)
    assert only_failure(doc)["equals"] is None  # not rank 1's even split: no diagnosis


def test_dt_bias_at_the_head_offset(tmp_path, capsys):
    meta, tensors, ckpt = fixture("sglang_kimi_linear_tp4_r2")
    full = SafetensorsSource(ckpt).get(PRE + "dt_bias").array
    tensors[PRE + "dt_bias"] = full[6 : 6 + 384].copy()  # rank 2 x 3 heads, not x 384 channels
    status, out, doc = audit_file(tmp_path, capsys, "sglang_kimi_linear_tp4_r2", tensors)
    assert status == 1
    [diff] = only_failure(doc)["differences"]
    assert diff["part"] == "dt_bias" and diff["index"] == [0]
    assert diff["equals"] == ("dt_bias[6:390]: sliced at the head offset rank x H/T = 6 "
                              "instead of the channel offset rank x C/T = 768")


def test_parts_in_another_order(tmp_path, capsys):
    meta, tensors, ckpt = fixture("sglang_glm_tp4_r3")
    name = PRE + "fused_qkvbfg_a_proj.weight"  # q, k, v (384 rows each), b (3), f_a, g_a (128)
    w = tensors[name]
    q, k, v, b, f_a, g_a = np.split(w, [384, 768, 1152, 1155, 1283])
    tensors[name] = np.concatenate([q, k, v, f_a, g_a, b])  # b last: the sizes differ
    status, out, doc = audit_file(tmp_path, capsys, "sglang_glm_tp4_r3", tensors)
    assert status == 1
    failure = only_failure(doc)
    assert failure["equals"] == ("its parts in another order: q_proj, k_proj, v_proj, f_a_proj, "
                                 "g_a_proj, b_proj (expected q_proj, k_proj, v_proj, b_proj, "
                                 "f_a_proj, g_a_proj)")
    assert [d["part"] for d in failure["differences"]] == ["b_proj", "f_a_proj", "g_a_proj"]
    # same-size parts swapped: each part says whose slice it holds
    tensors[name] = np.concatenate([k, q, v, b, f_a, g_a])
    status, out, doc = audit_file(tmp_path, capsys, "sglang_glm_tp4_r3", tensors)
    diffs = only_failure(doc)["differences"]
    assert [(d["part"], d["equals"]) for d in diffs] == [
        ("q_proj", "this rank's slice of k_proj: parts in another order"),
        ("k_proj", "this rank's slice of q_proj: parts in another order"),
    ]


def test_f_b_and_g_b_swapped(tmp_path, capsys):
    for stem, names in (("sglang_kimi_linear_tp4_r2", None),
                        ("vllm_kimi_linear_tp4_r2", ("f_b_proj.weight", "g_b_proj.weight"))):
        meta, tensors, ckpt = fixture(stem)
        if names is None:  # SGLang: stack(f_b, g_b)
            tensors[PRE + "fused_fg_b_proj.weight"] = tensors[PRE + "fused_fg_b_proj.weight"][::-1]
            wrong = [PRE + "fused_fg_b_proj.weight"]
        else:  # vLLM: two parameters
            f, g = (PRE + n for n in names)
            tensors[f], tensors[g] = tensors[g], tensors[f]
            wrong = [f, g]
        status, out, doc = audit_file(tmp_path, capsys, stem, tensors)
        assert status == 1
        failures = [p for p in doc["params"] if p["status"] != "exact"]
        assert [p["name"] for p in failures] == wrong
        equals = [d["equals"] for p in failures for d in p["differences"]]
        assert equals == ["this rank's slice of g_b_proj: f_b and g_b swapped",
                          "this rank's slice of f_b_proj: f_b and g_b swapped"]


def test_the_diagnosis_stops_at_its_budget_and_says_what_it_did_not_try(monkeypatch):
    # The verdict (which part, where) comes whatever the budget; the diagnosis
    # compares candidates only while the budget lasts, and counts those it did not try
    meta, tensors, ckpt = fixture("vllm_glm_tp4_r3")
    rank0 = rank_params(ckpt, "vllm-0.33-glm-5.3", 0, 4)
    tensors[PRE + "o_proj.weight"] = rank0[PRE + "o_proj.weight"]
    monkeypatch.setattr(sys.modules["kda_tp.audit._diagnosis"], "DIAGNOSIS_BUDGET", 0)
    [failure] = kda_tp.audit.audit(tensors, ckpt, tp_rank=3, tp_size=4, model_dtype="F32").failures
    [diff] = failure.differences
    # rank 0's column slice of o_proj starts as the part does (its first row's columns, read
    # in place): only a gather of the whole slice could tell, which the budget does not pay
    # for; ranks 1 and 2's first elements already differ
    assert (diff.part, diff.index, diff.equals, diff.untried) == ("o_proj", (0, 0), None, 1)
    assert failure.format().endswith(
        "part o_proj differs at [0, 0] (its [0, 0]; expected 111152.0, got 110000.0) (1 "
        "candidate slice(s) not tried: the diagnosis budget is spent)")
    assert diff.to_dict()["untried"] == 1


def test_non_zero_padding_rows(tmp_path, capsys):
    meta, tensors, ckpt = fixture("vllm_k3_tp4_r1")
    name = PRE + "in_proj_qkvgfab.weight"
    w = tensors[name].copy()
    w[1670, 5] = 7.0  # rows 1667..1679 pad q,k,v,g,f_a,b to a multiple of 16
    tensors[name] = w
    status, out, doc = audit_file(tmp_path, capsys, "vllm_k3_tp4_r1", tensors)
    assert status == 1
    [diff] = only_failure(doc)["differences"]
    assert diff == {"part": "padding", "index": [1670, 5], "part_index": [3, 5],
                    "expected": 0.0, "actual": 7.0,
                    "equals": "non-zero padding: rows 1667..1679 must be zero, row 1670 is not",
                    "untried": 0}
    assert "part padding differs at [1670, 5]" in out


def test_missing_parameter_and_zeros(tmp_path, capsys):
    meta, tensors, ckpt = fixture("sglang_k3_tp4_r1")
    del tensors[PRE + "f_b_proj.weight"]
    tensors[PRE + "dt_bias"] = np.zeros_like(tensors[PRE + "dt_bias"])
    status, out, doc = audit_file(tmp_path, capsys, "sglang_k3_tp4_r1", tensors)
    assert status == 1
    by_name = {p["name"]: p for p in doc["params"] if p["status"] != "exact"}
    assert by_name[PRE + "f_b_proj.weight"]["status"] == "missing"
    assert by_name[PRE + "f_b_proj.weight"]["problem"] == (
        "missing: sglang-0.5.23-k3 holds f_b_proj.weight [384, 128] here")
    assert by_name[PRE + "dt_bias"]["differences"][0]["equals"] == "zeros (never loaded?)"
    assert f"rank 1 {PRE}f_b_proj.weight: missing" in out


def test_a_value_that_matches_nothing_known(tmp_path, capsys):
    meta, tensors, ckpt = fixture("vllm_kimi_linear_tp4_r2")
    a = tensors[PRE + "o_norm.weight"].copy()
    a[5] += 0.5
    tensors[PRE + "o_norm.weight"] = a
    status, out, doc = audit_file(tmp_path, capsys, "vllm_kimi_linear_tp4_r2", tensors)
    [diff] = only_failure(doc)["differences"]
    assert status == 1 and diff["index"] == [5] and diff["equals"] is None
    assert (diff["expected"], diff["actual"]) == (5.0, 5.5)
