"""Regenerates the checked-in gRPC stubs of kdist's two services.

`SERVICES` names them: the variable service (`kdist/ps/wire/protos/variable_service.proto`,
the parameter servers) and the worker service
(`kdist/coordinator/protos/worker_service.proto`, the workers a coordinator
drives). Run it after editing a `.proto`:

```
python -m kdist.rpc.regenerate                          # rewrites every _generated/ folder
python -m kdist.rpc.regenerate --output-dir /tmp/stubs  # every service's stubs, e.g. to compare
```

`grpcio-tools` writes `import variable_service_pb2` into the service stub,
which only works with the output folder on `sys.path`; the import is rewritten
to be package-relative so the stubs work from their `_generated` package.

The services are data here (paths, not imports): the transport layer does not
import the packages above it that define them.
"""

import argparse
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

_KDIST = Path(__file__).resolve().parents[1]
PROTOC_TIMEOUT_SECONDS = 120


class Service(NamedTuple):
    """A `.proto` and the checked-in folder its stubs live in."""

    proto: Path
    generated_directory: Path


SERVICES = (
    Service(_KDIST / "ps" / "wire" / "protos" / "variable_service.proto", _KDIST / "ps" / "wire" / "_generated"),
    Service(_KDIST / "coordinator" / "protos" / "worker_service.proto", _KDIST / "coordinator" / "_generated"),
)


def regenerate(service, output_directory=None):
    """Generates `service`'s stubs with `grpcio-tools`.

    Args:
        service: a `Service` (one of `SERVICES`).
        output_directory: the folder that receives the two stub files
            (created if missing). None: the service's checked-in folder.

    Returns:
        The paths of the generated files.

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
    names = (f"{stem}_pb2.py", f"{stem}_pb2_grpc.py")
    service_stub = output_directory / names[1]
    text = service_stub.read_text(encoding="utf-8")
    absolute_import = re.compile(rf"^import {stem}_pb2 as ", re.MULTILINE)
    service_stub.write_text(absolute_import.sub(f"from . import {stem}_pb2 as ", text), encoding="utf-8")
    return [output_directory / name for name in names]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m kdist.rpc.regenerate", description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default=None,
                        help="where to write every service's stubs (default: each one's checked-in _generated/)")
    arguments = parser.parse_args(argv)
    for service in SERVICES:
        for path in regenerate(service, arguments.output_dir):
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
