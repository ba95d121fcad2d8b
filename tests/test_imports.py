"""The package's imports, read from the source (tests/import_graph.py): no module imports itself back
through others, and the layers import only downwards, as deepinfer/ARCHITECTURE.md §2 draws them:
`kernels <- deepinfer <- harness -> audit <- reports`."""

from __future__ import annotations

import pytest

from import_graph import REPO, import_graph

GRAPH = import_graph()
LAYERS = ("deepinfer.kernels", "deepinfer.audit", "deepinfer.harness", "deepinfer.reports")


def layer(module: str) -> str:
    """The folder a module comes from: one of LAYERS, or "deepinfer" for the engine."""
    return next((name for name in LAYERS if module == name or module.startswith(name + ".")), "deepinfer")


def test_no_module_imports_itself_through_others() -> None:
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = path[path.index(module):] + [module]
            pytest.fail("import cycle: " + " -> ".join(f"{a} (line {GRAPH[a][b]})" for a, b in zip(cycle, cycle[1:]))
                        + f" -> {module}")
        if module not in done:
            for imported in GRAPH[module]:
                visit(imported, [*path, module])
            done.add(module)

    assert len(GRAPH) > 100 and sum(map(len, GRAPH.values())) > 300  # the graph was read
    for module in GRAPH:
        visit(module, [])


# what each layer may import of ours besides itself; (module, imported) pairs allowed beyond that (with
# the packages holding `imported`)
ALLOWED = {"deepinfer.kernels": set(), "deepinfer": {"deepinfer.kernels"}, "deepinfer.audit": set(),
           "deepinfer.harness": {"deepinfer", "deepinfer.kernels", "deepinfer.audit"},
           "deepinfer.reports": {"deepinfer.audit"}}
EXCEPTIONS = {
    ("deepinfer.kernels.cpu_isa", "deepinfer.errors"),  # raises the engine's error type (lazily)
    ("deepinfer.harness.cli", "deepinfer.reports"),  # the command layer renders reports
    ("deepinfer.__main__", "deepinfer.harness.cli"),  # `python -m deepinfer` runs the console script
}


def test_the_layers_import_only_downwards() -> None:
    wrong = [f"{module} imports {imported} (line {line})" for module, imports in GRAPH.items()
             for imported, line in imports.items()
             if layer(imported) != layer(module) and layer(imported) not in ALLOWED[layer(module)]
             and not any(module == m and (imported == i or i.startswith(imported + ".")) for m, i in EXCEPTIONS)]
    assert wrong == []


def test_architecture_names_every_module_in_its_layout_section() -> None:
    """ARCHITECTURE.md §2 says what each module does: a module added without a line there fails here."""
    text = (REPO / "deepinfer" / "ARCHITECTURE.md").read_text()
    layout = text[text.index("## 2. Layout and layering"):text.index("## 3.")]
    modules = [path for folder in ("deepinfer", "kernels", "audit", "harness", "reports")
               for path in (REPO / folder).rglob("*.py") if path.name != "__init__.py"]
    assert modules
    unnamed = sorted(str(path.relative_to(REPO)) for path in modules if f"`{path.name}`" not in layout
                     and f"/{path.name}`" not in layout)
    assert not unnamed, f"modules ARCHITECTURE.md §2 does not name: {unnamed}"
