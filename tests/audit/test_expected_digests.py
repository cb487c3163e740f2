"""kda_tp.audit.expected_digests: a trainer's expected per-rank digests from the tensors it sends
(no checkpoint on disk) equal ``kda-tp digests`` / ``engine_digests`` on a checkpoint holding the
same tensors, for every vLLM layout, from numpy and torch tensors, streamed or as a mapping; it
refuses ``A_log``/``dt_bias`` of a layer its config does not list as KDA (another model's
config), and items that are not ``(name, tensor)`` pairs. (The ``kept`` fixture, a
``demo --keep`` directory, is tests/conftest.py's.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kda_tp
from kda_tp import SafetensorsSource
from kda_tp.cli import main
from kda_tp.engines import LAYOUTS, get_layout
from kda_tp.errors import CheckpointError, EngineLayoutError, PlanError, UsageError
from kda_tp.checkpoint import describe
from kda_tp.rank.mla import rank_mla_plan
from kda_tp.synth import write_small_checkpoint

from paths import ENGINE_RANKS as DATA

CKPTS = {"kimi-k3": DATA / "ckpt_k3", "kimi-linear": DATA / "ckpt_kl", "glm-5.3": DATA / "ckpt_glm"}
VLLM = [name for name, lay in LAYOUTS.items() if lay.engine == "vllm"]


def fed(ckpt: Path) -> list[tuple[str, np.ndarray]]:
    """Every tensor of ``ckpt`` as a trainer would send it: full, typed numpy arrays."""
    source = SafetensorsSource(ckpt)
    return [(name, source.get(name).array) for name in source.names()]


def cli_digests(capsys, ckpt: Path, engine: str, tp_size: int, *extra: str) -> dict[str, str]:
    """What ``kda-tp digests --json`` prints for ``ckpt``."""
    assert main(["digests", str(ckpt), "--engine", engine, "--tp-size", str(tp_size),
                 "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)["checksums"]


@pytest.mark.parametrize("engine", VLLM)
def test_equal_to_kda_tp_digests_for_every_vllm_layout(engine, capsys):
    ckpt = CKPTS[get_layout(engine).family]
    want = cli_digests(capsys, ckpt, engine, 4)
    got = kda_tp.audit.expected_digests(fed(ckpt), ckpt / "config.json", engine=engine, tp_size=4)
    assert list(got.items()) == list(want.items())  # the same keys, in the same order
    # A config dict, a mapping of tensors, one rank, the engine's model dtype.
    config = json.loads((ckpt / "config.json").read_text())
    got = kda_tp.audit.expected_digests(dict(fed(ckpt)), config, engine=engine, tp_size=4,
                                        ranks=[2], model_dtype="BF16")
    assert got == cli_digests(capsys, ckpt, engine, 4, "--ranks", "2", "--dtype", "BF16")


def test_a_generator_in_any_order_is_read_once(capsys):
    ckpt, engine = CKPTS["kimi-linear"], "vllm-0.33-kimi-linear"
    tensors = fed(ckpt)[::-1]
    reads = []

    def stream():
        for name, array in tensors:
            reads.append(name)
            yield name, array

    got = kda_tp.audit.expected_digests(stream(), ckpt, engine=engine, tp_size=2)
    assert got == cli_digests(capsys, ckpt, engine, 2)
    assert len(reads) == len(tensors)


def test_a_generator_is_consumed_by_one_call(capsys):
    """The documented contract: ``tensors`` is read once, in this call; the same generator
    passed again holds nothing, and the refusal says that none of the tensors came."""
    ckpt, engine = CKPTS["kimi-linear"], "vllm-0.33-kimi-linear"
    stream = iter(fed(ckpt))
    assert kda_tp.audit.expected_digests(stream, ckpt, engine=engine, tp_size=2) == cli_digests(
        capsys, ckpt, engine, 2)
    with pytest.raises(CheckpointError, match=r"KDA layers \[0\] of the 1 .* \(none of their "
                       r"tensors came\)"):
        kda_tp.audit.expected_digests(stream, ckpt, engine=engine, tp_size=2)


def test_a_partial_update_is_refused_saying_so():
    """An RL step that sends only some KDA tensors (here q_proj alone): refused, naming what the
    layer lacks, why (a fused parameter needs all its parts) and the ways out (feed the
    unchanged tensors too, or the guard in the engine); never digests of half a layer."""
    ckpt, engine = CKPTS["kimi-linear"], "vllm-0.33-kimi-linear"
    update = [(n, a) for n, a in fed(ckpt) if n.endswith("self_attn.q_proj.weight")]
    assert len(update) == 1
    with pytest.raises(CheckpointError) as info:
        kda_tp.audit.expected_digests(update, ckpt, engine=engine, tp_size=2)
    message = str(info.value)
    assert "layer 0 lacks A_log, b_proj.weight, dt_bias" in message
    assert ("expected_digests hashes whole KDA layers (an engine parameter such as "
            "in_proj_qkvgfab fuses several checkpoint tensors), so a partial update is not "
            "hashed from what it sends alone: feed every KDA tensor of every KDA layer, the "
            "unchanged ones too (the trainer's full state dict), or let the guard check the "
            "partial update inside the engine (docs/guard.md)") in message


STYLES = {"vllm-0.33-kimi-linear": "kimi", "vllm-0.33-glm-5.3": "glm", "vllm-0.33-k3": "k3"}


@pytest.mark.parametrize("engine", VLLM)
def test_torch_bf16_tensors_give_the_same_digests(engine, tmp_path, capsys):
    """BF16 projections (the engine fixtures are F32 throughout), torch tensors the trainer
    owns (clones, not views of a file), K3 under its language_model. prefix."""
    torch = pytest.importorskip("torch")
    ckpt = write_small_checkpoint(tmp_path / "ckpt", hidden=64, heads=4, head_dim=64,
                                  conv_kernel=4, gate_rank=64, num_layers=3, kda_layers=[0, 2],
                                  style=STYLES[engine], weight_dtype="BF16")
    source = SafetensorsSource(ckpt)
    tensors = {name: source.get(name).to_torch().clone() for name in source.names()}
    assert any(t.dtype == torch.bfloat16 for t in tensors.values())
    got = kda_tp.audit.expected_digests(tensors, ckpt, engine=engine, tp_size=2)
    assert list(got.items()) == list(cli_digests(capsys, ckpt, engine, 2).items())
    # Layers 0 and 2 are KDA, layer 1 MLA: per rank, each KDA layer's parameters, then the MLA
    # layer's and the W_UK_T / W_UV vLLM derives from its kv_b_proj, in layer order.
    layout = get_layout(engine)
    mla_plan = rank_mla_plan(describe(source), 0, 2)[0]
    assert mla_plan is not None
    mla = len(layout.mla_params_for(mla_plan)) + 2
    kda = len(layout.params_for(kda_tp.KdaTpPlan.from_config(source, 0, 2, qk_multiple=1)))
    assert len(got) == 2 * (2 * kda + mla)
    layers = [int(key.split(".layers.")[1].split(".")[0]) for key in got]
    assert layers == 2 * ([0] * kda + [1] * mla + [2] * kda)
    got = kda_tp.audit.expected_digests(tensors.items(), ckpt, engine=engine, tp_size=2,
                                        model_dtype="F32")
    assert got == cli_digests(capsys, ckpt, engine, 2, "--dtype", "F32")


def test_a_changed_tensor_changes_only_the_parameters_it_feeds(capsys):
    ckpt, engine = CKPTS["kimi-linear"], "vllm-0.33-kimi-linear"
    before = kda_tp.audit.expected_digests(fed(ckpt), ckpt, engine=engine, tp_size=2)
    tensors = dict(fed(ckpt))
    name = next(n for n in tensors if n.endswith("self_attn.o_proj.weight"))
    tensors[name] = tensors[name] + tensors[name].dtype.type(1)
    after = kda_tp.audit.expected_digests(tensors, ckpt, engine=engine, tp_size=2)
    changed = sorted(k for k in before if before[k] != after[k])
    layer = name.split(".self_attn.")[0]
    assert changed == [f"dp0:pp0:pcp0:tp{r}:{layer}.self_attn.o_proj.weight" for r in (0, 1)]


def test_refusals():
    ckpt, engine = CKPTS["kimi-linear"], "vllm-0.33-kimi-linear"
    tensors = fed(ckpt)
    dropped = next(n for n, _ in tensors if n.endswith("self_attn.dt_bias"))
    layer = int(dropped.split(".layers.")[1].split(".")[0])
    with pytest.raises(CheckpointError, match=rf"KDA layers \[{layer}\].*lacks dt_bias"):
        kda_tp.audit.expected_digests([t for t in tensors if t[0] != dropped], ckpt, engine=engine,
                                      tp_size=2)
    again = [t for t in tensors if t[0] == dropped]
    with pytest.raises(CheckpointError, match="was complete and hashed when this tensor"):
        kda_tp.audit.expected_digests(tensors + again, ckpt, engine=engine, tp_size=2)
    with pytest.raises(CheckpointError, match="sent twice"):
        kda_tp.audit.expected_digests(again + tensors, ckpt, engine=engine, tp_size=2)
    with pytest.raises(PlanError, match=r"heads \(12\) divisible by tp_size \(5\)"):
        kda_tp.audit.expected_digests(tensors, ckpt, engine=engine, tp_size=5)
    with pytest.raises(PlanError, match="rank 2 is out of range"):
        kda_tp.audit.expected_digests(tensors, ckpt, engine=engine, tp_size=2, ranks=[2])
    with pytest.raises(EngineLayoutError, match="Pass a vLLM layout"):
        kda_tp.audit.expected_digests(tensors, ckpt, engine="sglang-0.5.23-kimi-linear", tp_size=2)
    with pytest.raises(EngineLayoutError, match="this layout is for kimi-k3"):
        kda_tp.audit.expected_digests(tensors, ckpt, engine="vllm-0.33-k3", tp_size=2)


def test_each_layer_is_dropped_once_hashed(tmp_path):
    """The streaming promise: by the time the next KDA layer's tensors arrive, nothing of the
    previous layer's is held (the trainer's tensors included, once it lets them go)."""
    import gc
    import weakref

    torch = pytest.importorskip("torch")
    ckpt = write_small_checkpoint(tmp_path / "ckpt", hidden=64, heads=4, head_dim=64,
                                  conv_kernel=4, gate_rank=64, num_layers=3, kda_layers=[0, 1, 2],
                                  weight_dtype="BF16")
    source = SafetensorsSource(ckpt)
    names = sorted(source.names(), key=lambda n: (".layers." not in n, n))
    alive: dict[int, list[weakref.ref]] = {}
    checked = []

    def stream():
        for name in names:
            layer = int(name.split(".layers.")[1].split(".")[0]) if ".layers." in name else None
            if layer is not None and layer - 1 in alive and layer - 1 not in checked:
                gc.collect()
                assert all(ref() is None for ref in alive[layer - 1]), f"layer {layer - 1} held"
                checked.append(layer - 1)
            tensor = source.get(name).to_torch().clone()  # the trainer's own copy
            if layer is not None:
                alive.setdefault(layer, []).append(weakref.ref(tensor))
            yield name, tensor
            del tensor

    got = kda_tp.audit.expected_digests(stream(), ckpt, engine="vllm-0.33-kimi-linear", tp_size=2)
    params = get_layout("vllm-0.33-kimi-linear").params_for(
        kda_tp.KdaTpPlan.from_config(source, 0, 2, qk_multiple=1))
    assert checked == [0, 1] and len(got) == 2 * 3 * len(params)


@pytest.mark.engines
@pytest.mark.parametrize("kind", ["k3", "kimi_linear", "glm"])
def test_equal_to_what_vllms_own_load_weights_leaves(kind, tmp_path):
    """The trainer's digests, from the tensors it feeds (in the release dtypes), equal vLLM
    0.33's own checksums of what its own KDA layer's ``load_weights`` left from those tensors
    in a BF16 model (tests/audit/test_digests_vllm.py's engine run), rank by rank, with no dtype
    given: the engine's default."""
    pytest.importorskip("vllm")
    from test_digests_vllm import CASES, vllm_checksums
    from tp_fixtures import release_dtypes

    source, layout, runs = CASES[kind]
    ckpt = release_dtypes(source, tmp_path / "ckpt")
    engine = vllm_checksums(kind, ckpt, "bfloat16")
    tensors = fed(ckpt)
    for tp_size, rank in runs:
        ours = kda_tp.audit.expected_digests(tensors, ckpt, engine=layout, tp_size=tp_size,
                                             ranks=[rank])
        assert len(ours) >= 7 and ours == engine[f"{tp_size}:{rank}"]


def test_block_fp8_tensors_are_refused_with_the_checkpoint_route(tmp_path):
    from kda_tp.errors import DtypeMismatchError

    ckpt = write_small_checkpoint(tmp_path / "fp8", hidden=256, heads=2, head_dim=128,
                                  conv_kernel=4, gate_rank=128, num_layers=1, kda_layers=[0],
                                  style="k3", fp8=True)
    with pytest.raises(DtypeMismatchError, match="block-FP8 KDA weights are not handled from "
                       "tensors in memory; hash the checkpoint with kda_tp.audit.engine_digests"):
        kda_tp.audit.expected_digests(fed(ckpt), ckpt, engine="vllm-0.33-k3", tp_size=2)


def test_expected_digests_refuses_kda_tensors_of_a_layer_the_config_does_not_list(
    kept: Path,
) -> None:
    source = kda_tp.SafetensorsSource(kept / "checkpoint")
    tensors = {n: source.get(n) for n in source.names()}
    engine = {"engine": "vllm-0.33-kimi-linear", "tp_size": 2}
    digests = kda_tp.audit.expected_digests(tensors, kept / "checkpoint", **engine)
    assert digests == kda_tp.audit.engine_digests(kept / "checkpoint", **engine)
    copies = {n.replace("layers.0.", "layers.2."): t for n, t in tensors.items()
              if n.startswith("model.layers.0.self_attn.")}
    with pytest.raises(CheckpointError) as raised:
        kda_tp.audit.expected_digests({**tensors, **copies}, kept / "checkpoint", **engine)
    message = str(raised.value)
    assert message.startswith("model.layers.2.self_attn.A_log, model.layers.2.self_attn.dt_bias:"
                               " layer 2 holds KDA tensors, but the ")
    assert message.endswith("lists no KDA layer 2 (its KDA layers: [0]); is this the config of "
                            "the model being updated?")


@pytest.mark.parametrize("tensors", [["model.layers.0.self_attn.A_log"], [("a", 1, 2)], [7]])
def test_expected_digests_refuses_what_is_not_name_tensor_pairs(
    kept: Path, tensors: list[object]
) -> None:
    with pytest.raises(UsageError, match=r"^tensors: expected \(name, tensor\) pairs or a "
                       r"mapping of names to tensors, got an item "):
        kda_tp.audit.expected_digests(tensors, kept / "checkpoint",  # type: ignore[arg-type]
                                      engine="vllm-0.33-kimi-linear", tp_size=2)


def test_f18_no_raw_type_errors_and_the_clis_spellings():
    """F18: None for the tensors or the config is a UsageError naming the fix; numpy integer
    ranks are ranks; a model dtype in any case, as the command line takes it."""
    import numpy as np

    from kda_tp.audit import expected_digests
    from kda_tp.engines.dtype import config_model_dtype
    from kda_tp.errors import UsageError
    from kda_tp.audit.expected_params import checked_ranks

    with pytest.raises(UsageError, match="got NoneType; pass the state dict"):
        expected_digests(None, {}, engine="vllm", tp_size=2)
    with pytest.raises(UsageError, match="config: expected the model's config.json"):
        expected_digests({}, None, engine="vllm", tp_size=2)
    assert checked_ranks([np.int64(1), np.int32(0)], 2) == [0, 1]
    for spelling in ("bf16", "BF16", "bfloat16", "BFloat16"):
        assert config_model_dtype(None, "vllm", spelling) == "BF16"
