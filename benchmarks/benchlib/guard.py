"""Section 7: the guard (``kda_tp.guard.check``) and the refit check
(``kda_tp.guard.UpdateSession``) on one Kimi K3 rank; a per-tensor refit through the guard's own
``load_weights`` hook (``kda_tp.guard.follow``) against none; the guard on a non-KDA model."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from kda_tp import KdaTpPlan, SafetensorsSource

from .common import best_interleaved, log, per_call_us, row, verdict
from .k3 import k3_engine_rank, k3_rank_row


def section_guard(scratch: Path, reps: int, calls: int, loops: int) -> None:
    """Section 7: the guard on one K3 rank (TP 8, one layer) vs a single-thread memcpy of the
    same bytes; the guard on a non-KDA model's parameters."""
    import logging

    from kda_tp.guard import check

    log("section 7: the guard")
    logging.getLogger("kda_tp.guard").setLevel(logging.WARNING)  # no pass line per call
    ckpt = scratch / "k3-guard"
    rank, tp = 3, 8
    src, params = k3_engine_rank(ckpt, rank, tp, touch=True)
    nbytes = sum(a.nbytes for a in params.values())
    source = np.concatenate([src.get(n).data.reshape(-1).view(np.uint8)
                             for n in src.names() if ".self_attn." in n])[:nbytes]
    dst = np.ones(nbytes, np.uint8)  # prefaulted
    result = check(params, ckpt, tp_rank=rank, tp_size=tp)
    assert result is not None and result.passed, result

    def via_guard():
        check(params, ckpt, tp_rank=rank, tp_size=tp)

    def via_memcpy():
        np.copyto(dst, source)

    t = best_interleaved({"guard": via_guard, "memcpy": via_memcpy}, reps)
    ratio = t["guard"] / t["memcpy"]
    sec = f"7 guard K3 TP={tp} r{rank}"
    k3_rank_row(sec, rank, tp, params)
    row(sec, "single-thread memcpy of the same bytes", f"{t['memcpy'] * 1e3:.1f}", "ms")
    row(sec, "kda_tp.guard.check (mode fail, passes)", f"{t['guard'] * 1e3:.1f}", "ms",
        f"guard/memcpy {ratio:.2f}x", "<= 2.00x", verdict(ratio <= 2.0))
    log(f"  guard {t['guard'] * 1e3:.1f} ms, memcpy {t['memcpy'] * 1e3:.1f} ms, {ratio:.2f}x")
    section_guard_update(ckpt, src, params, rank, tp, reps)
    section_guard_per_tensor(ckpt, src, params, rank, tp, reps)
    del params, source, dst, src
    shutil.rmtree(ckpt)
    # A non-KDA model: an 80-layer Llama's parameter names (the values are never read).
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(80):
        names += [f"model.layers.{i}.{n}.weight" for n in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
            "post_attention_layernorm")]
    llama = {n: np.zeros(1, np.float32) for n in names}
    us = per_call_us(lambda: check(llama, "/nonexistent/llama", tp_rank=0, tp_size=8), calls,
                     loops)
    row("7 guard non-KDA", f"kda_tp.guard.check on a non-KDA model ({len(llama)} parameters)",
        f"{us:.1f}", "us", "skipped: no KDA parameter name", "< 1000 us", verdict(us < 1000))
    log(f"  non-KDA: {us:.1f} us per call")


