"""When a parameter server checkpoints itself, so that a restarted one comes back.

`kdist launch --ps K --ps-checkpoint-every EVERY` gives each ps process two
variables, read by `kdist.distribute.Server` when its `ServiceOptions` leave
checkpointing unset:

- `KDIST_PS_CHECKPOINT_EVERY`: `"N"` (every N applied pushes, N >= 1) or
  `"Ns"` (every N seconds, e.g. `"30s"`, `"0.5s"`);
- `KDIST_PS_CHECKPOINT_DIR`: this ps's own checkpoint directory.

`parse_every` turns the text into a `CheckpointEvery`.
"""

import dataclasses
import math

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
