"""Checking a user's list of 0-based layer indices (``--layers``) against the model.

Kimi-Linear's config numbers its KDA layers from 1 (``linear_attn_config.kda_layers``) while
kda_tp and the tensor names (``model.layers.{i}``) count from 0, so a list copied from the
config is off by one. :func:`check_layers` refuses such a list, and any negative, repeated or
out-of-range index, with a message that gives the model's layer count and the list to use.
"""

from __future__ import annotations

import numbers
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import PlanError

__all__ = ["check_layers", "config_layer_count"]


def check_layers(
    requested: Iterable[int],
    kda_layers: Sequence[int] | None,
    num_layers: int | None,
    *,
    option: str = "--layers",
) -> tuple[int, ...]:
    """Check ``requested`` 0-based layer indices; return them sorted.

    Args:
        requested: the indices as the user gave them (order kept for the messages).
        kda_layers: the model's KDA layers (0-based), or None when unknown. When known, every
            requested index must be one of them.
        num_layers: the model's decoder layer count, or None when unknown.
        option: how the messages name the list: a command-line option (``"--layers"``, shown
            as ``--layers 0,1``) or a Python argument (``"layers"``, shown as
            ``layers=[0, 1]``).

    Raises:
        PlanError: an empty list; an entry that is not an integer (a bool, a float, a
            string); a negative or repeated index; a list in which every index is
            one more than a KDA layer but some index is not a KDA layer (a 1-based list: the
            message says "1-based" and gives the 0-based list); an index ``>= num_layers``; an
            index that is not a KDA layer.
    """
    given = list(requested)
    for i in given:
        # int() would also take True (layer 1), 1.7 and "3".
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise PlanError(f"{option}: {i!r} is not a layer index (an integer)")
    given = [int(i) for i in given]
    count = f"the model has {num_layers} layers, 0..{num_layers - 1}" if num_layers else None
    if not given:
        raise PlanError(f"{option} is empty")
    for i in given:
        if i < 0:
            raise PlanError(
                f"{option}: {i} is negative; layers are 0-based indices"
                + (f" ({count})" if count else "")
            )
    repeated = sorted(i for i, times in Counter(given).items() if times > 1)
    if repeated:
        raise PlanError(
            f"{option}: {_csv(repeated)} given more than once"
            + (f" ({count})" if count else "")
        )
    kda = set(kda_layers) if kda_layers is not None else None
    if kda is not None and all(i - 1 in kda for i in given) and not set(given) <= kda:
        other = [i for i in given if i not in kda]
        raise PlanError(
            f"{_show(option, given)}: {_csv(other)} not a KDA layer (the KDA layers, 0-based, "
            f"are {_csv(sorted(kda))}); the list looks 1-based (each entry is one more than a "
            f"KDA layer, as in Kimi-Linear's config.json), and {option} takes 0-based indices: "
            f"{_show(option, [i - 1 for i in given])}"
        )
    if num_layers is not None:
        beyond = [i for i in given if i >= num_layers]
        if beyond:
            raise PlanError(f"{option}: {_csv(beyond)} out of range ({count})")
    if kda is not None:
        other = [i for i in given if i not in kda]
        if other:
            raise PlanError(
                f"{option}: {_csv(other)} not a KDA layer (the KDA layers, 0-based, are "
                f"{_csv(sorted(kda))})"
            )
    return tuple(sorted(given))


def config_layer_count(config: Mapping[str, Any]) -> int | None:
    """A config's ``num_hidden_layers`` when it is a positive int, else None."""
    n = config.get("num_hidden_layers")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def _show(option: str, values: list[int]) -> str:
    """``--layers 0,1`` for a command-line option, ``layers=[0, 1]`` for a Python argument."""
    return f"{option} {_csv(values)}" if option.startswith("-") else f"{option}={values}"


def _csv(values: Iterable[int]) -> str:
    return ",".join(str(v) for v in values)