def section_guard_update(ckpt: Path, src: SafetensorsSource, params: dict, rank: int, tp: int,
                         reps: int) -> None:
    """Section 7, updates: one refit of the K3 layer checked against what it fed
    (``kda_tp.guard.UpdateSession`` on the rank's ``RankTarget``, built once per model:
    digests as each parameter is first touched, each part verified as the engine consumes
    it, every touched region checked at the end) vs a single-thread memcpy of the rank's KDA
    bytes the update touched."""
    from kda_tp import describe
    from kda_tp.guard import RankTarget, UpdateSession

    fed = [(n, src.get(n).array) for n in src.names() if ".self_attn." in n]
    target = RankTarget.build(describe(ckpt), params, tp_rank=rank, tp_size=tp)
    # The engine applied each tensor as it was fed (the parameters hold the rank's slices):
    # wrap() verifies each part when the engine asks for the next one.
    session = UpdateSession(target)
    for _ in session.wrap(fed):
        pass
    report = session.close()
    assert report.passed, report.problems
    touched, kept = report.bytes, session.kept_bytes
    feed = UpdateSession(target)  # an engine that defers: copies
    for name, value in fed:
        feed.feed(name, value)
    deferred = feed.kept_bytes
    largest = max(a.nbytes for a in params.values())
    source = np.concatenate([a.reshape(-1).view(np.uint8) for _, a in fed])[:touched]
    dst = np.ones(touched, np.uint8)  # prefaulted

    def via_update():
        update = UpdateSession(target)
        for _ in update.wrap(fed):
            pass
        update.close()

    def via_memcpy():
        np.copyto(dst, source)

    t = best_interleaved({"update": via_update, "memcpy": via_memcpy}, reps)
    ratio = t["update"] / t["memcpy"]
    sec = f"7 guard update K3 TP={tp} r{rank}"
    row(sec, f"one refit of the K3 layer (the trainer's full tensors fed), rank {rank} of {tp}: "
        f"{report.regions} regions of {report.params} parameters, {touched / 1e6:.0f} MB touched",
        "", "", "numpy parameters; fed tensors mapped and warm")
    row(sec, "single-thread memcpy of the rank's KDA bytes touched", f"{t['memcpy'] * 1e3:.1f}",
        "ms")
    row(sec, "update check: session + digests + each part verified as fed + end check (every "
        "element)",
        f"{t['update'] * 1e3:.1f}", "ms", f"update/memcpy {ratio:.2f}x", "<= 2.00x",
        verdict(ratio <= 2.0))
    row(sec, "extra host memory held (parts applied as fed: digests only)",
        f"{kept / 1e6:.0f}", "MB", f"largest parameter {largest / 1e6:.0f} MB",
        "<= largest", verdict(kept <= largest))
    row(sec, "  (info) host memory if every part were deferred (this rank's slices, copied)",
        f"{deferred / 1e6:.0f}", "MB", f"{deferred / largest:.2f}x the largest parameter")
    log(f"  update {t['update'] * 1e3:.1f} ms, memcpy {t['memcpy'] * 1e3:.1f} ms, {ratio:.2f}x")


#: The per-tensor refit's other parameters: this many stacked expert projections (``w13``),
#: each filled from four tensors (two experts' gate and up projections), in 30 modules.
_OTHER_PARAMS = 1500


