"""Reductions: between devices of one process (`local`) and between processes (`process`)."""

from kdist.collectives.local import CrossDeviceOps, ReductionToOneDevice
from kdist.collectives.process import CommunicationOptions

__all__ = ["CommunicationOptions", "CrossDeviceOps", "ReductionToOneDevice"]
