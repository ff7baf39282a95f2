"""A variable-service server in its own process, for tests: prints `PORT <n>`, then serves.

Usage: python tests/ps/serve_main.py [max_staleness]
"""

import sys

import kdist  # noqa: F401 (chooses the torch backend before Keras is imported)
from kdist.ps import ServiceOptions, create_server


def main():
    max_staleness = int(sys.argv[1]) if len(sys.argv) > 1 else None
    server = create_server(options=ServiceOptions(max_staleness=max_staleness))
    print(f"PORT {server.port}", flush=True)
    # Serves until the test kills the process; the harness's hard timeout bounds it.
    server.wait()


if __name__ == "__main__":
    main()
