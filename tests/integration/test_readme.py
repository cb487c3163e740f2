"""The README and the documentation site (docs/, mkdocs.yml) stay true.

* Every ```` ```python ```` block of the README and of docs/*.md runs as written, on a small
  generated checkpoint standing in for ``/models/Kimi-Linear-48B-A3B`` (``tests/data/`` paths
  taken from the clone's root, wherever the tests run from). Blocks that need torch, a
  GPU, a process group or a real model are marked ```` ```py ```` and are only shown.
* The README's "Try it in one minute" commands (the same in docs/getting-started.md) run
  verbatim, one after the other, in a fresh directory.
* The README is a landing page: at most 200 lines, linking every page of the site's nav; every
  relative link in it and in the docs names a file that exists.
* docs/cli.md lists every command and every flag of ``kda-tp``, and its flag tables list none that
  the parser lacks; the API reference has an entry for every name in ``kda_tp.__all__``.

``mkdocs build --strict`` (in .ci/run) checks the site's own links, anchors and API references.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import kda_tp
from kda_tp.cli import main
from kda_tp.synth import write_small_checkpoint

from paths import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
MODEL = "/models/Kimi-Linear-48B-A3B"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    # 3 layers, KDA at 0 and 2; 4 heads of 64, so TP=2 passes the 256-channel q|k rule.
    return write_small_checkpoint(tmp_path_factory.mktemp("readme") / "ckpt", hidden=96, heads=4,
                                  head_dim=64, conv_kernel=4, gate_rank=16, num_layers=3,
                                  kda_layers=[0, 2])


def run_block(code: str, ckpt: Path, where: str) -> dict:
    namespace: dict = {}
    code = code.replace(MODEL, str(ckpt)).replace('"tests/data/', f'"{ROOT}/tests/data/')
    exec(compile(code, where, "exec"), namespace)
    return namespace


def test_readme_loader_runs(ckpt):
    blocks = python_blocks(README)
    assert len(blocks) == 1, "the README shows one loader example; more go in docs/"
    namespace = run_block(blocks[0], ckpt, "README loader example")
    # Rank 1 of 2 keeps channels 128..256 of o_proj's 256 input columns; MLA layer 1 is whole.
    weights = namespace["weights"]
    assert weights["model.layers.0.self_attn.o_proj.weight"].shape == (96, 128)
    assert weights["model.layers.2.self_attn.A_log"].shape == (1, 1, 2, 1)
    assert namespace["plan"].needs_output_all_reduce


DOC_BLOCKS = [(page.name, i, code) for page in sorted(DOCS.glob("*.md"))
              for i, code in enumerate(python_blocks(page))]


@pytest.mark.parametrize(("page", "index", "code"), DOC_BLOCKS,
                         ids=[f"{page}-{i}" for page, i, _ in DOC_BLOCKS])
def test_docs_python_examples_run(page, index, code, ckpt):
    namespace = run_block(code, ckpt, f"docs/{page} example {index}")
    if "weights" in namespace:  # the loader
        assert namespace["weights"]["model.layers.0.self_attn.o_proj.weight"].shape == (96, 128)
    if "local" in namespace and "o" in namespace:  # the plan alone: o_proj's bytes of rank 1
        assert namespace["local"].nbytes == namespace["o"].local_bytes == 4096 * 4096 * 2
    if "report" in namespace:  # the numeric check
        assert namespace["report"].passed and len(namespace["report"].layers) == 2


def try_it_block(path: Path) -> list[str]:
    """The commands of a page's "Try it in one minute" section (its one ```sh block)."""
    section = path.read_text().split("## Try it in one minute", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"^```sh\n(.*?)^```", section, flags=re.S | re.M)
    return block.splitlines()


@pytest.mark.slow  # a 2-layer checkpoint of Kimi-Linear's real geometry (0.17 GB)
def test_the_try_it_path_runs_verbatim(tmp_path):
    """README's "Try it in one minute", as a newcomer runs it after the README's install
    command (the same commands as Getting started's), from a fresh directory, and then again
    as written (people copy it twice)."""
    commands = try_it_block(README)
    assert try_it_block(DOCS / "getting-started.md") == commands
    for _ in range(2):
        outputs = []
        for line in commands:
            argv = shlex.split(line)
            assert argv[0] == ".venv/bin/kda-tp", line  # the README's install command's venv
            done = subprocess.run([sys.executable, "-m", "kda_tp", *argv[1:]], cwd=tmp_path,
                                  capture_output=True, text=True, timeout=600, check=False)
            assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
            outputs.append(done.stdout)
    names = [shlex.split(line)[1] for line in commands]
    assert names == ["demo", "plan", "shard", "verify", "dump", "audit"]
    assert "per KDA layer: 20.6 MB per rank of 79.0 MB (26.1%)" in outputs[1]
    assert "numerical TP equivalence passes (2 KDA layers" in outputs[3]
    assert outputs[5].splitlines()[-1] == (
        "OK: 72 of 72 KDA parameters exact on ranks 0, 1, 2, 3 of 4 (vllm-0.33-kimi-linear); "
        "0 other parameters ignored")


