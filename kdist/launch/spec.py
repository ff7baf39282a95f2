"""`ProcessSpec`, what one process of a `ProcessSet` runs, its `RestartPolicy`, how its
exit is described, and the errors of a `ProcessSet`."""

import dataclasses
import signal

from kdist.errors import InvalidArgumentError, KdistError


# Backoff before a restart after the first: backoff_seconds, then doubling, at most this.
MAX_RESTART_DELAY_SECONDS = 60.0


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """How often, and after how long, a `ProcessSet` restarts a process that failed.

    A failure that the policy restarts is not the set's failure. Once
    `max_restarts` are used, the next failure counts as one (the set's fail-fast
    rule applies). The first restart is immediate: one failure is a lost process
    (a `kill -9`, a machine gone), and every second spent before it is training
    lost. From the second on, a failure may repeat (a crash loop), so restart
    number k waits `backoff_seconds * 2 ** (k - 2)`, at most
    `MAX_RESTART_DELAY_SECONDS`. The restarted process gets the same command and
    environment.

    Args:
        max_restarts: restarts allowed over the life of the set (0: none).
        backoff_seconds: the delay before the second restart.

    Raises:
        kdist.errors.InvalidArgumentError: a negative count or delay.

    Example:
        >>> [RestartPolicy(max_restarts=3, backoff_seconds=1.0).delay_seconds(k) for k in (1, 2, 3)]
        [0.0, 1.0, 2.0]
    """

    max_restarts: int = 3
    backoff_seconds: float = 1.0

    def __post_init__(self):
        if self.max_restarts < 0 or not self.backoff_seconds >= 0:
            raise InvalidArgumentError(
                "max_restarts and backoff_seconds must be >= 0. Received: "
                f"max_restarts={self.max_restarts}, "
                f"backoff_seconds={self.backoff_seconds}."
            )

    def delay_seconds(self, restart_number):
        """Seconds to wait before restart number `restart_number` (1 for the first)."""
        if restart_number <= 1:
            return 0.0
        delay = self.backoff_seconds * 2.0 ** (restart_number - 2)
        return min(delay, MAX_RESTART_DELAY_SECONDS)


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """One process of a `ProcessSet`.

    Args:
        name: unique name, used as output prefix `[name]`, e.g. "worker-0".
        argv: the command, e.g. `(sys.executable, "train.py", "--epochs", "2")`.
        env: variables set on top of `os.environ`; a None value removes one.
        daemon: True for processes that serve until stopped (parameter servers).
        cwd: working directory, or None for the parent's.
        restart: a `RestartPolicy` to restart it when it fails, or None (a
            failure is the set's failure).

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
    restart: RestartPolicy | None = None

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


class ProcessSetTimeout(KdistError, TimeoutError):
    """`ProcessSet.wait` reached its deadline with processes still running.

    Not retryable: a hang is a bug to find in the stacks, which were printed to
    each process's stderr (see `ProcessSet.output`).

    Attributes:
        running: names of the processes that were still running.
    """

    def __init__(self, message, running):
        super().__init__(message)
        self.running = tuple(running)


class ProcessSetStateError(KdistError, RuntimeError):
    """A `ProcessSet` method was called in the wrong state (e.g. `start` twice)."""
