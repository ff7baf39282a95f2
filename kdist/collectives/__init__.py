"""Reductions: between devices of one process (`local`) and between processes (`process`)."""

from kdist.collectives.compression import Compression
from kdist.collectives.local import CrossDeviceOps, ReductionToOneDevice
from kdist.collectives.options import CommunicationOptions

__all__ = ["CommunicationOptions", "Compression", "CrossDeviceOps", "ReductionToOneDevice"]
