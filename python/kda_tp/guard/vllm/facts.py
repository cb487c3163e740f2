"""What the vLLM plugin (:mod:`kda_tp.guard.vllm`) reads from vLLM 0.33: the worker's ranks
(tensor-parallel, pipeline, data-parallel), its current config, whether a model is a
speculative draft and the checkpoint a load is checked against; gathered for the guard's one
flow as vLLM's adapter (:class:`VllmEngine`). The guard's lines never go through vLLM's
logging (``kda_tp.guard._modes``: its own logger and handler).

This module imports vLLM only inside its functions (they run in a vLLM process).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ...engines.derived import derived_copies
from ...engines.dtype import model_dtype_name
from .._derived import mla_copies
from .._modes import LoadSource, load_checkpoint
from .._target import Reader, Spelling, mapper_spelling
from .._names import stage_layers
from . import repacked

__all__ = ["VllmEngine", "current_config", "dp_rank", "is_draft", "load_source", "pp_rank_size",
           "stage_layers_of", "tp_rank_size"]


class _VllmReader:
    """How vLLM holds its parameters: ModelOpt block scales squeezed after loading, weights
    repacked by its CPU GEMM dispatch (:mod:`kda_tp.guard.vllm.repacked`)."""

    def described(self, name: str, param: Any) -> Any:
        return repacked.as_described(name, param)

    def read_back(self, module: Any, param: Any) -> tuple[Any, str | None]:
        return repacked.read_back(module, param)

    def masked_copy(self, copy: Any) -> bool:
        return repacked.masked_copy(copy)

    def spelling(self, model: Any) -> Spelling | None:
        """The served model class's ``hf_to_vllm_mapper`` (its ``load_weights`` maps every
        fed name through it: K3's ``language_model.layers.``, GLM-5.3's
        ``model.language_model.``)."""
        return mapper_spelling(model, "hf_to_vllm_mapper")


class VllmEngine:
    """vLLM's facts about one model on this worker (:class:`kda_tp.guard.Engine`).

    Args:
        model_config: the model's vLLM ``ModelConfig`` (None: the current config's).
        vllm_config: vLLM's config (None: the current one).
        loader: the loader class's name (``"DefaultModelLoader"``), ``"reload_weights"``,
            ``"update"``...: how :func:`load_source` reads the load format.
    """

    name = "vllm"
    reader: Reader = _VllmReader()

    def __init__(self, model_config: Any, vllm_config: Any = None, loader: str = "update"):
        self.vllm_config = current_config(vllm_config)
        self.model_config = model_config or getattr(self.vllm_config, "model_config", None)
        self.loader = loader

    def label(self) -> str:
        return "vllm"

    def is_draft(self) -> bool:
        """A speculative draft (:func:`is_draft`), or no model config to know it by."""
        return self.model_config is None or is_draft(self.model_config, self.vllm_config)

    def rank_size(self) -> tuple[int, int]:
        return tp_rank_size()

    def stage_layers(self, names: Iterable[str]) -> list[int] | None:
        return stage_layers_of(names)

    def load_source(self, where: str, given: str | None) -> LoadSource:
        return load_source(self.model_config, self.vllm_config, self.loader, where, given)

    def held(self, model: Any, params: Mapping[str, Any]
             ) -> tuple[dict[str, Any], dict[str, str]]:
        return repacked.held(model, params)

    def derived(self, model: Any) -> dict[str, Any]:
        return {**derived_copies(model), **mla_copies(model)}

    def model_dtype(self) -> str | None:
        return model_dtype_name(getattr(self.model_config, "dtype", None))


def current_config(vllm_config: Any) -> Any:
    """``vllm_config``, else vLLM's current one."""
    if vllm_config is not None:
        return vllm_config
    from vllm.config import get_current_vllm_config_or_none

    return get_current_vllm_config_or_none()


def is_draft(model_config: Any, vllm_config: Any) -> bool:
    """Whether ``model_config`` is a speculative draft's: a separate model (vLLM builds its
    ``ModelConfig`` with ``runner="draft"``: EAGLE, MTP, draft models), not the target's config
    that n-gram, suffix and ``custom_class`` decoding reuse as their "draft" config."""
    if getattr(model_config, "runner_type", None) == "draft":
        return True
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None)
    if spec is None or draft is None or model_config is not draft:
        return False
    targets = (getattr(spec, "target_model_config", None),
               getattr(vllm_config, "model_config", None))
    return not any(draft is target for target in targets)


def tp_rank_size() -> tuple[int, int]:
    """This worker's rank and world size in vLLM's tensor-parallel group."""
    from vllm.distributed import parallel_state

    tp = parallel_state.get_tp_group()
    return int(tp.rank_in_group), int(tp.world_size)


def load_source(model_config: Any, vllm_config: Any, loader: str, where: str,
                given: str | None = None) -> LoadSource:
    """:func:`kda_tp.guard.load_checkpoint` for a vLLM model config and loader."""
    download = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    path = str(getattr(model_config, "model_weights", "") or model_config.model)
    return load_checkpoint(path, loader, where, given=given,
                           revision=getattr(model_config, "revision", None),
                           download_dir=download)


def stage_layers_of(names: Iterable[str]) -> list[int] | None:
    """Under pipeline parallelism, the decoder layers whose KDA parameters this stage holds;
    None (every KDA layer) without it."""
    return stage_layers(names) if pp_rank_size()[1] > 1 else None


def pp_rank_size() -> tuple[int, int]:
    """This worker's pipeline rank and size ((0, 1) without a pipeline group)."""
    from vllm.distributed import parallel_state

    try:
        group = parallel_state.get_pp_group()
    except AssertionError:  # no pipeline group (a single process, as in tests)
        return 0, 1
    return int(group.rank_in_group), int(group.world_size)


def dp_rank(vllm_config: Any) -> int:
    """The data-parallel rank of ``vllm_config`` (0 without one)."""
    return int(getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_rank", 0))
