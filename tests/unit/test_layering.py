"""The package map of docs/architecture.md, checked: no import cycle between modules, and no
import against the layering (a lower layer importing a higher one). Imports inside functions
count; imports only for type checking (`if TYPE_CHECKING:`) do not."""

from __future__ import annotations

import ast
from pathlib import Path

import sluice

ROOT = Path(sluice.__file__).parent
# docs/architecture.md, "What may import what": a package may import its own modules and those
# of lower layers only.
LAYERS = {
    "errors": 0, "clock": 0, "units": 0, "logs": 0, "formula": 0, "collector": 0, "files": 0,
    "redis": 1, "slices": 1,
    "config": 2,
    "graph": 3,
    "flow": 4,
    "source": 5,
    "status": 6,
    "pipeline": 7, "query": 7, "web": 7,
    "server": 8, "offline": 8,
    "cli": 9, "commands": 9, "offline_cli": 9, "training_cli": 9, "demo": 9, "demo_offline": 9,
    "submit": 9, "testing": 9, "__init__": 9, "launch": 9,
}  # fmt: skip
COMMANDS = 9  # the top layer's packages (the commands) may import one another
MAX_AGAINST = 2  # issue 14's bound


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path) -> set[str]:
    """The `sluice.*` modules `path` imports, anywhere but under `if TYPE_CHECKING:`."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "sluice":
                found.update(f"sluice.{a.name}" for a in node.names)
            elif node.module.startswith("sluice."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("sluice."))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    out: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imp in imports_of(path):
            # `from sluice.x import y` may name a module y: count the deepest module it names.
            while imp not in modules and "." in imp:
                imp = imp.rsplit(".", 1)[0]
            if imp in modules and imp != name:
                targets.add(imp)
        out[name] = targets
    return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                strong(w)
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

    for v in sorted(g):
        if v not in index:
            strong(v)
    return out


def test_every_package_has_a_layer() -> None:
    packages = {package_of(m) for m in graph()}
    assert packages <= set(LAYERS), sorted(packages - set(LAYERS))


def test_no_module_imports_another_that_imports_it_back() -> None:
    assert cycles(graph()) == []


def test_imports_follow_the_layering() -> None:
    against = sorted(
        f"{src} -> {dst}"
        for src, targets in graph().items()
        for dst in targets
        if package_of(src) != package_of(dst)
        and LAYERS[package_of(dst)] >= LAYERS[package_of(src)]
        and not LAYERS[package_of(src)] == LAYERS[package_of(dst)] == COMMANDS
    )
    assert len(against) <= MAX_AGAINST, against


def test_no_module_is_over_500_lines() -> None:
    long = {
        module_name(p): n
        for p in ROOT.rglob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > 500
    }
    assert long == {}
