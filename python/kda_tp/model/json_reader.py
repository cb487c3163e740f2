"""The hardened JSON reader: every JSON document and header metadata integer kda_tp reads
(``config.json``, ``hf_quant_config.json``, an index, a rank header's ``kda_tp_layers``,
``tp_size``/``tp_rank`` metadata), bounded before it costs time or memory: a size bound on files,
a nesting-depth scan before ``json.loads`` recurses, and a digit count before ``int`` sees a
number (Python's own limit is 4300 digits and a plain ``ValueError``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

__all__ = [
    "MAX_INT_DIGITS",
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "ascii_int",
    "parse_json",
    "parse_metadata_int",
    "read_json",
    "short_repr",
]

#: Deepest nesting of arrays and objects in a JSON document kda_tp reads (``config.json``,
#: ``hf_quant_config.json``, a rank header's ``kda_tp_layers``); real ones nest 2 to 4 deep.
MAX_JSON_DEPTH = 64
#: Most digits of an integer in a JSON document or a header metadata value (``2**64`` has 20).
MAX_INT_DIGITS = 32
#: Largest JSON file read whole (``config.json``, ``hf_quant_config.json``), in bytes: 16 MiB
#: (published ones are under 100 KB).
MAX_JSON_BYTES = 16 * 2**20


def read_json(path: str | os.PathLike[str], what: str = "it") -> Any:
    """Read a small JSON file (a config) with the bounds of :func:`parse_json` and a size bound.

    Args:
        path: the file.
        what: how messages name the document (``"the config"``).

    Raises:
        FileNotFoundError: there is no such file (the caller says what was expected).
        CheckpointError: not a regular file (a FIFO would block a read forever), unreadable
            (permissions, I/O), larger than :data:`MAX_JSON_BYTES` bytes (read up to one byte
            past the bound, never the whole file), not UTF-8, or refused by :func:`parse_json`.
            The message names the file.
    """
    path = Path(path)
    if path.exists() and not path.is_file():
        raise CheckpointError(f"{path}: not a regular file")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what}: {e}") from None
    if len(raw) > MAX_JSON_BYTES:
        raise CheckpointError(
            f"{path}: {what} is larger than {MAX_JSON_BYTES} bytes (MAX_JSON_BYTES), far more "
            "than any model's; is it the right file?"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: cannot read {what} as JSON: {e}") from None
    return parse_json(text, str(path))



# A JSON string (escapes included): what the depth scan skips.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# Every byte but the four brackets, deleted before the depth scan.
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


#: An innermost pair of either kind; one ``sub`` pass removes each level once (two chained
#: ``replace`` calls would remove ``{[]}`` whole in one round and count it as one level).
_EMPTY_PAIR = re.compile(rb"\[\]|\{\}")


def _too_deep(text: str) -> bool:
    """Whether ``text``'s arrays and objects nest deeper than ``MAX_JSON_DEPTH``, or its
    brackets cannot match with less (then ``json.loads`` would recurse on them); linear time:
    strings dropped, then each round deletes the innermost (empty) pairs, one level a round."""
    brackets = _JSON_STRING.sub(b"", text.encode("utf-8", "surrogatepass"))
    brackets = brackets.translate(None, _NOT_BRACKETS)
    rounds = 0
    while brackets and rounds <= MAX_JSON_DEPTH:
        shorter = _EMPTY_PAIR.sub(b"", brackets)  # one pass: one level a round, not two
        if len(shorter) == len(brackets):
            break  # brackets that do not match: json.loads names where, if it can get there
        brackets, rounds = shorter, rounds + 1
    return rounds > MAX_JSON_DEPTH or rounds + len(brackets) > 2 * MAX_JSON_DEPTH


class _TooManyDigits(Exception):
    """Raised from inside ``json.loads`` by :func:`_bounded_int`."""


def _bounded_int(digits: str) -> int:
    try:
        found = ascii_int(digits, signed=True)
    except OverflowError:
        raise _TooManyDigits(len(digits.lstrip("-"))) from None
    assert found is not None  # json's scanner passes ASCII digits with an optional "-"
    return found


def parse_json(text: str, source: str) -> Any:
    """``json.loads(text)``, refusing what no real config holds before it costs time or memory.

    The nesting depth is bounded first by a linear scan (strings skipped), so a document
    nested 200,000 deep is refused without recursing; an integer's digits are counted before
    ``int`` sees them (Python's own limit is 4300 digits, and a plain ``ValueError``).

    Args:
        text: the document.
        source: what it is (a path, or ``"<file>: kda_tp_layers"``), named in messages.

    Raises:
        CheckpointError: not JSON (with the decoder's position); arrays and objects nested
            deeper than ``MAX_JSON_DEPTH`` ("nested more than MAX_JSON_DEPTH = 64 deep"),
            or brackets that cannot match without going deeper; an integer of more than ``MAX_INT_DIGITS`` digits ("an integer of N
            digits, more than MAX_INT_DIGITS = 32").
    """
    if _too_deep(text):
        raise CheckpointError(
            f"{source}: JSON nested more than MAX_JSON_DEPTH = {MAX_JSON_DEPTH} deep (or its "
            "brackets do not match); not a config kda_tp can read"
        )
    try:
        return json.loads(text, parse_int=_bounded_int)
    except _TooManyDigits as e:
        raise CheckpointError(
            f"{source}: an integer of {e.args[0]} digits, more than MAX_INT_DIGITS = "
            f"{MAX_INT_DIGITS}; not a value kda_tp can use"
        ) from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{source}: cannot read it as JSON: {e}") from None


# ASCII digits, after an optional sign (ascii_int's signed=True).
_ASCII_INT = re.compile(r"([+-]?)([0-9]+)")


def ascii_int(text: object, *, signed: bool = False) -> int | None:
    """``text`` read as an integer written in ASCII digits ``0-9``, after one ``+`` or ``-``
    when ``signed``: the one way kda_tp reads an integer from text (a config's numbers, header
    metadata, a file name's rank, the command line's). None for anything else: not a str, empty,
    spaces or underscores, other scripts' digits (``int`` reads ``"٤"`` as 4, ``str.isdigit``
    takes ``"²"``).

    Raises:
        OverflowError: more than ``MAX_INT_DIGITS`` digits (``int`` would spend time on
            them, and refuses 4300 with a plain ``ValueError``); the caller says where.
    """
    if not isinstance(text, str):
        return None
    match = _ASCII_INT.fullmatch(text)
    if match is None or (match.group(1) and not signed):
        return None
    if len(match.group(2)) > MAX_INT_DIGITS:
        raise OverflowError(f"an integer of {len(match.group(2))} digits, more than "
                            f"MAX_INT_DIGITS = {MAX_INT_DIGITS}")
    return int(text)


def parse_metadata_int(value: object, key: str, source: str) -> int:
    """A count or index from a header's metadata (``tp_size``, ``tp_rank``): ASCII digits only
    (:func:`ascii_int`).

    ``int()`` would also take ``" 4"``, ``"+4"``, ``"4_0"`` and other scripts' digits
    (``"٤"``), and raise a plain ``ValueError`` past 4300 digits.

    Args:
        value: the metadata value (a string in a safetensors header).
        key: the metadata key, named in messages.
        source: the file, named in messages.

    Raises:
        CheckpointError: not a string of ASCII digits ``0-9``, or longer than
            ``MAX_INT_DIGITS`` digits.
    """
    try:
        found = ascii_int(value)
    except OverflowError:
        assert isinstance(value, str)
        raise CheckpointError(
            f"{source}: metadata {key} has {len(value)} digits, more than MAX_INT_DIGITS = "
            f"{MAX_INT_DIGITS}"
        ) from None
    if found is None:
        raise CheckpointError(
            f"{source}: metadata {key} = {short_repr(value)} is not a non-negative integer in "
            "ASCII digits"
        )
    return found


def short_repr(value: object) -> str:
    """``repr(value)``, cut to 40 characters (a hostile value can be megabytes)."""
    text = repr(value[:61] if isinstance(value, (str, list)) else value)
    return text if len(text) <= 60 else text[:56] + " ..."
