"""The strategy in effect when no scope is active: one replica, ordinary behaviour."""

import contextlib
import threading

import torch

from kdist.distribute.context import ReplicaContext
from kdist.distribute.devices import parse_device
from kdist.distribute.extended import StrategyExtended
from kdist.distribute.strategy import Strategy


class _DefaultExtended(StrategyExtended):
    is_default = True

    def __init__(self, container_strategy):
        super().__init__(container_strategy, ())
        self.default_replica_context = ReplicaContext(container_strategy, 0)

    @property
    def replica_devices(self):
        # Follows the caller's current Keras device (e.g. inside `keras.device("cuda:1")`).
        return (parse_device(_current_torch_device()),)

    def replica_device_scope(self, replica_id):
        # Ordinary code stays where the caller put it.
        return contextlib.nullcontext()


def _current_torch_device():
    # Keras' torch backend places tensors on the current CUDA device when one is
    # visible, else on the CPU; kdist reports the same (KERAS_TORCH_DEVICE
    # overrides are not reflected in this informational value).
    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


class DefaultStrategy(Strategy):
    """One replica on the current device; `run` simply calls the function.

    Returned by `kdist.get_strategy()` outside every scope, so code written for
    strategies also runs without one.
    """

    def __init__(self):
        super().__init__(_DefaultExtended(self))


_lock = threading.Lock()
_instance = None


def default_strategy():
    """Returns the process-wide `DefaultStrategy`."""
    global _instance
    with _lock:
        if _instance is None:
            _instance = DefaultStrategy()
        return _instance
