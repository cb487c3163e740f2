"""Files people actually have: packed sub-byte tensors outside the KDA layers (MXFP4 experts) are
copied through byte for byte, and a header with ``"__metadata__": null`` opens as no metadata.

The checkpoints are written and read back here with the stdlib helpers of ``malformed.py``, not
with kda_tp's own writer, so the bytes are checked independently of the code under test.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import kda_tp
import malformed
import pytest
from kda_tp import SafetensorsSource, cli, oracle
from kda_tp.checkpoint import write_index, write_safetensors
from kda_tp.cli import main
from kda_tp.errors import CheckpointError
from kda_tp.shard import rank_dir, shard_checkpoint, verify_shards
from kda_tp.synth import write_small_checkpoint

from paths import DATA

# Tensors outside the KDA layers in every dtype the writer sizes by bits, not bytes (plus the
# one-byte E8M0 block scales MX formats pair with them): name, dtype, shape, bytes.
SUB_BYTE = [
    ("model.layers.0.mlp.experts.w1.weight_packed", "F4", [4, 6], malformed.pattern(12, 1)),
    ("model.layers.0.mlp.experts.w1.weight_scale", "F8_E8M0", [4, 1], malformed.pattern(4, 2)),
    ("model.layers.0.mlp.experts.w2.weight_packed", "F6_E2M3", [4, 4], malformed.pattern(12, 3)),
    ("model.layers.1.mlp.experts.w3.weight_packed", "F6_E3M2", [8], malformed.pattern(6, 4)),
    ("model.layers.1.mlp.experts.w4.weight_packed", "F4", [2, 1], malformed.pattern(1, 5)),
]


def read_raw(path: Path) -> tuple[dict, bytes]:
    """(header, data section) of a safetensors file, parsed with the standard library."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def raw_tensor(path: Path, name: str) -> tuple[str, list[int], bytes]:
    header, data = read_raw(path)
    entry = header[name]
    begin, end = entry["data_offsets"]
    return entry["dtype"], entry["shape"], data[begin:end]


