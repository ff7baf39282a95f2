"""Gradient compression: the dtype gradients travel in between processes.

A namespace of choices, as in Horovod (`hvd.Compression.fp16`):

- `Compression.none`: gradients travel in their own dtype (the default);
- `Compression.fp16`: float32/float64 gradients travel as float16;
- `Compression.bf16`: float32/float64 gradients travel as bfloat16.

Compression halves (float32) the bytes every gradient all-reduce sends, and
the sum over processes is taken in the compressed dtype; the result is cast
back to the gradient's dtype before the optimizer sees it. It pays where the
wire is the bottleneck (a link between hosts); on a fast link the
half-precision reduction costs more than the bytes it saves (measured on
gloo, one 25 MB all-reduce between 2 processes: plain loopback fp32 20 ms,
bf16 31 ms; over a 2 Gbit/s link fp32 204 ms, bf16 130 ms).

Accuracy: bfloat16 keeps float32's range with an 8-bit mantissa (relative
error up to 2^-8 per value); float16 keeps 11 bits but overflows above 65504,
so use it with a loss scale (`keras.optimizers.LossScaleOptimizer`) or small
gradients. Only gradients are compressed: weights, optimizer slots, metrics
and BatchNormalization statistics always travel exactly.
"""

import dataclasses

import torch

from kdist.errors import InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class Compressor:
    """One way of sending gradients (see `Compression` for the choices).

    Attributes:
        name: `"none"`, `"fp16"` or `"bf16"`.
        wire_dtype: the torch dtype wider floating gradients travel in
            (None: no compression).
    """

    name: str
    wire_dtype: torch.dtype = None

    def wire_dtype_for(self, dtype):
        """The dtype a tensor of `dtype` travels in: narrower only for wider floating dtypes."""
        if self.wire_dtype is None or not dtype.is_floating_point:
            return dtype
        if torch.empty((), dtype=dtype).element_size() <= self.wire_dtype.itemsize:
            return dtype
        return self.wire_dtype

    def __repr__(self):
        return f"kdist.Compression.{self.name}"


class Compression:
    """The gradient compressions `kdist.CommunicationOptions(compression=...)` takes.

    Example:

    ```python
    strategy = kdist.MultiWorkerMirroredStrategy(
        communication_options=kdist.CommunicationOptions(compression=kdist.Compression.bf16))
    ```
    """

    none = Compressor("none")
    fp16 = Compressor("fp16", torch.float16)
    bf16 = Compressor("bf16", torch.bfloat16)

    @classmethod
    def check(cls, compression):
        """Returns `compression` when it is one of the choices.

        Raises:
            kdist.errors.InvalidArgumentError: anything else.
        """
        if compression not in (cls.none, cls.fp16, cls.bf16) or not isinstance(compression, Compressor):
            raise InvalidArgumentError(
                "compression must be kdist.Compression.none, kdist.Compression.fp16 or "
                f"kdist.Compression.bf16. Received: compression={compression!r}."
            )
        return compression
