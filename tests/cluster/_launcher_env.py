"""Shared by the launcher-variable tests: environments, and the no-argument strategy worker."""

import math
import re
import sys
from pathlib import Path

from tests import harness
from tests.cluster.workers import no_argument_strategy

WORKER = Path(no_argument_strategy.__file__)
# Every variable any launcher could have left in the test runner's environment.
NO_LAUNCHER = {
    name: None
    for name in (
        "TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_USE_AGENT_STORE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS",
        "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE",
        "SLURM_STEP_NUM_NODES", "PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
        "PET_MASTER_PORT", "CUDA_VISIBLE_DEVICES",
    )
}


def changed(base, **changes):
    """A copy of the environment `base` with `changes` applied; a None value removes the variable."""
    environ = dict(base)
    for name, value in changes.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    return environ


_LINE = re.compile(r"RESOLVER (\S+) RANK (\d+) WORLD (\d+) TASK (\S+)\nSUM (\S+)\nWEIGHTS (\S+)")


def run_worker(envs, timeout=150):
    """Runs the worker once per `(name, env)` (on top of `NO_LAUNCHER`); returns `{name: report}`.

    A report is `(resolver class, rank, world size, "job:index", sum, weights checksum)`.
    """
    argv = (sys.executable, str(WORKER))
    specs = [harness.ProcessSpec(name, argv, {**NO_LAUNCHER, **env}) for name, env in envs]
    result = harness.run(specs, timeout=timeout).check()
    reports = {}
    for name, _ in envs:
        match = _LINE.search(result.output(name, "stdout"))
        assert match, result.output(name)
        kind, rank, world, task, total, weights = match.groups()
        reports[name] = (kind, int(rank), int(world), task, float(total), float(weights))
    return reports


def single_process_reference():
    """The worker with no launcher variables: one process, rank 0 of 1, trained on the whole batch."""
    (report,) = run_worker([("alone", {})]).values()
    return report


def assert_same_weights(reports, reference):
    """Every rank ended with the weights of one process trained on the same global batches."""
    for report in reports.values():
        assert math.isclose(report[5], reference[5], rel_tol=1e-5), (report, reference)
