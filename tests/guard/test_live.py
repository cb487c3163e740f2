"""kda_tp.guard.live, with torch and no engine: how a live model's updates are
checked, the same for both engine plugins. The model is a torch module holding one rank's KDA
parameters (built from the fixture checkpoint); its ``load_weights`` applies what it is fed as
an engine's loaders do (this rank's slice of each part into its region), or with a bug."""

from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")

from kda_tp import GuardError, KdaShardedSource, KdaTpPlan, SafetensorsSource  # noqa: E402
from kda_tp.engines import build_param, get_layout  # noqa: E402
from kda_tp.guard import MODE_ENV, follow, followed  # noqa: E402
from kda_tp.guard._record import RECORD  # noqa: E402
from kda_tp.errors import GuardWarning  # noqa: E402

from tp_fixtures import CKPT, PRE  # noqa: E402

KIND, LAYOUT, RANK, SIZE = "kimi_linear", "vllm-0.33-kimi-linear", 1, 2


@pytest.fixture(autouse=True)
def fail_mode(monkeypatch):
    monkeypatch.setenv(MODE_ENV, "fail")


def tensors(scale: float) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file
    return [(n, t * scale) for n, t in sorted(load_file(str(CKPT[KIND] / "model.safetensors"))
                                              .items())]


class Engine(torch.nn.Module):
    """One rank's KDA layer (``model.layers.0.self_attn``) whose ``load_weights`` puts this
    rank's slice of each fed part into its region, except the parts in ``drop``."""

    def __init__(self) -> None:
        super().__init__()
        source = SafetensorsSource(CKPT[KIND])
        shard = KdaShardedSource(source, KdaTpPlan.from_config(source, RANK, SIZE, qk_multiple=1))
        layout = get_layout(LAYOUT)
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
        attn = torch.nn.Module()
        self.model.layers[0].self_attn = attn
        for p in layout.params_for(shard.plan):
            *path, attr = p.suffix.split(".")
            module = attn
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_parameter(attr, torch.nn.Parameter(torch.from_numpy(
                build_param(shard, layout, p.suffix, 0).copy()), requires_grad=False))
        self.calls: list[int] = []
        self.drop: tuple[str, ...] = ()
        self.places: dict = {}  # set once followed: the guard's own map of the regions

    def load_weights(self, weights):
        count = 0
        target = followed(self).target
        params = dict(self.named_parameters())
        for name, tensor in weights:
            count += 1
            hit = target.fed.get(name)
            if hit is None or name.endswith(self.drop):
                continue
            layer, part, t = hit
            local = tensor.reshape(t.full_rows, t.full_row_elems)[
                t.src_row_offset:t.src_row_offset + t.local_rows,
                t.src_col_offset:t.src_col_offset + t.local_row_elems].reshape(-1)
            for place in target.places[(layer, part)]:
                params[place.name].data.reshape(-1)[place.start:place.stop].copy_(local)
        self.calls.append(count)


def engine(dummy: bool = False) -> Engine:
    model = Engine()
    follow(model, "test", str(CKPT[KIND]), tp_rank=RANK, tp_size=SIZE, layout=LAYOUT, dummy=dummy)
    return model


def test_a_call_feeding_no_kda_tensor_touches_nothing_and_mode_off_passes_straight_through(
        monkeypatch, guard_log):
    model = engine()
    how = followed(model)
    target, checks = how.target, dict(RECORD.checks)
    with guard_log:
        model.load_weights([("model.layers.0.mlp.down_proj.weight", torch.zeros(4))])
    assert guard_log.lines == [] and how.target is target and not how.memory
    assert RECORD.checks == checks and model.calls == [1]
    monkeypatch.setenv(MODE_ENV, "off")
    model.drop = ("v_proj.weight",)  # wrong, and not looked at
    model.load_weights(tensors(2.0))
    assert guard_log.lines == []


