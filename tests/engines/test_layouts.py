"""Engine layouts (kda_tp.engines) and kda_tp.engines.build_param against parameters that
vLLM 0.33.0 and SGLang 0.5.23 loaded with their own code (tests/data/engine_ranks)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

import kda_tp
from kda_tp import EngineLayoutError, KdaShardedSource, KdaTpPlan, SafetensorsSource
from kda_tp.checkpoint.names import param_location
from kda_tp.engines import (
    LAYOUTS,
    build_param,
    get_layout,
    layouts_for,
    param_plan,
    recognise,
)

from layout_tables import layouts_markdown
from paths import ENGINE_RANKS as DATA, ROOT

CKPT = {"k3": "ckpt_k3", "kimi_linear": "ckpt_kl", "glm": "ckpt_glm"}
DUMPS = sorted(DATA.glob("*_tp*_r*.safetensors"))
EXPECTED = {
    "vllm_k3": "vllm-0.33-k3",
    "vllm_kimi_linear": "vllm-0.33-kimi-linear",
    "vllm_glm": "vllm-0.33-glm-5.3",
    "sglang_k3": "sglang-0.5.23-k3",
    "sglang_kimi_linear": "sglang-0.5.23-kimi-linear",
    "sglang_glm": "sglang-0.5.23-glm-5.3",
}


def open_dump(path: Path) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """A fixture's header metadata and its tensors by name after ``self_attn.``."""
    with safe_open(path, "np") as f:
        meta = f.metadata()
        prefix = meta["prefix"]
        return meta, {k[len(prefix):]: f.get_tensor(k) for k in f.keys()}


def adapter(meta: dict[str, str], backend: str = "mmap") -> KdaShardedSource:
    src = SafetensorsSource(DATA / CKPT[meta["model"]], backend=backend)
    plan = KdaTpPlan.from_config(src, int(meta["tp_rank"]), int(meta["tp_size"]))
    return KdaShardedSource(src, plan)


def test_every_engine_dump_is_there():
    assert {p.name.split("_tp")[0] for p in DUMPS} == set(EXPECTED)


@pytest.mark.parametrize("backend", ["mmap", "pread"])
@pytest.mark.parametrize("path", DUMPS, ids=lambda p: p.stem)
def test_build_param_equals_the_engine_dump(path, backend):
    meta, dump = open_dump(path)
    shard = adapter(meta, backend)
    family = shard.description.family.name
    assert [lay.name for lay in recognise(dump, family)] == [EXPECTED[path.name.split("_tp")[0]]]
    layout = get_layout(EXPECTED[path.name.split("_tp")[0]])
    params = layout.params_for(shard.plan)
    assert {p.suffix for p in params} == set(dump)
    for p in params:
        want = dump[p.suffix]
        got = build_param(shard, layout, p.suffix, 0)
        assert got.shape == want.shape and got.dtype == want.dtype, p.suffix
        assert got.tobytes() == want.tobytes(), p.suffix
        # into a caller's buffer (a flat byte view, as of a torch parameter), dirty beforehand
        buf = np.full(want.nbytes, 0xAB, np.uint8)
        assert build_param(shard, layout, p.suffix, 0, buf) is buf
        assert buf.tobytes() == want.tobytes(), p.suffix


def test_vllm_k3_padding_rows_are_zero_and_sized_by_16():
    meta, dump = open_dump(DATA / "vllm_k3_tp4_r1.safetensors")
    shard = adapter(meta)
    plan = param_plan(shard, "vllm-0.33-k3", "in_proj_qkvgfab.weight")
    # 4 x 384 (q, k, v, g) + 128 (f_a, whole) + 3 (b) = 1667 rows, padded to 1680
    assert [(r.part, r.rows) for r in plan.regions] == [
        ("q_proj", (0, 384)), ("k_proj", (384, 768)), ("v_proj", (768, 1152)),
        ("g_proj", (1152, 1536)), ("f_a_proj", (1536, 1664)), ("b_proj", (1664, 1667)),
    ]
    assert plan.shape == (1680, 64) and plan.padding == (1667 * 64 * 4, 1680 * 64 * 4)
    assert not dump["in_proj_qkvgfab.weight"][1667:].any()
    # row i of b_proj holds 80000 + i: rank 1 of 4 has heads 3..5
    assert dump["in_proj_qkvgfab.weight"][1664:1667, 0].tolist() == [80003, 80004, 80005]


