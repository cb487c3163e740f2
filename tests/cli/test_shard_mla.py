"""``kda-tp shard`` and ``verify`` on the hybrids' MLA layers: each rank holds its MLA slice by
the MlaTpPlan (checked against the oracle's ``mla_plan``, byte for byte), verify names a rank
holding another rank's slice, and an MLA layer that cannot be planned is passed through whole
with one warning line, never silently."""

from __future__ import annotations

import json

import pytest

import kda_tp
from kda_tp import oracle
from kda_tp.cli import main
from kda_tp.shard import rank_dir, shard_checkpoint, verify_shards
from kda_tp.synth import write_small_checkpoint

from paths import DATA

# 4 KDA heads of 64 and 4 MLA heads (synth's hybrids: v_head_dim = head_dim); layer 1 is MLA.
SMALL = dict(hidden=64, heads=4, head_dim=64, conv_kernel=4, gate_rank=16, num_layers=3,
             kda_layers=[0, 2], seed=11)
PREFIX = {"kimi": "model.layers.", "k3": "language_model.model.layers.",
          "glm": "model.language_model.layers."}


def _checkpoint(tmp_path, style):
    return write_small_checkpoint(tmp_path / "ckpt", **SMALL, style=style)


@pytest.mark.parametrize("style", ["kimi", "k3", "glm"])
def test_each_rank_holds_the_oracles_mla_slice(tmp_path, style):
    ckpt = _checkpoint(tmp_path, style)
    out = tmp_path / "out"
    shard_checkpoint(ckpt, out, 2)
    report = verify_shards(ckpt, out)
    assert report.ok and report.mla_note is None, report.problems
    assert oracle.verify(ckpt, out) == []
    full = kda_tp.SafetensorsSource(ckpt)
    geometry = oracle.read_mla_geometry(json.loads((ckpt / "config.json").read_text()))
    layer = f"{PREFIX[style]}1.self_attn."
    names = [n for n in full.names() if n.startswith(layer)]
    for r in range(2):
        rank = kda_tp.SafetensorsSource(rank_dir(out, r))
        assert json.loads(rank.files()[0][1]["kda_tp_mla_layers"]) == [1]
        plan = oracle.mla_plan(r, 2, **geometry)
        for name in names:
            entry = plan.get(oracle.plan_name(name.removeprefix(layer)))
            assert entry is not None, name
            assert rank.get(name).shape == oracle.local_shape(entry, full.get(name).shape)
            assert bytes(rank.get(name)) == oracle.shard_bytes(entry, bytes(full.get(name)))
        # The head-split tensors are halves; o_proj is a column gather, as KDA's.
        kv_b = rank.get(layer + "kv_b_proj.weight").shape
        assert kv_b[0] * 2 == full.get(layer + "kv_b_proj.weight").shape[0]
        o = rank.get(layer + "o_proj.weight").shape
        assert o == (64, full.get(layer + "o_proj.weight").shape[1] // 2)


def _swap(out, name, from_rank, to_rank):
    """Write ``from_rank``'s bytes of ``name`` over ``to_rank``'s, in place."""
    src = kda_tp.SafetensorsSource(rank_dir(out, from_rank))
    data = bytes(src.get(name))
    dst = kda_tp.SafetensorsSource(rank_dir(out, to_rank))
    path = dst.file_of(name)
    header = json.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])
    start = 8 + int.from_bytes(path.read_bytes()[:8], "little") + header[name]["data_offsets"][0]
    raw = bytearray(path.read_bytes())
    raw[start:start + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("tensor", ["o_proj.weight", "kv_b_proj.weight"])
def test_verify_names_a_rank_holding_rank_0s_mla_slice(tmp_path, tensor):
    ckpt = _checkpoint(tmp_path, "k3")
    out = tmp_path / "out"
    shard_checkpoint(ckpt, out, 2)
    name = f"{PREFIX['k3']}1.self_attn.{tensor}"
    _swap(out, name, 0, 1)
    report = verify_shards(ckpt, out)
    kind = "CHANNEL_COLS" if tensor.startswith("o_proj") else "CHANNEL_ROWS"
    assert report.problems == [
        f"{name}: the ranks' {kind} slices do not rejoin to the input (the slice on rank 1 "
        "differs)"
    ]
    assert oracle.verify(ckpt, out) == [
        f"rank1: {name}: bytes differ from this rank's slice of the input"
    ]


def test_an_mla_layer_that_cannot_be_planned_passes_through_whole_and_says_so(
    tmp_path, capsys
):
    ckpt = _checkpoint(tmp_path, "kimi")
    config = json.loads((ckpt / "config.json").read_text())
    del config["kv_lora_rank"]
    (ckpt / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert main(["shard", str(ckpt), "--tp-size", "2", "--out", str(out), "--quiet"]) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("kda-tp: warning:")]
    assert warnings == [
        "kda-tp: warning: MLA layers [1] passed through whole (not sliced per rank): "
        f"CheckpointError: {ckpt / 'config.json'}: config has no 'kv_lora_rank', which the MLA "
        "layers 1 need: add the model's kv_lora_rank to its config.json"
    ]
    full = kda_tp.SafetensorsSource(ckpt)
    rank1 = kda_tp.SafetensorsSource(rank_dir(out, 1))
    assert json.loads(rank1.files()[0][1]["kda_tp_mla_layers"]) == []
    for name in [n for n in full.names() if ".layers.1.self_attn." in n]:
        assert bytes(rank1.get(name)) == bytes(full.get(name))
    report = verify_shards(ckpt, out)
    assert report.ok and report.mla_note == warnings[0].removeprefix("kda-tp: warning: ")
    assert oracle.verify(ckpt, out) == []


def test_an_mla_head_count_the_tp_size_cannot_split_is_refused(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path, "kimi")
    config = json.loads((ckpt / "config.json").read_text())
    config["num_attention_heads"] = 3
    (ckpt / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert main(["shard", str(ckpt), "--tp-size", "2", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kda-tp: error: PlanError: ") and "num_attention_heads" in err
    assert not out.exists()


def test_verify_refuses_ranks_written_with_mla_whole(tmp_path):
    """An output whose headers record no sliced MLA layer (an older kda-tp passed them through)
    is not what this kda-tp writes: verify says so instead of a shape per tensor."""
    ckpt = _checkpoint(tmp_path, "glm")
    out = tmp_path / "out"
    shard_checkpoint(ckpt, out, 2)
    for r in range(2):
        for path in rank_dir(out, r).glob("*.safetensors"):
            raw = path.read_bytes()
            size = int.from_bytes(raw[:8], "little")
            header = raw[8:8 + size].replace(b'"kda_tp_mla_layers":"[1]"',
                                             b'"kda_tp_mla_layers":"[] "')
            assert header != raw[8:8 + size]
            path.write_bytes(raw[:8] + header + raw[8 + size:])
    report = verify_shards(ckpt, out)
    assert len(report.problems) == 1
    assert "were written with MLA layers [] sliced, this kda-tp slices [1]" in report.problems[0]


def test_k3_smalls_mla_layer_disagrees_with_its_config_and_passes_through_whole(
    tmp_path, capsys
):
    """tests/data/k3_small's MLA layer holds the KDA shapes (its trap: g_proj [256, 128]), not
    its config's MLA geometry (4 heads of v_head_dim 128: [512, 128]): not sliced, and said."""
    ckpt = DATA / "k3_small"
    out = tmp_path / "out"
    assert main(["shard", str(ckpt), "--tp-size", "2", "--out", str(out), "--quiet"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines()
                if line.startswith("kda-tp: warning:")]
    assert len(warnings) == 1
    assert warnings[0].startswith(
        "kda-tp: warning: MLA layers [1] passed through whole (not sliced per rank): "
        "ShapeMismatchError: "
    )
    assert "g_proj.weight: g_proj: on-disk shape [256, 128]" in warnings[0]
    assert "[512, 128]" in warnings[0]
    report = verify_shards(ckpt, out)
    assert report.ok and report.mla_note == warnings[0].removeprefix("kda-tp: warning: ")
    assert oracle.verify(ckpt, out) == []
    rank1 = kda_tp.SafetensorsSource(rank_dir(out, 1))
    assert rank1.get("language_model.model.layers.1.self_attn.g_proj.weight").shape == (256, 128)
