"""The import rules of docs/architecture.md, checked on every module's import statements
(lazy imports inside functions included: they are dependencies all the same)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "longctx_cli"

# Top-level modules every layer may use: they import nothing of longctx_cli but each other.
LEAVES = {"constants", "durable", "errors", "families", "kernel_choice", "layout"}
LAYERS = {"config", "data", "parallel", "runtime", "launcher", "checks", "train", "eval", "cli"}
# What each part may import from longctx_cli (besides itself).
ALLOWED = {
    "__init__": set(),
    "__main__": {"cli"},
    "rank": {"train", "eval", "runtime", "launcher"} | LEAVES,  # what the launcher's ranks run
    "cli": LAYERS | LEAVES | {"hub", "integrity", "preflight"},
    "train": {"checks", "runtime", "launcher", "parallel", "data", "config", "integrity",
              "preflight", "user_code"} | LEAVES,
    "eval": {"runtime", "launcher", "parallel", "data", "config", "integrity",
             "preflight"} | LEAVES,
    "checks": {"runtime", "parallel", "config"} | LEAVES,  # the fidelity probe
    "runtime": {"parallel", "data", "config"} | LEAVES,
    "launcher": LEAVES,  # torchrun's launch and supervision: no model, no config
    "parallel": {"constants", "errors", "kernel_choice", "layout"},
    "data": {"config", "hub", "user_code"} | LEAVES,
    "config": {"constants", "errors", "families", "hub", "kernel_choice", "layout"},
    "hub": {"errors"},
    "preflight": {"config", "data", "errors", "user_code"},
    "user_code": {"errors"},  # the user's reward functions and dataset transforms
    "integrity": LEAVES,
    **{leaf: LEAVES for leaf in LEAVES},
}
NO_DISTRIBUTED = {"config", "data"}  # the launcher imports them before any process group


def _part(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> set[str]:
    """Absolute names of every module `path` imports (relative imports resolved)."""
    # A package's __init__ counts as one level down, so `from . import x` is its package.
    module = ["longctx_cli", *path.relative_to(PACKAGE).with_suffix("").parts]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module[: len(module) - node.level]
                found.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                found.add(node.module)
    return found


def test_import_rules():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        part = _part(path)
        assert part in ALLOWED, f"{path}: a new part of the package; add it to the rules"
        for name in _imports(path):
            if name.startswith("longctx_cli."):
                target = name.split(".")[1]
                if target != part and target not in ALLOWED[part]:
                    wrong.append(f"{path.relative_to(PACKAGE)} imports {name}")
            if part in NO_DISTRIBUTED and name.startswith("torch.distributed"):
                wrong.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_eval_never_imports_train():
    for path in (PACKAGE / "eval").rglob("*.py"):
        assert not any(n.startswith("longctx_cli.train") for n in _imports(path)), path


def _module_name(path: Path) -> str:
    parts = ["longctx_cli", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_circles():
    """No module reaches itself through imports (lazy ones included): a circle means two
    modules share something that belongs in a third."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(path):
            # `from package import module` names the module; else the module itself.
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                targets.add(imported)
        graph[name] = targets
    circles = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert not circles, "\n".join(circles)


DOC = PACKAGE.parent / "docs" / "architecture.md"


def _doc_rows(table_heading: str) -> list[list[str]]:
    """The rows (cells) of the first markdown table after `table_heading` in DOC."""
    text = DOC.read_text()
    rows = []
    for line in text[text.index(table_heading):].splitlines():
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows:
            break
    return rows[2:]  # past the header and its rule


def test_the_doc_import_table_is_the_rules():
    """docs/architecture.md's import table says what test_import_rules enforces."""
    import re

    found = {}
    for part, allowed in _doc_rows("| part | may import"):
        name = re.match(r"`(\w+)`", part)[1]
        found[name] = set(re.findall(r"`(\w+)`", allowed)) | (
            LEAVES if "the leaves" in allowed else set())
    rules = {part: set(allowed) - {part} for part, allowed in ALLOWED.items()
             if part not in LEAVES and part != "__init__"}
    assert found == rules


def test_the_doc_names_every_module():
    """Every module of longctx_cli has its line in docs/architecture.md, and every line
    names a module that exists."""
    import re

    text = DOC.read_text()
    section = text[text.index("## The modules"):]
    section = section[: section.index("\n## ", 1)]
    named = set(re.findall(r"^\| `([\w/]+\.py)` \|", section, flags=re.M))
    modules = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
    assert named <= modules, sorted(named - modules)
    missing = {m for m in modules - named if not m.endswith("__init__.py")}
    assert not missing, sorted(missing)