def test_docs_examples_are_found():
    pages = {page for page, _, _ in DOC_BLOCKS}
    assert {"getting-started.md", "proof.md"} <= pages


def nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_readme_is_a_landing_page_that_links_every_docs_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    nav = nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    linked = set(re.findall(r"\]\(docs/([^)#]+)", text))
    assert sorted(set(nav) - {"index.md"} - linked) == []
    for page in nav:
        assert (DOCS / page).is_file(), page


@pytest.mark.parametrize("path", [README, *sorted(DOCS.rglob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_name_existing_files(path):
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        assert (path.parent / target.split("#")[0]).exists(), f"{path.name}: {target}"


def help_text(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def flags(help_output: str) -> set[str]:
    """The long options argparse lists (each at the start of its help line)."""
    options = help_output.split("options:", 1)[1]
    found = re.findall(r"^  (?:-\w, )?(--[a-z][a-z0-9-]*)", options, flags=re.M)
    return set(found) - {"--help"}


def cli_sections() -> dict[str, str]:
    text = (DOCS / "cli.md").read_text()
    parts = re.split(r"^## `kda-tp (\w+)`$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_cli_reference_lists_every_command(capsys):
    top = help_text(capsys)
    listed = set(re.findall(r"^    (\w+)\s", top.split("COMMAND", 2)[2], flags=re.M))
    assert {"plan", "shard", "verify", "demo"} <= listed
    assert set(cli_sections()) == listed
    assert "--version" in flags(top) and "`kda-tp --version`" in (DOCS / "cli.md").read_text()


@pytest.mark.parametrize("command", sorted(cli_sections()))
def test_cli_reference_lists_every_flag(command, capsys):
    section = cli_sections()[command]
    table = set(re.findall(r"^\| `(--[a-z][a-z0-9-]*)", section, flags=re.M))
    assert table == flags(help_text(capsys, command))


def test_api_reference_documents_every_public_name():
    directives = set(re.findall(r"^::: ([\w.]+)$", "\n".join(
        page.read_text() for page in sorted((DOCS / "api").glob("*.md"))), flags=re.M))
    whole_modules = {"kda_tp.errors", "kda_tp.torch", "kda_tp.reference", "kda_tp.shard"}
    assert whole_modules <= directives
    errors = set(kda_tp.errors.__all__)
    missing = [name for name in kda_tp.__all__
               if name not in errors | {"__version__", "errors"}
               and f"kda_tp.{name}" not in directives]
    assert missing == []


def test_the_docs_index_shows_the_split_and_links_the_guard_and_rl_pages():
    """A newcomer's first page: the picture of the split, and the way to the guard and to RL
    refits (issue 33)."""
    index = (DOCS / "index.md").read_text()
    pictures = re.findall(r"!\[[^\]]+\]\((img/[^)]+\.svg)\)", index)
    assert pictures[0] == "img/plan-kimi-linear-tp4.svg"  # the split comes first
    assert all((DOCS / picture).is_file() for picture in pictures)
    linked = set(re.findall(r"\]\(([a-z-]+\.md)", index))
    assert {"guard.md", "guard-cpu.md", "rl.md"} <= linked


def test_install_lines_work_from_this_checkout():
    """No install line names a package index's ``kda_tp[...]`` as the way to install today
    (kda_tp is not on PyPI: it finds nothing), and the README says what pip does without
    cargo."""
    for page in [README, DOCS / "getting-started.md", DOCS / "torch.md"]:
        for line in page.read_text().splitlines():
            assert not re.search(r"pip install '?kda_tp\[", line) or "once" in line, (page, line)
    readme = " ".join(README.read_text().split())
    assert "about 736 MB" in readme and "MATURIN_NO_INSTALL_RUST=1" in readme
