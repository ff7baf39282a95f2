"""Regenerates the checked-in gRPC stubs from `protos/variable_service.proto`.

Run it after editing the `.proto`:

```
python -m kdist.ps.regenerate              # rewrites kdist/ps/_generated/
python -m kdist.ps.regenerate --output-dir /tmp/stubs   # e.g. to compare
```

`grpcio-tools` writes `import variable_service_pb2` into the service stub,
which only works with the output folder on `sys.path`; the import is rewritten
to be package-relative so the stubs work from `kdist.ps._generated`.
"""

import argparse
import re
import sys
from pathlib import Path

PROTO_DIRECTORY = Path(__file__).resolve().parent / "protos"
PROTO_NAME = "variable_service.proto"
GENERATED_DIRECTORY = Path(__file__).resolve().parent / "_generated"
GENERATED_FILES = ("variable_service_pb2.py", "variable_service_pb2_grpc.py")
_ABSOLUTE_IMPORT = re.compile(r"^import variable_service_pb2 as ", re.MULTILINE)


def regenerate(output_directory=GENERATED_DIRECTORY):
    """Generates the stubs into `output_directory` with `grpcio-tools`.

    Args:
        output_directory: the folder that receives `GENERATED_FILES`
            (created if missing). Defaults to the checked-in `_generated/`.

    Returns:
        The paths of the generated files.

    Raises:
        RuntimeError: `protoc` failed (its message is on stderr).

    Example:

    >>> regenerate("/tmp/stubs")  # doctest: +SKIP
    """
    # Imported here: grpcio-tools is needed only to regenerate, not to run.
    import grpc_tools
    from grpc_tools import protoc

    output_directory = Path(output_directory)
    output_directory.mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).resolve().parent / "_proto"
    status = protoc.main([
        "grpc_tools.protoc",
        f"-I{PROTO_DIRECTORY}",
        f"-I{include}",
        f"--python_out={output_directory}",
        f"--grpc_python_out={output_directory}",
        str(PROTO_DIRECTORY / PROTO_NAME),
    ])
    if status != 0:
        raise RuntimeError(f"protoc failed with status {status} on {PROTO_DIRECTORY / PROTO_NAME}")
    service_stub = output_directory / GENERATED_FILES[1]
    text = service_stub.read_text(encoding="utf-8")
    service_stub.write_text(
        _ABSOLUTE_IMPORT.sub("from . import variable_service_pb2 as ", text), encoding="utf-8"
    )
    return [output_directory / name for name in GENERATED_FILES]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m kdist.ps.regenerate", description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default=str(GENERATED_DIRECTORY),
                        help="where to write the stubs (default: the checked-in kdist/ps/_generated/)")
    arguments = parser.parse_args(argv)
    for path in regenerate(arguments.output_dir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
