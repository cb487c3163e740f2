"""transformers' own KDA modules as the judge of kda_tp's shards, configs and reference forward.

transformers (>= 5.20, the ``test`` extra; CI installs it into the torch venv) ships the model
code users run for Kimi-Linear (``KimiLinearForCausalLM``) and GLM-5.3-Flash
(``Glm5NextForConditionalGeneration``), with pure-torch fallbacks of the KDA kernels. These tests
build a tiny random model of each with transformers itself (no download), save it with
``save_pretrained`` (GLM in several files with an index), shard it with kda_tp and check, for
every KDA layer:

* every rank directory loads into transformers' own class with the rank's config
  (``linear_num_heads / tp_size``), with no missing, unexpected or mismatched key, and keeps
  every tensor's dtype;
* the ranks' KDA module outputs (partial sums before the all-reduce) add up to the full
  module's output;
* :func:`kda_tp.reference.checkpoint_layer_forward` equals transformers' module output, full
  and per rank; with the forget gate's lower bound dropped it does not.

And that kda_tp reads each family's config (geometry, KDA layers, eps and the gate's lower
bound) as transformers does, and that its synthetic checkpoints' KDA layers are what
transformers builds. The GLM model has MLA/DSA ``indexed_attention`` layers whose
``self_attn.o_proj`` has KDA's name, and a vision tower; both are passed through unsliced.

"Relative error" here is ``max|actual - expected| / max|expected|``, as in
:mod:`kda_tp.reference.equivalence`; every check allows 1e-4 (float32 rounding is ~1e-6).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", minversion="5.20")

import kda_tp.reference.forward  # noqa: E402
from kda_tp import SafetensorsSource, cli, oracle  # noqa: E402
from kda_tp.model import load_config, parse_config  # noqa: E402
from kda_tp.checkpoint import describe  # noqa: E402
from kda_tp.reference import checkpoint_layer_forward  # noqa: E402
from kda_tp.shard import rank_dir, shard_checkpoint  # noqa: E402
from kda_tp.synth import write_small_checkpoint  # noqa: E402

# Kimi-Linear's and GLM-5.3-Flash's head_dim (128); 4 heads, so TP 2 and 4 keep the default
# q|k width rule (2 * local heads * head_dim a multiple of 256) and TP 4 has one head per rank.
HIDDEN, HEAD_DIM, HEADS, CONV = 64, 128, 4, 4
TP_SIZES = (2, 4)
RTOL = 1e-4
# Two sequences of 80 tokens: more than one 64-token chunk of transformers' chunked KDA.
BATCH, SEQ_LEN = 2, 80


@dataclass(frozen=True)
class Family:
    """How to build one model family's tiny model with transformers, and how it is stored.

    ``prefix`` is the decoder layers' name prefix (module path and checkpoint name alike).
    ``f32`` names the parameters real checkpoints keep in F32 (everything else is BF16):
    Kimi-Linear's ``A_log`` and ``dt_bias``; GLM-5.3-Flash's also its convs
    (``nn.Conv1d(..., dtype=float32)`` in ``modeling_glm5_next.py``). ``max_shard_size`` is
    passed to ``save_pretrained`` (Kimi-Linear: one file; GLM: an index and many files).
    """

    name: str
    model_class: str
    config: Callable[[], Any]
    prefix: str
    f32: tuple[str, ...]
    max_shard_size: str


def _kimi_linear_config() -> Any:
    return transformers.KimiLinearConfig(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        num_local_experts=4, num_experts_per_tok=2,
        linear_head_dim=HEAD_DIM, linear_num_heads=HEADS, linear_conv_kernel_dim=CONV,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def _glm_text_config() -> dict[str, Any]:
    # index_topk must be a multiple of index_kpool (16); hc_mult sets the residual streams.
    return dict(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=0, qk_nope_head_dim=16, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, index_topk=16, index_head_dim=16,
        index_n_heads=2, hc_mult=2,
        linear_head_dim=HEAD_DIM, linear_num_heads=HEADS, linear_conv_kernel_dim=CONV,
        layer_types=[
            "linear_attention", "indexed_attention", "linear_attention", "linear_attention"
        ],
        pad_token_id=0,
    )


def _glm_config() -> Any:
    vision = dict(
        depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=HIDDEN,
        projection_intermediate_size=32,
    )
    return transformers.Glm5NextConfig(text_config=_glm_text_config(), vision_config=vision)


FAMILIES = {
    "kimi_linear": Family(
        "kimi_linear", "KimiLinearForCausalLM", _kimi_linear_config, "model.layers.",
        ("A_log", "dt_bias"), "1GB",
    ),
    "glm5_next": Family(
        "glm5_next", "Glm5NextForConditionalGeneration", _glm_config,
        "model.language_model.layers.", ("A_log", "dt_bias", "conv1d"), "64KB",
    ),
}


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    """``max|actual - expected| / max|expected|``."""
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def kda_layers(config: Any) -> list[int]:
    """The 0-based KDA layers as transformers builds them (``layer_types``)."""
    types = config.get_text_config().layer_types
    return [i for i, t in enumerate(types) if t == "linear_attention"]


def randomize_kda(module: Any, generator: Any) -> None:
    """Fill one KDA attention module with random values of a trained layer's scale, so every
    tensor (and a wrong gate) moves the output: projections and convs ``N(0, 1/fan_in)``,
    ``A_log`` uniform in ``[0, log 16]`` (fla's init), ``dt_bias`` ``N(0, 1)``, ``o_norm`` in
    ``[0.5, 1.5]``. transformers' own init would zero GLM's ``A_log`` and set ``o_norm`` to 1."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                p.copy_(torch.rand(p.shape, generator=generator) * float(np.log(16)))
            elif leaf == "dt_bias":
                p.copy_(torch.randn(p.shape, generator=generator))
            elif name == "o_norm.weight":
                p.copy_(0.5 + torch.rand(p.shape, generator=generator))
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * p.shape[-1] ** -0.5)


