"""The package's shape (docs/architecture.md): public surface, layers, module sizes.

These read the source with `ast`; none imports a framework except the public
surface checks, which run `python -m kdist` and the documented imports in
new processes (the imports warm: forked from a process that has imported NumPy,
torch and Keras, but not kdist).
"""

import ast
import pathlib
import subprocess
import sys

import pytest

import kdist
from tests import harness

ROOT = pathlib.Path(kdist.__file__).parent

# What `kdist.__all__` held when the layout was regrouped (issue 17). A name
# added later goes here too; a name removed is an API break.
PUBLIC_NAMES = [
    "CommunicationOptions", "Compression", "CrossDeviceOps", "DistributedValues", "InputContext", "Mirrored",
    "MirroredStrategy", "MultiWorkerMirroredStrategy", "ParameterServerStrategy", "PerReplica", "ReduceOp",
    "ReductionToOneDevice", "ReplicaContext", "SidecarEvaluator", "Strategy", "StrategyExtended", "ValueContext",
    "VariableAggregation", "callbacks", "cluster", "coordinator", "distribute", "errors", "get_cross_replica_context",
    "get_replica_context", "get_strategy", "has_strategy", "in_cross_replica_context", "nn", "partitioners", "ps",
    "visible_gpus",
]

# Imports the docs show users (docs/*.md, README.md, examples/).
DOCUMENTED_IMPORTS = [
    "from kdist.distribute import ShardedVariable, RemoteVariable, Server, partitioners",
    "from kdist.distribute.parameter_server import partitioners",
    "from kdist.cluster import TFConfigClusterResolver, SimpleClusterResolver, ClusterSpec",
    "from kdist.cluster import SlurmClusterResolver, KubeflowTrainerClusterResolver, expand_hostlist",
    "from kdist.callbacks import TensorBoard",
    "from kdist.distribute import per_rank, PerRankInput",
    "from kdist.coordinator import ClusterCoordinator, PerWorkerDataset, RemoteValue",
    "from kdist.ps import Security, ServiceOptions",
    "from kdist.keras.sync_batchnorm import convert, is_synchronized",
    "from kdist.keras.replica import loss_denominators",
    "from kdist.launch.ports import free_port",
    "from kdist.nn import compute_average_loss, scale_regularization_loss",
    "import kdist.rpc.regenerate",
    "from kdist.errors import InvalidArgumentError, UnsupportedError",
]

# Layers (docs/architecture.md): a module imports only from its own package
# or from a strictly lower layer.
# `import kdist` itself is allowed anywhere: it is the lazy loader, and the
# strategy and server CLI call `kdist._load()` at run time so that the Keras
# hooks are installed however a program reached them.
LAYERS = {
    "kdist.errors": 0,
    "kdist.types": 1, "kdist.faults": 1, "kdist.validation": 1, "kdist.atomic_files": 1, "kdist._backend": 1,
    "kdist.cluster": 2, "kdist.collectives": 2,
    "kdist.rpc": 3,
    "kdist.ps": 4,
    "kdist.coordinator": 5,
    "kdist.distribute": 6,
    "kdist.nn": 7,
    "kdist.keras": 8,
    "kdist.backends": 9, "kdist.launch": 9, "kdist.callbacks": 9,
    "kdist.__main__": 10, "kdist": 10,
}
MAX_LINES = 400


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        if "_generated" in path.parts:
            continue
        parts = ("kdist",) + path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path


def _package(name):
    """The layered unit a module belongs to: `kdist.<first part>`, or `kdist` itself."""
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else name


