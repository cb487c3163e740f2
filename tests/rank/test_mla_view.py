"""``open_rank(..., mla=True)``: a rank's view slices the hybrid's MLA layers too (the layers the
config names), byte for byte as the oracle's MLA plan (``kda_tp.oracle.mla_plan``, restated from
``tests/data/spec/mla.md``) slices the checkpoint's bytes; without ``mla`` (what shard, verify,
the audit and the guard open) the MLA tensors pass through whole, as before."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kda_tp
from kda_tp import oracle
from kda_tp.errors import CheckpointError, DtypeMismatchError, ShapeMismatchError
from kda_tp.model import parse_mla_config
from kda_tp.synth import write_small_checkpoint

from paths import DATA

SMALL = dict(hidden=96, heads=4, head_dim=64, conv_kernel=4, gate_rank=64, num_layers=4)
STYLES = ("kimi", "k3", "glm")


@pytest.fixture(scope="module", params=STYLES)
def hybrid(request, tmp_path_factory) -> Path:
    """A synthetic hybrid of the family: layers 0, 2 KDA, 1, 3 MLA."""
    return write_small_checkpoint(tmp_path_factory.mktemp(request.param), **SMALL,
                                  kda_layers=[0, 2], seed=3, style=request.param)


def oracle_mla(ckpt: Path, rank: int, tp_size: int) -> oracle.OracleMlaPlan:
    config = json.loads((ckpt / "config.json").read_text())
    mla = parse_mla_config(config)
    assert mla is not None
    return oracle.mla_plan(rank, tp_size, mla.hidden, mla.heads, mla.kv_lora_rank,
                           mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim,
                           q_lora_rank=mla.q_lora_rank, output_gate=mla.output_gate,
                           indexer=mla.indexer)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_every_mla_tensor_is_the_oracle_s_slice(hybrid, tp_size):
    full = kda_tp.SafetensorsSource(hybrid)
    for rank in range(tp_size):
        expected = oracle_mla(hybrid, rank, tp_size)
        with kda_tp.open_rank(hybrid, tp_rank=rank, tp_size=tp_size, mla=True,
                              qk_multiple=1) as view:
            assert view.mla_layers == (1, 3) and view.mla is not None
            held = 0
            for name in view.names():
                if ".layers.1.self_attn." not in name and ".layers.3.self_attn." not in name:
                    continue
                plan_name = name.split(".self_attn.")[1].removesuffix(".weight")
                entry = expected.get(plan_name)
                assert entry is not None, name
                want = oracle.shard_bytes(entry, full.get(name).data.tobytes())
                got = view[name]
                assert got.data.tobytes() == want, name
                assert view.is_sharded(name)
                out = np.empty(entry.local_bytes, dtype=np.uint8)
                view.read_into(name, out)
                assert out.tobytes() == want, name
                held += 1
            # Every tensor of the plan but GLM's absent indexer, in both MLA layers.
            planned = [t for t in expected.tensors if not t.name.startswith("indexer.")]
            assert held == 2 * len(planned)


def test_the_ranks_rejoin_kv_b_proj_and_o_proj(hybrid):
    full = kda_tp.SafetensorsSource(hybrid)
    prefix = kda_tp.describe(full).prefix
    kv, o = (f"{prefix}1.self_attn.{n}.weight" for n in ("kv_b_proj", "o_proj"))
    views = [kda_tp.open_rank(hybrid, tp_rank=r, tp_size=4, mla=True, qk_multiple=1)
             for r in range(4)]
    assert np.array_equal(np.concatenate([v[kv].array for v in views], axis=0), full.get(kv).array)
    assert np.array_equal(np.concatenate([v[o].array for v in views], axis=1), full.get(o).array)
    # Rank 1's kv_b_proj is its head (P + V rows each), not rank 0's.
    assert not np.array_equal(views[1][kv].array, views[0][kv].array)
    for view in views:
        view.close()


def test_without_mla_the_mla_tensors_pass_through_whole(hybrid):
    full = kda_tp.SafetensorsSource(hybrid)
    with kda_tp.open_rank(hybrid, tp_rank=1, tp_size=2) as view:
        assert view.mla is None and view.mla_layers == ()
        for name in view.names():
            if ".layers.1.self_attn." in name:
                assert not view.is_sharded(name)
                assert view[name].data.tobytes() == full.get(name).data.tobytes()


def test_a_kda_only_checkpoint_has_no_mla_layers_to_slice():
    with kda_tp.open_rank(DATA / "kda_small", tp_rank=0, tp_size=2, mla=True) as view:
        assert view.mla is None and view.mla_layers == ()


def test_k3_small_s_mla_layer_disagrees_with_its_config_and_is_refused():
    """The fixture's MLA layer holds the KDA-shaped g_proj/o_proj (its trap) while its config
    says v_head_dim 128: the plan follows the config, so the view names the tensor."""
    with pytest.raises(ShapeMismatchError) as refused:
        kda_tp.open_rank(DATA / "k3_small", tp_rank=0, tp_size=2, mla=True)
    message = str(refused.value)
    assert "layers.1.self_attn.g_proj.weight" in message and "[256, 128]" in message
    assert "[512, 128]" in message and "num_attention_heads" in message


def tensors_and_config(ckpt: Path) -> tuple[dict, dict]:
    source = kda_tp.SafetensorsSource(ckpt)
    tensors = {name: source.get(name).array.copy() for name in source.names()}
    return tensors, json.loads((ckpt / "config.json").read_text())


def test_an_mla_layer_lacking_a_tensor_or_holding_an_unknown_one_is_refused(hybrid):
    tensors, config = tensors_and_config(hybrid)
    source = kda_tp.SafetensorsSource(hybrid)
    prefix = kda_tp.describe(source).prefix
    kv = f"{prefix}3.self_attn.kv_b_proj.weight"
    lacking = {n: t for n, t in tensors.items() if n != kv}
    with pytest.raises(CheckpointError, match=f"MLA layer 3 lacks {kv}"):
        kda_tp.open_rank(lacking, config=config, tp_rank=0, tp_size=2, mla=True)
    extra = dict(tensors)
    extra[f"{prefix}1.self_attn.kv_b_proj.weight_scale_inv"] = np.ones((2, 2), np.float32)
    with pytest.raises(CheckpointError, match="MLA layer 1 holds a self_attn tensor the MLA "
                                              "plan does not know"):
        kda_tp.open_rank(extra, config=config, tp_rank=0, tp_size=2, mla=True)
    # The same tensors without mla: passed through, as before.
    kda_tp.open_rank(extra, config=config, tp_rank=0, tp_size=2).close()


def test_an_mla_tensor_in_another_dtype_than_the_first_mla_layer_s_is_refused(hybrid):
    tensors, config = tensors_and_config(hybrid)
    source = kda_tp.SafetensorsSource(hybrid)
    prefix = kda_tp.describe(source).prefix
    name = f"{prefix}3.self_attn.o_proj.weight"
    tensors[name] = tensors[name].astype(np.float32)
    with pytest.raises(DtypeMismatchError, match=f"{name}: dtype F32, expected BF16 as in the "
                                                 "first MLA layer \\(1\\)"):
        kda_tp.open_rank(tensors, config=config, tp_rank=0, tp_size=2, mla=True, qk_multiple=1)
