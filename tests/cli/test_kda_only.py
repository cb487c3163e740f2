"""``kda-tp shard --kda-only``: per rank only the sliced tensors (KDA, and a hybrid's MLA
where planned), an overlay on the input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tp_fixtures

from kda_tp import KdaShardedSource, KdaTpPlan, SafetensorsSource, cli, describe
from kda_tp.rank.mla import rank_mla_plan
from kda_tp.shard import rank_dir, verify_shards

from paths import ROOT

CASES = [(f, f.tp_sizes[0]) for f in tp_fixtures.FIXTURES.values()]


@pytest.fixture(params=CASES, ids=[f"{f.name}-tp{t}" for f, t in CASES])
def kda_only_output(request, tmp_path, tmp_path_factory):
    fixture, tp_size = request.param
    path = tp_fixtures.checkpoint(fixture, tmp_path_factory.getbasetemp())
    out = tmp_path / "out"
    status = cli.main([
        "shard", str(path), "--tp-size", str(tp_size), "--out", str(out), "--kda-only",
        "--quiet", "--qk-multiple", str(fixture.qk_multiple),
    ])
    assert status == 0
    return path, out, tp_size, fixture


def _view(source, rank, tp_size, fixture):
    """Rank ``rank``'s view as shard slices it: the KDA tensors and the hybrid's MLA ones."""
    plan = KdaTpPlan.from_config(source, rank, tp_size, qk_multiple=fixture.qk_multiple)
    mla = rank_mla_plan(describe(source), rank, tp_size)[0]
    return KdaShardedSource(source, plan, mla=mla)


def test_each_rank_holds_exactly_its_kda_tensors_with_metadata(kda_only_output):
    path, out, tp_size, fixture = kda_only_output
    source = SafetensorsSource(path)
    for rank in range(tp_size):
        shard = _view(source, rank, tp_size, fixture)
        kda = [n for n in source.names() if shard.is_sharded(n)]
        written = SafetensorsSource(rank_dir(out, rank))
        assert sorted(written.names()) == sorted(kda)
        for name in kda:
            assert np.array_equal(written.get(name).data, shard[name].data), name
        for file, meta in written.files():
            assert meta["tp_rank"] == str(rank) and meta["tp_size"] == str(tp_size)
            assert meta["kda_tp_kda_only"] == "1"
            assert meta["kda_tp_source"] == str(path.resolve())
            assert file.name in {source.file_of(n).name for n in kda}, "input file names"
        # Nothing but the tensors, their headers and the index.
        files = sorted(p.name for p in rank_dir(out, rank).iterdir())
        assert "config.json" not in files
        index = json.loads((rank_dir(out, rank) / "model.safetensors.index.json").read_text())
        local = sum(shard[n].nbytes for n in kda)
        assert index["metadata"]["total_size"] == local
        assert set(index["weight_map"]) == set(kda)
        on_disk = sum(p.stat().st_size for p in rank_dir(out, rank).glob("*.safetensors"))
        headers = sum(8 + int.from_bytes(p.read_bytes()[:8], "little")
                      for p in rank_dir(out, rank).glob("*.safetensors"))
        assert on_disk - headers == local


def test_verify_accepts_kda_only_output_and_catches_tampering(kda_only_output):
    path, out, tp_size, fixture = kda_only_output
    report = verify_shards(path, out, numeric=True)
    assert report.ok, report.problems
    assert report.numeric is not None and report.numeric.passed
    source = SafetensorsSource(path)
    shard = _view(source, 0, tp_size, fixture)
    assert report.tensors == len([n for n in source.names() if shard.is_sharded(n)])
    target = next(rank_dir(out, 1).glob("*.safetensors"))
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    assert not verify_shards(path, out).ok
    assert cli.main(["verify", str(path), str(out)]) == 1


def test_the_readme_overlay_example_rebuilds_a_rank(kda_only_output):
    """docs/sharding.md "KDA-only output": the overlay of rank r on the original is rank r's
    checkpoint."""
    import re

    path, out, tp_size, fixture = kda_only_output
    page = (ROOT / "docs" / "sharding.md").read_text()
    section = page[page.index("## KDA-only output"):]
    code = re.search(r"```py\n(.*?)```", section, flags=re.S).group(1)
    rank = tp_size - 1
    code = (code.replace("/models/Kimi-K3", str(path)).replace("/shards/rank", f"{out}/rank")
            .replace("rank = 5 ", f"rank = {rank} "))
    namespace: dict = {}
    exec(compile(code, "docs overlay example", "exec"), namespace)
    source = SafetensorsSource(path)
    shard = _view(source, rank, tp_size, fixture)
    state = namespace["state"]
    assert list(state) == source.names()
    for name, tensor in state.items():
        assert tensor.shape == shard.info(name)[1], name
        assert np.array_equal(tensor.data, shard[name].data), name
