"""Types as a user's type checker sees them: ``_native.pyi`` matches the built module
(``mypy.stubtest``), ``mypy --strict`` passes on the package and on the Python examples of the
README and the documentation pages, and gives the expected errors for code that misuses the
types. The signature ``help(KdaTpPlan)`` shows carries the real ``qk_multiple`` default.

mypy runs on the installed package, so in CI it checks the wheel's files and stub.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import kda_tp
import numpy as np
import pytest

from paths import ROOT

pytest.importorskip("mypy")

EXAMPLE_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

GOOD = """\
from typing_extensions import assert_type

import kda_tp
from kda_tp import KdaShard, KdaTensorPlan, KdaTpPlan, Tensor

plan = KdaTpPlan(0, 2, 4096, 128, 64, 4, 128, qk_multiple=1, dtypes={"A_log": "F32"})
assert_type(plan.hidden, int)
assert_type(plan.needs_output_all_reduce, bool)
assert_type(plan["o_proj"], KdaTensorPlan)
assert_type(plan.get("o_proj"), KdaTensorPlan | None)
assert_type(plan.tensors, list[KdaTensorPlan])
o = plan["o_proj"]
assert_type(o.local_shape(o.disk_shape), tuple[int, ...])
assert_type(o.local_shape([4096, 8192]), tuple[int, ...])
assert_type(o.byte_range, tuple[int, int] | None)
assert_type(o.kind, KdaShard)
assert_type(o.kind == KdaShard.CHANNEL_COLS, bool)
assert_type(KdaTpPlan.from_config({}, 0, 1), KdaTpPlan)
source = kda_tp.SafetensorsSource("ckpt")
assert_type(source.get("w"), Tensor | None)
local = kda_tp.KdaShardedSource(source, plan)
assert_type(local["w"], Tensor)
"""

# Each line is a misuse; the expected mypy error for it follows ``# E:``.
BAD = """\
from kda_tp import KdaTpPlan, SafetensorsSource

plan = KdaTpPlan(0, 2, 4096, 128, 64, 4, 128)
hidden: str = plan.hidden  # E: Incompatible types in assignment (expression has type "int", variable has type "str")
shape: list[int] = plan["o_proj"].local_shape([4096, 8192])  # E: Incompatible types in assignment (expression has type "tuple[int, ...]", variable has type "list[int]")
KdaTpPlan(0, 2, 4096, 128, 64, 4, 128, qk_multiple="256")  # E: Argument "qk_multiple" to "KdaTpPlan" has incompatible type "str"; expected "int"
KdaTpPlan(0, 2, 4096, 128, 64, 4, 128, 256)  # E: Too many positional arguments for "KdaTpPlan"
data = SafetensorsSource("ckpt").get("w").data  # E: Item "None" of "Tensor | None" has no attribute "data"
"""


def mypy(tmp_path: Path, *targets: str) -> tuple[int, str]:
    """``mypy --strict`` over ``targets`` (files, or ``-p package``); exit status and output."""
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "--show-error-codes",
         "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(tmp_path / ".mypy_cache"), *targets],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )
    return result.returncode, result.stdout + result.stderr


def readme_examples() -> str:
    """The ```` ```python ```` blocks of the README and docs/*.md as one module, each block in its
    own function (as the code would sit in a loader)."""
    blocks = [block for page in EXAMPLE_PAGES
              for block in re.findall(r"^```python\n(.*?)^```", page.read_text(),
                                      flags=re.S | re.M)]
    assert len(blocks) >= 3
    functions = [
        f"def example_{i}() -> None:\n" + textwrap.indent(block, "    ")
        for i, block in enumerate(blocks)
    ]
    return "\n\n".join(functions)


def test_the_stub_matches_the_native_module(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "kda_tp._native",
         "--mypy-config-file", str(ROOT / "pyproject.toml")],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# numpy < 2.3 gives ndarray's type parameters no defaults, so every bare ``np.ndarray`` in the
# package is an error under --strict there (numpy 2.2 is the last release for CPython 3.10).
NUMPY_DEFAULTS_NDARRAY_PARAMETERS = tuple(map(int, np.__version__.split(".")[:2])) >= (2, 3)


@pytest.mark.skipif(not NUMPY_DEFAULTS_NDARRAY_PARAMETERS, reason="numpy < 2.3 stubs")
def test_the_package_passes_mypy_strict(tmp_path: Path) -> None:
    # By module name: a site-packages path would make mypy take site-packages for a source root.
    status, output = mypy(tmp_path, "-p", "kda_tp")
    assert status == 0, output


def test_the_readme_examples_and_correct_uses_pass_mypy_strict(tmp_path: Path) -> None:
    (tmp_path / "readme_examples.py").write_text(readme_examples())
    (tmp_path / "good.py").write_text(GOOD)
    status, output = mypy(tmp_path, "readme_examples.py", "good.py")
    assert status == 0, output


def test_mypy_strict_reports_each_misuse(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text(BAD)
    status, output = mypy(tmp_path, "bad.py")
    assert status == 1
    expected = {
        f"bad.py:{number}: error: {line.split('# E: ')[1]}"
        for number, line in enumerate(BAD.splitlines(), 1)
        if "# E: " in line
    }
    got = {re.sub(r"  \[[a-z-]+\]$", "", line) for line in output.splitlines() if ": error: " in line}
    assert got == expected, output


def test_help_shows_the_real_qk_multiple_default() -> None:
    for cls in (kda_tp.KdaTpPlan, kda_tp._native.KdaTpPlan):
        parameter = inspect.signature(cls).parameters["qk_multiple"]
        assert parameter.default == 256
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY
    # The text signature is hand-written beside the Rust default it must repeat.
    assert kda_tp.KdaTpPlan(0, 1, 1, 128, 1, 1, 1).qk_multiple == 256
    assert "qk_multiple=256" in kda_tp._native.KdaTpPlan.__text_signature__


def test_the_installed_package_ships_its_type_information() -> None:
    package = Path(kda_tp.__file__).parent
    assert (package / "py.typed").is_file()
    assert (package / "_native.pyi").is_file()