def to_stored_dtypes(model: Any, f32: tuple[str, ...]) -> None:
    """BF16 for every parameter but those whose name contains one of ``f32``, as real
    checkpoints store them (a blanket ``model.to(bfloat16)`` would convert those too)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not any(part in name for part in f32):
                p.data = p.data.to(torch.bfloat16)


def local_config(config: Any, tp_size: int) -> Any:
    """The config a rank's model is built with: ``linear_num_heads / tp_size`` KDA heads and
    ``num_attention_heads / tp_size`` MLA heads (and as many key/value heads: shard slices the MLA
    layers too)."""
    local = copy.deepcopy(config)
    text = local.get_text_config()
    text.linear_num_heads //= tp_size
    text.num_attention_heads //= tp_size
    text.num_key_value_heads //= tp_size
    return local


def load(family: Family, path: Path, config: Any = None) -> tuple[Any, dict[str, Any]]:
    """``from_pretrained`` in float32 (the BF16 weights upcast exactly), with its loading info."""
    cls = getattr(transformers, family.model_class)
    kwargs = {} if config is None else {"config": config}
    model, info = cls.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True, **kwargs
    )
    return model.eval(), info


def attention(model: Any, prefix: str, layer: int) -> Any:
    """Layer ``layer``'s attention module: its module path is its checkpoint name prefix."""
    return model.get_submodule(f"{prefix}{layer}.self_attn")


def module_output(module: Any, x: np.ndarray) -> np.ndarray:
    """The KDA module's output for ``x`` (no cache, no mask), as the decoder layer calls it."""
    with torch.no_grad():
        return module(hidden_states=torch.from_numpy(x)).numpy()


def dtypes(path: Path) -> dict[str, str]:
    source = SafetensorsSource(path)
    return {name: source.info(name)[0] for name in source.names()}


