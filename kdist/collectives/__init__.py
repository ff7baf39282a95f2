"""Cross-device reductions: in-process (device copies) now, torch.distributed later."""

from kdist.collectives.local import CrossDeviceOps, ReductionToOneDevice

__all__ = ["CrossDeviceOps", "ReductionToOneDevice"]
