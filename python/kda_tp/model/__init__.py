"""Model facts: the model families (``families``), the KDA geometry and gate a config
describes (``config``), block-FP8 quantization formats and :func:`dequantize` (``quant``), the
hardened JSON reader every config and metadata value goes through (``json_reader``), and the
dtype facts with the engines' cast (``dtypes``).

Imports nothing but ``kda_tp.errors``.
"""

from . import config, dtypes, families, json_reader, quant
from .families import *  # noqa: F403
from .config import *  # noqa: F403
from .quant import *  # noqa: F403
from .json_reader import *  # noqa: F403
from .dtypes import *  # noqa: F403

__all__ = (families.__all__ + config.__all__ + quant.__all__ + json_reader.__all__
           + dtypes.__all__)