def test_one_call_is_one_update_right_or_stopped_or_logged(monkeypatch, guard_log):
    model = engine()
    with guard_log:
        model.load_weights(tensors(2.0))
    (line,) = guard_log.lines
    assert line.startswith("kda_tp guard: test load_weights: tp rank 1/2: 9 KDA parameters "
                           f"updated ({LAYOUT}), ") and line.endswith(": OK")
    assert RECORD.last == line
    model.drop = ("dt_bias",)
    with pytest.raises(GuardError) as caught:
        model.load_weights(tensors(3.0))
    assert (f"rank 1 {PRE}dt_bias: dt_bias: holds the values from before the update: "
            f"{PRE}dt_bias was fed but the engine never applied it") in str(caught.value)
    assert RECORD.last.endswith(": FAIL (1 wrong)")
    monkeypatch.setenv(MODE_ENV, "warn")
    guard_log.clear()
    with guard_log, pytest.warns(GuardWarning, match="FAIL"):
        model.load_weights(tensors(4.0))
    (line,) = guard_log.lines
    assert "FAIL (1 wrong)" in line and "dt_bias: holds the values from before" in line


def test_an_engine_session_is_one_update_whatever_its_calls():
    model = engine()
    how = followed(model)
    assert how.open("transfer", "weight transfer") and not how.open("layerwise", "inner")
    fed = tensors(2.0)
    model.load_weights(fed[:3])  # calls join the session: no verdict yet
    model.load_weights(fed[3:])
    assert how.close("layerwise") is None and how.session is not None  # not its session
    report = how.close("transfer")
    assert report is not None and report.passed and report.fed == len(fed)
    assert how.open("transfer", "weight transfer")
    model.load_weights(fed)
    how.abandon("transfer")  # the engine's own call failed: nothing reported
    assert how.session is None


def test_an_error_of_the_engine_propagates_unchanged_and_nothing_is_reported(guard_log):
    model = engine()
    model.drop = ("o_norm.weight",)
    model.calls = None  # the engine fails after consuming every tensor (a TypeError of its own)
    with guard_log, pytest.raises(AttributeError):
        model.load_weights(tensors(2.0))
    assert guard_log.lines == [] and followed(model).session is None


def test_after_a_dummy_load_the_first_update_must_fill_every_region():
    model = engine(dummy=True)
    how = followed(model)
    partial = [t for t in tensors(2.0) if not t[0].endswith(("A_log", "dt_bias"))]
    assert how.open("layerwise", "layerwise reload")
    model.load_weights(partial)
    with pytest.raises(GuardError) as caught:
        how.close("layerwise")
    assert (f"rank 1 {PRE}A_log: A_log: never loaded since the dummy load (random values): the "
            "update did not feed it") in str(caught.value)
    assert how.unloaded is None  # judged once: later updates as any update
    model = engine(dummy=True)
    how = followed(model)
    model.load_weights(partial[:5])  # a refit of plain calls: each call right by itself
    model.load_weights(partial[5:])
    with pytest.raises(GuardError, match="never loaded since the dummy load"):
        how.end_of_refit("process_weights_after_loading")
    model = engine(dummy=True)
    how = followed(model)
    model.load_weights(tensors(2.0))
    assert how.unloaded is None  # every region loaded: nothing pending
    assert how.end_of_refit("process_weights_after_loading") is None


def test_a_parameter_the_engine_re_registers_is_read_anew():
    model = engine()
    how = followed(model)
    attn = model.model.layers[0].self_attn
    attn.A_log = torch.nn.Parameter(attn.A_log.detach().clone(), requires_grad=False)
    model.load_weights(tensors(2.0))  # right: checked on the object the engine holds now
    assert how.target.params[f"{PRE}A_log"] is attn.A_log


def test_an_update_feeding_mla_parameters_says_they_are_not_checked_once(guard_log):
    from kda_tp.guard._names import names_mla

    model = engine()
    mla = [("model.layers.1.self_attn.kv_b_proj.weight", torch.ones(8, 4)),
           ("model.layers.1.self_attn.kv_a_layernorm.weight", torch.ones(4))]
    assert all(names_mla(n) for n, _ in mla)
    assert not any(names_mla(n) for n, _ in tensors(1.0))  # no KDA name (o_proj, q_proj...)
    with guard_log:
        model.load_weights(tensors(2.0) + mla)
        model.load_weights(tensors(3.0))
    first, second = guard_log.lines
    assert first.startswith(f"kda_tp guard: test load_weights: tp rank 1/2: 9 KDA parameters "
                            f"updated ({LAYOUT}), ")
    assert first.endswith(", MLA parameters not checked on updates: OK")
    assert first.count("MLA") == 1
    assert "MLA" not in second and second.endswith(" s: OK")
