"""With backend="pread", serving one rank reads only that rank's bytes of its KDA tensors: the
row range of row-sliced tensors and the column block of o_proj (SafetensorsSource.bytes_read)."""

from __future__ import annotations

import numpy as np
import pytest
import tp_fixtures
from kda_tp import KdaShard, KdaShardedSource, KdaTpPlan, SafetensorsSource

CASES = [
    (fixture, tp_size)
    for fixture in tp_fixtures.FIXTURES.values()
    for tp_size in fixture.tp_sizes
    if tp_size in (2, 3, 6)
]


@pytest.mark.parametrize(
    "fixture,tp_size", CASES, ids=[f"{f.name}-tp{t}" for f, t in CASES]
)
def test_one_rank_reads_at_most_1_1x_its_local_kda_bytes(fixture, tp_size, tmp_path_factory):
    path = tp_fixtures.checkpoint(fixture, tmp_path_factory.getbasetemp())
    mapped = SafetensorsSource(path)
    for rank in range(tp_size):
        source = SafetensorsSource(path, backend="pread")
        plan = KdaTpPlan.from_config(source, rank, tp_size, qk_multiple=fixture.qk_multiple)
        shard = KdaShardedSource(source, plan)
        reference = KdaShardedSource(mapped, plan)
        names = [n for n in source.names() if shard.is_sharded(n)]
        before = source.bytes_read
        local = 0
        for name in names:
            tensor = shard[name]
            local += tensor.nbytes
            assert np.array_equal(tensor.data, reference[name].data), name
        read = source.bytes_read - before
        assert read <= 1.1 * local, (rank, read, local)
        assert read == local, "exactly the local bytes: nothing around them"


def test_o_proj_costs_its_column_block_and_the_header_is_counted_at_open():
    path = tp_fixtures.DATA / "kda_small"
    source = SafetensorsSource(path, backend="pread")
    header = source.bytes_read
    size = (path / "model.safetensors").stat().st_size
    data_bytes = sum(np.prod(source.info(n)[1]) * 2 for n in source.names()
                     if source.info(n)[0] == "BF16")
    data_bytes += sum(np.prod(source.info(n)[1]) * 4 for n in source.names()
                      if source.info(n)[0] == "F32")
    assert header == size - data_bytes, "8-byte length + header JSON"
    plan = KdaTpPlan.from_config(source, 1, 2)
    entry = plan["o_proj"]
    assert entry.kind == KdaShard.CHANNEL_COLS
    block = source.read_columns("model.layers.0.self_attn.o_proj.weight", entry)
    assert source.bytes_read - header == entry.local_bytes == block.nbytes
    assert not block.flags.writeable
    mapped = SafetensorsSource(path)
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    assert np.array_equal(block, mapped.read_columns(o_proj, entry))
    assert mapped.bytes_read == header, "mapped pages are not counted"