def _imported(tree):
    """(line, module) for every kdist module a tree imports, at any depth (function-level too)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names if alias.name.startswith("kdist"))
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("kdist"):
            if node.module == "kdist":
                yield from ((node.lineno, f"kdist.{alias.name}") for alias in node.names)
            else:
                yield node.lineno, node.module


def test_public_names_are_unchanged():
    assert sorted(kdist.__all__) == sorted(PUBLIC_NAMES)


@pytest.mark.parametrize("statement", DOCUMENTED_IMPORTS)
def test_documented_imports_work(statement):
    # Forked warm (tests/harness.py): NumPy, torch and Keras are imported already,
    # kdist is not, so each statement still imports kdist's modules in a new process.
    spec = harness.ProcessSpec("python", [sys.executable, "-c", f"import kdist; {statement}"])
    result = harness.run([spec], timeout=120)
    assert result.returncodes == {"python": 0}, result.output("python")


def test_python_m_kdist_runs():
    result = subprocess.run([sys.executable, "-m", "kdist", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "launch" in result.stdout and "server" in result.stdout


def test_every_package_has_a_layer():
    assert {_package(name) for name, _ in _modules()} <= set(LAYERS)


def upward_imports(sources):
    """Every import of `sources` (`(module name, where, source text)`) that breaks the layers, as text."""
    upward = []
    for name, where, text in sources:
        own = _package(name)
        for line, target in _imported(ast.parse(text)):
            other = _package(target)
            if target != "kdist" and other != own and other in LAYERS and LAYERS[other] >= LAYERS[own]:
                upward.append(f"{where}:{line} imports {target} (layer {LAYERS[other]} from layer {LAYERS[own]})")
    return upward


def _sources():
    return [(name, path.relative_to(ROOT.parent), path.read_text()) for name, path in _modules()]


def test_imports_flow_downward():
    upward = upward_imports(_sources())
    assert not upward, "\n".join(upward)


def test_layer_check_catches_an_upward_import():
    # Negative control: the real package's sources, plus one module of `kdist.ps` (layer 4)
    # that imports `kdist.keras` (layer 8) inside a function, one of `kdist.cluster`
    # (layer 2) that imports its peer layer `kdist.collectives` at module level, and one
    # of the transport `kdist.rpc` (layer 3) that imports the service above it.
    planted = [
        ("kdist.ps.planted", "kdist/ps/planted.py", "import os\n\ndef f():\n    from kdist.keras import hooks\n"),
        ("kdist.cluster.planted", "kdist/cluster/planted.py", "from kdist.collectives import local\n"),
        ("kdist.rpc.planted", "kdist/rpc/planted.py", "from kdist.ps.options import ServiceOptions\n"),
    ]
    assert upward_imports(_sources() + planted) == [
        "kdist/ps/planted.py:4 imports kdist.keras (layer 8 from layer 4)",
        "kdist/cluster/planted.py:1 imports kdist.collectives (layer 2 from layer 2)",
        "kdist/rpc/planted.py:1 imports kdist.ps.options (layer 4 from layer 3)",
    ]
    # Allowed: the lazy loader anywhere, a lower layer, the module's own package.
    allowed = "import kdist\nfrom kdist.errors import KdistError\nfrom kdist.ps import store\n"
    assert upward_imports([("kdist.ps.planted", "kdist/ps/planted.py", allowed)]) == []


# Inside `kdist.ps`, each side imports the wire and the shared configuration (`options`,
# `autosave`), never the other side; the shared modules import neither side.
_PS_SHARED = {"kdist.ps.wire", "kdist.ps.options", "kdist.ps.autosave"}
PS_SIDES = {"kdist.ps.wire": _PS_SHARED,
            "kdist.ps.options": _PS_SHARED,
            "kdist.ps.autosave": _PS_SHARED,
            "kdist.ps.client": _PS_SHARED | {"kdist.ps.client"},
            "kdist.ps.server": _PS_SHARED | {"kdist.ps.server"}}


def crossed_sides(sources):
    """Imports of one side of `kdist.ps` (wire, client, server) into a side it must not read, as text."""
    crossed = []
    for name, where, text in sources:
        side = ".".join(name.split(".")[:3])
        allowed = PS_SIDES.get(side)
        if allowed is None:
            continue
        for line, target in _imported(ast.parse(text)):
            target_side = ".".join(target.split(".")[:3])
            if target.startswith("kdist.ps") and target_side not in allowed:
                crossed.append(f"{where}:{line} imports {target} ({side} must not read {target_side})")
    return crossed


def test_ps_sides_share_only_the_wire():
    assert crossed_sides(_sources()) == []
    planted = [
        ("kdist.ps.client.planted", "kdist/ps/client/planted.py", "from kdist.ps.server import store\n"),
        ("kdist.ps.wire.planted", "kdist/ps/wire/planted.py", "from kdist.ps.client import retry\n"),
        ("kdist.ps.options", "kdist/ps/options.py", "def f():\n    from kdist.ps.server import store\n"),
    ]
    assert crossed_sides(planted) == [
        "kdist/ps/client/planted.py:1 imports kdist.ps.server (kdist.ps.client must not read kdist.ps.server)",
        "kdist/ps/wire/planted.py:1 imports kdist.ps.client (kdist.ps.wire must not read kdist.ps.client)",
        "kdist/ps/options.py:2 imports kdist.ps.server (kdist.ps.options must not read kdist.ps.server)",
    ]


def test_no_module_is_over_the_size_limit():
    long = {str(path.relative_to(ROOT.parent)): n for _, path in _modules()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
