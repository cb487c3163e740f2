"""One description per checkpoint (kda_tp.checkpoint.description), the loader's API (open_rank and
the view's safe_open-like methods), and the registry of model families (kda_tp.model.families)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from paths import DATA

import kda_tp
from kda_tp import (
    CheckpointError,
    KdaShardedSource,
    KdaTpPlan,
    SafetensorsSource,
    TensorNotFoundError,
    describe,
    open_rank,
)
from kda_tp.model import parse_config
from kda_tp.model.config import RULES
from kda_tp.model.families import RULES_GLM, RULES_KIMI
from kda_tp.engines import FAMILIES, LAYOUTS, kda_only_suffixes
from kda_tp.model import FAMILIES as REGISTRY
from kda_tp.model import family_for
from kda_tp.guard import looks_kda
from kda_tp.model import declared_quantization
from kda_tp.synth import GEOMETRIES, write_small_checkpoint

K3 = DATA / "k3_small"
K3_FP8 = DATA / "k3_fp8_small"


class Counting(SafetensorsSource):
    """A SafetensorsSource counting its name lists and header look-ups."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.listed = 0
        self.looked_up = 0

    def names(self) -> list[str]:
        self.listed += 1
        return super().names()

    def info(self, name: str) -> tuple[str, tuple[int, ...]] | None:
        self.looked_up += 1
        return super().info(name)


def test_every_rank_of_one_source_shares_one_description_and_one_name_list():
    source = Counting(K3)
    views = [KdaShardedSource(source, KdaTpPlan.from_config(source, r, 4, qk_multiple=1))
             for r in range(4)]
    assert {id(describe(source))} == {id(v.description) for v in views}
    assert source.listed == 1
    # Rank 0 reads each KDA tensor's header once; ranks 1-3 read none again.
    first = Counting(K3)
    KdaShardedSource(first, KdaTpPlan.from_config(first, 0, 4, qk_multiple=1))
    assert source.looked_up == first.looked_up
    # The same plan as a description-free construction would give, rank by rank.
    for rank, view in enumerate(views):
        fresh = KdaTpPlan.from_config(str(K3), rank, 4, qk_multiple=1)
        assert [(t.name, t.dtype, t.local_shape(list(t.disk_shape))) for t in view.plan.tensors] \
            == [(t.name, t.dtype, t.local_shape(list(t.disk_shape))) for t in fresh.tensors]
        assert view.plan.a_log_len == fresh.a_log_len == 16


def test_the_description_reads_the_config_and_layers():
    source = SafetensorsSource(K3)  # a description does not keep its source open
    description = describe(source)
    assert description.family is REGISTRY["kimi-k3"]
    assert description.prefix == "language_model.model.layers."
    assert description.kda_layers() == description.kda.kda_layers
    facts = description.layer_facts()
    assert facts.a_log_len == 16 and facts.disk_shapes["A_log"] == (16,)
    assert facts.gate_rank == facts.disk_shapes["f_a_proj"][0]
    assert description.layer_facts() is facts  # read once per selection


def test_a_bare_config_description_assumes_its_familys_dtypes():
    config = {"model_type": "glm5_next", "text_config": {
        "model_type": "glm5_next_text", "hidden_size": 256, "linear_head_dim": 64,
        "linear_num_heads": 4, "num_hidden_layers": 4}}
    description = kda_tp.CheckpointDescription(None, config)
    assert description.family is REGISTRY["glm-5.3"]
    plan = KdaTpPlan.from_description(description, 0, 2, qk_multiple=1)
    assert plan["q_conv1d"].dtype == plan["A_log"].dtype == "F32"
    assert plan["q_proj"].dtype == "BF16"


def test_declared_quantization_reads_the_config_once_and_agrees():
    source = SafetensorsSource(K3_FP8)
    fmt, modules = declared_quantization(source.config, source.root)
    assert fmt is not None and getattr(fmt, "block", None) == (128, 128)


def test_open_rank_is_a_closable_view_with_its_plan():
    with open_rank(K3, tp_rank=1, tp_size=2, qk_multiple=1) as view:
        assert (view.plan.tp_rank, view.plan.tp_size) == (1, 2)
        names = view.keys()
        assert names == view.source.names()
        kda = next(n for n in names if n.endswith("self_attn.q_proj.weight") and view.is_sharded(n))
        other = next(n for n in names if not view.is_sharded(n))
        assert kda in view and other in view and "no.such.tensor" not in view
        local = view[kda]
        assert local.shape == view.info(kda)[1]
        assert bytes(view.get_tensor(kda)) == bytes(local)
        with pytest.raises(TensorNotFoundError, match="no tensor named 'no.such.tensor'") as e:
            view["no.such.tensor"]
        assert isinstance(e.value, KeyError) and isinstance(e.value, CheckpointError)
        kept = np.array(local.array, copy=True)
    with pytest.raises(CheckpointError, match="closed"):
        view[kda]
    with pytest.raises(CheckpointError, match="closed"):
        view.source.names()
    view.close()  # twice is harmless
    assert kept.shape == local.shape


