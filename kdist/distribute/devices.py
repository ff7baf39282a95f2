"""Device strings: parsing, validation and placement scopes.

Accepted spellings (case-insensitive): `"cpu"`, `"cpu:1"`, `"gpu:0"`,
`"cuda:0"`, `"/gpu:0"`, `"/device:GPU:0"`,
`"/job:localhost/replica:0/task:0/device:GPU:1"` and `torch.device` objects.

Torch has a single CPU device: `"cpu:1"` is not a second one. Several CPU
entries in a strategy's device list are *logical* replicas that all compute on
the real CPU device; they exist to test data-parallel correctness without
accelerators.
"""

import contextlib
import dataclasses
import re

import keras
import torch

from kdist.errors import InvalidArgumentError, InvalidDeviceError

_DEVICE_PATTERN = re.compile(
    r"^(?:/job:[^/]+)?(?:/replica:\d+)?(?:/task:\d+)?(?:/?device:|/)?"
    r"(?P<kind>cpu|gpu|cuda)(?::(?P<index>\d+))?$"
)


@dataclasses.dataclass(frozen=True)
class Device:
    """One replica device.

    Attributes:
        kind: `"cpu"` or `"cuda"`.
        index: the device index (a logical index for CPU replicas).
    """

    kind: str
    index: int

    @property
    def name(self):
        """Canonical spelling, e.g. `"cuda:1"` or `"cpu:0"`."""
        return f"{self.kind}:{self.index}"

    @property
    def torch_device(self):
        """The real torch device tensors of this replica live on."""
        if self.kind == "cpu":
            return torch.device("cpu")
        return torch.device("cuda", self.index)

    @property
    def keras_name(self):
        """What `keras.device(...)` must receive so Keras resolves exactly `torch_device`."""
        return "cpu" if self.kind == "cpu" else self.name

    def __str__(self):
        return self.name


def parse_device(spec, argument_name="devices", gpu_count=None):
    """Parses one device spelling into a `Device`.

    Args:
        spec: a device spelling (see the module docstring) or `torch.device`.
        argument_name: named in errors.
        gpu_count: how many GPUs this process sees, or a function returning
            it (called only for a GPU entry); None asks torch. The TensorFlow
            and JAX backends pass their own.

    Raises:
        kdist.errors.InvalidDeviceError: the spelling is unknown, or it names a
            CUDA device that is not visible.
    """
    if isinstance(spec, Device):
        device = spec
    elif isinstance(spec, torch.device):
        if spec.type not in ("cpu", "cuda"):
            raise InvalidDeviceError(
                f"Unsupported device type. Received: {argument_name} entry {spec!r}. "
                "Expected a CPU or CUDA device."
            )
        device = Device(spec.type, spec.index or 0)
    elif isinstance(spec, str):
        match = _DEVICE_PATTERN.match(spec.strip().lower())
        if match is None:
            raise InvalidDeviceError(
                f"Cannot parse device string. Received: {argument_name} entry {spec!r}. "
                "Expected a spelling like 'cpu', 'cpu:1', 'gpu:0', 'cuda:0' or "
                "'/device:GPU:0'."
            )
        kind = "cpu" if match["kind"] == "cpu" else "cuda"
        device = Device(kind, int(match["index"] or 0))
    else:
        raise InvalidDeviceError(
            f"Device must be a string or torch.device. Received: {argument_name} "
            f"entry {spec!r} of type {type(spec).__name__}."
        )
    if device.kind == "cuda":
        visible = _count(gpu_count)
        if device.index >= visible:
            raise InvalidDeviceError(
                f"Device {device.name} is not visible. Received: {argument_name} entry "
                f"{spec!r}; this process sees {visible} CUDA device(s). Check "
                "CUDA_VISIBLE_DEVICES or pass logical CPU replicas such as "
                "['cpu:0', 'cpu:1']."
            )
    return device


def _count(gpu_count):
    if gpu_count is None:
        return torch.cuda.device_count()
    return gpu_count() if callable(gpu_count) else gpu_count


def resolve_devices(devices, argument_name="devices", gpu_count=None):
    """Validates a device list; `None` means every visible GPU, else one CPU.

    Args:
        devices: device spellings, one per replica, or None.
        argument_name: named in errors.
        gpu_count: as for `parse_device`.

    Returns:
        A tuple of `Device`, in the given order.

    Raises:
        kdist.errors.InvalidDeviceError: an entry is invalid, the list is
            empty, has duplicates, or mixes CPU and CUDA devices.
    """
    if devices is None:
        count = _count(gpu_count)
        if count:
            return tuple(Device("cuda", i) for i in range(count))
        return (Device("cpu", 0),)
    if isinstance(devices, (str, torch.device)):
        devices = [devices]
    try:
        devices = list(devices)
    except TypeError:
        raise InvalidArgumentError(
            f"Expected a list of device strings. Received: {argument_name}={devices!r}."
        ) from None
    if not devices:
        raise InvalidDeviceError(
            f"At least one device is required. Received: {argument_name}=[]. Pass "
            "devices=None to use every visible GPU (or one CPU replica)."
        )
    parsed = tuple(parse_device(spec, argument_name, gpu_count) for spec in devices)
    if len(set(parsed)) != len(parsed):
        raise InvalidDeviceError(
            f"Duplicate devices. Received: {argument_name}={devices!r}. Each replica "
            "needs its own device; for several CPU replicas write 'cpu:0', 'cpu:1', ..."
        )
    kinds = {device.kind for device in parsed}
    if len(kinds) > 1:
        raise InvalidDeviceError(
            f"Mixing CPU and GPU replicas is not supported. Received: {argument_name}="
            f"{devices!r}. Use only GPUs or only logical CPU replicas."
        )
    return parsed


@contextlib.contextmanager
def device_scope(device):
    """Places Keras variables and ops (and, on GPUs, torch factory calls) on `device`.

    `torch.device(...)` as a context manager installs a function mode that
    intercepts every torch call; it is only worth that cost where it changes
    placement, i.e. on CUDA devices.
    """
    with keras.device(device.keras_name):
        if device.kind == "cpu":
            yield
        else:
            with torch.device(device.torch_device):
                yield
