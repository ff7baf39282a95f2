"""`CommunicationOptions`: how the processes of a synchronous job talk to each other."""

import dataclasses

from kdist.collectives.compression import Compression, Compressor
from kdist.errors import InvalidArgumentError
from kdist.validation import require_integer, require_seconds

# Long enough for a slow first step (lazy builds, data loading, a checkpoint
# written by the chief while the others wait at the barrier), short enough that
# a dead job is noticed within minutes rather than torch's 30-minute default.
DEFAULT_TIMEOUT_SECONDS = 300.0
# DDP's default: gradient buckets are reduced while backward still runs, so a
# bucket should be large enough that a call's fixed cost is small against its
# bytes, and small enough that the first one is ready early and the last one
# (which cannot overlap with anything) is short.
DEFAULT_BUCKET_BYTES = 25 * 2**20
# The first bucket reduced during backward (the last layers' gradients) is kept
# small, as DDP's is, so communication starts as soon as backward does.
DEFAULT_FIRST_BUCKET_BYTES = 2**20


@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
    """How `MultiWorkerMirroredStrategy` talks between processes.

    Args:
        timeout_seconds: deadline of every collective (and of joining the job).
            Default `DEFAULT_TIMEOUT_SECONDS` (300 s).
        bucket_bytes: the largest flattened buffer sent in one call (default
            25 MiB, DDP's).
        backend: `"gloo"`, `"nccl"`, or None to pick NCCL when the process
            drives GPUs and gloo otherwise.
        compression: the dtype gradients travel in: `kdist.Compression.none`
            (default), `.fp16` or `.bf16` (see `kdist.collectives.compression`
            for when it pays and what it costs in accuracy).
        overlap_with_backward: reduce each gradient bucket as soon as backward
            has produced all of its gradients, while backward goes on
            (default True). Steps that cannot overlap (see
            `docs/multi_worker.md`, "Performance") reduce after backward.
        first_bucket_bytes: the cap of the first bucket reduced during
            backward (default 1 MiB, DDP's).

    Raises:
        kdist.errors.InvalidArgumentError: a value is out of range.

    Example:

    ```python
    strategy = kdist.MultiWorkerMirroredStrategy(
        communication_options=kdist.CommunicationOptions(
            timeout_seconds=60, compression=kdist.Compression.bf16))
    ```
    """

    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    backend: str = None
    compression: Compressor = Compression.none
    overlap_with_backward: bool = True
    first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES

    def __post_init__(self):
        require_seconds("timeout_seconds", self.timeout_seconds)
        for name in ("bucket_bytes", "first_bucket_bytes"):
            require_integer(name, getattr(self, name), minimum=1024, expected="an integer of at least 1024")
        if self.backend not in (None, "gloo", "nccl"):
            raise InvalidArgumentError(
                f"Unknown backend. Received: backend={self.backend!r}. Expected 'gloo', "
                "'nccl' or None (NCCL with GPUs, gloo otherwise)."
            )
        Compression.check(self.compression)
        if not isinstance(self.overlap_with_backward, bool):
            raise InvalidArgumentError(
                "overlap_with_backward must be True or False. Received: "
                f"overlap_with_backward={self.overlap_with_backward!r}."
            )

    @classmethod
    def from_argument(cls, communication_options):
        """`communication_options`, or the defaults for None.

        Raises:
            kdist.errors.InvalidArgumentError: it is not a `CommunicationOptions`.
        """
        if communication_options is None:
            return cls()
        if not isinstance(communication_options, cls):
            raise InvalidArgumentError(
                "Expected a kdist.CommunicationOptions. Received: communication_options="
                f"{communication_options!r}."
            )
        return communication_options
