"""The package stays layered (review 61): no module of the library imports the CLI layer, and no import cycle, counting
the imports inside functions, beyond the few listed here on purpose (a compiled or GPU kernel loaded only when used,
which reads its caller's constants back). A new cycle, or a listed one that grows, fails this test."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "indknn_cli"

#: Cycles kept on purpose: numba/triton/torch kernels imported lazily by the code that calls them; tuning runs the
#: index build it tunes; two benchmark pairs.
KNOWN_CYCLES = [
    {"candidates", "exact_jit", "gpu_fused", "gpu_screen"},
    {"engine", "filter_jit", "noise_jit"},
    {"indexing", "tuning"},
    {"benchmarks.experiments", "benchmarks.private_tuning"},
    {"benchmarks.serve_speed", "benchmarks.serve_speed_gpu"},
]


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Every import of another module of the package (at module top or inside a function; TYPE_CHECKING blocks and
    a package's own parents left out)."""
    edges: dict[str, set[str]] = {m: set() for m in mods}

    def target(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    for mod, path in mods.items():
        base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]

        class Visitor(ast.NodeVisitor):
            def visit_If(self, node):
                if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                    return
                self.generic_visit(node)

            def visit_Import(self, node):
                for a in node.names:
                    if a.name.startswith("indknn_cli."):
                        self.add(a.name.removeprefix("indknn_cli."))

            def visit_ImportFrom(self, node):
                if node.level:
                    prefix = base[:len(base) - (node.level - 1)] + ([node.module] if node.module else [])
                elif node.module and node.module.startswith("indknn_cli"):
                    prefix = node.module.split(".")[1:]
                else:
                    return
                for a in node.names:
                    self.add(".".join(prefix + [a.name]))

            def add(self, name):
                t = target(name)
                if t is not None and t != mod and not mod.startswith(t + "."):
                    edges[mod].add(t)

        Visitor().visit(ast.parse(path.read_text(encoding="utf-8")))
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    index, low, on, stack, out = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_beyond_the_known_ones():
    cycles = _cycles(_edges(_modules()))
    unknown = [sorted(c) for c in cycles if c not in KNOWN_CYCLES]
    assert not unknown, f"new import cycles (an import runs back up): {unknown}"


def test_the_library_never_imports_the_cli_layer():
    edges = _edges(_modules())
    upward = sorted(f"{m} -> {t}" for m, ts in edges.items() for t in ts
                    if not (m == "cli" or m.startswith("cli.") or m == "__main__") and (t == "cli" or t.startswith("cli.")))
    assert not upward, upward


def test_the_cycle_finder_finds_a_cycle():
    """The check can fail: two modules importing each other are one cycle."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [{"a", "b"}]