def test_recognise_needs_the_family_when_names_agree():
    _, dump = open_dump(DATA / "sglang_glm_tp4_r3.safetensors")
    assert sorted(lay.name for lay in recognise(dump)) == [
        "sglang-0.5.23-glm-5.3", "sglang-0.5.23-kimi-linear"]
    assert recognise({"no_such.weight"}) == []


def test_recognise_a_dump_missing_a_parameter():
    _, dump = open_dump(DATA / "vllm_k3_tp4_r1.safetensors")
    del dump["f_b_proj.weight"]
    assert [lay.name for lay in recognise(dump, "kimi-k3")] == ["vllm-0.33-k3"]


def test_layouts_for_family_and_plan():
    assert {lay.name for lay in layouts_for("kimi-k3")} == {"vllm-0.33-k3", "sglang-0.5.23-k3"}
    k3 = KdaTpPlan(0, 2, 64, 128, 12, 4, 128, full_rank_gate=True, dtypes={"A_log": "F32"})
    assert {lay.name for lay in layouts_for(plan=k3)} == {"vllm-0.33-k3", "sglang-0.5.23-k3"}
    kl = KdaTpPlan(0, 1, 64, 128, 12, 4, 128)
    assert "transformers-5-kimi-linear" in {lay.name for lay in layouts_for(plan=kl)}
    with pytest.raises(EngineLayoutError, match="unknown model family"):
        layouts_for("llama")


def test_refusals_name_the_problem():
    with pytest.raises(EngineLayoutError, match="no engine layout 'vllm-9'"):
        get_layout("vllm-9")
    with pytest.raises(EngineLayoutError, match="no parameter 'in_proj.weight'"):
        LAYOUTS["vllm-0.33-k3"].param("in_proj.weight")
    kl = KdaTpPlan(0, 2, 64, 128, 12, 4, 128)
    with pytest.raises(EngineLayoutError, match="g_proj, which the plan does not have"):
        LAYOUTS["vllm-0.33-k3"].param_plan("in_proj_qkvgfab.weight", kl)
    with pytest.raises(EngineLayoutError, match="replicated"):
        LAYOUTS["transformers-5-kimi-linear"].param_plan("conv1d.weight", kl)


# ------------------------------------------------------------------------------------------------
# Random geometries: an in-memory checkpoint, expected parameters built from the oracle's slices
# (written from the spec, not the Rust core) and the table read directly.

import ml_dtypes  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kda_tp import Tensor  # noqa: E402
from kda_tp import oracle  # noqa: E402
from kda_tp.engines import EngineParam  # noqa: E402
from kda_tp.engines.layout import CONFIG_DTYPE  # noqa: E402

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NUMPY = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32,
         "F8_E4M3": ml_dtypes.float8_e4m3fn}
SCALE_SPELLING = {"vllm": "weight_scale", "sglang": "weight_scale_inv"}


class MemorySource:
    """A checkpoint held in memory: one KDA layer, names ``model.layers.0.self_attn.*``."""

    def __init__(self, tensors: dict[str, Tensor]):
        self.tensors = tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def get(self, name: str) -> Tensor | None:
        return self.tensors.get(name)


