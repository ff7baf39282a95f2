"""Regenerates the checked-in gRPC stubs of kdist's two services, and compares stubs.

`SERVICES` names them: the variable service (`kdist/ps/wire/protos/variable_service.proto`,
the parameter servers) and the worker service
(`kdist/coordinator/protos/worker_service.proto`, the workers a coordinator
drives).

Which generator: the stubs grpcio-tools writes refuse to import on a grpcio older than
the generator (`GRPC_GENERATED_VERSION`) and on a protobuf runtime older than the
protoc it bundles. So the checked-in stubs are generated with the oldest grpcio-tools
kdist supports, `GENERATOR_VERSION`, and `pyproject.toml`'s floors for grpcio and
protobuf are exactly what those stubs stamp. Regenerate them after editing a `.proto`,
in a throwaway environment with that generator (this file imports only the standard
library, so it runs as a plain script):

```
python -m venv /tmp/stubgen && /tmp/stubgen/bin/pip install grpcio-tools==1.74.0
/tmp/stubgen/bin/python kdist/rpc/regenerate.py              # rewrites every _generated/ folder
python -m kdist.rpc.regenerate --output-dir /tmp/stubs       # any generator: stubs to compare
```

Stubs from another generator version differ in their version stamps and in cosmetics
(`class Stub(object):` against `class Stub:`); `stub_contents` reads what a stub means
(the serialized file descriptor, the services' classes, methods and (de)serializers), which
is what the test of the checked-in stubs compares.

`grpcio-tools` writes `import variable_service_pb2` into the service stub,
which only works with the output folder on `sys.path`; the import is rewritten
to be package-relative so the stubs work from their `_generated` package.

The services are data here (paths, not imports): the transport layer does not
import the packages above it that define them.
"""

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

_KDIST = Path(__file__).resolve().parents[1]
PROTOC_TIMEOUT_SECONDS = 120
# The oldest grpcio-tools kdist supports, and the one the checked-in stubs come from. Its
# stubs need grpcio >= 1.74.0 and protobuf >= 6.31.1 (the protoc it bundles); both are
# pyproject.toml's floors. protobuf 7's runtime accepts 6.x gencode without a warning.
GENERATOR_VERSION = "1.74.0"


class Service(NamedTuple):
    """A `.proto` and the checked-in folder its stubs live in."""

    proto: Path
    generated_directory: Path


class StampedVersions(NamedTuple):
    """The oldest runtimes a pair of stubs accepts: `grpcio` and `protobuf`, as tuples of ints."""

    grpcio: tuple
    protobuf: tuple


SERVICES = (
    Service(_KDIST / "ps" / "wire" / "protos" / "variable_service.proto", _KDIST / "ps" / "wire" / "_generated"),
    Service(_KDIST / "coordinator" / "protos" / "worker_service.proto", _KDIST / "coordinator" / "_generated"),
)


def stub_names(service):
    """The file names of `service`'s two stubs: (messages, service)."""
    stem = service.proto.stem
    return f"{stem}_pb2.py", f"{stem}_pb2_grpc.py"


def regenerate(service, output_directory=None):
    """Generates `service`'s stubs with the installed `grpcio-tools`.

    Args:
        service: a `Service` (one of `SERVICES`).
        output_directory: the folder that receives the two stub files
            (created if missing). None: the service's checked-in folder.

    Returns:
        The paths of the generated files: (messages, service).

    Raises:
        RuntimeError: `protoc` failed (the error holds its message).

    Example:

    >>> regenerate(SERVICES[0], "/tmp/stubs")  # doctest: +SKIP
    """
    # Imported here: grpcio-tools is needed only to regenerate, not to run.
    import grpc_tools

    output_directory = Path(service.generated_directory if output_directory is None else output_directory)
    output_directory.mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).resolve().parent / "_proto"
    # protoc runs in a child process: its bundled libprotobuf crashes (SIGSEGV)
    # in a process that has also loaded jaxlib's, which Keras imports when JAX
    # is installed.
    completed = subprocess.run([
        sys.executable, "-m", "grpc_tools.protoc",
        f"-I{service.proto.parent}",
        f"-I{include}",
        f"--python_out={output_directory}",
        f"--grpc_python_out={output_directory}",
        str(service.proto),
    ], capture_output=True, text=True, timeout=PROTOC_TIMEOUT_SECONDS)
    if completed.returncode != 0:
        raise RuntimeError(f"protoc failed with status {completed.returncode} on {service.proto}:\n"
                           f"{completed.stderr}")
    stem = service.proto.stem
    names = stub_names(service)
    service_stub = output_directory / names[1]
    text = service_stub.read_text(encoding="utf-8")
    absolute_import = re.compile(rf"^import {stem}_pb2 as ", re.MULTILINE)
    service_stub.write_text(absolute_import.sub(f"from . import {stem}_pb2 as ", text), encoding="utf-8")
    return [output_directory / name for name in names]


