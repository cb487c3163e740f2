"""A checkpoint whose ``model.safetensors.index.json`` is wrong (``action="shard"``): the message
names the index and, where there is one, the tensor."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kda_tp.errors import CheckpointError

from .core import ATTN, INDEX, Kinds, base_checkpoint, copy_base, edit_index

KINDS = Kinds()


def _index_edit(
    *contains: str,
) -> Callable[[Callable[[dict, Path], object]], Callable[[Path], object]]:
    """Decorator: the decorated ``edit(index, base)`` (``base``: the base checkpoint's folder)
    changes a copy of the base checkpoint's index in place; the kind is named after it."""

    def register(edit: Callable[[dict, Path], object]) -> Callable[[Path], object]:
        def write(root: Path, kind: str) -> Path:
            base = base_checkpoint(root)
            return edit_index(root, kind, lambda index: edit(index, base))

        write.__name__, write.__doc__ = edit.__name__, edit.__doc__
        return KINDS.kind(CheckpointError, *contains, action="shard", subject=INDEX)(write)

    return register


@KINDS.kind(CheckpointError, "not JSON", action="shard", subject=INDEX)
def index_not_json(root: Path, kind: str) -> Path:
    target = copy_base(root, kind)
    (target / INDEX).write_text('{"weight_map": {')
    return target


@_index_edit("weight_map")
def index_no_weight_map(index: dict, base: Path) -> None:
    index.update(weight_map=["a"])


_Q1 = ATTN.format(1) + "q_proj.weight"


@_index_edit("model-00009-of-00009.safetensors", _Q1)
def index_missing_file(index: dict, base: Path) -> None:
    index["weight_map"][_Q1] = "model-00009-of-00009.safetensors"


_Q0 = ATTN.format(0) + "q_proj.weight"


@_index_edit(_Q0, "no such tensor")
def index_tensor_not_in_file(index: dict, base: Path) -> None:
    files = sorted(set(index["weight_map"].values()))
    index["weight_map"][_Q0] = next(f for f in files if f != index["weight_map"][_Q0])


_O_NORM_1 = ATTN.format(1) + "o_norm.weight"


@_index_edit(_O_NORM_1, "no file")
def index_unlisted_tensor(index: dict, base: Path) -> None:
    index["weight_map"].pop(_O_NORM_1)


_A_LOG_0 = ATTN.format(0) + "A_log"


@_index_edit(_A_LOG_0, "not a plain relative path")
def index_parent_path(index: dict, base: Path) -> None:
    index["weight_map"][_A_LOG_0] = "../_base/" + index["weight_map"][_A_LOG_0]


@_index_edit(_A_LOG_0, "not a plain relative path")
def index_absolute_path(index: dict, base: Path) -> None:
    index["weight_map"][_A_LOG_0] = str((base / index["weight_map"][_A_LOG_0]).resolve())