def random_checkpoint(op: oracle.OraclePlan, rng: np.random.Generator, spelling: str):
    """Full tensors with random bytes (FP8 and scales finite; A_log's padding zero), keyed by
    checkpoint name, and the same bytes by plan name (scale grids as ``<name>.scale``)."""
    tensors, full = {}, {}
    pre = "model.layers.0.self_attn."
    for t in op.tensors:
        entries = [(t, f"{pre}{t.name}" if t.name in ("A_log", "dt_bias") else f"{pre}{t.name}.weight",
                    t.name)]
        if t.scale is not None:
            entries.append((t.scale, f"{pre}{t.name}.{spelling}", f"{t.name}.scale"))
        for entry, name, key in entries:
            n = entry.full_rows * entry.full_row_elems
            values = rng.uniform(-4, 4, n).astype(NUMPY[entry.dtype])
            if key == "A_log":
                values[op.full_heads:] = 0
            data = values.view(np.uint8)
            tensors[name] = Tensor(name, entry.dtype, entry.disk_shape, data)
            full[key] = data
    return tensors, full


def expected_param(param: EngineParam, layout, op: oracle.OraclePlan, full, model_dtype):
    """The parameter's bytes as the table says, from the oracle's slices: parts in order
    (stacked or concatenated), cast, then zero rows up to the padding multiple."""
    weight = layout.param(param.scale_of) if param.scale_of else param
    names = [f"{p}.scale" for p in weight.parts] if param.scale_of else list(weight.parts)
    entries = [op.get(p.removesuffix(".scale")) for p in names]
    entries = [e.scale if n.endswith(".scale") else e for e, n in zip(entries, names)]
    fp8 = any(e.dtype == "F8_E4M3" for e in entries)
    own = None if param.dtype == CONFIG_DTYPE else param.dtype  # no config here: the model's
    dtype = entries[0].dtype if (fp8 or param.scale_of) else (own or model_dtype
                                                               or entries[0].dtype)
    chunks = []
    for e, n in zip(entries, names):
        raw = np.frombuffer(oracle.shard_bytes(e, full[n].tobytes()), NUMPY[e.dtype])
        chunks.append(raw.astype(NUMPY[dtype]).view(np.uint8))
    body = np.concatenate(chunks)
    rows = sum(e.local_rows for e in entries)
    multiple = param.pad_to_fp8 if fp8 and param.pad_to_fp8 else param.pad_to
    pad_rows = -rows % multiple if not param.stacked else 0
    row_bytes = entries[0].local_row_elems * np.dtype(NUMPY[dtype]).itemsize
    return np.concatenate([body, np.zeros(pad_rows * row_bytes, np.uint8)]), dtype


@st.composite
def engine_cases(draw):
    layout = draw(st.sampled_from(sorted(LAYOUTS.values(), key=lambda lay: lay.name)))
    tp = 1 if not layout.tensor_parallel else draw(st.sampled_from([1, 2, 3, 4]))
    fp8 = layout.fp8 and draw(st.booleans())
    head_dim = 128 if fp8 else draw(st.sampled_from([4, 8, 16]))
    heads = tp * draw(st.integers(1, 3))
    k3 = layout.family == "kimi-k3"
    projection = "F8_E4M3" if fp8 else draw(st.sampled_from(["BF16", "F32", "F16"]))
    names = oracle.FULL_RANK_GATE_TENSOR_NAMES if k3 else oracle.TENSOR_NAMES
    dtypes = {n: projection for n in names if n.endswith("_proj")}
    dtypes.update({c: draw(st.sampled_from(["BF16", "F32"])) for c in ("q_conv1d",)})
    dtypes.update({"k_conv1d": dtypes["q_conv1d"], "v_conv1d": dtypes["q_conv1d"],
                   "o_norm": draw(st.sampled_from(["BF16", "F32"])),
                   "A_log": draw(st.sampled_from(["BF16", "F32"])), "dt_bias": "F32"})
    geometry = dict(
        tp_rank=draw(st.integers(0, tp - 1)), tp_size=tp,
        hidden=128 * draw(st.integers(1, 2)) if fp8 else draw(st.integers(1, 24)),
        head_dim=head_dim, full_heads=heads, conv_kernel=draw(st.integers(1, 4)),
        gate_rank=128 if fp8 else draw(st.integers(1, 20)),
        qk_multiple=1, full_rank_gate=k3, dtypes=dtypes,
        a_log_len=heads + draw(st.integers(0, 5)) if k3 else None,
    )
    if fp8:
        geometry.update(quant_block=(128, 128), scale_layout="modelopt")
    model_dtype = draw(st.sampled_from([None, "BF16", "F32"]))
    return layout, geometry, model_dtype, draw(st.integers(0, 2**32))


