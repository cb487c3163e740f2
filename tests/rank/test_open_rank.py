"""``open_rank``'s view is a mapping of names: it iterates and counts its names like a dict;
``5 in view`` is False, and membership after ``close()`` raises the closed-view error as
``view[name]`` does. Opening a rank directory ``shard`` wrote says it is already a shard.

(The ``kept`` fixture, a ``demo --keep`` directory, is tests/conftest.py's.)
"""

from __future__ import annotations

from pathlib import Path

import kda_tp
import pytest
from kda_tp.errors import CheckpointError, DtypeMismatchError


def test_the_rank_view_iterates_and_counts_its_names_like_a_dict(kept: Path) -> None:
    view = kda_tp.open_rank(kept / "checkpoint", tp_rank=0, tp_size=2)
    names = view.names()
    assert list(view) == names and [n for n in view] == names and len(view) == len(names)
    assert len(names) == 20 and "model.layers.0.self_attn.q_proj.weight" in view
    assert 5 not in view and None not in view and "no.such.tensor" not in view
    assert dict(zip(view, view.keys())) == {n: n for n in names}
    view.close()
    for use in (lambda: names[0] in view, lambda: 5 in view, lambda: list(view),
                lambda: len(view), lambda: view[names[0]]):
        with pytest.raises(CheckpointError, match="(view|checkpoint) is closed"):
            use()


def test_open_rank_on_a_rank_directory_says_it_is_already_a_shard(kept: Path) -> None:
    with pytest.raises(CheckpointError) as raised:
        kda_tp.open_rank(kept / "tp2" / "rank0", tp_rank=0, tp_size=2)
    assert "already a tensor-parallel shard (rank 0 of 2, its header says); open the original " \
        "checkpoint" in str(raised.value)
    assert str(kept / "tp2" / "rank0") in str(raised.value)


def test_a_layer_of_another_dtype_is_named_beside_the_layer_the_plan_follows(
        tmp_path: Path) -> None:
    """A KDA tensor stored in another dtype in the first KDA layer (layer 0's q_proj F32, the
    others BF16): the refusal names the odd pair, both dtypes and the fix, never just the honest
    tensor of layer 1 (found by a new user)."""
    import json

    import ml_dtypes
    import numpy as np
    from checkpoint_files import read_checkpoint_tensors, write_checkpoint
    from kda_tp.synth import write_small_checkpoint

    ckpt = write_small_checkpoint(tmp_path / "ckpt", hidden=64, heads=4, head_dim=128,
                                  conv_kernel=4, gate_rank=16, num_layers=2, kda_layers=[0, 1])
    tensors = dict(read_checkpoint_tensors(ckpt))
    odd = "model.layers.0.self_attn.q_proj.weight"
    dtype, shape, data = tensors[odd]
    assert dtype == "BF16"
    tensors[odd] = ("F32", shape,
                    np.frombuffer(data, ml_dtypes.bfloat16).astype(np.float32).tobytes())
    write_checkpoint(tmp_path / "mixed", json.loads((ckpt / "config.json").read_text()), tensors)
    with pytest.raises(DtypeMismatchError) as refused:
        kda_tp.open_rank(tmp_path / "mixed", tp_rank=0, tp_size=2)
    message = str(refused.value)
    assert ("model.layers.1.self_attn.q_proj.weight: dtype BF16, expected F32 as "
            f"{odd} (the first KDA layer, whose dtypes the plan follows)") in message
    assert "convert the odd layers' tensors, or select layers of one dtype (--layers)" in message


def test_a_checkpoint_source_lists_its_names_as_keys_as_safe_open_does(kept: Path) -> None:
    with kda_tp.SafetensorsSource(kept / "checkpoint") as source:
        assert source.keys() == source.names() and len(source.keys()) == 20
