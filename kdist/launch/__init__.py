"""Launching the processes of a distributed job (`kdist launch`) and supervising them.

- `ProcessSet`: starts processes, echoes their output as `[name] line`, applies the
  fail-fast policy (first failure's exit code, stack dumps of survivors after a
  grace period), stops daemons (parameter servers) when the job ends, and never
  leaves orphans.
- `free_ports`: free TCP ports for local clusters.
- `cli.main`: the `kdist` command.

Imports neither Keras nor torch: the launcher only starts the programs that do.
"""

from kdist.launch.ports import free_port, free_ports
from kdist.launch.processes import ProcessSet, ProcessSetStateError, ProcessSetTimeout
from kdist.launch.spec import ProcessSpec

__all__ = [
    "ProcessSet",
    "ProcessSetStateError",
    "ProcessSetTimeout",
    "ProcessSpec",
    "free_port",
    "free_ports",
]