@pytest.fixture(scope="module")
def sub_byte_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small two-KDA-layer checkpoint of ``malformed.py`` plus the ``SUB_BYTE`` tensors."""
    root = tmp_path_factory.mktemp("quirks")
    return malformed.rewritten(root, "sub_byte", lambda ts: [*ts, *SUB_BYTE])


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_sub_byte_tensors_are_copied_through_byte_for_byte(
    sub_byte_checkpoint: Path, tmp_path: Path, backend: str
) -> None:
    out = tmp_path / "out"
    status = cli.main(
        ["shard", str(sub_byte_checkpoint), "--tp-size", "2", "--out", str(out), "--quiet",
         "--backend", backend]
    )
    assert status == 0
    for rank in range(2):
        for name, dtype, shape, data in SUB_BYTE:
            got = raw_tensor(out / f"rank{rank}" / "model.safetensors", name)
            assert got == (dtype, shape, data), (rank, name)
    assert cli.main(["verify", str(sub_byte_checkpoint), str(out)]) == 0
    report = verify_shards(sub_byte_checkpoint, out)
    assert report.ok and report.tensors == len(SafetensorsSource(sub_byte_checkpoint).names())
    # The independent stdlib verifier agrees.
    assert oracle.verify(sub_byte_checkpoint, out) == []


def test_verify_catches_a_changed_sub_byte_tensor(sub_byte_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shard_checkpoint(sub_byte_checkpoint, out, 2)
    name = SUB_BYTE[0][0]
    path = out / "rank1" / "model.safetensors"
    header, data = read_raw(path)
    begin = header[name]["data_offsets"][0]
    raw = bytearray(path.read_bytes())
    raw[len(raw) - len(data) + begin] ^= 0x10  # one F4 nibble of rank 1's copy
    path.write_bytes(bytes(raw))
    report = verify_shards(sub_byte_checkpoint, out)
    assert not report.ok
    assert any(name in p for p in report.problems), report.problems


def test_sub_byte_tensors_read_as_raw_bytes(sub_byte_checkpoint: Path) -> None:
    source = SafetensorsSource(sub_byte_checkpoint)
    for name, dtype, shape, data in SUB_BYTE:
        tensor = source.get(name)
        assert tensor is not None
        assert (tensor.dtype, tensor.shape, bytes(tensor)) == (dtype, tuple(shape), data)


# ----------------------------------------------------------------------------------------------
# "__metadata__": null


def null_metadata_file(path: Path) -> bytes:
    """A one-tensor file whose header carries ``"__metadata__": null``; returns its data."""
    data = malformed.pattern(6, 9)
    header = {
        "__metadata__": None,
        "w": {"dtype": "F16", "shape": [3], "data_offsets": [0, 6]},
    }
    malformed.write_raw(path, header, data)
    return data


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_null_metadata_opens_as_no_metadata(tmp_path: Path, backend: str) -> None:
    path = tmp_path / "null.safetensors"
    data = null_metadata_file(path)
    assert b'"__metadata__": null' in path.read_bytes()
    source = SafetensorsSource(path, backend)
    assert source.files() == [(path, None)]
    tensor = source.get("w")
    assert tensor is not None and bytes(tensor) == data
    # The reference reader agrees.
    safetensors = pytest.importorskip("safetensors")
    with safetensors.safe_open(path, "np") as f:
        assert f.metadata() is None and list(f.keys()) == ["w"]


def test_a_checkpoint_with_null_metadata_shards(tmp_path: Path) -> None:
    """A whole checkpoint whose file header has ``"__metadata__": null`` shards and verifies."""
    root = tmp_path / "ckpt"
    base = malformed.rewritten(tmp_path, "base", lambda ts: ts)
    header, data = read_raw(base / "model.safetensors")
    header["__metadata__"] = None
    root.mkdir()
    (root / "config.json").write_bytes((base / "config.json").read_bytes())
    malformed.write_raw(root / "model.safetensors", header, data)
    out = tmp_path / "out"
    assert cli.main(["shard", str(root), "--tp-size", "2", "--out", str(out), "--quiet"]) == 0
    assert cli.main(["verify", str(root), str(out)]) == 0
    metadata = read_raw(out / "rank1" / "model.safetensors")[0]["__metadata__"]
    assert (metadata["tp_rank"], metadata["tp_size"]) == ("1", "2")




THREE_LAYERS = dict(hidden=96, heads=4, head_dim=64, conv_kernel=4, gate_rank=16, num_layers=3)


@pytest.fixture
def three_layer_ckpt(tmp_path) -> Path:
    return write_small_checkpoint(tmp_path / "three_layer_ckpt", **THREE_LAYERS, kda_layers=[0, 2], seed=5)


def test_one_file_of_an_indexed_checkpoint_is_refused_by_the_api_too():
    member = DATA / "k3_small" / "model-00002-of-00002.safetensors"
    for given in (member, kda_tp.SafetensorsSource(member)):
        with pytest.raises(CheckpointError, match=r"one file of an indexed checkpoint; pass the "
                                                  r"directory .*k3_small \(it has model"):
            kda_tp.KdaTpPlan.from_config(given, 0, 2)


def _add_tensor(three_layer_ckpt: Path, name: str, shape: tuple[int, ...], data: bytes) -> None:
    """Add a BF16 tensor in a new file of the checkpoint, and list it in the index."""
    index_path = three_layer_ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    write_safetensors(three_layer_ckpt / "extra.safetensors", [(name, "BF16", shape, len(data), lambda: data)])
    index["weight_map"][name] = "extra.safetensors"
    write_index(index_path, index["weight_map"], index["metadata"]["total_size"] + len(data))


def test_another_stack_with_self_attn_layers_passes_through(three_layer_ckpt, tmp_path):
    name = "vision_tower.encoder.layers.0.self_attn.q_proj.weight"
    data = bytes(range(256)) * (256 * 96 * 2 // 256)
    _add_tensor(three_layer_ckpt, name, (256, 96), data)
    out = tmp_path / "out"
    shard_checkpoint(three_layer_ckpt, out, 2)
    rank0 = kda_tp.SafetensorsSource(rank_dir(out, 0))
    assert rank0.info(name) == ("BF16", (256, 96))
    assert bytes(rank0.get(name)) == data
    assert verify_shards(three_layer_ckpt, out, numeric=True).ok
    assert oracle.verify(three_layer_ckpt, out) == []


def test_a_language_model_prefix_is_found(tmp_path):
    """KDA layers under `language_model.model.layers.` shard, and the numeric check finds them."""
    base = write_small_checkpoint(tmp_path / "base", **THREE_LAYERS, kda_layers=[0, 2], seed=5)
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


def test_config_json_given_as_the_checkpoint(three_layer_ckpt, tmp_path, capsys):
    assert main(["shard", str(three_layer_ckpt / "config.json"), "--tp-size", "2", "--out",
                 str(tmp_path / "out"), "--quiet"]) == 2
    assert "a JSON file; expected a checkpoint directory or a .safetensors file" in (
        capsys.readouterr().err
    )


def test_hugging_face_cache_layout(tmp_path):
    """snapshots/<rev>/ holds symlinks into ../../blobs/: followed, not refused."""
    base = write_small_checkpoint(tmp_path / "base", **THREE_LAYERS, kda_layers=[0, 2], seed=5)
    blobs, snapshot = tmp_path / "hub/blobs", tmp_path / "hub/snapshots/abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(base.iterdir())):
        blob = blobs / f"sha{i}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    shard_checkpoint(snapshot, tmp_path / "out", 2)
    assert verify_shards(snapshot, tmp_path / "out").ok
