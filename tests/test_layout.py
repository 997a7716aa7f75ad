"""The package's shape: imports flow one way through the layers docs/internals.md draws, no
module imports itself back through others, every package's docstring names each of its modules,
and no module outgrows 600 lines unless docs/internals.md says why. Read from the source (every
import statement, function-level ones included), nothing imported."""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "drafter"
# Bottom to top: a package imports only from itself and the packages before it.
LAYERS = ["core", "data", "features", "serve", "decoding", "generation", "train", "export",
          "measure", "steps", "learn", "run", "cli"]
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The drafter modules `path` imports (`from drafter.x import y` counts drafter.x.y when
    that is a module, else drafter.x)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("drafter")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("drafter"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if MODULES.get(sub) else node.module)
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}:{node.lineno}: a relative import (drafter uses "
                                 "absolute ones)")
    return out


MODULES = {module_name(p): p for p in PKG.rglob("*.py")}


def graph() -> dict[str, set[str]]:
    return {m: {i for i in imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # drafter/__init__: below every layer


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
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
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert cycles(graph()) == []


def test_cycle_finder_finds_a_planted_circle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]


def test_imports_flow_down_the_layers():
    bad = []
    for m, deps in graph().items():
        lm = layer(m)
        for d in deps:
            ld = layer(d)
            if lm is None:
                bad.append(f"{m} -> {d}: drafter/__init__ imports nothing of drafter")
            elif ld is not None and LAYERS.index(ld) > LAYERS.index(lm):
                bad.append(f"{m} -> {d}: {lm} sits below {ld}")
            elif lm == ld == "steps" and m != "drafter.steps" and d != "drafter.steps":
                bad.append(f"{m} -> {d}: no step imports another step")
    assert bad == []


def test_every_package_is_a_layer_with_a_docstring():
    pkgs = {p.parent.name for p in PKG.glob("*/__init__.py")}
    assert pkgs == set(LAYERS) - {"cli"}
    for name in pkgs:
        doc = ast.get_docstring(ast.parse((PKG / name / "__init__.py").read_text()))
        assert doc and len(doc) > 40, f"drafter/{name}/__init__.py: a docstring naming its job"


def named_in(doc: str) -> set[str]:
    """The words a package docstring names its modules by: those inside parentheses, the
    convention "the run-dir paths (rundir)", "(plan, counts)"."""
    return {w for group in re.findall(r"\(([^()]*)\)", doc) for w in re.findall(r"\w+", group)}


def test_every_module_is_named_in_its_package_docstring():
    """A reader finds every file of a package from its docstring: each module's name stands in
    parentheses after what it does."""
    missing = []
    for init in sorted(PKG.glob("*/__init__.py")):
        names = named_in(ast.get_docstring(ast.parse(init.read_text())) or "")
        missing += [str(p.relative_to(REPO)) for p in sorted(init.parent.glob("*.py"))
                    if p.name != "__init__.py" and p.stem not in names]
    assert missing == []


def test_named_in_reads_the_parentheses():
    doc = "Paths (rundir), the plan before weights load (plan, counts); the store, no module."
    assert {"rundir", "plan", "counts"} <= named_in(doc) and "store" not in named_in(doc)


def test_modules_stay_under_600_lines_or_internals_says_why():
    text = (REPO / "docs" / "internals.md").read_text()
    assert "## Modules over 600 lines" in text
    section = text.split("## Modules over 600 lines")[1].split("\n## ")[0]
    excused = set(re.findall(r"`(drafter/[\w/]+\.py)`", section))
    long = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in MODULES.values()}
    over = sorted(f"{k} ({n} lines)" for k, n in long.items() if n > MAX_LINES and k not in excused)
    assert over == []