@PROPERTY
@given(engine_cases())
def test_built_parameters_match_the_table_on_random_geometries(case):
    layout, geometry, model_dtype, seed = case
    plan = KdaTpPlan(**geometry)
    op = oracle.plan(**geometry)
    tensors, full = random_checkpoint(op, np.random.default_rng(seed),
                                      SCALE_SPELLING.get(layout.engine, "weight_scale"))
    shard = KdaShardedSource(MemorySource(tensors), plan, layers=[0])
    for param in layout.params_for(plan):
        pp = param_plan(shard, layout, param.suffix, model_dtype=model_dtype)
        want, dtype = expected_param(param, layout, op, full, model_dtype)
        assert pp.dtype == dtype and pp.nbytes == want.nbytes == (
            math.prod(pp.shape) * np.dtype(NUMPY[dtype]).itemsize)
        # the regions and the padding tile the buffer, in order, without gaps
        spans = [r.byte_range for r in pp.regions] + ([pp.padding] if pp.padding else [])
        assert spans[0][0] == 0 and spans[-1][1] == pp.nbytes
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert [r.part.removesuffix(".scale") for r in pp.regions] == list(
            param.parts or layout.param(param.scale_of).parts)
        # the bytes: every part where the table puts it, the padding zero (the buffer was dirty)
        out = np.full(pp.nbytes, 0x7F, np.uint8)
        build_param(shard, layout, param.suffix, 0, out, model_dtype=model_dtype)
        assert out.tobytes() == want.tobytes(), param.suffix
        if pp.padding:
            assert not out[pp.padding[0]:].any()


