"""Model facts: the model families (:data:`FAMILIES`), the KDA geometry and gate a config
describes (:class:`KdaConfig`, :func:`load_config`), block-FP8 quantization formats and
:func:`dequantize`, the MLA layers of a hybrid and their geometry (:func:`parse_mla_config`), the hardened JSON reader every config goes through (:func:`parse_json`), and
the dtype facts with the engines' cast (:func:`cast_to`).

Imports nothing but ``kda_tp.errors``. The face lists what a user may touch.
"""

from .config import KdaConfig, load_config, parse_config
from .dtypes import (
    DTYPE_SIZES,
    FLOAT_DTYPES,
    FP8_DTYPES,
    MODEL_DTYPES,
    cast_to,
    numpy_dtype,
    torch_dtype,
)
from .families import FAMILIES, ModelFamily, family_for
from .json_reader import parse_json
from .mla import MlaConfig, parse_mla_config
from .quant import BlockFormat, declared_quantization, dequantize, quantization_config

__all__ = [
    "FAMILIES",
    "ModelFamily",
    "family_for",
    "KdaConfig",
    "load_config",
    "parse_config",
    "MlaConfig",
    "parse_mla_config",
    "parse_json",
    "BlockFormat",
    "quantization_config",
    "declared_quantization",
    "dequantize",
    "DTYPE_SIZES",
    "FLOAT_DTYPES",
    "FP8_DTYPES",
    "MODEL_DTYPES",
    "numpy_dtype",
    "torch_dtype",
    "cast_to",
]

