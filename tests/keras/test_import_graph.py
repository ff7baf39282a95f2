"""Imports inside `kdist` flow one way: no module reaches back into one that imports it.

Every `import`/`from ... import` counts, at module level and inside
functions alike: a function-level import only hides a cycle until the
function runs. `kdist.keras` has no exception at all; the whole package has
the two written in `ALLOWED_EDGES` (docs/architecture.md).
"""

import ast
import pathlib

import kdist
import kdist.keras

PACKAGE = "kdist.keras"
ROOT = pathlib.Path(kdist.keras.__file__).parent
KDIST_ROOT = pathlib.Path(kdist.__file__).parent

# Edges into the root package: `import kdist` is the lazy loader, allowed anywhere
# (docs/architecture.md, Layers): the root imports the public names only inside
# `kdist._load()`, at run time, so no module's import reaches back through it.
ROOT_PACKAGE = "kdist"
# The one allowed back edge, and why. Every other edge of the graph must be acyclic.
ALLOWED_EDGES = {
    # `_top()` makes the default strategy on first use outside every scope, and
    # the default strategy is a `Strategy` whose extended and `ReplicaContext`
    # come from the modules that import `context`: the five-module circle
    # context -> default_strategy -> {strategy, extended -> replica_runner} ->
    # context. The import runs inside `_top()`, after both modules are loaded,
    # as TensorFlow keeps its default strategy beside its context stack.
    ("kdist.distribute.context", "kdist.distribute.default_strategy"):
        "the default strategy is built lazily by the context stack",
}


def module_names(root=ROOT, package=PACKAGE):
    """`{dotted name: path}` of every module under `root` (checked-in generated stubs excluded)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        if "_generated" in path.relative_to(root).parts:
            continue
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


def function_level_imports(path):
    """The import statements (`ast` nodes) inside the function bodies of the source at `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [node for node in ast.walk(function) if isinstance(node, (ast.Import, ast.ImportFrom))]
    return found


def without_allowed_edges(graph, allowed=ALLOWED_EDGES, root_package=ROOT_PACKAGE):
    """`graph` less the edges into `root_package` and the `allowed` edges."""
    return {
        name: {target for target in targets if target != root_package and (name, target) not in allowed}
        for name, targets in graph.items()
    }


def test_kdist_keras_has_no_import_cycle():
    cycle = find_cycle(import_graph(module_names()))
    assert cycle is None, "import cycle in kdist.keras: " + " -> ".join(cycle)


def test_kdist_has_no_import_cycle_but_the_allowed_edges():
    modules = module_names(KDIST_ROOT, ROOT_PACKAGE)
    # Every package of kdist is in the graph (distribute/, ps/, launch/, ...).
    packages = {path.parent for path in modules.values()}
    assert packages == {path.parent for path in KDIST_ROOT.rglob("__init__.py") if "_generated" not in path.parts}
    graph = import_graph(modules)
    cycle = find_cycle(without_allowed_edges(graph))
    assert cycle is None, "import cycle in kdist: " + " -> ".join(cycle)


def test_each_allowed_edge_is_still_there_and_only_at_run_time():
    # An allowance nobody needs any more goes; one taken at module level is a real cycle at import.
    graph = import_graph(module_names(KDIST_ROOT, ROOT_PACKAGE))
    for (source, target), reason in ALLOWED_EDGES.items():
        assert target in graph[source], f"{source} no longer imports {target}: remove the allowance ({reason})"
        path = module_names(KDIST_ROOT, ROOT_PACKAGE)[source]
        assert any(target in ast.unparse(node) for node in function_level_imports(path))
        module_level = [node for node in ast.parse(path.read_text()).body
                        if isinstance(node, (ast.Import, ast.ImportFrom))]
        assert not any(target in ast.unparse(node) for node in module_level), f"{source} imports {target} at import"


def test_the_allowance_does_not_hide_another_cycle():
    """A planted cycle through an allowed edge's modules is still found; the allowed edge alone is not."""
    graph = {
        "kdist.distribute.context": {"kdist.distribute.default_strategy"},
        "kdist.distribute.default_strategy": {"kdist.distribute.context", ROOT_PACKAGE},
        ROOT_PACKAGE: {"kdist.distribute.default_strategy"},
    }
    assert find_cycle(graph) is not None
    assert find_cycle(without_allowed_edges(graph)) is None
    graph["kdist.distribute.default_strategy"].add("kdist.distribute.strategy")
    graph["kdist.distribute.strategy"] = {"kdist.distribute.default_strategy"}
    assert find_cycle(without_allowed_edges(graph)) == [
        "kdist.distribute.default_strategy", "kdist.distribute.strategy", "kdist.distribute.default_strategy"]


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
