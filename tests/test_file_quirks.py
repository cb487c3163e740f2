"""Files people actually have: packed sub-byte tensors outside the KDA layers (MXFP4 experts) are
copied through byte for byte, and a header with ``"__metadata__": null`` opens as no metadata.

The checkpoints are written and read back here with the stdlib helpers of ``malformed.py``, not
with kda_tp's own writer, so the bytes are checked independently of the code under test.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import malformed
import pytest
from kda_tp import SafetensorsSource, cli, oracle
from kda_tp.shard import shard_checkpoint, verify_shards

# Tensors outside the KDA layers in every dtype the writer sizes by bits, not bytes (plus the
# one-byte E8M0 block scales MX formats pair with them): name, dtype, shape, bytes.
SUB_BYTE = [
    ("model.layers.0.mlp.experts.w1.weight_packed", "F4", [4, 6], malformed._pattern(12, 1)),
    ("model.layers.0.mlp.experts.w1.weight_scale", "F8_E8M0", [4, 1], malformed._pattern(4, 2)),
    ("model.layers.0.mlp.experts.w2.weight_packed", "F6_E2M3", [4, 4], malformed._pattern(12, 3)),
    ("model.layers.1.mlp.experts.w3.weight_packed", "F6_E3M2", [8], malformed._pattern(6, 4)),
    ("model.layers.1.mlp.experts.w4.weight_packed", "F4", [2, 1], malformed._pattern(1, 5)),
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
    return malformed._rewritten(root, "sub_byte", lambda ts: [*ts, *SUB_BYTE])


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
    data = malformed._pattern(6, 9)
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
    base = malformed._rewritten(tmp_path, "base", lambda ts: ts)
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
