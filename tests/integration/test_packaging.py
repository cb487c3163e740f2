"""What an index and a user's installer see: the installed distribution's metadata (license
expression and files, Python versions, operating systems, the console script, URLs) and the
release workflow.

In CI (``.ci/run``) the installed distribution is the manylinux abi3 wheel built from the sdist;
``.ci/run`` itself checks that wheel's tag with ``auditwheel show`` and its symbols with
``abi3audit``.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys

import pytest

from paths import ROOT

WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
METADATA = importlib.metadata.metadata("kda_tp")


def test_license_expression_and_files_are_in_the_distribution() -> None:
    cargo_license = re.search(r'^license = "(.+)"$', (ROOT / "Cargo.toml").read_text(), re.M)
    assert cargo_license is not None
    assert METADATA["License-Expression"] == cargo_license.group(1) == "MIT OR Apache-2.0"
    assert sorted(METADATA.get_all("License-File") or []) == ["LICENSE-APACHE", "LICENSE-MIT"]
    files = {f.name: f for f in importlib.metadata.files("kda_tp") or [] if "licenses" in f.parts}
    assert sorted(files) == ["LICENSE-APACHE", "LICENSE-MIT"]
    for name, file in files.items():
        assert file.read_text() == (ROOT / name).read_text()
    # PEP 639: no License :: classifiers beside an expression.
    assert not [c for c in METADATA.get_all("Classifier") or [] if c.startswith("License ::")]


def test_python_versions_and_operating_systems() -> None:
    classifiers = set(METADATA.get_all("Classifier") or [])
    assert METADATA["Requires-Python"] == ">=3.10"
    listed = sorted(
        int(m.group(1))
        for c in classifiers
        if (m := re.fullmatch(r"Programming Language :: Python :: 3\.(\d+)", c))
    )
    # Every minor version from the floor on, the one running these tests included.
    assert listed == list(range(10, listed[-1] + 1)) and listed[-1] >= 13
    assert sys.version_info[1] in listed
    assert {
        "Programming Language :: Python :: Implementation :: CPython",
        "Operating System :: POSIX :: Linux",
        "Operating System :: MacOS",
        "Typing :: Typed",
    } <= classifiers
    # The writer locks output directories with fcntl.flock (kda_tp.shard): no Windows claim.
    assert not [c for c in classifiers if "Windows" in c]


def test_the_console_script_is_the_interruptible_entry_point() -> None:
    """``kda-tp`` runs ``kda_tp.__main__:main``, which imports the command line inside its own
    Ctrl-C handler (tests/integration/test_start.py runs it as ``python -m kda_tp``)."""
    scripts = importlib.metadata.entry_points(group="console_scripts", name="kda-tp")
    assert [e.value for e in scripts] == ["kda_tp.__main__:main"]


def test_project_urls() -> None:
    urls = dict(u.split(", ", 1) for u in METADATA.get_all("Project-URL") or [])
    assert {"Homepage", "Repository", "Issues"} <= set(urls)
    assert all(u.startswith("https://") for u in urls.values())


def test_the_release_workflow() -> None:
    yaml = pytest.importorskip("yaml")
    workflow = yaml.safe_load(WORKFLOW.read_text())
    triggers = workflow["on"] if "on" in workflow else workflow[True]  # YAML 1.1: `on` is true
    assert triggers["push"]["tags"] == ["v*"]
    jobs = workflow["jobs"]
    assert set(jobs) == {"linux", "macos", "sdist", "release"}  # no Windows: see above
    targets = {
        job: {p["target"] for p in jobs[job]["strategy"]["matrix"]["platform"]}
        for job in ("linux", "macos")
    }
    assert targets == {"linux": {"x86_64", "aarch64"}, "macos": {"x86_64", "aarch64"}}
    for job in ("linux", "macos"):
        builds = [s for s in jobs[job]["steps"] if s.get("uses", "").startswith("PyO3/maturin-action")]
        assert len(builds) == 1, job  # one abi3 wheel per platform
        assert "--locked" in builds[0]["with"]["args"] and "-i" not in builds[0]["with"]["args"]
    linux_checks = " ".join(s.get("run", "") for s in jobs["linux"]["steps"])
    assert "auditwheel show" in linux_checks and "abi3audit" in linux_checks
    release = jobs["release"]
    assert release["if"] == "${{ startsWith(github.ref, 'refs/tags/v') }}"
    assert set(release["needs"]) == {"linux", "macos", "sdist"}
    assert release["permissions"]["id-token"] == "write"  # trusted publishing