def test_vllm_and_sglang_k3_fp8_fused_weights_and_scales():
    """vLLM K3 under ModelOpt FP8_PB_WO: [q,k,v,g,f_a,b] padded to 128 rows, the scale grid
    [ob, ib] of each part's block rows (f_a's whole, b's single row on every rank); SGLang fuses
    only [q,k,v,g] and keeps b_proj's whole grid. Written from the engines' loaders."""
    tp, rank, heads, hidden = 2, 1, 4, 256
    geometry = dict(tp_rank=rank, tp_size=tp, hidden=hidden, head_dim=128, full_heads=heads,
                    conv_kernel=4, gate_rank=128, full_rank_gate=True, a_log_len=8,
                    quant_block=(128, 128), scale_layout="modelopt")
    plan, op = KdaTpPlan(**geometry), oracle.plan(**geometry)
    for layout, spelling in (("vllm-0.33-k3", "weight_scale"),
                             ("sglang-0.5.23-k3", "weight_scale_inv")):
        tensors, full = random_checkpoint(op, np.random.default_rng(7), spelling)
        shard = KdaShardedSource(MemorySource(tensors), plan, layers=[0])

        def arr(name, shape):
            return full[name].view(NUMPY[op.get(name.removesuffix(".scale")).scale.dtype
                                         if name.endswith(".scale") else
                                         op.get(name).dtype]).reshape(shape)

        cl, hl, ib = 256, 2, hidden // 128
        rows = slice(rank * cl, (rank + 1) * cl)
        blocks = slice(rank * hl, (rank + 1) * hl)
        w = {n: arr(n, (heads * 128, hidden)) for n in ("q_proj", "k_proj", "v_proj", "g_proj")}
        s = {n: arr(f"{n}.scale", (heads, 1, ib, 1))[:, 0, :, 0] for n in w}
        f_a, b = arr("f_a_proj", (128, hidden)), arr("b_proj", (heads, hidden))
        f_a_s = arr("f_a_proj.scale", (1, 1, ib, 1))[:, 0, :, 0]
        b_s = arr("b_proj.scale", (1, 1, ib, 1))[:, 0, :, 0]
        if layout.startswith("vllm"):
            weight = build_param(shard, layout, "in_proj_qkvgfab.weight", 0)
            scale = build_param(shard, layout, "in_proj_qkvgfab.weight_scale", 0)
            local = 4 * cl + 128 + hl  # 1154 rows, padded to 1280
            assert weight.shape == (1280, hidden) and weight.dtype == NUMPY["F8_E4M3"]
            parts = [w[n][rows] for n in w] + [f_a, b[rank * hl:(rank + 1) * hl]]
            assert weight[:local].tobytes() == np.concatenate(parts).tobytes()
            assert not weight[local:].view(np.uint8).any()
            assert scale.shape == (1280 // 128, ib)
            want = np.concatenate([s[n][blocks] for n in s] + [f_a_s, b_s[0:1]])
            assert scale.tobytes() == want.tobytes()
        else:
            weight = build_param(shard, layout, "fused_qkvg_proj.weight", 0)
            scale = build_param(shard, layout, "fused_qkvg_proj.weight_scale_inv", 0)
            assert weight.tobytes() == np.concatenate([w[n][rows] for n in w]).tobytes()
            assert scale.tobytes() == np.concatenate([s[n][blocks] for n in s]).tobytes()
            b_scale = build_param(shard, layout, "b_proj.weight_scale_inv", 0)
            assert b_scale.tobytes() == b_s.tobytes()
        o_s = arr("o_proj.scale", (hidden // 128, 1, heads, 1))[:, 0, :, 0]
        o_scale = build_param(shard, layout, f"o_proj.{spelling}", 0)
        assert o_scale.tobytes() == np.ascontiguousarray(o_s[:, blocks]).tobytes()


def test_fp8_parts_off_the_block_boundary_are_refused():
    # head_dim 64: vLLM's fused b_proj would start at row 4*128 + 64, inside a block
    plan = KdaTpPlan(0, 2, 128, 64, 4, 4, 64, full_rank_gate=True, a_log_len=16,
                     quant_block=(128, 128), scale_layout="modelopt")
    with pytest.raises(EngineLayoutError, match="b_proj starts at row 576 .* 128-row block"):
        LAYOUTS["vllm-0.33-k3"].param_plan("in_proj_qkvgfab.weight_scale", plan)
    with pytest.raises(EngineLayoutError, match="has no scale grid for it"):
        LAYOUTS["vllm-0.33-kimi-linear"].param_plan(
            "in_proj_qkvgfab.weight",
            KdaTpPlan(0, 2, 128, 64, 4, 4, 64, quant_block=(128, 128)))


DOC = ROOT / "docs" / "engine-layouts.md"


def test_docs_tables_are_the_layouts():
    text = DOC.read_text()
    start = text.index("-->\n", text.index("<!-- generated by")) + 4
    assert text[start:text.index("<!-- end of generated tables -->")] == layouts_markdown()


def test_docs_examples_run_and_fill_what_vllm_loaded():
    """The page's torch-only block (``py``; integration/test_readme.py runs the ``python`` ones)."""
    torch = pytest.importorskip("torch")
    [loader] = re.findall(r"^```py\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)
    meta, dump = open_dump(DATA / "vllm_k3_tp4_r1.safetensors")
    namespace: dict = {"rank": int(meta["tp_rank"]), "world_size": int(meta["tp_size"]),
                       "kda_tp": kda_tp, "build_param": build_param, "param_plan": param_plan}
    exec(compile(loader.replace("/models/Kimi-K3", str(DATA / "ckpt_k3")), "doc loader", "exec"),
         namespace)
    assert namespace["param"].dtype == torch.float32  # the fixture checkpoint is F32
    assert namespace["param"].numpy().tobytes() == dump["in_proj_qkvgfab.weight"].tobytes()


def test_param_location_takes_any_prefix():
    assert param_location("language_model.model.layers.3.self_attn.in_proj_qkvgfab.weight") == (
        "language_model.model.layers.", 3, "in_proj_qkvgfab.weight")
    assert param_location("layers.0.self_attn.A_log") == ("layers.", 0, "A_log")
    assert param_location("model.layers.0.mlp.gate_up_proj.weight") is None


def test_build_param_refuses_a_wrong_buffer_or_layer():
    from kda_tp import ShapeMismatchError

    meta, _ = open_dump(DATA / "vllm_k3_tp4_r1.safetensors")
    shard = adapter(meta)
    with pytest.raises(ShapeMismatchError, match="in_proj_qkvgfab.weight: the output buffer is "
                       "100 bytes, this rank's tensor is 430080 bytes"):
        build_param(shard, "vllm-0.33-k3", "in_proj_qkvgfab.weight", 0, np.empty(100, np.uint8))
    with pytest.raises(EngineLayoutError, match="layer 5 is not a KDA layer"):
        build_param(shard, "vllm-0.33-k3", "A_log", 5)


@pytest.mark.parametrize("ckpt", ["ckpt_kl", "ckpt_glm"])
def test_transformers_tables_match_what_transformers_loads(ckpt, tmp_path):
    """transformers 5 loads the F32 checkpoint as BF16 (its conversion mapping fuses the convs
    and moves the forget gate); every KDA parameter of its state_dict equals build_param's with
    model_dtype BF16, the tensors it keeps F32 included."""
    model_dtype = "BF16"
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from kda_tp.torch import torch_dtype

    config = transformers.AutoConfig.from_pretrained(DATA / ckpt)
    text = getattr(config, "text_config", config)
    small = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None, intermediate_size=32,
                 moe_intermediate_size=16, num_experts=2, n_routed_experts=2,
                 num_local_experts=2, num_experts_per_tok=1, n_shared_experts=1)
    for key, value in small.items():  # the KDA layer as is, everything around it tiny
        for c in {id(config): config, id(text): text}.values():
            if hasattr(c, key):
                setattr(c, key, value)
    path = DATA / ckpt
    if ckpt == "ckpt_glm":  # transformers' GLM-5.3 keeps its decoder under model.language_model.
        from safetensors.torch import load_file, save_file

        tensors = load_file(path / "model.safetensors")
        save_file({k.replace("model.layers.", "model.language_model.layers."): v
                   for k, v in tensors.items()}, tmp_path / "model.safetensors")
        (tmp_path / "config.json").write_bytes((path / "config.json").read_bytes())
        path = tmp_path
    model = getattr(transformers, config.architectures[0]).from_pretrained(
        path, config=config, dtype=torch_dtype(model_dtype))
    loaded = {}
    for name, value in model.state_dict().items():
        found = param_location(name)
        if found is not None and found[1] == 0:
            loaded[found[2]] = value
    src = SafetensorsSource(DATA / ckpt)
    shard = KdaShardedSource(src, KdaTpPlan.from_config(src, 0, 1))
    (layout,) = recognise(loaded, kda_tp.describe(src).family.name)
    assert layout.engine == "transformers"
    params = layout.params_for(shard.plan)
    assert {p.suffix for p in params} == set(loaded)
    for p in params:
        want = loaded[p.suffix]
        got = build_param(shard, layout, p.suffix, 0, model_dtype=model_dtype)
        assert want.dtype == torch_dtype(param_plan(shard, layout, p.suffix,
                                                    model_dtype=model_dtype).dtype)
        assert tuple(want.shape) == got.shape, p.suffix
        assert want.contiguous().view(-1).view(torch.uint8).numpy().tobytes() == got.tobytes()


def test_model_family_needs_a_config(tmp_path):
    from kda_tp import CheckpointError

    with pytest.raises(CheckpointError, match="no config.json"):
        kda_tp.describe(tmp_path).family
    assert kda_tp.describe({"text_config": {"model_type": "glm5_next_text", "hidden_size": 64,
                                            "linear_head_dim": 128, "linear_num_heads": 12,
                                            "linear_conv_kernel_dim": 4}}).family.name == "glm-5.3"