@dataclass
class Built:
    """A saved model, its sharded copies and what transformers computes on each."""

    family: Family
    path: Path
    config: Any
    x: np.ndarray
    full: dict[int, np.ndarray]  # KDA layer -> full module output
    ranks: dict[int, list[dict[int, np.ndarray]]]  # tp_size -> rank -> layer -> partial output
    loading_info: dict[int, list[dict[str, Any]]]  # tp_size -> rank -> from_pretrained's info


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Built:
    """Build, save and shard one family's model once, and run transformers on every copy."""
    transformers.utils.logging.disable_progress_bar()
    family = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(family.name)
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    config = family.config()
    model = getattr(transformers, family.model_class)(config)
    prefix = family.prefix
    layers = kda_layers(config)
    for layer in layers:
        randomize_kda(attention(model, prefix, layer), generator)
    to_stored_dtypes(model, family.f32)
    path = root / "full"
    model.save_pretrained(path, max_shard_size=family.max_shard_size)

    x = np.random.default_rng(2).standard_normal((BATCH, SEQ_LEN, HIDDEN)).astype(np.float32)
    full_model, _ = load(family, path)
    full = {layer: module_output(attention(full_model, prefix, layer), x) for layer in layers}
    ranks: dict[int, list[dict[int, np.ndarray]]] = {}
    infos: dict[int, list[dict[str, Any]]] = {}
    for tp_size in TP_SIZES:
        out = root / f"tp{tp_size}"
        shard_checkpoint(path, out, tp_size)
        ranks[tp_size], infos[tp_size] = [], []
        for r in range(tp_size):
            rank_model, info = load(family, rank_dir(out, r), local_config(config, tp_size))
            infos[tp_size].append(info)
            ranks[tp_size].append(
                {layer: module_output(attention(rank_model, prefix, layer), x) for layer in layers}
            )
    return Built(family, path, config, x, full, ranks, infos)


def test_saved_model_is_stored_as_real_checkpoints_are(built: Built) -> None:
    """The fixture itself: checkpoint names (not transformers' in-memory ones), F32 where real
    checkpoints have it, and the layout kda_tp finds (GLM: an index and several files)."""
    stored = dtypes(built.path)
    source = SafetensorsSource(built.path)
    prefix = describe(source).prefix
    assert prefix == built.family.prefix
    a_log_shape = (1, 1, HEADS, 1) if built.family.name == "kimi_linear" else (HEADS,)
    for layer in kda_layers(built.config):
        kda = f"{prefix}{layer}.self_attn."
        assert source.info(kda + "A_log") == ("F32", a_log_shape)
        assert stored[kda + "dt_bias"] == "F32"
        conv = "F32" if "conv1d" in built.family.f32 else "BF16"
        for n in "qkv":
            assert stored[f"{kda}{n}_conv1d.weight"] == conv
        assert stored[kda + "q_proj.weight"] == stored[kda + "o_proj.weight"] == "BF16"
        assert not any(name.startswith(kda + "forget_gate.") for name in stored)
    files = sorted(p.name for p in built.path.glob("*.safetensors"))
    if built.family.name == "kimi_linear":
        assert files == ["model.safetensors"]
    else:
        assert len(files) > 2 and (built.path / "model.safetensors.index.json").is_file()
        assert any(name.startswith("model.visual.") for name in stored)


@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_rank_dirs_load_into_transformers(built: Built, tp_size: int) -> None:
    """Every rank directory loads into the family's class with the rank's config: no missing,
    unexpected or mismatched key, and every tensor keeps its dtype. kda_tp's independent oracle
    finds every byte where it belongs."""
    out = built.path.parent / f"tp{tp_size}"
    assert oracle.verify(built.path, out) == []
    full = dtypes(built.path)
    for r, info in enumerate(built.loading_info[tp_size]):
        assert not info["missing_keys"], (r, info)
        assert not info["unexpected_keys"], (r, info)
        assert not info["mismatched_keys"], (r, info)
        assert not info["error_msgs"], (r, info)
        assert dtypes(rank_dir(out, r)) == full


@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_rank_modules_sum_to_the_full_module(built: Built, tp_size: int) -> None:
    """transformers' own KDA modules on the rank directories: their partial outputs, summed (the
    all-reduce), equal the full module's output, for every KDA layer."""
    for layer, expected in built.full.items():
        total = sum(rank[layer] for rank in built.ranks[tp_size])
        assert rel_err(total, expected) <= RTOL, layer
        # Each rank holds a genuine part of it, not the whole output or nothing.
        for rank in built.ranks[tp_size]:
            assert rel_err(rank[layer], expected) > 0.05


def test_checkpoint_layer_forward_equals_transformers(built: Built) -> None:
    """kda_tp's reference forward of the saved checkpoint is transformers' module output."""
    for layer, expected in built.full.items():
        actual = checkpoint_layer_forward(built.path, layer, built.x)
        assert actual.dtype == np.float32 and actual.shape == expected.shape
        assert rel_err(actual, expected) <= RTOL, layer


