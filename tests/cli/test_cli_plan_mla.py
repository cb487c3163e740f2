"""``kda-tp plan`` on the hybrids: the MLA layers (from the config) get their own table after
the KDA one, and a ``"mla"`` entry in ``--json``, equal to the oracle's plan; a KDA-only
checkpoint's output is unchanged (no MLA section)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kda_tp import oracle
from kda_tp.synth import write_small_checkpoint

from cli_run import run
from paths import DATA

# 4 decoder layers, 0-based 0 and 2 KDA, 1 and 3 MLA.
SMALL = dict(hidden=96, heads=4, head_dim=64, conv_kernel=4, gate_rank=64, num_layers=4)


def checkpoint(tmp_path: Path, style: str) -> Path:
    return write_small_checkpoint(tmp_path / style, **SMALL, kda_layers=[0, 2], seed=1,
                                  style=style)


def oracle_plan(rank: int, tp_size: int, doc: dict) -> oracle.OracleMlaPlan:
    """The oracle's plan of the geometry ``doc`` (the JSON ``"mla"`` entry) states."""
    return oracle.mla_plan(
        rank, tp_size, doc["hidden"], doc["heads"], doc["kv_lora_rank"], doc["qk_nope_head_dim"],
        doc["qk_rope_head_dim"], doc["v_head_dim"], q_lora_rank=doc["q_lora_rank"],
        output_gate=doc["output_gate"],
        indexer=None if doc["indexer"] is None else tuple(doc["indexer"]),
    )


