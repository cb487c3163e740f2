"""A checkpoint whose ``config.json`` is wrong (``action="shard"``): missing, not JSON, not an
object, not a regular file, or with values out of range or not the weights' geometry."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from kda_tp.errors import CheckpointError, KdaTpError, ShapeMismatchError

from .core import ATTN, Kinds, config_text, copy_base, edit_config

KINDS = Kinds()
CONFIG = "config.json"


def _config_edit(
    error: type[KdaTpError], *contains: str, subject: str = CONFIG
) -> Callable[[Callable[[dict], object]], Callable[[Path], object]]:
    """Decorator: the decorated ``edit(config)`` changes a copy of the base checkpoint's
    ``config.json`` in place; the kind is named after it. The message names ``subject`` inside
    the copy (``""``: the copy itself)."""

    def register(edit: Callable[[dict], object]) -> Callable[[Path], object]:
        def write(root: Path, kind: str) -> Path:
            return edit_config(root, kind, edit)

        write.__name__, write.__doc__ = edit.__name__, edit.__doc__
        return KINDS.kind(error, *contains, action="shard", subject=subject)(write)

    return register


@KINDS.kind(CheckpointError, CONFIG, action="shard")
def config_missing(root: Path, kind: str) -> Path:
    target = copy_base(root, kind)
    (target / CONFIG).unlink()
    return target


KINDS.add("config_not_json", config_text('{"hidden_size": 64,'), CheckpointError, ("JSON",),
          "shard", CONFIG)
KINDS.add("config_not_object", config_text("[64, 4, 64]"), CheckpointError,
          ("not a JSON object",), "shard", CONFIG)


@KINDS.kind(CheckpointError, "not a regular file", action="shard", subject=CONFIG, blocking=True)
def config_not_regular(root: Path, kind: str) -> Path:
    """config.json is a FIFO: reading it naively blocks forever."""
    target = copy_base(root, kind)
    (target / CONFIG).unlink()
    os.mkfifo(target / CONFIG)
    return target


@_config_edit(CheckpointError, "linear_attn_config.num_heads", "-4")
def config_negative(config: dict) -> None:
    config["linear_attn_config"].update(num_heads=-4)


@_config_edit(CheckpointError, "linear_attn_config.head_dim")
def config_zero(config: dict) -> None:
    config["linear_attn_config"].update(head_dim=0)


@_config_edit(CheckpointError, "hidden_size", str(2**40))
def config_absurd(config: dict) -> None:
    config.update(hidden_size=2**40)


@_config_edit(CheckpointError, "hidden_size")
def config_not_an_int(config: dict) -> None:
    config.update(hidden_size="64")


@_config_edit(ShapeMismatchError, ATTN.format(0) + "q_proj.weight", subject="")
def config_disagrees_with_weights(config: dict) -> None:
    """A config in range but not the weights' geometry: the first KDA tensor checked is refused."""
    config.update(hidden_size=2**31 - 1)


@_config_edit(CheckpointError, "'linear_attn_config.kda_layers' = [1, 2, 9]",
              "9 beyond num_hidden_layers = 2", subject="")
def config_kda_layer_out_of_range(config: dict) -> None:
    config["linear_attn_config"].update(kda_layers=[1, 2, 9])
