"""`ProcessSpec`, what one process of a `ProcessSet` runs, and how its exit is described."""

import dataclasses
import signal

from kdist.errors import InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """One process of a `ProcessSet`.

    Args:
        name: unique name, used as output prefix `[name]`, e.g. "worker-0".
        argv: the command, e.g. `(sys.executable, "train.py", "--epochs", "2")`.
        env: variables set on top of `os.environ`; a None value removes one.
        daemon: True for processes that serve until stopped (parameter servers).
        cwd: working directory, or None for the parent's.

    Raises:
        kdist.errors.InvalidArgumentError: empty or spaced name, empty argv.

    Example:
        >>> ProcessSpec("ps-0", ["python", "serve.py"], {"TF_CONFIG": "{}"}, daemon=True).name
        'ps-0'
    """

    name: str
    argv: tuple
    env: dict = dataclasses.field(default_factory=dict)
    daemon: bool = False
    cwd: str | None = None

    def __post_init__(self):
        name = self.name
        if not isinstance(name, str) or not name or any(c.isspace() for c in name):
            raise InvalidArgumentError(
                "A process name must be a non-empty string without spaces. "
                f"Received: name={name!r}."
            )
        argv = (self.argv,) if isinstance(self.argv, str) else tuple(self.argv)
        if not argv or not all(isinstance(arg, str) for arg in argv):
            raise InvalidArgumentError(
                f"argv must be a non-empty list of strings. Received: argv={self.argv!r} "
                f"for process {name!r}."
            )
        object.__setattr__(self, "argv", argv)
        object.__setattr__(self, "env", dict(self.env))


def describe_returncode(returncode):
    """'exited with code 3' or 'was killed by SIGKILL' for a `Popen.returncode`."""
    if returncode is not None and returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"