@pytest.mark.parametrize("style, names", [
    ("kimi", ["q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]),
    ("k3", ["q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
            "kv_b_proj", "g_proj", "o_proj"]),
    ("glm", ["q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
             "kv_b_proj", "o_proj", *oracle.INDEXER_TENSOR_NAMES]),
])
@pytest.mark.parametrize("rank", [0, 1])
def test_the_mla_section_is_the_oracle_s_plan_from_a_checkpoint_or_its_config(
        tmp_path, capsys, style, names, rank):
    ckpt = checkpoint(tmp_path, style)
    docs = []
    for given in (ckpt, ckpt / "config.json"):
        status, out, _ = run(capsys, "plan", given, "--tp-size", 2, "--rank", rank, "--json")
        assert status == 0
        docs.append(json.loads(out))
    assert docs[0]["mla"] == docs[1]["mla"]
    doc = docs[0]["mla"]
    assert doc["mla_layers"] == [1, 3] and docs[0]["kda_layers"] == [0, 2]
    assert (doc["heads"], doc["local_heads"]) == (4, 2)
    assert [t["name"] for t in doc["tensors"]] == names
    expected = oracle_plan(rank, 2, doc)
    for row, t in zip(doc["tensors"], expected.tensors):
        assert (row["kind"], row["dtype"], tuple(row["full_shape"])) == (t.kind, t.dtype,
                                                                          t.disk_shape)
        assert row["local_bytes"] == t.local_bytes
        if t.kind == "CHANNEL_COLS":
            assert row["local_shape"] == [t.full_rows, t.local_row_elems]
            assert (row["sharded_axis"], row["offset"]) == (1, t.src_col_offset)
        elif t.kind == "CHANNEL_ROWS":
            assert row["local_shape"][0] == t.local_rows
            assert (row["sharded_axis"], row["offset"]) == (0, t.src_row_offset)
        else:
            assert row["local_shape"] == row["full_shape"] and row["sharded_axis"] is None
    assert doc["total_local_bytes"] == 2 * expected.local_bytes
    assert doc["total_full_bytes"] == 2 * expected.full_bytes


def test_the_text_form_lists_the_mla_layers_after_the_kda_table(tmp_path, capsys):
    ckpt = checkpoint(tmp_path, "k3")
    status, text, _ = run(capsys, "plan", ckpt, "--tp-size", 2, "--rank", 1)
    assert status == 0
    kda, mla = text.split("MLA tensor-parallel plan")
    assert "KDA tensor-parallel plan" in kda and "g_proj" in kda
    assert mla.startswith(" (layers 1, 3): tp_size=2, num_attention_heads 4 -> 2 per rank, "
                          "q_lora_rank 768, kv_lora_rank 256, qk_nope 64, qk_rope 32, v 64, "
                          "hidden 96, output gate")
    # K3's MLA g_proj: the KDA name and shape, this rank's second half of the heads' rows.
    g_proj = next(line for line in mla.splitlines() if line.startswith("g_proj"))
    assert g_proj.split() == ["g_proj", "CHANNEL_ROWS", "BF16", "[256,", "96]", "[128,", "96]",
                              "dim", "0", "@", "128", "24,576"]
    assert "2 MLA layers:" in mla


def test_a_kda_only_checkpoint_prints_no_mla_section(capsys):
    status, text, _ = run(capsys, "plan", DATA / "kda_small", "--tp-size", 2)
    assert status == 0 and "MLA" not in text
    status, out, _ = run(capsys, "plan", DATA / "kda_small", "--tp-size", 2, "--json")
    assert status == 0 and "mla" not in json.loads(out)


def test_mla_heads_the_world_size_does_not_divide_are_refused_with_the_sizes(tmp_path, capsys):
    ckpt = checkpoint(tmp_path, "kimi")
    config = json.loads((ckpt / "config.json").read_text())
    config["num_attention_heads"] = 6  # KDA keeps 4 heads: TP 4 passes its plan, not MLA's
    (ckpt / "config.json").write_text(json.dumps(config))
    status, out, err = run(capsys, "plan", ckpt / "config.json", "--tp-size", 4, "--qk-multiple",
                           1, "--json")
    doc = json.loads(out)
    assert status == 2 and doc["ok"] is False and doc["error"]["type"] == "PlanError"
    assert ("MLA TP requires num_attention_heads (6) divisible by tp_size (4)"
            in doc["error"]["message"])
    assert "tp_size may be one of 1, 2, 3, 6" in doc["error"]["message"]


def test_a_hybrid_config_without_an_mla_size_keeps_its_kda_plan_and_says_why(tmp_path, capsys):
    """The KDA table stands as before (exit 0); the MLA layers are said not to be planned,
    naming the missing key and the fix (the K3 FP8 fixture's config has no MLA keys)."""
    ckpt = checkpoint(tmp_path, "kimi")
    config = json.loads((ckpt / "config.json").read_text())
    del config["kv_lora_rank"]
    (ckpt / "config.json").write_text(json.dumps(config))
    status, text, _ = run(capsys, "plan", ckpt / "config.json", "--tp-size", 2)
    assert status == 0 and "per KDA layer:" in text
    assert text.splitlines()[-2] == (
        f"MLA layers: not planned: CheckpointError: {ckpt / 'config.json'}: config has no "
        "'kv_lora_rank', which the MLA layers 1, 3 need: add the model's kv_lora_rank to its "
        "config.json")
    status, out, _ = run(capsys, "plan", ckpt / "config.json", "--tp-size", 2, "--json")
    doc = json.loads(out)
    assert status == 0 and doc["ok"] is True and doc["kda_layers"] == [0, 2]
    assert doc["mla"]["mla_layers"] is None
    assert doc["mla"]["error"]["type"] == "CheckpointError"
    assert "no 'kv_lora_rank'" in doc["mla"]["error"]["message"]


def test_fp8_mla_weights_split_inside_a_block_are_refused(tmp_path, capsys):
    ckpt = write_small_checkpoint(tmp_path / "fp8", hidden=128, heads=4, head_dim=64,
                                  conv_kernel=4, gate_rank=64, num_layers=2, kda_layers=[0],
                                  style="k3", fp8=True)
    status, out, _ = run(capsys, "plan", ckpt, "--tp-size", 2, "--json")
    doc = json.loads(out)
    assert status == 2 and doc["ok"] is False and doc["error"]["type"] == "PlanError"
    assert ("q_b_proj: rank 0's rows 0..192 do not start and end on block boundaries"
            in doc["error"]["message"])
