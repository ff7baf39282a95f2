"""The `kdist` command starts at once: `--help`, `--version`, `launch` and `server --help`
import no framework (torch, Keras, TensorFlow, JAX; nor gRPC).

Each check runs the command's code in a fresh interpreter and reads its `sys.modules`.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kdist

REPOSITORY = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "keras", "tensorflow", "jax", "grpc")

# Runs `kdist <argv>` through kdist.launch.cli.main in this interpreter, then
# prints the exit code and the heavy packages it imported.
PROBE = """
import sys
from kdist.launch import cli
code = cli.main({argv!r})
print("EXIT", code, sorted({{name.split(".")[0] for name in sys.modules}} & set({heavy!r})))
"""


def _run(code, *args, cwd=None):
    environment = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    environment["PYTHONPATH"] = os.pathsep.join([str(REPOSITORY), environment.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, *args, "-c", code] if code else [sys.executable, *args],
                          env=environment, capture_output=True, text=True, timeout=120, cwd=cwd)


def _probe(argv):
    result = _run(PROBE.format(argv=argv, heavy=HEAVY))
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("EXIT"), result.stderr
    return last


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["--version"], ["launch", "--help"], ["server", "--help"]],
    ids=["help", "version", "launch-help", "server-help"],
)
def test_help_and_version_import_no_framework(argv):
    assert _probe(argv) == "EXIT 0 []"


def test_launch_imports_no_framework_up_to_and_after_its_children(tmp_path):
    script = tmp_path / "child.py"
    marker = tmp_path / "started"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    assert _probe(["launch", "--nproc", "2", "--grace", "5", str(script)]) == "EXIT 0 []"
    assert marker.exists()


def test_a_missing_script_is_a_usage_error_without_importing_a_framework(tmp_path):
    assert _probe(["launch", "--nproc", "1", str(tmp_path / "no_such_script.py")]) == "EXIT 2 []"


def test_server_argument_errors_import_no_framework():
    # A job that is not served fails in the checks, before anything imports torch.
    code = _probe(["server", "--job", "chief", "--index", "0", "--cluster", "/no/such/cluster.json"])
    assert code.startswith("EXIT 2") and code.endswith("[]")


def test_version_prints_kdists_version():
    result = _run(None, "-m", "kdist", "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"kdist {kdist.__version__}"


def test_the_version_is_declared_in_one_place():
    # pyproject.toml reads it from kdist/__init__.py (setuptools' static `attr:`).
    pyproject = (REPOSITORY / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject
    assert 'version = { attr = "kdist.__version__" }' in pyproject
    assert "\nversion =" not in pyproject.split("[tool.setuptools.dynamic]")[0]
