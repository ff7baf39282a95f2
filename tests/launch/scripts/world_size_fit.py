"""backup_fit.py with an optional negative-control switch, for tests/launch/test_world_size_resume.py.

world_size_fit.py OUTDIR [backup_fit.py's options] [--fault NAME]

`--fault NAME` turns on `kdist.faults.ACTIVE.NAME` in this process before it
trains (e.g. `unskipped_resume_steps`: the resumed epoch trains the steps the
backup holds again). Everything else is backup_fit.py's.
"""

import os
import runpy
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

from kdist import faults  # noqa: E402

if __name__ == "__main__":
    if "--fault" in sys.argv:
        at = sys.argv.index("--fault")
        setattr(faults.ACTIVE, sys.argv[at + 1], True)
        del sys.argv[at:at + 2]
    sys.argv[0] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "backup_fit.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
