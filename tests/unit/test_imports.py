"""No import circles in ``vrgd_ds`` (the data pipeline included, as it installs): every import
counts, at module level or inside a function, except those under ``if TYPE_CHECKING:``. A
circle dodged with an import inside a function is still a circle: this test finds it."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"vrgd_ds": ROOT / "vrgd_ds", "vrgd_ds.data_pipeline": ROOT / "data_pipeline"}


def modules() -> dict[str, Path]:
    out = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``path`` (module ``name``) imports anywhere."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def visit(node: ast.AST) -> None:
        if _type_checking(node):
            return
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            if t.startswith("vrgd_ds"):
                r = resolve(t)
                if r is not None and r != name:
                    found.add(r)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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

    for v in graph:
        if v not in index:
            strong(v)
    return out


def test_no_import_circles():
    known = modules()
    graph = {name: imports(path, name, known) for name, path in known.items()}
    found = circles(graph)
    assert found == [], "\n".join(" <-> ".join(c) for c in found)


def test_the_walker_finds_a_circle_dodged_inside_a_function(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("import vrgd_ds.b\n")
    b.write_text("def f():\n    from vrgd_ds import a\n")
    c = tmp_path / "c.py"
    c.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import vrgd_ds.a\n")
    known = {"vrgd_ds.a": a, "vrgd_ds.b": b, "vrgd_ds.c": c}
    graph = {name: imports(path, name, known) for name, path in known.items()}
    assert circles(graph) == [["vrgd_ds.a", "vrgd_ds.b"]]
    assert graph["vrgd_ds.c"] == set()


ENGINES = ("vrgd_ds.ds", "vrgd_ds.megatron", "vrgd_ds.fsdp")


def test_no_engine_package_imports_another():
    """DeepSpeed, megatron-core and FSDP2 share what lies below them (``vrgd_ds/stats``: layouts,
    buckets, collectives); none imports another. Megatron's and FSDP2's imports of
    ``vrgd_ds/ds/layout.py`` failed this."""
    known = modules()
    crossing = []
    for name, path in known.items():
        own = next((e for e in ENGINES if name == e or name.startswith(e + ".")), None)
        if own is None:
            continue
        for target in imports(path, name, known):
            other = next((e for e in ENGINES if target == e or target.startswith(e + ".")), None)
            if other is not None and other != own:
                crossing.append(f"{name} -> {target}")
    assert not crossing, crossing
