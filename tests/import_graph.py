"""The import graph of the installed package, read from the source: for every module of the repo's
five folders (as installed: `harness/x.py` is `deepinfer.harness.x`), the modules of ours it imports
anywhere in its code, top level or inside functions, with the line of the first such import. Imports
under `if TYPE_CHECKING:` are left out: they never run. A module's own parent packages are left out
too: Python imports them before the module anyway."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLDERS = {"deepinfer": "deepinfer", "kernels": "deepinfer.kernels", "audit": "deepinfer.audit",
           "harness": "deepinfer.harness", "reports": "deepinfer.reports"}


def module_files() -> dict[str, Path]:
    modules = {}
    for folder, package in FOLDERS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            modules[".".join([package, *parts[:-1], *([] if parts[-1] == "__init__" else parts[-1:])])] = path
    return modules


def _run_time_nodes(node: ast.AST):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            continue
        yield child
        yield from _run_time_nodes(child)


def import_graph() -> dict[str, dict[str, int]]:
    modules = module_files()
    graph = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found: dict[str, int] = {}
        for node in _run_time_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names, named = [alias.name for alias in node.names], set()
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [base] * bool(base))
                submodules = [f"{base}.{alias.name}" for alias in node.names]
                names = [base, *submodules]
                # `from P import NAME` (NAME not a module) reads P itself, even where P is our own parent
                named = {base} if not all(name in modules for name in submodules) else set()
            else:
                continue
            for name in names:
                parts = name.split(".")
                for end in range(1, len(parts) + 1):
                    target = ".".join(parts[:end])
                    implicit = module.startswith(target + ".") and target not in named  # a parent, imported anyway
                    if target in modules and target != module and not implicit:
                        found.setdefault(target, node.lineno)
        graph[module] = found
    return graph
