"""Tests of kda_tp.reference.check_tp_equivalence on the kda_small fixture.

The correct split must pass; wrong splits, injected through the ``shard_source_factory`` hook as
views over the real ``KdaShardedSource`` that swap one tensor for a same-shape wrong slice, must
fail and name the layer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import kda_tp
import numpy as np
import pytest
from kda_tp import oracle, synth
from kda_tp.checkpoint import write_safetensors
from kda_tp.cli import main
from kda_tp.reference import check_tp_equivalence
from kda_tp.errors import CheckpointError, PlanError

from paths import DATA

FIXTURE = DATA / "kda_small"
PREFIX = "model.layers.0.self_attn."


class _Array:
    """A stand-in tensor record: only ``.array`` is read by the check."""

    def __init__(self, array: np.ndarray):
        self.array = array


class _Swapped:
    """A rank view that returns ``replacements[name]`` instead of the inner view's tensor."""

    def __init__(self, inner, replacements: dict[str, np.ndarray]):
        self._inner = inner
        self._replacements = replacements

    def get(self, name):
        if name in self._replacements:
            return _Array(self._replacements[name])
        return self._inner[name]


def _wrong_split(make_array):
    """A factory whose rank views swap one tensor: ``make_array(source, plan, inner) -> (name, a)``.

    The swapped array must keep the correct local shape, so only the numbers can expose it.
    """

    def factory(source, plan, layers):
        inner = kda_tp.KdaShardedSource(source, plan, layers)
        name, array = make_array(source, plan, inner)
        assert array.shape == inner[name].array.shape
        return _Swapped(inner, {name: array})

    return factory


def _o_proj_row_block(source, plan, inner):
    """o_proj cut as a row block (rank's share of the flat buffer), read in the column shape."""
    name = PREFIX + "o_proj.weight"
    full = source.get(name).array
    rows = full.shape[0] // plan.tp_size
    local_shape = inner[name].array.shape
    return name, full[plan.tp_rank * rows : (plan.tp_rank + 1) * rows].reshape(local_shape)


def _dt_bias_head_offset(source, plan, inner):
    """dt_bias sliced from ``rank * local_heads`` instead of ``rank * local_heads * head_dim``."""
    name = PREFIX + "dt_bias"
    start = plan.tp_rank * plan.local_heads
    return name, source.get(name).array[start : start + plan.local_heads * plan.head_dim]


def _a_log_of_rank0(source, plan, inner):
    name = PREFIX + "A_log"
    return name, source.get(name).array[:, :, : plan.local_heads, :]


def test_fixture_split_passes_at_tp2():
    report = check_tp_equivalence(FIXTURE, 2)
    assert report.passed and report.failed_layers == []
    assert [entry.layer for entry in report.layers] == [0]
    entry = report.layers[0]
    assert entry.max_abs_error < 1e-5 and entry.passed
    assert entry.max_rel_error == pytest.approx(entry.max_abs_error / entry.y_abs_max)
    assert entry.tolerance == pytest.approx(report.atol + report.rtol * entry.y_abs_max)
    assert report.format().startswith("layer 0:") and report.format().endswith(" ok")
    assert len(report.format().splitlines()) == 1


def test_accepts_an_open_source_and_explicit_layers():
    source = kda_tp.SafetensorsSource(FIXTURE)
    report = check_tp_equivalence(source, 2, layers=[0], seq_len=5, seed=3)
    assert report.passed and (report.seq_len, report.seed) == (5, 3)


def test_tp4_needs_the_relaxed_qk_rule():
    with pytest.raises(PlanError):
        check_tp_equivalence(FIXTURE, 4)
    assert check_tp_equivalence(FIXTURE, 4, qk_multiple=128).passed


@pytest.mark.parametrize("make_array", [_o_proj_row_block, _dt_bias_head_offset, _a_log_of_rank0])
def test_wrong_split_fails_and_names_the_layer(make_array):
    report = check_tp_equivalence(FIXTURE, 2, shard_source_factory=_wrong_split(make_array))
    assert not report.passed
    assert report.failed_layers == [0]
    assert report.layers[0].max_abs_error > 1e-3
    assert report.format().startswith("layer 0:") and report.format().endswith("FAIL")


