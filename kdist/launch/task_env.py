"""The environment each launched process gets: torchrun variables or a `TF_CONFIG`.

The two ways of describing a cluster never reach one process together: a
torchrun-style process has `TF_CONFIG` removed and a `TF_CONFIG` process has
the torchrun variables removed, so a resolver never has to guess which one wins.
The test harness builds its environments with these same functions.
"""

import json

from kdist.launch.ports import free_ports

# What `torchrun --standalone --nproc-per-node N` sets for every worker, minus the
# TORCHELASTIC_* variables: kdist runs no elastic agent, so rank 0 hosts the
# rendezvous store at MASTER_ADDR:MASTER_PORT (`init_method="env://"`).
TORCHRUN_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)
TF_CONFIG = "TF_CONFIG"
# Set for every launched process, so programs can tell they run under kdist.
LAUNCHER_VARIABLE = "KDIST_LAUNCHER"

# Job order of a local cluster: the order of keys in TF_CONFIG and of port numbers.
CLUSTER_JOB_ORDER = ("chief", "worker", "ps", "evaluator")
# Start order of a local cluster: servers first, so the others find them sooner.
START_JOB_ORDER = ("ps", "worker", "chief", "evaluator")


def torchrun_env(rank, num_processes, master_addr, master_port):
    """Returns the variable overrides for local rank `rank` of a one-host job.

    Example:
        >>> torchrun_env(1, 2, "127.0.0.1", 29500)["RANK"]
        '1'
    """
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(num_processes),
        "LOCAL_WORLD_SIZE": str(num_processes),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(num_processes),
        "ROLE_NAME": "default",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        TF_CONFIG: None,
        LAUNCHER_VARIABLE: "1",
    }


def tf_config_env(cluster, task_type, task_index):
    """Returns the variable overrides for task `task_type:task_index` of `cluster`.

    Args:
        cluster: dict job name -> list of "host:port" (already validated).

    Example:
        >>> env = tf_config_env({"worker": ["h:1", "h:2"]}, "worker", 1)
        >>> json.loads(env["TF_CONFIG"])["task"]
        {'type': 'worker', 'index': 1}
    """
    env = {name: None for name in TORCHRUN_VARIABLES}
    env[TF_CONFIG] = json.dumps(
        {"cluster": cluster, "task": {"type": task_type, "index": task_index}}
    )
    env[LAUNCHER_VARIABLE] = "1"
    return env


def local_cluster(num_workers, num_ps=0, chief=False, evaluator=False, host="127.0.0.1"):
    """Returns a cluster dict with a free port on `host` for every task.

    Jobs appear in `CLUSTER_JOB_ORDER`; jobs with no task are left out.

    Example:
        >>> sorted(local_cluster(2, num_ps=1))
        ['ps', 'worker']
    """
    sizes = {"chief": int(chief), "worker": num_workers, "ps": num_ps, "evaluator": int(evaluator)}
    ports = iter(free_ports(sum(sizes.values()), host))
    return {
        job: [f"{host}:{next(ports)}" for _ in range(sizes[job])]
        for job in CLUSTER_JOB_ORDER
        if sizes[job]
    }


def cluster_tasks(cluster):
    """Every (task_type, task_index) of `cluster` in `START_JOB_ORDER`, then other jobs by name."""
    jobs = [job for job in START_JOB_ORDER if job in cluster]
    jobs += sorted(job for job in cluster if job not in START_JOB_ORDER)
    return [(job, index) for job in jobs for index in range(len(cluster[job]))]


def task_name(task_type, task_index):
    """The process name (and output prefix) of a task: "worker-1"."""
    return f"{task_type}-{task_index}"
