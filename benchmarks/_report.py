"""What every benchmark's JSON lines carry besides its measurements: commit and environment."""

import os
import platform
import subprocess


def git_commit():
    """The repository's short HEAD hash, or None outside a git checkout."""
    try:
        result = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return result.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(**extra):
    """Versions, core count and load of this machine, plus `extra` fields."""
    import keras
    import torch

    import kdist

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "keras": keras.version(),
        "kdist": kdist.__version__,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "device": "cpu",
        "load_average_1min": round(os.getloadavg()[0], 2),
        **extra,
    }