def stub_contents(path):
    """What a generated stub means, without its version stamps and generator cosmetics.

    A messages stub (`*_pb2.py`) means its serialized file descriptor (every message,
    field, enum and service of the `.proto`). A service stub (`*_pb2_grpc.py`) means its
    imports, its classes and their methods, and every call that binds an RPC (the method
    path, its kind, its (de)serializers).

    Args:
        path: a stub file.

    Returns:
        A comparable value: equal for stubs of the same `.proto` from any generator.
    """
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    if Path(path).name.endswith("_pb2_grpc.py"):
        return _service_stub_contents(tree)
    descriptors = [node.args[0].value for node in ast.walk(tree)
                   if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                   and node.func.attr == "AddSerializedFile"]
    return tuple(descriptors)


def _service_stub_contents(tree):
    imports = sorted(ast.unparse(node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom)))
    classes = tuple((node.name, tuple(item.name for item in node.body if isinstance(item, ast.FunctionDef)))
                    for node in tree.body if isinstance(node, ast.ClassDef))
    binding_keywords = {"request_serializer", "response_deserializer", "request_deserializer", "response_serializer"}
    bindings = tuple(ast.unparse(node) for node in ast.walk(tree)
                     if isinstance(node, ast.Call) and binding_keywords & {k.arg for k in node.keywords})
    return tuple(imports), classes, bindings


def stamped_versions(service, directory=None):
    """The oldest grpcio and protobuf that `service`'s stubs in `directory` import on.

    Args:
        service: a `Service`.
        directory: where the stubs are. None: the checked-in folder.

    Returns:
        A `StampedVersions`.

    Raises:
        ValueError: a stub carries no version stamp (a generator older than grpcio-tools 1.63).
    """
    directory = Path(service.generated_directory if directory is None else directory)
    messages_name, service_name = stub_names(service)
    service_text = (directory / service_name).read_text(encoding="utf-8")
    grpcio = re.search(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'", service_text, re.MULTILINE)
    messages_text = (directory / messages_name).read_text(encoding="utf-8")
    protobuf = re.search(r"^# Protobuf Python Version: ([0-9.]+)$", messages_text, re.MULTILINE)
    if grpcio is None or protobuf is None:
        raise ValueError(f"The stubs in {directory} carry no version stamp. Received: a generator without one; "
                         f"expected: stubs from grpcio-tools=={GENERATOR_VERSION}.")
    return StampedVersions(parse_version(grpcio.group(1)), parse_version(protobuf.group(1)))


def parse_version(text):
    """'1.74.0' -> (1, 74, 0): the leading numeric release of a version string."""
    return tuple(int(part) for part in re.match(r"[0-9]+(?:\.[0-9]+)*", text).group(0).split("."))


def _installed_generator_version():
    from importlib.metadata import version

    return version("grpcio-tools")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python kdist/rpc/regenerate.py", description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default=None,
                        help="where to write every service's stubs (default: each one's checked-in _generated/)")
    arguments = parser.parse_args(argv)
    installed = _installed_generator_version()
    if arguments.output_dir is None and parse_version(installed) != parse_version(GENERATOR_VERSION):
        # Stubs from a newer generator would refuse to import on the grpcio and protobuf
        # floors kdist declares; an older one is below them.
        print(f"regenerate: the checked-in stubs are generated with grpcio-tools=={GENERATOR_VERSION} "
              f"(their stamps are kdist's grpcio and protobuf floors). Received: grpcio-tools=={installed}. "
              f"Run this file with that generator (see its docstring), or pass --output-dir.", file=sys.stderr)
        return 2
    for service in SERVICES:
        for path in regenerate(service, arguments.output_dir):
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