@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_checkpoint_layer_forward_partials_equal_transformers_ranks(
    built: Built, tp_size: int
) -> None:
    """With ``tp_rank``, kda_tp's partial sum is what transformers' module computes on that
    rank's directory."""
    for r, rank in enumerate(built.ranks[tp_size]):
        for layer, expected in rank.items():
            actual = checkpoint_layer_forward(
                built.path, layer, built.x, tp_rank=r, tp_size=tp_size
            )
            assert rel_err(actual, expected) <= RTOL, (r, layer)


def _kda_view(config: Any) -> dict[str, Any]:
    """What transformers builds the KDA layers from, in kda_tp's terms. The gate's bound is
    what the forget-gate module runs with: GLM-5.3-Flash's ``linear_lower_bound``;
    Kimi-Linear's gate has none (``KimiLinearForgetGate``: softplus, whatever the config says)."""
    text = config.get_text_config()
    return {
        "hidden": text.hidden_size,
        "head_dim": text.linear_head_dim,
        "heads": text.linear_num_heads,
        "conv_kernel": text.linear_conv_kernel_dim,
        "kda_layers": tuple(kda_layers(config)),
        "rms_norm_eps": text.rms_norm_eps,
        "gate_lower_bound": getattr(text, "linear_lower_bound", None),
    }


def _kda_tp_view(config: dict[str, Any]) -> dict[str, Any]:
    parsed = dataclasses.asdict(parse_config(config))
    return {key: parsed[key] for key in _KEYS}


_KEYS = ("hidden", "head_dim", "heads", "conv_kernel", "kda_layers", "rms_norm_eps",
         "gate_lower_bound")


def test_kda_tp_reads_the_saved_config_as_transformers_does(built: Built) -> None:
    """Geometry, KDA layers, eps and the gate's bound of the saved config.json, and the bound
    the built forget-gate modules actually run with."""
    assert _kda_tp_view(load_config(built.path)) == _kda_view(built.config)
    model, _ = load(built.family, built.path)
    for layer in built.full:
        gate = attention(model, built.family.prefix, layer).forget_gate
        bound = getattr(gate, "safe_gate_lower_bound", None)
        assert parse_config(load_config(built.path)).gate_lower_bound == bound
    if built.family.name == "glm5_next":
        assert bound == -5.0


