#!/usr/bin/env python3
"""Print the Python package's import cycles and cross-module private imports.

Usage: python3 tools/layers.py [PACKAGE_DIR]   (default: python/kda_tp)
Counts every `import`/`from ... import` in a module, inside functions too. Exit 1 if it finds any.
"""
from __future__ import annotations

import ast
import os
import sys


def modules(pkg_dir: str) -> dict[str, str]:
    root = os.path.dirname(os.path.abspath(pkg_dir))
    out = {}
    for dp, _, fs in os.walk(pkg_dir):
        for f in fs:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dp, f), root)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = os.path.join(dp, f)
    return out


def graph(mods: dict[str, str]) -> tuple[dict[str, set[str]], list[str]]:
    top = min(mods, key=len)
    g: dict[str, set[str]] = {m: set() for m in mods}
    private: list[str] = []
    for m, path in mods.items():
        pkg = m if path.endswith("__init__.py") else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom):
                base = pkg
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                target = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
                if not target.startswith(top):
                    continue
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    t = sub if sub in mods else target
                    if t in mods and t != m and t != top:
                        g[m].add(t)
                    if a.name.startswith("_") and not a.name.startswith("__") and sub not in mods \
                            and a.name != "_native" and t != m:
                        private.append(f"{m} imports {t}.{a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods and a.name not in (m, top):
                        g[m].add(a.name)
    return g, private


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in list(g):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    pkg = sys.argv[1] if len(sys.argv) > 1 else os.path.join("python", "kda_tp")
    if not os.path.isdir(pkg):
        print(f"layers: no package directory {pkg}")
        return 0
    mods = modules(pkg)
    g, private = graph(mods)
    cyc = cycles(g)
    for c in cyc:
        print("import cycle: " + " <-> ".join(c))
    for p in private:
        print("private import: " + p)
    if not cyc and not private:
        print(f"layers: {len(mods)} modules, no import cycle, no cross-module private import")
    return 1 if cyc or private else 0


if __name__ == "__main__":
    sys.exit(main())
