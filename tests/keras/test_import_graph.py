"""Imports inside `kdist.keras` flow one way: no module reaches back into one that imports it.

Every `import`/`from ... import` counts, at module level and inside
functions alike: a function-level import only hides a cycle until the
function runs.
"""

import ast
import pathlib

import kdist.keras

PACKAGE = "kdist.keras"
ROOT = pathlib.Path(kdist.keras.__file__).parent


def module_names(root=ROOT, package=PACKAGE):
    """`{dotted name: path}` of every module under `root`."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join((package, *parts))] = path
    return names


def imported_modules(name, path, modules):
    """The modules of `modules` that the source at `path` (module `name`) imports anywhere."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from package import module` names a module; `from module import name` the module.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            # `import a.b.c` imports a.b.c; the enclosing packages' own code is not an edge here.
            if target in modules and target != name:
                found.add(target)
    return found


def import_graph(modules):
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def find_cycle(graph):
    """One cycle as a list of modules (first repeated last), or None. Visits in sorted order."""
    state = {}  # name -> "active" while on the path, "done" after

    def visit(name, path):
        state[name] = "active"
        path.append(name)
        for target in sorted(graph.get(name, ())):
            if state.get(target) == "active":
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target, path)
                if cycle:
                    return cycle
        path.pop()
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state:
            cycle = visit(name, [])
            if cycle:
                return cycle
    return None


def test_kdist_keras_has_no_import_cycle():
    cycle = find_cycle(import_graph(module_names()))
    assert cycle is None, "import cycle in kdist.keras: " + " -> ".join(cycle)


def test_function_level_imports_count(tmp_path):
    """A planted cycle hidden in a function body is found (the checker is not blind to it)."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def late():\n    from pkg.a import thing\n    return thing\n")
    (package / "c.py").write_text("from . import a\n")
    graph = import_graph(module_names(package, "pkg"))
    assert graph["pkg.c"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