def test_plan_json_shows_the_bound_transformers_runs(
    built: Built, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kda-tp plan --json`` on the saved model: the gate and the key its bound came from."""
    assert cli.main(["plan", str(built.path), "--tp-size", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    if built.family.name == "glm5_next":
        assert plan["forget_gate"] == "lower_bound"
        assert plan["gate_lower_bound"] == built.config.text_config.linear_lower_bound == -5.0
        assert plan["gate_bound_key"] == "text_config.linear_lower_bound"
    else:
        assert plan["forget_gate"] == "softplus" and plan["gate_lower_bound"] is None


_LINEAR = {"head_dim": HEAD_DIM, "num_heads": HEADS, "short_conv_kernel_size": CONV}


def _flat_glm(model_type: str, **extra: Any) -> dict[str, Any]:
    """A flat (text-only) GLM-5.3-Flash config: the text fields at the top level."""
    text = _glm_text_config()
    del text["layer_types"]  # transformers' default: every 4th layer (index % 4 == 3) is MLA
    return {"model_type": model_type, **text, **extra}


# Configs as users' config.json files hold them. transformers' reading (Glm5NextTextConfig.
# __post_init__): linear_lower_bound (default -5.0), overridden by linear_attn_config's
# gate_lower_bound when that key is present; still none and safe_gate (default true): -5.0.
CONFIGS = {
    "glm flat, linear_attn_config states no bound": _flat_glm(
        "glm5_next", linear_attn_config=_LINEAR
    ),
    "glm_text flat, linear_attn_config states no bound": _flat_glm(
        "glm5_next_text", linear_attn_config=_LINEAR
    ),
    "glm flat, no linear_attn_config": _flat_glm(
        "glm5_next", linear_head_dim=HEAD_DIM, linear_num_heads=HEADS
    ),
    "glm flat, linear_attn_config bound -3": _flat_glm(
        "glm5_next", linear_attn_config={**_LINEAR, "gate_lower_bound": -3.0}
    ),
    "glm flat, linear_attn_config bound null, safe_gate": _flat_glm(
        "glm5_next", linear_attn_config={**_LINEAR, "gate_lower_bound": None}
    ),
    "glm flat, linear_lower_bound -2, linear_attn_config states no bound": _flat_glm(
        "glm5_next", linear_lower_bound=-2.0, linear_attn_config=_LINEAR
    ),
    "glm flat, no bound anywhere, safe_gate off": _flat_glm(
        "glm5_next", linear_lower_bound=None,
        linear_attn_config={**_LINEAR, "safe_gate": False},
    ),
    "glm flat, kda_layers ignored": _flat_glm(
        "glm5_next", linear_attn_config={**_LINEAR, "kda_layers": [1, 2]}
    ),
    "glm wrapper, text_config with linear_attn_config": {
        "model_type": "glm5_next",
        "text_config": {"model_type": "glm5_next_text", **_flat_glm(
            "glm5_next_text", linear_attn_config=_LINEAR
        )},
    },
    "kimi_linear as transformers writes it: layer_types, linear_attn_config without layers": {
        "model_type": "kimi_linear", "hidden_size": HIDDEN, "num_hidden_layers": 3,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        "linear_attn_config": _LINEAR,
    },
    "kimi_linear, linear_attn_config (1-based kda_layers)": {
        "model_type": "kimi_linear", "hidden_size": HIDDEN, "num_hidden_layers": 4,
        "linear_attn_config": {**_LINEAR, "kda_layers": [1, 2, 4], "full_attn_layers": [3]},
    },
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_kda_tp_reads_configs_as_transformers_does(name: str, tmp_path: Path) -> None:
    """The same config.json through transformers' AutoConfig and kda_tp's parse_config, and
    again as transformers writes it back (``save_pretrained``)."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS[name]))
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    expected = _kda_view(config)
    assert _kda_tp_view(load_config(tmp_path)) == expected
    config.save_pretrained(tmp_path / "resaved")
    assert _kda_tp_view(load_config(tmp_path / "resaved")) == expected


@pytest.fixture
def bound_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """kda_tp reading configs with the forget gate's lower bound dropped: its
    reference forward then runs the unbounded softplus gate whatever the config says."""
    parse = kda_tp.checkpoint.description.parse_config  # the description's reading of it

    def without_bound(*args: Any, **kwargs: Any) -> Any:
        return dataclasses.replace(parse(*args, **kwargs), gate_lower_bound=None)

    monkeypatch.setattr(kda_tp.checkpoint.description, "parse_config", without_bound)


def test_a_dropped_bound_fails_the_comparison(built: Built, bound_dropped: None) -> None:
    """The comparison with transformers has teeth: on GLM-5.3-Flash, whose gate is
    lower-bounded, dropping the bound moves kda_tp's output far from transformers' (by ~50% of
    its largest value here); on Kimi-Linear, which has no bound, nothing changes."""
    for layer, expected in built.full.items():
        err = rel_err(checkpoint_layer_forward(built.path, layer, built.x), expected)
        if built.family.name == "glm5_next":
            assert err > 0.2, layer
        else:
            assert err <= RTOL, layer


@pytest.mark.parametrize("style", ["kimi", "glm"])
def test_synthetic_checkpoints_are_what_transformers_builds(style: str, tmp_path: Path) -> None:
    """kda_tp's synthetic checkpoints (``kda-tp synth``/``demo``) hold KDA layers transformers
    loads as they are (no unexpected or mismatched key, none of a KDA layer missing; the MLP,
    indexer and vision weights they leave out are missing) and computes as
    ``checkpoint_layer_forward`` does."""
    family = FAMILIES["kimi_linear" if style == "kimi" else "glm5_next"]
    kda = [0, 1, 3] if style == "kimi" else [0, 1, 2]
    write_small_checkpoint(
        tmp_path, hidden=HIDDEN, heads=HEADS, head_dim=HEAD_DIM, conv_kernel=CONV,
        gate_rank=HEAD_DIM, num_layers=4, kda_layers=kda, style=style,
    )
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert kda_layers(config) == kda
    # The synthetic configs name no pad token; transformers' default is past their 64 tokens.
    config.get_text_config().pad_token_id = 0
    model, info = load(family, tmp_path, config)
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not [k for k in info["missing_keys"] if ".self_attn." in k and "indexer" not in k]
    x = np.random.default_rng(3).standard_normal((1, SEQ_LEN, HIDDEN)).astype(np.float32)
    for layer in kda:
        expected = module_output(attention(model, family.prefix, layer), x)
        assert rel_err(checkpoint_layer_forward(tmp_path, layer, x), expected) <= RTOL, layer
