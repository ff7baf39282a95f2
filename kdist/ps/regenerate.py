"""Regenerates the checked-in gRPC stubs of kdist's two services.

`kdist/ps/protos/variable_service.proto` (the parameter servers) and
`kdist/coordinator/protos/worker_service.proto` (the workers a coordinator
drives). Run it after editing a `.proto`:

```
python -m kdist.ps.regenerate              # rewrites both _generated/ folders
python -m kdist.ps.regenerate --output-dir /tmp/stubs   # the variable service, e.g. to compare
```

`grpcio-tools` writes `import variable_service_pb2` into the service stub,
which only works with the output folder on `sys.path`; the import is rewritten
to be package-relative so the stubs work from their `_generated` package.
"""

import argparse
import re
import subprocess
import sys
from pathlib import Path

PROTO_DIRECTORY = Path(__file__).resolve().parent / "protos"
PROTO_NAME = "variable_service.proto"
GENERATED_DIRECTORY = Path(__file__).resolve().parent / "_generated"
_COORDINATOR = Path(__file__).resolve().parents[1] / "coordinator"
WORKER_PROTO_DIRECTORY = _COORDINATOR / "protos"
WORKER_GENERATED_DIRECTORY = _COORDINATOR / "_generated"
PROTOC_TIMEOUT_SECONDS = 120


def regenerate(output_directory=GENERATED_DIRECTORY, proto_directory=PROTO_DIRECTORY, proto_name=PROTO_NAME):
    """Generates the stubs into `output_directory` with `grpcio-tools`.

    Args:
        output_directory: the folder that receives the two stub files
            (created if missing). Defaults to the checked-in `_generated/`.
        proto_directory, proto_name: the `.proto` to compile (the variable
            service by default).

    Returns:
        The paths of the generated files.

    Raises:
        RuntimeError: `protoc` failed (the error holds its message).

    Example:

    >>> regenerate("/tmp/stubs")  # doctest: +SKIP
    """
    # Imported here: grpcio-tools is needed only to regenerate, not to run.
    import grpc_tools

    output_directory = Path(output_directory)
    output_directory.mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).resolve().parent / "_proto"
    # protoc runs in a child process: its bundled libprotobuf crashes (SIGSEGV)
    # in a process that has also loaded jaxlib's, which Keras imports when JAX
    # is installed.
    completed = subprocess.run([
        sys.executable, "-m", "grpc_tools.protoc",
        f"-I{proto_directory}",
        f"-I{include}",
        f"--python_out={output_directory}",
        f"--grpc_python_out={output_directory}",
        str(Path(proto_directory) / proto_name),
    ], capture_output=True, text=True, timeout=PROTOC_TIMEOUT_SECONDS)
    if completed.returncode != 0:
        raise RuntimeError(
            f"protoc failed with status {completed.returncode} on {Path(proto_directory) / proto_name}:\n"
            f"{completed.stderr}")
    stem = Path(proto_name).stem
    names = (f"{stem}_pb2.py", f"{stem}_pb2_grpc.py")
    service_stub = output_directory / names[1]
    text = service_stub.read_text(encoding="utf-8")
    absolute_import = re.compile(rf"^import {stem}_pb2 as ", re.MULTILINE)
    service_stub.write_text(absolute_import.sub(f"from . import {stem}_pb2 as ", text), encoding="utf-8")
    return [output_directory / name for name in names]


def regenerate_worker_service(output_directory=WORKER_GENERATED_DIRECTORY):
    """Generates the worker service's stubs (see `regenerate`)."""
    return regenerate(output_directory, WORKER_PROTO_DIRECTORY, "worker_service.proto")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m kdist.ps.regenerate", description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default=str(GENERATED_DIRECTORY),
                        help="where to write the stubs (default: the checked-in kdist/ps/_generated/)")
    arguments = parser.parse_args(argv)
    paths = regenerate(arguments.output_dir)
    if arguments.output_dir == str(GENERATED_DIRECTORY):
        paths += regenerate_worker_service()
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
