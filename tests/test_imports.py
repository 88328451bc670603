"""The import graph of eagle3kit, read from the source with `ast` (every import, also those
inside functions and under TYPE_CHECKING): no module sits in a circle, and no module reaches
for another module's private (underscore) names. A circle means neither side can be read,
tested or moved alone; a private name taken across modules is an interface nobody declared
(issue 38)."""

from __future__ import annotations

import ast
from pathlib import Path

import eagle3kit

SRC = Path(eagle3kit.__file__).parent

# Circles known today, each a set of modules. The list may only shrink: an entry that is no
# longer a circle fails the test, so it is deleted the moment the circle is cut.
KNOWN_CIRCLES: list[frozenset[str]] = []

# (importer, module, name) of private names taken across modules today. May only shrink, as
# KNOWN_CIRCLES. Empty: add nothing here; make the name public where it is defined instead.
KNOWN_PRIVATE: set[tuple[str, str, str]] = set()


def modules(src: Path = SRC) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's __init__)."""
    out = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_module(importer: str, module: str) -> bool:
    """`module` is private (a `_name` part) and `importer` is outside the package holding it."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if is_private(part) and not (importer + ".").startswith(".".join(parts[:i]) + "."):
            return True
    return False


def read_imports(src: Path = SRC) -> tuple[dict[str, set[str]], set[tuple[str, str, str]]]:
    """The import edges between eagle3kit modules, and every (importer, module, name) where
    `name` is private to `module`: `from module import _name`, `alias._name` on a module
    imported as `alias`, or a private module imported from outside its package."""
    mods = modules(src)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    private: set[tuple[str, str, str]] = set()
    for name, (path, package) in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        here = name if package else name.rpartition(".")[0]
        aliases: dict[str, str] = {}  # local name -> eagle3kit module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "eagle3kit" and a.name in mods:
                        edges[name].add(a.name)
                        aliases[a.asname or a.name] = a.name
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                if base.split(".")[0] != "eagle3kit":
                    continue
                for a in node.names:
                    full = f"{base}.{a.name}"
                    if full in mods:  # a submodule
                        edges[name].add(full)
                        aliases[a.asname or a.name] = full
                    else:
                        edges[name].add(base)
                        if is_private(a.name) and base != name:
                            private.add((name, base, a.name))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and is_private(node.attr)
                    and aliases[node.value.id] != name):
                private.add((name, aliases[node.value.id], node.attr))
        for target in edges[name]:
            if private_module(name, target):
                private.add((name, target, target.rpartition(".")[2]))
    return edges, private


def circles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), and
    a module that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges[v]:
                found.append(frozenset(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_circles():
    found = circles(read_imports()[0])
    new = [sorted(c) for c in found if c not in KNOWN_CIRCLES]
    assert not new, f"import circles: {new}; move what both sides need into a module both import"
    gone = [sorted(c) for c in KNOWN_CIRCLES if c not in found]
    assert not gone, f"no longer circles, delete them from KNOWN_CIRCLES: {gone}"


def test_no_module_imports_another_modules_private_names():
    private = read_imports()[1]
    new = sorted(private - KNOWN_PRIVATE)
    assert not new, f"private names used across modules (importer, module, name): {new}"
    gone = sorted(KNOWN_PRIVATE - private)
    assert not gone, f"no longer used, delete them from KNOWN_PRIVATE: {gone}"


def test_the_reader_sees_what_it_must(tmp_path):
    """The checks above would pass on a reader that sees nothing: a toy package with a
    circle through a function-level import and a private name taken three ways."""
    pkg = tmp_path / "eagle3kit"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "_hidden.py").write_text("X = 1\n")
    (pkg / "sub" / "ok.py").write_text("from eagle3kit.sub import _hidden\n")
    (pkg / "a.py").write_text("from eagle3kit import b\n")
    (pkg / "b.py").write_text("def f():\n    from eagle3kit.a import _x\n    return _x\n")
    (pkg / "c.py").write_text("from eagle3kit import a as m\nprint(m._y, m.__name__)\n")
    (pkg / "d.py").write_text("import eagle3kit.sub._hidden\n")
    edges, private = read_imports(pkg)
    assert circles(edges) == [frozenset({"eagle3kit.a", "eagle3kit.b"})]
    assert private == {("eagle3kit.b", "eagle3kit.a", "_x"), ("eagle3kit.c", "eagle3kit.a", "_y"),
                       ("eagle3kit.d", "eagle3kit.sub._hidden", "_hidden")}