def section_guard_per_tensor(ckpt: Path, src: SafetensorsSource, params: dict, rank: int,
                             tp: int, reps: int) -> None:
    """Section 7, a per-tensor refit (OpenRLHF's ``WorkerWrap.update_weight``, TRL's colocated
    sync: one ``model.load_weights([(name, tensor)])`` per tensor): the K3 layer's tensors
    among the 4 x :data:`_OTHER_PARAMS` expert projections of MLP layers, into a torch stand-in
    of the engine's model whose ``load_weights`` does per call what vLLM 0.33's
    ``KimiLinearModel.load_weights`` does (``dict(self.named_parameters())``, then each tensor's
    loader: the rank's values into the KDA parameter's region, a stacked shard into its half),
    with the guard's own hook (``kda_tp.guard.follow``, mode ``fail``) against without it;
    no vLLM needed. Skipped without torch."""
    import os

    try:
        import torch
    except ImportError:
        row("7 guard per-tensor refit", "skipped: no torch", "", "", "", "<= 1.20x", "")
        return
    from kda_tp.engines import get_layout
    from kda_tp.guard import MODE_ENV, follow

    def as_torch(array: np.ndarray) -> torch.Tensor:
        kind = {2: torch.bfloat16, 4: torch.float32}[array.dtype.itemsize]
        return torch.from_numpy(array.view(f"<i{array.dtype.itemsize}").copy()).view(kind)

    layout = get_layout("vllm-0.33-k3")
    prefix = next(n for n in params if n.endswith("self_attn.A_log"))[: -len("A_log")]
    plan = KdaTpPlan.from_config(src, rank, tp, qk_multiple=1)
    fed = [(n, as_torch(src.get(n).array)) for n in src.names() if n.startswith(prefix)]
    # The stand-in engine's loaders: each fed KDA name's rank values into its regions.
    regions: dict[str, list[tuple[str, int, int]]] = {}
    for p in layout.params_for(plan):
        size = params[prefix + p.suffix].dtype.itemsize
        for region in layout.param_plan(p.suffix, plan, "BF16").regions:
            name = next(n for n, _ in fed if n[len(prefix):] in (region.part, f"{region.part}.weight"))
            regions.setdefault(name, []).append(
                (prefix + p.suffix, region.byte_range[0] // size, region.byte_range[1] // size))

    def model() -> torch.nn.Module:
        top = torch.nn.Module()
        for name, array in params.items():
            *path, attr = name.split(".")
            module = top
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_parameter(attr, torch.nn.Parameter(as_torch(array),
                                                               requires_grad=False))
        top.mlp = torch.nn.Module()
        for i in range(30):
            layer = torch.nn.Module()
            for j in range(_OTHER_PARAMS // 30):
                layer.register_parameter(f"w13_{j}", torch.nn.Parameter(
                    torch.zeros(2, 2, 16), requires_grad=False))
            top.mlp.add_module(str(i), layer)
        values = {name: [(param, start, stop, as_torch(params[param]).reshape(-1)[start:stop])
                         for param, start, stop in spots] for name, spots in regions.items()}

        def load_weights(weights):  # as vLLM's model class does per call
            named = dict(top.named_parameters())
            for name, tensor in weights:
                if name in values:
                    for param, start, stop, value in values[name]:
                        named[param].data.reshape(-1)[start:stop].copy_(value)
                    continue
                _, i, j, expert, weight, _ = name.split(".")  # mlp.I.J.E.{gate,up}_proj.weight
                named[f"mlp.{i}.w13_{j}"].data[int(expert), int(weight == "up_proj")].copy_(
                    tensor)

        top.load_weights = load_weights
        return top

    others = [(f"mlp.{i}.{j}.{e}.{w}.weight", torch.full((16,), float(j)))
              for i in range(30) for j in range(_OTHER_PARAMS // 30) for e in (0, 1)
              for w in ("gate_proj", "up_proj")]
    calls = others[: len(others) // 2] + fed + others[len(others) // 2:]
    plain, guarded = model(), model()
    previous = os.environ.get(MODE_ENV)
    os.environ[MODE_ENV] = "fail"
    try:
        follow(guarded, "bench", str(ckpt), tp_rank=rank, tp_size=tp, layout=layout.name)

        def run(m: torch.nn.Module):
            def go() -> None:
                for item in calls:
                    m.load_weights([item])
            return go

        def one_call(m: torch.nn.Module):
            def go() -> None:
                m.load_weights(fed)
            return go

        def per_tensor(m: torch.nn.Module):
            def go() -> None:
                for item in fed:
                    m.load_weights([item])
            return go

        t = best_interleaved({"plain": run(plain), "guard": run(guarded)}, max(2, reps // 2))
        k3 = best_interleaved({"plain 1": one_call(plain), "guard 1": one_call(guarded),
                               "plain N": per_tensor(plain), "guard N": per_tensor(guarded)},
                              reps)
    finally:
        if previous is None:
            os.environ.pop(MODE_ENV, None)
        else:
            os.environ[MODE_ENV] = previous
    ratio = t["guard"] / t["plain"]
    sec = f"7 guard per-tensor refit K3 TP={tp} r{rank}"
    row(sec, f"{len(calls)} load_weights calls of one tensor each: the K3 layer's {len(fed)} "
        f"among {len(others)} others (into {_OTHER_PARAMS} parameters)", "", "",
        "torch stand-in of vLLM's model class; no vLLM")
    row(sec, "the engine alone (no plugin)", f"{t['plain'] / len(calls) * 1e6:.0f}", "us/call")
    row(sec, "through the guard's load_weights hook, mode fail",
        f"{t['guard'] / len(calls) * 1e6:.0f}", "us/call", f"guard/none {ratio:.2f}x",
        "<= 1.20x", verdict(ratio <= 1.2))
    log(f"  per-tensor refit: {t['plain']:.2f} s plain, {t['guard']:.2f} s guarded, {ratio:.2f}x")
    sec = f"7 guard K3 layer refit TP={tp} r{rank}"
    row(sec, f"the K3 layer's {len(fed)} tensors alone, every element of every touched "
        "parameter judged (digests before and after)", "", "",
        "same stand-in, same run; goal <= 1.20x")
    for how, key, calls_made in (("in one load_weights call", "1", 1),
                                 ("one tensor per load_weights call", "N", len(fed))):
        ratio = k3[f"guard {key}"] / k3[f"plain {key}"]
        row(sec, f"{how}: the engine alone (no plugin)", f"{k3[f'plain {key}'] * 1e3:.1f}",
            "ms")
        row(sec, f"{how}: through the guard's hook, mode fail",
            f"{k3[f'guard {key}'] * 1e3:.1f}", "ms",
            f"guard/none {ratio:.2f}x ({calls_made} calls)", "<= 1.20x", verdict(ratio <= 1.2))
        log(f"  K3 layer refit {how}: {k3[f'plain {key}'] * 1e3:.1f} ms plain, "
            f"{k3[f'guard {key}'] * 1e3:.1f} ms guarded, {ratio:.2f}x")
