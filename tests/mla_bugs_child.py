"""The MLA acceptance matrix (issue 41): loader bugs injected into vLLM 0.33's or SGLang
0.5.23's own MLA classes and model ``load_weights`` on CPU, at the first load and on an update,
for Kimi K3, Kimi-Linear and GLM-5.3-Flash at TP 1, 2 and 4, each judged by the guard.

Run in its own interpreter (the faked tensor-parallel group is global):
``python mla_bugs_child.py ENGINE CKPT_ROOT OUT_JSON`` with ENGINE ``vllm`` or ``sglang`` and
CKPT_ROOT holding one hybrid per family (``k3``, ``kimi_linear``, ``glm``: layer 0 KDA, layer 1
MLA, 4 MLA heads). Each case builds rank ``T-1``'s MLA layer (every rank for the honest first
load) by the engine's class (tests/mla_engine_child.py), loads it through the model class's
``load_weights`` wrapped by :class:`Loader` (the bug, when on, is in there: the engine's own
loader misbehaving), checks the first load as the plugins do (``kda_tp.guard.check``, the KDA
layer 0 built by the layout), follows the model (``kda_tp.guard.follow``), lets the engine
build its derived copies (vLLM: ``process_weights_after_loading`` through the guard's hook;
SGLang: ``post_load_weights`` inside ``load_weights``) and, for an update case, refits the
whole MLA layer with new values (a streamer reusing one buffer for the bug of the cached view)
with the bug on. Writes ``{case: {"lines": [...], "error": str | None, "failures": [...],
"stale": [...]}}`` to OUT_JSON, a case being ``"{kind}/tp{T}/r{R}/{when}/{bug}"``.

The bugs (:data:`BUGS`): ``kv_b_rank0`` (column-parallel ``kv_b_proj`` narrowed at rank 0),
``o_proj_rank0`` (row-parallel ``o_proj`` narrowed at rank 0), ``kv_a_holds_q_a`` (the loader
keeps ``kv_a_proj_with_mqa`` as a view of the streamer's buffer until ``q_a_proj`` came, the
streamer having reused that buffer: SGLang GLM-5.3's own ``cached_a_proj``, a caching shim for
the others), ``kv_a_dropped`` (``kv_a_proj_with_mqa`` fed, never copied), ``copies_stale``
(updates only: the derived copies held apart from ``kv_b_proj``, as for an FP8 one, and the
post-load step not forwarded: SGLang #26744) and ``norm_other`` (``kv_a_layernorm`` loaded with
something else: its init, ones).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import types
import warnings
from pathlib import Path
from typing import Any

LAYER = 1
KINDS = ("k3", "kimi_linear", "glm")
SIZES = (1, 2, 4)
BUGS = ("kv_b_rank0", "o_proj_rank0", "kv_a_holds_q_a", "kv_a_dropped", "copies_stale",
        "norm_other")
LAYOUT = {("vllm", "k3"): "vllm-0.33-k3", ("vllm", "kimi_linear"): "vllm-0.33-kimi-linear",
          ("vllm", "glm"): "vllm-0.33-glm-5.3", ("sglang", "k3"): "sglang-0.5.23-k3",
          ("sglang", "kimi_linear"): "sglang-0.5.23-kimi-linear",
          ("sglang", "glm"): "sglang-0.5.23-glm-5.3"}


def applies(kind: str, t: int, bug: str, when: str) -> bool:
    """Whether ``bug`` is a bug of ``kind`` at TP ``t`` (rank 0's slice is rank ``t-1``'s at
    TP 1; Kimi-Linear has no fused a-projection; a copy is stale only after a refit)."""
    if bug in ("kv_b_rank0", "o_proj_rank0") and t == 1:
        return False
    if bug == "kv_a_holds_q_a" and kind == "kimi_linear":
        return False
    return not (bug == "copies_stale" and when == "first")


def cases() -> list[tuple[str, int, int, str, str]]:
    """Every ``(kind, T, rank, when, bug)`` of the matrix (``bug`` ``"honest"`` for none)."""
    out = []
    for kind in KINDS:
        for t in SIZES:
            out += [(kind, t, r, "first", "honest") for r in range(t)]
            out.append((kind, t, t - 1, "update", "honest"))
            out += [(kind, t, t - 1, when, bug) for when in ("first", "update") for bug in BUGS
                    if applies(kind, t, bug, when)]
    return out


def reusing_stream(items: list[tuple[str, Any]]) -> Any:
    """A weight streamer that hands out every tensor as a view of one buffer it reuses (each
    tensor valid until the consumer asks for the next), ``kv_a_proj_with_mqa`` before
    ``q_a_proj``."""
    import torch

    size = max(w.numel() for _, w in items)
    buffer = torch.empty(size, dtype=items[0][1].dtype)
    for name, w in sorted(items, key=lambda item: ".q_a_proj." in item[0]):
        view = buffer[:w.numel()].view(w.shape)
        view.copy_(w)
        yield name, view


class Loader:
    """The model class's ``load_weights`` with one loader bug switched on (``bug``) or none.

    ``narrow``: the module whose loader narrows at rank 0 for ``kv_b_rank0`` / ``o_proj_rank0``
    by name; ``engine``: ``vllm`` (the parameter's ``tp_rank``) or ``sglang`` (the module's
    ``tp_group``)."""

    def __init__(self, engine: str, load: Any, attn: Any):
        self.engine, self.load, self.attn, self.bug = engine, load, attn, ""

    def __call__(self, weights: Any, *args: Any, **kwargs: Any) -> Any:
        module = {"kv_b_rank0": "kv_b_proj", "o_proj_rank0": "o_proj"}.get(self.bug)
        if module is None:
            return self.load(self._stream(weights), *args, **kwargs)
        linear = getattr(self.attn, module)
        if self.engine == "vllm":  # the module's and its parameter's rank, whichever loads it
            saved = linear.tp_rank, linear.weight.tp_rank
            linear.tp_rank = linear.weight.tp_rank = 0
        else:
            saved = linear.tp_group
            linear.tp_group = types.SimpleNamespace(rank_in_group=0,
                                                    world_size=saved.world_size)
        try:
            return self.load(self._stream(weights), *args, **kwargs)
        finally:
            if self.engine == "vllm":
                linear.tp_rank, linear.weight.tp_rank = saved
            else:
                linear.tp_group = saved

    def _stream(self, weights: Any) -> Any:
        held = None
        for name, w in weights:
            if self.bug == "kv_a_dropped" and ".kv_a_proj_with_mqa." in name:
                continue
            if self.bug == "norm_other" and ".kv_a_layernorm." in name:
                w = w.new_ones(w.shape)
            if self.bug == "kv_a_holds_q_a" and self.caches and ".kv_a_proj_with_mqa." in name:
                held = (name, w)  # a view of the streamer's buffer, kept across tensors
                continue
            yield name, w
            if held is not None and ".q_a_proj." in name:
                yield held
                held = None
        if held is not None:
            yield held

    @property
    def caches(self) -> bool:
        """Whether the shim must keep ``kv_a`` (SGLang GLM-5.3's loader keeps it itself)."""
        return not (self.engine == "sglang" and getattr(self.attn, "_glm", False))


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _kda_params(ckpt: Path, layout: Any, t: int, r: int) -> tuple[dict[str, Any], str]:
    """Rank ``r``'s KDA layer 0 as the layout builds it, and the layers' name prefix."""
    import kda_tp
    from kda_tp.engines import build_param

    view = kda_tp.open_rank(ckpt, tp_rank=r, tp_size=t, qk_multiple=1, mla=True)
    base = layout.state_dict_prefix(view.prefix)
    return ({f"{base}0.self_attn.{p.suffix}": build_param(view, layout, p.suffix, 0,
                                                          model_dtype="BF16")
             for p in layout.params_for(view.plan)}, base)


def fresh(attn: Any, bug: str) -> None:
    """For a first load that never copies a tensor: the layer's parameters zero, as fresh
    memory (``torch.empty`` may hand back a block an earlier layer freed, holding the right
    bytes by chance)."""
    if bug == "kv_a_dropped":
        for param in attn.parameters():
            param.data.zero_()


def _refit(mla: dict[str, Any], bug: str, prefix: str = "") -> Any:
    """The whole MLA layer with new values (twice the checkpoint's), names under ``prefix``;
    from a streamer reusing its buffer for ``kv_a_holds_q_a``."""
    refit = [(prefix + n, w * 2) for n, w in mla.items()]
    return reusing_stream(refit) if bug == "kv_a_holds_q_a" else iter(refit)


def _vllm_case(kind: str, ckpt: Path, t: int, r: int, when: str, bug: str,
               found: dict[str, Any]) -> None:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import utils as loader_utils

    from kda_tp.engines import LAYOUTS
    from kda_tp.guard import check, follow
    from mla_engine_child import FromLayers, _checkpoint, vllm_layer

    text, mla = _checkpoint(ckpt, LAYER)
    layout = LAYOUTS[LAYOUT["vllm", kind]]
    loader: list[Loader] = []

    def wrap(load: Any, attn: Any) -> Loader:
        loader.append(Loader("vllm", load, attn))
        loader[0].bug = bug if when == "first" else ""
        fresh(attn, loader[0].bug)
        return loader[0]

    first = (reusing_stream(list(mla.items())) if (when, bug) == ("first", "kv_a_holds_q_a")
             else None)
    vc, stack, attn, absorbing = vllm_layer(kind, text, mla, LAYER, t, r, wrap=wrap,
                                            weights=first)
    params, base = _kda_params(ckpt, layout, t, r)
    params.update({f"{base}{LAYER}.self_attn.{n}": p for n, p in attn.named_parameters()})

    def post_process() -> None:
        vc.model_config.word_embeddings_untied_by_checkpoint = False
        vc.model_config.quantization = None
        with set_current_vllm_config(vc):
            loader_utils.process_weights_after_loading(stack, vc.model_config,
                                                       torch.device("cpu"))

    result = check(params, ckpt, tp_rank=r, tp_size=t, engine=layout.name)
    assert result is not None
    follow(stack, "vllm", plan=result.plan, tp_rank=r, tp_size=t, mla_plan=result.mla_plan,
           reader=FromLayers("layers."))
    post_process()
    if when != "update":
        return
    if bug == "copies_stale":  # held apart from kv_b_proj (an FP8 one), hook not forwarded
        for copy in ("W_UK_T", "W_UV"):  # fresh tensors, never views of kv_b_proj
            getattr(absorbing, copy).data = getattr(absorbing, copy).detach().contiguous().clone()
        absorbing.process_weights_after_loading = lambda dtype: None
        found["before"] = {c: getattr(absorbing, c).detach().clone() for c in ("W_UK_T", "W_UV")}
        found["copies"] = lambda: {c: getattr(absorbing, c) for c in ("W_UK_T", "W_UV")}
    loader[0].bug = bug
    with set_current_vllm_config(vc):
        stack.load_weights(_refit(mla, bug))
    post_process()




def _sglang_case(kind: str, ckpt: Path, t: int, r: int, when: str, bug: str,
                 found: dict[str, Any]) -> None:
    from kda_tp.engines import LAYOUTS
    from kda_tp.guard import check, follow
    from sglang.srt.models.deepseek_common.deepseek_weight_loader import (
        DeepseekV2WeightLoaderMixin)

    from kda_tp.guard._derived import mla_copies
    from mla_engine_child import FromLayers, _checkpoint, _sglang

    text, mla = _checkpoint(ckpt, LAYER)
    layout = LAYOUTS[LAYOUT["sglang", kind]]
    loader: list[Loader] = []

    def wrap(load: Any, attn: Any) -> Loader:
        attn._glm = kind == "glm"
        loader.append(Loader("sglang", load, attn))
        loader[0].bug = bug if when == "first" else ""
        fresh(attn, loader[0].bug)
        return loader[0]

    def then(top: Any) -> None:
        params, base = _kda_params(ckpt, layout, t, r)
        named = {base + n.removeprefix("model.layers."): p
                 for n, p in [*top.named_parameters(), *mla_copies(top).items()]}
        params.update({n: p for n, p in named.items() if n.endswith(".weight")})
        result = check(params, ckpt, tp_rank=r, tp_size=t, engine=layout.name,
                       derived={n: p for n, p in named.items() if n not in params})
        assert result is not None
        follow(top, "sglang", plan=result.plan, tp_rank=r, tp_size=t,
               mla_plan=result.mla_plan, reader=FromLayers("model.layers."))
        if when != "update":
            return
        attn = top.model.layers[LAYER].self_attn
        mixin = DeepseekV2WeightLoaderMixin.post_load_weights
        if bug == "copies_stale":  # the post-load step not forwarded (SGLang #26744)
            top.post_load_weights = lambda *args, **kwargs: None
            # GLM-5.3's load_weights calls the mixin's directly
            DeepseekV2WeightLoaderMixin.post_load_weights = lambda *args, **kwargs: None
            found["before"] = {c: getattr(attn, c).clone() for c in ("w_kc", "w_vc")}
            found["copies"] = lambda: {c: getattr(attn, c) for c in ("w_kc", "w_vc")}
        loader[0].bug = bug
        try:
            top.load_weights(_refit(mla, bug, "model."))
        finally:
            DeepseekV2WeightLoaderMixin.post_load_weights = mixin

    first = (reusing_stream(list(mla.items())) if (when, bug) == ("first", "kv_a_holds_q_a")
             else None)
    _sglang(kind, text, mla, LAYER, t, r, then=then, wrap=wrap, weights=first)


def run(engine: str, root: Path) -> dict[str, Any]:
    """Every case of :func:`cases` for ``engine``: the guard's lines, its error, the names it
    failed and, for ``copies_stale``, the copies the refit left as they were."""
    import torch

    from kda_tp.errors import GuardError

    handler = _Lines()
    logging.getLogger("kda_tp.guard").addHandler(handler)
    out: dict[str, Any] = {}
    case = _vllm_case if engine == "vllm" else _sglang_case
    for kind, t, r, when, bug in cases():
        handler.lines.clear()
        found: dict[str, Any] = {}
        error = None
        failures: list[str] = []
        try:
            case(kind, root / kind, t, r, when, bug, found)
        except GuardError as caught:
            error = str(caught)
            report = getattr(caught, "report", None)
            failures = [p.name for p in getattr(report, "failures", None) or []]
        stale = []
        if "copies" in found:
            stale = sorted(c for c, now in found["copies"]().items()
                           if torch.equal(now, found["before"][c]))
        out[f"{kind}/tp{t}/r{r}/{when}/{bug}"] = {
            "lines": list(handler.lines), "error": error, "failures": failures,
            "stale": stale}
    return out


def main(argv: list[str]) -> None:
    warnings.simplefilter("ignore")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.pop("KDA_TP_GUARD", None)  # mode fail
    import torch

    engine, root, out = argv[0], Path(argv[1]), Path(argv[2])
    torch.set_default_dtype(torch.bfloat16)  # the engines build a model in its model dtype
    if engine == "vllm":
        from vllm.model_executor.layers import utils as layer_utils

        from kda_tp.guard.vllm import register

        # a BF16 layer's repack takes vLLM's sgl-kernel GEMM on a CPU with AMX tiles, whose op
        # this CUDA build of vLLM lacks: its plain GEMM (as test_mla_post_processing.py)
        layer_utils.check_cpu_sgl_kernel = lambda *args: False
        register()
    else:
        from sglang.srt.runtime_context import _CONTEXT
        from sglang.srt.server_args import ServerArgs

        _CONTEXT.set_server_args(ServerArgs(model_path=str(root / "k3"), device="cpu"))
    out.write_text(json.dumps(run(engine, root)))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main(sys.argv[1:])
