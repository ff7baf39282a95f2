"""Tests for kdist.cluster.slurm: the SLURM_* variables of an srun step, and real processes under them."""

import os

import pytest

from kdist.cluster import ClusterSpec, Rendezvous, SlurmClusterResolver, resolve_cluster
from kdist.cluster.resolve import slurm_step_resolver
from kdist.cluster.resolve import step_port_base
from kdist.errors import ClusterEnvironmentError, InvalidArgumentError
from tests import harness
from tests.cluster import _launcher_env

# Two nodes, two tasks each, as `srun -N2 --ntasks-per-node=2` sets it for task 2.
STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "2",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NODELIST": "node[01-02]",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_NODEID": "1",
    "SLURM_LOCALID": "0",
}
LAYOUT = {0: ("0", "0"), 1: ("0", "1"), 2: ("1", "0"), 3: ("1", "1")}  # procid -> (nodeid, localid)


def step(procid=2, **changes):
    base = dict(STEP, SLURM_PROCID=str(procid), SLURM_NODEID=LAYOUT[procid][0], SLURM_LOCALID=LAYOUT[procid][1])
    return _launcher_env.changed(base, **changes)


def test_tensorflow_job_layout_ps_then_workers():
    # TensorFlow assigns jobs in sorted name order: 'ps' takes SLURM_PROCID 0.
    expected_spec = ClusterSpec({"ps": ["node01:8888"], "worker": ["node01:8889", "node02:8888", "node02:8889"]})
    tasks = []
    for procid in range(4):
        resolver = SlurmClusterResolver(jobs={"worker": 3, "ps": 1}, gpus_per_node=0, environ=step(procid))
        assert resolver.cluster_spec() == expected_spec
        tasks.append(resolver.get_task_info())
    assert tasks == [("ps", 0), ("worker", 0), ("worker", 1), ("worker", 2)]


def test_default_jobs_make_every_task_a_worker_ranked_by_procid():
    for procid in range(4):
        resolver = SlurmClusterResolver(gpus_per_node=0, environ=step(procid))
        assert (resolver.task_type, resolver.task_id) == ("worker", procid)
        assert resolver.is_chief == (procid == 0)
        assert resolver.rendezvous() == Rendezvous(
            rank=procid,
            world_size=4,
            local_rank=procid % 2,
            local_world_size=2,
            master_addr="node01",
            master_port=8888,
        )
    assert resolver.cluster_spec().as_dict() == {
        "worker": ["node01:8888", "node01:8889", "node02:8888", "node02:8889"]
    }


def test_uneven_tasks_per_node_and_port_base():
    environ = {
        "SLURM_PROCID": "6",
        "SLURM_NTASKS": "7",
        "SLURM_STEP_NODELIST": "gpu[07-10]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "3",
    }
    resolver = SlurmClusterResolver(port_base=2222, gpus_per_node=0, environ=environ)
    assert resolver.cluster_spec().as_dict()["worker"] == [
        "gpu07:2222", "gpu07:2223", "gpu08:2222", "gpu08:2223", "gpu09:2222", "gpu09:2223", "gpu10:2222",
    ]
    assert resolver.master() == "grpc://gpu10:2222"
    assert resolver.rendezvous().master_addr == "gpu07" and resolver.rendezvous().master_port == 2222


def test_nodes_keep_node_list_order_not_string_order():
    # TensorFlow sorts host names as strings (node10 before node9); Slurm numbers tasks in list order.
    environ = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "node[9-10]",
               "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": "0"}
    resolver = SlurmClusterResolver(gpus_per_node=0, environ=environ)
    assert resolver.cluster_spec().as_dict() == {"worker": ["node9:8888", "node10:8888"]}


def test_one_node_needs_no_tasks_per_node():
    environ = {"SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_STEP_NODELIST": "127.0.0.1"}
    resolver = SlurmClusterResolver(gpus_per_node=0, environ=environ)
    assert resolver.cluster_spec().as_dict() == {"worker": ["127.0.0.1:8888", "127.0.0.1:8889", "127.0.0.1:8890"]}
    assert (resolver.rendezvous().local_rank, resolver.rendezvous().local_world_size) == (1, 3)


