"""Regressions for problems found by review: other stacks mistaken for KDA layers, output
directories mixing world sizes, configs without layer lists, odd buffers, pickling, and the
Hugging Face cache layout."""

from __future__ import annotations

import copy
import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

import kda_tp
from kda_tp import oracle
from kda_tp._io import write_index, write_safetensors
from kda_tp.cli import main
from kda_tp.shard import rank_dir, shard_checkpoint, verify_shards
from kda_tp.synth import write_small_checkpoint

SMALL = dict(hidden=96, heads=4, head_dim=64, conv_kernel=4, gate_rank=16, num_layers=3)


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return write_small_checkpoint(tmp_path / "ckpt", **SMALL, kda_layers=[0, 2], seed=5)


def _add_tensor(ckpt: Path, name: str, shape: tuple[int, ...], data: bytes) -> None:
    """Add a BF16 tensor in a new file of the checkpoint, and list it in the index."""
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    write_safetensors(ckpt / "extra.safetensors", [(name, "BF16", shape, len(data), lambda: data)])
    index["weight_map"][name] = "extra.safetensors"
    write_index(index_path, index["weight_map"], index["metadata"]["total_size"] + len(data))


def test_another_stack_with_self_attn_layers_passes_through(ckpt, tmp_path):
    name = "vision_tower.encoder.layers.0.self_attn.q_proj.weight"
    data = bytes(range(256)) * (256 * 96 * 2 // 256)
    _add_tensor(ckpt, name, (256, 96), data)
    out = tmp_path / "out"
    shard_checkpoint(ckpt, out, 2)
    rank0 = kda_tp.SafetensorsSource(rank_dir(out, 0))
    assert rank0.info(name) == ("BF16", (256, 96))
    assert bytes(rank0.get(name)) == data
    assert verify_shards(ckpt, out, numeric=True).ok
    assert oracle.verify(ckpt, out) == []


def test_a_language_model_prefix_is_found(tmp_path):
    """KDA layers under `language_model.model.layers.` shard, and the numeric check finds them."""
    base = write_small_checkpoint(tmp_path / "base", **SMALL, kda_layers=[0, 2], seed=5)
    src = kda_tp.SafetensorsSource(base)
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    specs = [("language_model." + n, *src.info(n), src.get(n).nbytes, lambda n=n: src.get(n).data)
             for n in src.names()]
    write_safetensors(renamed / "model.safetensors", specs)
    shutil.copy(base / "config.json", renamed / "config.json")
    shard_checkpoint(renamed, tmp_path / "out", 2)
    rank1 = kda_tp.SafetensorsSource(rank_dir(tmp_path / "out", 1))
    assert rank1.info("language_model.model.layers.0.self_attn.A_log")[1] == (1, 1, 2, 1)
    assert verify_shards(renamed, tmp_path / "out", numeric=True).ok
    assert oracle.verify(renamed, tmp_path / "out") == []


def test_a_different_world_size_is_not_mixed_into_one_output(ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    shard_checkpoint(ckpt, out, 4, qk_multiple=128, ranks=[2, 3])
    with pytest.raises(kda_tp.OutputError, match="holds output for tp_size 4, not 2"):
        shard_checkpoint(ckpt, out, 2)
    # --force replaces the other world size's ranks instead of leaving them beside the new ones.
    shard_checkpoint(ckpt, out, 2, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["rank0", "rank1"]
    assert verify_shards(ckpt, out).ok


def test_verify_flags_ranks_beyond_tp_size(ckpt, tmp_path):
    out = tmp_path / "out"
    shard_checkpoint(ckpt, out, 2)
    shutil.copytree(rank_dir(out, 1), rank_dir(out, 2))
    report = verify_shards(ckpt, out)
    assert not report.ok
    assert "rank directories [2] beyond tp_size 2" in report.problems[0]


def test_verify_on_an_empty_rank0(ckpt, tmp_path):
    out = tmp_path / "out"
    rank_dir(out, 0).mkdir(parents=True)
    (rank_dir(out, 0) / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    report = verify_shards(ckpt, out)
    assert not report.ok and "holds no safetensors file" in report.problems[0]


def test_verify_refuses_an_absurd_tp_size_quickly(ckpt, tmp_path):
    out = tmp_path / "out"
    rank_dir(out, 0).mkdir(parents=True)
    write_safetensors(rank_dir(out, 0) / "model.safetensors",
                      [("x", "U8", (1,), 1, lambda: b"\0")], {"tp_size": str(10**9), "tp_rank": "0"})
    with pytest.raises(kda_tp.PlanError, match="divisible by tp_size"):
        verify_shards(ckpt, out)


def test_layers_argument_when_the_config_does_not_list_them(ckpt, tmp_path):
    config = json.loads((ckpt / "config.json").read_text())
    del config["linear_attn_config"]["kda_layers"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(kda_tp.CheckpointError, match="pass layers="):
        shard_checkpoint(ckpt, tmp_path / "out", 2)
    shard_checkpoint(ckpt, tmp_path / "out", 2, layers=[0, 2])
    rank1 = kda_tp.SafetensorsSource(rank_dir(tmp_path / "out", 1))
    assert rank1.info("model.layers.2.self_attn.q_proj.weight")[1] == (128, 96)
    assert rank1.info("model.layers.1.self_attn.q_proj.weight")[1] != (128, 96)  # not KDA
    assert verify_shards(ckpt, tmp_path / "out").ok


def test_strided_buffers_are_copied_not_refused():
    q = kda_tp.KdaTpPlan(1, 2, 4, 64, 4, 2, 4)["q_proj"]
    full = np.arange(2 * q.full_bytes, dtype=np.uint32).astype(np.uint8)[::2]
    assert not full.flags.c_contiguous
    expected = full.tobytes()[q.full_bytes // 2 :]
    assert bytes(kda_tp.shard_bytes(q, full)) == expected
    assert bytes(kda_tp.shard_bytes(q, memoryview(full.copy())[::1])) == expected


def test_plans_pickle_and_copy():
    plan = kda_tp.KdaTpPlan(1, 2, 4096, 128, 64, 4, 128, qk_multiple=128, dtypes={"q_conv1d": "F32"})
    for other in (pickle.loads(pickle.dumps(plan)), copy.deepcopy(plan), copy.copy(plan)):
        assert type(other) is kda_tp.KdaTpPlan and other == plan
        assert other["q_conv1d"].dtype == "F32" and other.qk_multiple == 128


def test_a_plan_name_typo_lists_the_names():
    with pytest.raises(KeyError, match="expected one of q_proj, k_proj"):
        kda_tp.KdaTpPlan(0, 2, 4096, 128, 64, 4, 128)["o_proj.weight"]


def test_tp_size_zero_is_named():
    with pytest.raises(kda_tp.PlanError, match="tp_size is 0"):
        kda_tp.KdaTpPlan(0, 0, 4096, 128, 64, 4, 128)


def test_config_json_given_as_the_checkpoint(ckpt, tmp_path, capsys):
    assert main(["shard", str(ckpt / "config.json"), "--tp-size", "2", "--out",
                 str(tmp_path / "out"), "--quiet"]) == 2
    assert "a JSON file; expected a checkpoint directory or a .safetensors file" in (
        capsys.readouterr().err
    )


def test_hugging_face_cache_layout(tmp_path):
    """snapshots/<rev>/ holds symlinks into ../../blobs/: followed, not refused."""
    base = write_small_checkpoint(tmp_path / "base", **SMALL, kda_layers=[0, 2], seed=5)
    blobs, snapshot = tmp_path / "hub/blobs", tmp_path / "hub/snapshots/abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(base.iterdir())):
        blob = blobs / f"sha{i}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    shard_checkpoint(snapshot, tmp_path / "out", 2)
    assert verify_shards(snapshot, tmp_path / "out").ok


@pytest.mark.parametrize("name", ["rank5", ".rank0.partial-keep"])
def test_an_input_inside_the_output_is_never_removed(ckpt, tmp_path, name):
    out = tmp_path / "out"
    inside = out / name
    shutil.copytree(ckpt, inside)
    before = sorted(p.name for p in inside.iterdir())
    for force in (False, True):
        with pytest.raises(kda_tp.OutputError, match="is \\(or holds\\) the input checkpoint"):
            shard_checkpoint(inside, out, 2, force=force)
    assert sorted(p.name for p in inside.iterdir()) == before


def test_an_empty_kda_layer_list_is_a_named_error(ckpt, tmp_path):
    config = json.loads((ckpt / "config.json").read_text())
    config["linear_attn_config"]["kda_layers"] = []
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(kda_tp.CheckpointError, match="no KDA layer"):
        shard_checkpoint(ckpt, tmp_path / "out", 2)


def test_a_failed_force_rerun_restores_the_previous_output(ckpt, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shard_checkpoint(ckpt, out, 2)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    import kda_tp.shard as shard_module

    real = shard_module.write_safetensors

    def fail_on_rank1(path, *args, **kwargs):
        if ".rank1.partial" in str(path):
            raise kda_tp.OutputError(f"{path}: write failed: [Errno 28] No space left on device")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shard_module, "write_safetensors", fail_on_rank1)
    with pytest.raises(kda_tp.OutputError, match="No space left"):
        shard_checkpoint(ckpt, out, 2, force=True)
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert sorted(p.name for p in out.iterdir()) == ["rank0", "rank1"]
    assert verify_shards(ckpt, out).ok
