"""When a parameter server checkpoints itself, so that a restarted one comes back.

`kdist launch --ps K --ps-checkpoint-every EVERY` gives each ps process two
variables, read by `kdist.distribute.Server` when its `ServiceOptions` leave
checkpointing unset:

- `KDIST_PS_CHECKPOINT_EVERY`: `"N"` (every N applied pushes, N >= 1) or
  `"Ns"` (every N seconds, e.g. `"30s"`, `"0.5s"`);
- `KDIST_PS_CHECKPOINT_DIR`: this ps's own checkpoint directory.

`parse_every` turns the text into a `CheckpointEvery`; `with_environment`
fills a `ServiceOptions` from those variables. The running side (saving,
restoring at start, counting the pushes a checkpoint misses) is
`kdist.ps.server.autosaver.Autosaver`.
"""

import dataclasses
import math
import os

from kdist.errors import InvalidArgumentError

CHECKPOINT_EVERY_VARIABLE = "KDIST_PS_CHECKPOINT_EVERY"
CHECKPOINT_DIR_VARIABLE = "KDIST_PS_CHECKPOINT_DIR"


@dataclasses.dataclass(frozen=True)
class CheckpointEvery:
    """A checkpoint interval: `steps` applied pushes or `seconds`, exactly one of them set."""

    steps: int | None = None
    seconds: float | None = None

    def __str__(self):
        return f"{self.steps}" if self.steps is not None else f"{self.seconds:g}s"


def parse_every(text, name=CHECKPOINT_EVERY_VARIABLE):
    """Parses `"N"` (applied pushes) or `"Ns"` (seconds) into a `CheckpointEvery`.

    Args:
        text: the interval, as on the command line.
        name: what to call it in an error (the flag or the variable).

    Raises:
        kdist.errors.InvalidArgumentError: anything else, zero or negative.

    Example:
        >>> parse_every("30s"), parse_every("1")
        (CheckpointEvery(steps=None, seconds=30.0), CheckpointEvery(steps=1, seconds=None))
    """
    expected = ('a whole number of steps (applied pushes) >= 1, such as "1" or "100", or '
                'seconds > 0 ending in "s", such as "30s"')
    value = str(text).strip()
    try:
        if value.endswith("s"):
            seconds = float(value[:-1])
            if math.isfinite(seconds) and seconds > 0:
                return CheckpointEvery(seconds=seconds)
        else:
            steps = int(value)
            if steps >= 1:
                return CheckpointEvery(steps=steps)
    except ValueError:
        pass
    raise InvalidArgumentError(f"{name} must be {expected}. Received: {text!r}.")


def with_environment(options, environ=None):
    """Returns `options` with `kdist launch`'s checkpoint settings where it has none.

    A `ServiceOptions` that sets `checkpoint_dir` is returned as it is (the
    program's own settings win); otherwise both variables, when set, give
    `checkpoint_dir` and `checkpoint_every`.

    Args:
        options: a `kdist.ps.ServiceOptions`.
        environ: the variables to read (default: `os.environ`).

    Raises:
        kdist.errors.InvalidArgumentError: one variable set without the
            other, or an interval `parse_every` refuses.

    Example:
        >>> with_environment(ServiceOptions(), {CHECKPOINT_EVERY_VARIABLE: "1",
        ...     CHECKPOINT_DIR_VARIABLE: "/ckpt/ps-0"}).checkpoint_dir  # doctest: +SKIP
        '/ckpt/ps-0'
    """
    environ = os.environ if environ is None else environ
    if options.checkpoint_dir is not None:
        return options
    every, directory = environ.get(CHECKPOINT_EVERY_VARIABLE), environ.get(CHECKPOINT_DIR_VARIABLE)
    if not every and not directory:
        return options
    if not every or not directory:
        raise InvalidArgumentError(
            f"{CHECKPOINT_EVERY_VARIABLE} and {CHECKPOINT_DIR_VARIABLE} go together. Received: "
            f"{CHECKPOINT_EVERY_VARIABLE}={every!r}, {CHECKPOINT_DIR_VARIABLE}={directory!r}. "
            "Set both (kdist launch --ps does) or neither."
        )
    return dataclasses.replace(options, checkpoint_dir=directory,
                               checkpoint_every=parse_every(every))