def test_open_rank_takes_keyword_rank_and_size_only():
    with pytest.raises(TypeError):
        open_rank(K3, 0, 2)  # type: ignore[misc]


def test_open_rank_refuses_like_from_config(tmp_path):
    with pytest.raises(kda_tp.PlanError, match="layers"):
        open_rank(K3, tp_rank=0, tp_size=2, qk_multiple=1, layers=[7])


def test_membership_of_a_plain_source_builds_one_set():
    class Plain:
        def __init__(self, inner: SafetensorsSource):
            self.inner, self.listed = inner, 0
            self.config, self.root = inner.config, inner.root

        def names(self) -> list[str]:
            self.listed += 1
            return self.inner.names()

        def get(self, name: str):
            return self.inner.get(name)

    plain = Plain(SafetensorsSource(K3))
    view = KdaShardedSource(plain, KdaTpPlan.from_config(SafetensorsSource(K3), 0, 2,
                                                         qk_multiple=1))
    before = plain.listed
    names = plain.inner.names()
    assert all(n in view for n in names[:50]) and "nope" not in view
    assert plain.listed == before + 1


def test_every_list_of_families_is_the_registry():
    assert FAMILIES == tuple(REGISTRY)
    assert {layout.family for layout in LAYOUTS.values()} == set(REGISTRY)
    assert {g: GEOMETRIES[g]["style"] for g in GEOMETRIES} == {
        **{f.demo: f.style for f in REGISTRY.values()},
        **{v: f.style for f in REGISTRY.values() for v in f.variants},
    }
    assert set(RULES[RULES_KIMI][0]) == {"kimi_linear", "kimi_k3", "kimi_k3_text"}
    assert set(RULES[RULES_GLM][0]) == {"glm5_next", "glm5_next_text"}



def test_the_demo_offers_every_familys_demo_geometry(capsys):
    from kda_tp.cli import main

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    choices = "{" + ",".join(f.demo for f in REGISTRY.values()) + "}"
    assert choices == "{kimi-linear,glm-5.3-flash,kimi-k3}"
    assert f"--model {choices}" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("family", list(REGISTRY.values()), ids=lambda f: f.name)
def test_a_synthetic_checkpoint_is_read_back_as_its_family(family, tmp_path):
    out = write_small_checkpoint(tmp_path / family.name, hidden=64, heads=2, head_dim=16,
                                 conv_kernel=4, gate_rank=16, num_layers=2, kda_layers=[0],
                                 style=family.style)
    source = SafetensorsSource(out)
    assert describe(source).family.name == family.name
    kda = parse_config(source.config)
    assert family_for(kda.rules, kda.full_rank_gate) is family
    assert describe(source).prefix == family.decoder_prefix
    assert family.lm_head in source


def test_kda_looking_names_cover_the_hand_list_they_replace():
    before = (".f_a_proj.weight", ".f_b_proj.weight", ".g_a_proj.weight", ".g_b_proj.weight",
              ".o_norm.weight", ".q_conv1d.weight", ".k_conv1d.weight", ".v_conv1d.weight",
              ".in_proj_qkvgfab.weight", ".fused_qkvbfg_a_proj.weight",
              ".in_proj_qkvbfg_a.weight", ".decode_conv1d_weight")
    for end in before:
        assert looks_kda([f"model.layers.0.self_attn{end}"]), end
    shared = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
              "g_proj.weight", "fused_qkvg_proj.weight", "qkv_proj.weight")
    assert not set(shared) & kda_only_suffixes()
    assert not looks_kda([f"model.layers.0.self_attn.{s}" for s in shared])


def test_a_closed_source_refuses_reads_and_its_arrays_stay_valid():
    with SafetensorsSource(K3) as source:
        name = source.names()[0]
        data = source.get(name).data
        expected = bytes(data)
    assert bytes(data) == expected  # the array keeps its mapping alive
    for read in (source.names, lambda: source.get(name), lambda: source.info(name)):
        with pytest.raises(CheckpointError, match="closed"):
            read()
    source.close()


def test_a_described_source_goes_when_its_users_drop_it():
    import weakref

    source = SafetensorsSource(K3)
    view = KdaShardedSource(source, KdaTpPlan.from_config(source, 0, 2, qk_multiple=1))
    description, gone = view.description, weakref.ref(source)
    del source, view
    assert gone() is None  # no reference cycle keeps the mappings: refcounting frees them
    assert description.prefix == "language_model.model.layers."  # what it read stays
    with pytest.raises(CheckpointError, match="dropped"):
        description.source
