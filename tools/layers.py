#!/usr/bin/env python3
"""Print the Python package's import cycles, cross-module private imports, imports of a room's
private (underscore) modules from outside it, and imports against the order of its rooms.

A room is a folder of the package (with everything in it) or a module at its root. kda_tp's rooms
stand in the order of LAYERS (as import-linter's `layers` contract: top first, rooms on one
floor independent of each other): a room imports only rooms on the floors below it, and nothing
imports the package face (`kda_tp/__init__.py`) but `__main__`. A module whose name starts with
an underscore (`kda_tp/cli/_format.py`) is its room's own: only modules of that room import it.
ARCHITECTURE.md explains the order.

Usage: python3 tools/layers.py [PACKAGE_DIR]   (default: python/kda_tp)
Counts every `import`/`from ... import` in a module, inside functions too (type-checking-only
imports as well). Exit 1 if it finds any of the above.
"""
from __future__ import annotations

import ast
import os
import sys


#: kda_tp's rooms, top floor first; the rooms of one floor import none of each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__main__",),
    ("guard", "cli"),
    ("audit", "shard"),
    ("engines", "reference", "torch"),
    ("rank", "output", "synth"),
    ("checkpoint",),
    ("model", "oracle"),
    ("errors",),
)


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


def room(module: str) -> str:
    """The room of a module: its folder, or itself at the root (`kda_tp.audit.dump` -> `audit`)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def face_imports(mods: dict[str, str]) -> list[str]:
    """Modules that import the package face (a name of `__init__` that is no module, or
    `import kda_tp`), `__main__` excepted."""
    top = min(mods, key=len)
    found = []
    for m, path in mods.items():
        if m in (top, f"{top}.__main__"):
            continue
        pkg = m if path.endswith("__init__.py") else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom):
                base = pkg
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                target = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
                names = [a.name for a in node.names
                         if f"{top}.{a.name}" not in mods and a.name != "_native"]
                if target == top and names:
                    found.append(f"{m} imports {', '.join(names)} from the package face {top}")
            elif isinstance(node, ast.Import) and any(a.name == top for a in node.names):
                found.append(f"{m} imports the package face {top}")
    return found


def private_modules(mods: dict[str, str], g: dict[str, set[str]]) -> list[str]:
    """Imports of a private (underscore) module, ``_native`` aside, from outside its room."""
    top = min(mods, key=len)
    found = []
    for m in sorted(g):
        for t in sorted(g[m]):
            name = t.rpartition(".")[2]
            if name.startswith("_") and not name.startswith("__") and t != f"{top}._native" \
                    and room(m) != room(t):
                found.append(f"{m} imports {t}, a private module of room {room(t)}")
    return found


def against_layers(mods: dict[str, str], g: dict[str, set[str]]) -> list[str]:
    """Imports between rooms that do not go down LAYERS (kda_tp only), and rooms it lacks."""
    top = min(mods, key=len)
    floor = {r: i for i, rooms in enumerate(LAYERS) for r in rooms}
    found = []
    for r in sorted({room(m) for m in mods if m != top} - set(floor)):
        found.append(f"room {r} is on no floor of tools/layers.py's LAYERS")
    for m in sorted(g):
        for t in sorted(g[m]):
            a, b = room(m), room(t)
            if m == top or a == b or a not in floor or b not in floor:
                continue
            if floor[a] >= floor[b]:
                how = "on the same floor as" if floor[a] == floor[b] else "below"
                found.append(f"{m} imports {t}: room {a} is {how} room {b} (LAYERS)")
    return found


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
    ordered = min(mods, key=len) == "kda_tp"
    against = (against_layers(mods, g) + face_imports(mods)) if ordered else []
    against += private_modules(mods, g)
    for c in cyc:
        print("import cycle: " + " <-> ".join(c))
    for p in private:
        print("private import: " + p)
    for a in against:
        print("against the layers: " + a)
    if not cyc and not private:
        down = f", every import down the {len(LAYERS)} floors of LAYERS" if ordered else ""
        print(f"layers: {len(mods)} modules, no import cycle, no cross-module private import"
              + ("" if against else down))
    return 1 if cyc or private or against else 0


if __name__ == "__main__":
    sys.exit(main())