def test_tasks_per_node_argument_int_and_dict():
    environ = step(3, SLURM_STEP_TASKS_PER_NODE=None)
    by_int = SlurmClusterResolver(tasks_per_node=2, gpus_per_node=0, environ=environ)
    by_dict = SlurmClusterResolver(tasks_per_node={"node02": 2, "node01": 2}, gpus_per_node=0, environ=environ)
    assert by_int.cluster_spec() == by_dict.cluster_spec()
    assert by_dict.cluster_spec().task_address("worker", 0) == "node01:8888"  # node-list order, not dict order
    with pytest.raises(InvalidArgumentError, match=r"tasks_per_node=\{'node01': 4\}"):
        SlurmClusterResolver(tasks_per_node={"node01": 4}, gpus_per_node=0, environ=environ)
    with pytest.raises(InvalidArgumentError, match="add up to 6"):
        SlurmClusterResolver(tasks_per_node=3, gpus_per_node=0, environ=environ)


@pytest.mark.parametrize(
    "gpus_per_node, gpus_per_task, procid, visible, accelerators",
    [
        (4, None, 3, "2,3", {"GPU": 2}),  # 4 GPUs shared by 2 tasks per node
        (4, 1, 3, "1", {"GPU": 1}),
        (4, 1, 2, "0", {"GPU": 1}),
        (0, None, 1, "", {}),
        (3, None, 1, "1", {"GPU": 1}),  # 3 // 2 tasks
    ],
)
def test_gpus_of_each_task(gpus_per_node, gpus_per_task, procid, visible, accelerators, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    resolver = SlurmClusterResolver(gpus_per_node=gpus_per_node, gpus_per_task=gpus_per_task, environ=step(procid))
    assert resolver.cuda_visible_devices() == visible
    assert resolver.num_accelerators() == accelerators
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # returned, never written


def test_gpu_arguments_are_checked():
    with pytest.raises(InvalidArgumentError, match="gpus_per_task=3"):
        SlurmClusterResolver(gpus_per_node=4, gpus_per_task=3, environ=step())
    with pytest.raises(InvalidArgumentError, match="gpus_per_node=-1"):
        SlurmClusterResolver(gpus_per_node=-1, environ=step())
    with pytest.raises(InvalidArgumentError, match="auto_set_gpu=True.*cuda_visible_devices"):
        SlurmClusterResolver(gpus_per_node=0, auto_set_gpu=True, environ=step())


def test_master_addresses_tasks_as_tensorflow_does():
    resolver = SlurmClusterResolver(gpus_per_node=0, environ=step(1))
    assert resolver.master() == "grpc://node01:8889"
    assert resolver.master("worker", 3) == "grpc://node02:8889"
    assert resolver.master("worker", 0, rpc_layer="tcp") == "tcp://node01:8888"
    assert SlurmClusterResolver(gpus_per_node=0, rpc_layer=None, environ=step(1)).master() == "node01:8889"
    assert resolver.environment == ""
    with pytest.raises(InvalidArgumentError):
        resolver.master("ps", 0)


@pytest.mark.parametrize(
    "jobs, port_base, match",
    [
        ({"worker": 3}, 8888, r"ask for 3 tasks but SLURM_STEP_NUM_TASKS='4'"),
        ({"worker": 4, "ps": 0}, 8888, "Malformed jobs"),
        (["worker"], 8888, "Malformed jobs"),
        (None, 65535, "port_base=65535"),
        (None, 0, "port_base=0"),
        (None, "8888", "port_base='8888'"),
    ],
)
def test_bad_arguments(jobs, port_base, match):
    with pytest.raises(InvalidArgumentError, match=match):
        SlurmClusterResolver(jobs=jobs, port_base=port_base, gpus_per_node=0, environ=step())


@pytest.mark.parametrize(
    "changes, variable, value",
    [
        ({"SLURM_PROCID": "one"}, "SLURM_PROCID", "one"),
        ({"SLURM_PROCID": "-1"}, "SLURM_PROCID", "-1"),
        ({"SLURM_PROCID": "4"}, "SLURM_PROCID", "4"),  # not below the task count
        ({"SLURM_PROCID": None}, "SLURM_PROCID", None),
        ({"SLURM_NTASKS": "0", "SLURM_STEP_NUM_TASKS": None}, "SLURM_NTASKS", "0"),
        ({"SLURM_NTASKS": "four", "SLURM_STEP_NUM_TASKS": None}, "SLURM_NTASKS", "four"),
        ({"SLURM_STEP_NUM_TASKS": "4x"}, "SLURM_STEP_NUM_TASKS", "4x"),
        ({"SLURM_NTASKS": "8"}, "SLURM_NTASKS", "8"),  # disagrees with SLURM_STEP_NUM_TASKS
        ({"SLURM_NTASKS": None, "SLURM_STEP_NUM_TASKS": None}, "SLURM_NTASKS", None),
        ({"SLURM_STEP_NODELIST": "node[01-02"}, "SLURM_STEP_NODELIST", "node[01-02"),
        ({"SLURM_STEP_NODELIST": "node01", "SLURM_STEP_NUM_NODES": None}, "SLURM_STEP_NODELIST", "node01"),
        ({"SLURM_STEP_NODELIST": "node[01-03]", "SLURM_STEP_NUM_NODES": None}, "SLURM_STEP_TASKS_PER_NODE", "2(x2)"),
        ({"SLURM_STEP_NODELIST": "node01,node01"}, "SLURM_STEP_NODELIST", "node01,node01"),
        ({"SLURM_STEP_NODELIST": "user@node[01-02]"}, "SLURM_STEP_NODELIST", "user@node[01-02]"),
        ({"SLURM_STEP_NUM_NODES": "3"}, "SLURM_STEP_NUM_NODES", "3"),
        ({"SLURM_STEP_TASKS_PER_NODE": "2,1"}, "SLURM_STEP_TASKS_PER_NODE", "2,1"),  # adds up to 3, not 4
        ({"SLURM_STEP_TASKS_PER_NODE": "2(x)"}, "SLURM_STEP_TASKS_PER_NODE", "2(x)"),
        ({"SLURM_STEP_TASKS_PER_NODE": None}, "SLURM_STEP_TASKS_PER_NODE", None),  # needed on two nodes
        ({"SLURM_LOCALID": "1"}, "SLURM_LOCALID", "1"),  # procid 2 is the first task of node 1 ...
        ({"SLURM_NODEID": "0"}, "SLURM_NODEID", "0"),  # ... unless tasks were dealt out cyclically
        ({"SLURM_LOCALID": "zero"}, "SLURM_LOCALID", "zero"),
    ],
)
def test_bad_or_inconsistent_variables_name_the_variable_and_value(changes, variable, value):
    with pytest.raises(ClusterEnvironmentError) as raised:
        SlurmClusterResolver(gpus_per_node=0, environ=step(**changes))
    assert (raised.value.variable, raised.value.value) == (variable, value)
    assert variable in str(raised.value)
    if value is not None:
        assert repr(value) in str(raised.value)
    assert isinstance(raised.value, InvalidArgumentError)


def test_cyclic_distribution_is_refused_on_every_rank():
    # srun --distribution=cyclic deals procids 0, 2 to node01 and 1, 3 to node02.
    cyclic = {0: ("0", "0"), 1: ("1", "0"), 2: ("0", "1"), 3: ("1", "1")}
    refused = 0
    for procid, (nodeid, localid) in cyclic.items():
        try:
            SlurmClusterResolver(gpus_per_node=0, environ=step(procid, SLURM_NODEID=nodeid, SLURM_LOCALID=localid))
        except ClusterEnvironmentError:
            refused += 1
    assert refused == 2  # procids 0 and 3 sit where block numbering puts them too


def test_reads_the_environment_once(monkeypatch):
    for name, value in step(1).items():
        monkeypatch.setenv(name, value)
    resolver = SlurmClusterResolver(gpus_per_node=0)
    monkeypatch.setenv("SLURM_PROCID", "3")
    assert resolver.task_id == 1


def test_automatic_port_is_master_port_else_derived_from_the_job_and_step():
    # 15000 + 8 * ((4242 * 8 + 0) % 2000): every task of the step computes the same port.
    assert {slurm_step_resolver(step(procid)).rendezvous().master_port for procid in LAYOUT} == {30488}
    resolver = resolve_cluster(environ=step(3, MASTER_PORT="29511"))
    assert isinstance(resolver, SlurmClusterResolver)
    assert resolver.rendezvous() == Rendezvous(3, 4, 1, 2, "node01", 29511)
    with pytest.raises(ClusterEnvironmentError) as raised:
        resolve_cluster(environ=step(3, MASTER_PORT="70000"))
    assert (raised.value.variable, raised.value.value) == ("MASTER_PORT", "70000")
    # The derived base is the first task's port on each node; the next task takes the next one.
    assert slurm_step_resolver(step(3)).cluster_spec().as_dict() == {
        "worker": ["node01:30488", "node01:30489", "node02:30488", "node02:30489"]
    }


def test_two_jobs_sharing_a_node_get_different_ports():
    ports = {job: step_port_base({"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0"}) for job in range(1000, 1250)}
    # 250 consecutive jobs: 250 blocks of 8 ports that do not overlap, none on TensorFlow's 8888.
    assert len(set(ports.values())) == 250
    assert all(15000 <= port <= 30992 and (port - 15000) % 8 == 0 for port in ports.values())
    # Two steps of one job differ too; the rule wraps after 250 jobs (documented).
    assert step_port_base({"SLURM_JOB_ID": "1000", "SLURM_STEP_ID": "1"}) == ports[1000] + 8
    assert step_port_base({"SLURM_JOB_ID": "1250", "SLURM_STEP_ID": "0"}) == ports[1000]
    # Slurm's special step ids (batch 4294967294, extern 4294967295) stay in range.
    assert 15000 <= step_port_base({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "4294967295"}) <= 30992


@pytest.mark.parametrize(
    "changes, variable, value",
    [
        ({"SLURM_JOB_ID": None}, "SLURM_JOB_ID", None),
        ({"SLURM_JOB_ID": "12_3"}, "SLURM_JOB_ID", "12_3"),  # an array task's "<job>_<index>" is SLURM_ARRAY_*'s
        ({"SLURM_STEP_ID": None}, "SLURM_STEP_ID", None),
        ({"SLURM_STEP_ID": "-1"}, "SLURM_STEP_ID", "-1"),
    ],
)
def test_malformed_job_or_step_id_without_master_port_names_the_rule(changes, variable, value):
    with pytest.raises(ClusterEnvironmentError, match=r"SLURM_JOB_ID \* 8 \+ SLURM_STEP_ID.*Set MASTER_PORT") as raised:
        resolve_cluster(environ=step(3, **changes))
    assert (raised.value.variable, raised.value.value) == (variable, value)
    # With MASTER_PORT the ids are not needed.
    assert resolve_cluster(environ=step(3, MASTER_PORT="29511", **changes)).rendezvous().master_port == 29511


def test_a_batch_script_shell_is_not_an_srun_step():
    # sbatch's own shell has SLURM_PROCID=0 and the job's SLURM_NTASKS, but no step node list.
    batch_shell = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_NODELIST": "node[01-02]"}
    assert not SlurmClusterResolver.is_available(batch_shell)
    assert resolve_cluster(environ=batch_shell).rendezvous().world_size == 1


# -- Real processes ---------------------------------------------------------------------


def _slurm_envs(hosts, tasks_per_node):
    port = str(harness.free_port("127.0.0.1"))
    envs, procid = [], 0
    for node, _ in enumerate(hosts):
        for local in range(tasks_per_node):
            envs.append((f"task-{procid}", {
                "SLURM_PROCID": str(procid), "SLURM_NTASKS": str(len(hosts) * tasks_per_node),
                "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node),
                "SLURM_STEP_NODELIST": ",".join(hosts), "SLURM_STEP_TASKS_PER_NODE": f"{tasks_per_node}(x{len(hosts)})",
                "MASTER_PORT": port,
            }))
            procid += 1
    return envs


@pytest.mark.parametrize(
    "hosts, tasks_per_node",
    [
        (["127.0.0.1"], 2),  # srun -n2 on one node
        (["127.0.0.1", "localhost"], 1),  # two "nodes": SLURM_LOCALID is 0 on both, ranks still differ
    ],
)
def test_srun_tasks_train_as_one_job_with_a_no_argument_strategy(hosts, tasks_per_node):
    envs = _slurm_envs(hosts, tasks_per_node)
    reports = _launcher_env.run_worker(envs + [("alone", {})])
    reference = reports.pop("alone")
    assert reference[1:5] == (0, 1, "worker:0", 1.0)  # negative control: no launcher, no group
    assert {name: report[:5] for name, report in reports.items()} == {
        "task-0": ("SlurmClusterResolver", 0, 2, "worker:0", 3.0),
        "task-1": ("SlurmClusterResolver", 1, 2, "worker:1", 3.0),
    }
    _launcher_env.assert_same_weights(reports, reference)