def test_bad_arguments():
    with pytest.raises(ValueError, match="seq_len"):
        check_tp_equivalence(FIXTURE, 2, seq_len=0)
    with pytest.raises(PlanError):
        check_tp_equivalence(FIXTURE, 0)
    with pytest.raises(CheckpointError, match="no KDA layer"):
        check_tp_equivalence(FIXTURE, 2, layers=[])
    # Checked as --layers is (KdaTpPlan.from_config), not "KDA layer 5 lacks ...".
    with pytest.raises(PlanError, match=r"layers: 5 out of range \(the model has 1 layers, 0..0\)"):
        check_tp_equivalence(FIXTURE, 2, layers=[5])


def test_config_without_kda_layers_is_refused(tmp_path):
    shutil.copy(FIXTURE / "model.safetensors", tmp_path / "model.safetensors")
    config = json.loads((FIXTURE / "config.json").read_text())
    del config["linear_attn_config"]["kda_layers"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="kda_layers"):
        check_tp_equivalence(tmp_path, 2)


@pytest.mark.parametrize(("style", "flat"), [("kimi", False), ("kimi", True), ("glm", False)])
def test_synthetic_multi_layer_checkpoints_pass(tmp_path, style, flat):
    """Both config dialects, several files, a non-KDA layer in the middle, hidden != H * D."""
    geometry = {"hidden": 192, "heads": 4, "head_dim": 64, "conv_kernel": 3, "gate_rank": 64}
    synth.write_small_checkpoint(
        tmp_path,
        **geometry,
        num_layers=3,
        kda_layers=[0, 2],
        seed=5,
        style=style,
        flat_a_log=flat,
        flat_conv=flat,
        max_file_bytes=1 << 18,
    )
    report = check_tp_equivalence(tmp_path, 2, seq_len=8)
    assert [entry.layer for entry in report.layers] == [0, 2]
    assert report.passed, report.format()




def _relaid(tmp_path: Path, shapes: dict[str, list[int]]) -> Path:
    """The k3_small fixture in one file, with some tensors stored under other shapes holding the
    same bytes in the same order (extra unit axes)."""
    source = kda_tp.SafetensorsSource(DATA / "k3_small")
    out = tmp_path / "relaid"
    out.mkdir()
    shutil.copy(DATA / "k3_small" / "config.json", out)
    specs = []
    for name in source.names():
        t = source.get(name)
        assert t is not None
        data = bytes(np.asarray(t.data))
        specs.append((name, t.dtype, shapes.get(name, list(t.shape)), len(data), lambda d=data: d))
    write_safetensors(out / "model.safetensors", specs)
    return out


def test_the_numeric_check_accepts_every_layout_shard_accepts(tmp_path, capsys):
    kda = "language_model.model.layers.0.self_attn."
    ckpt = _relaid(tmp_path, {
        kda + "A_log": [1, 1, 16, 1],          # K3's padded A_log in Kimi-Linear's 4-D layout
        kda + "q_conv1d.weight": [1, 256, 4],  # a leading unit axis
        kda + "o_proj.weight": [1, 128, 256],
        kda + "dt_bias": [1, 256],
    })
    out = tmp_path / "out"
    assert main(["shard", str(ckpt), "--tp-size", "2", "--out", str(out), "--quiet"]) == 0
    rank1 = kda_tp.SafetensorsSource(out / "rank1")
    assert rank1.info(kda + "A_log") == ("F32", (1, 1, 2, 1))
    assert main(["verify", str(ckpt), str(out), "--numeric"]) == 0
    assert "numerical TP equivalence passes" in capsys.readouterr().out
    report = kda_tp.reference.check_tp_equivalence(ckpt, 2)
    assert report.passed and report.layers[0].max_abs_error < 1e-5
    assert oracle.verify(ckpt, out) == []
