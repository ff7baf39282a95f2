"""Tests for tests/harness.py, the multi-process test harness every such test uses."""

import json
import signal
import sys
from pathlib import Path

import pytest

from tests import harness

SCRIPTS = Path(__file__).parent / "scripts"
PRINT_ENV = (
    "import json, os; print(json.dumps({name: os.environ.get(name) for name in "
    "('KERAS_BACKEND', 'PYTHONUNBUFFERED', 'PYTHONPATH', 'RANK', 'TF_CONFIG')}))"
)


def test_torchrun_envs_match_what_kdist_launch_sets():
    envs = harness.torchrun_envs(2, master_port=1234)

    assert [name for name, _ in envs] == ["worker-0", "worker-1"]
    for rank, (_, env) in enumerate(envs):
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["TF_CONFIG"]) == (
            "127.0.0.1",
            "1234",
            None,
        )


def test_tf_config_envs_give_each_task_its_own_free_port():
    envs = harness.tf_config_envs(2, chief=True, ps=1)

    assert [name for name, _ in envs] == ["ps-0", "worker-0", "worker-1", "chief-0"]
    configs = [json.loads(env["TF_CONFIG"]) for _, env in envs]
    cluster = configs[0]["cluster"]
    assert all(config["cluster"] == cluster for config in configs)
    assert [(c["task"]["type"], c["task"]["index"]) for c in configs] == [
        ("ps", 0),
        ("worker", 0),
        ("worker", 1),
        ("chief", 0),
    ]
    ports = [address.rsplit(":", 1)[1] for job in cluster.values() for address in job]
    assert len(set(ports)) == 4
    assert all(env["RANK"] is None for _, env in envs)


def test_python_specs_make_ps_tasks_daemons():
    specs = harness.python_specs(harness.tf_config_envs(1, ps=1), "script.py", 3)

    assert [(spec.name, spec.daemon) for spec in specs] == [("ps-0", True), ("worker-0", False)]
    assert specs[0].argv == (sys.executable, "script.py", "3")


def test_children_get_the_test_environment():
    specs = harness.python_specs(harness.torchrun_envs(1), "-c", PRINT_ENV)

    result = harness.run(specs).check()

    env = json.loads(result.output("worker-0"))
    assert env["KERAS_BACKEND"] == "torch" and env["PYTHONUNBUFFERED"] == "1" and env["RANK"] == "0"
    assert env["PYTHONPATH"].split(":")[0] == str(harness.REPO_ROOT)


def test_a_local_ps_cluster_runs_and_its_servers_are_stopped(tmp_path):
    specs = harness.python_specs(harness.tf_config_envs(2, ps=1), SCRIPTS / "tf_task.py", tmp_path)

    result = harness.run(specs, timeout=60).check()

    assert result.returncodes == {"ps-0": -signal.SIGTERM, "worker-0": 0, "worker-1": 0}
    assert sorted(path.stem for path in tmp_path.glob("*.json")) == ["ps-0", "worker-0", "worker-1"]


def test_check_reports_every_process_output():
    specs = [
        harness.ProcessSpec("good", [sys.executable, str(SCRIPTS / "exit_code.py"), "0", "0"]),
        harness.ProcessSpec("bad", [sys.executable, str(SCRIPTS / "exit_code.py"), "3", "0.2"]),
    ]
    result = harness.run(specs)

    with pytest.raises(AssertionError) as raised:
        result.check()
    message = str(raised.value)
    assert "bad failed first with returncode 3" in message
    assert (
        "[good] out line" in message
        and "[bad] err line" in message
        and "[bad] exiting with 3" in message
    )


def test_a_hang_fails_the_test_with_the_stacks():
    specs = [
        harness.ProcessSpec("hung", [sys.executable, str(SCRIPTS / "block.py"), "-", "socket"])
    ]

    with pytest.raises(pytest.fail.Exception) as raised:
        harness.run(specs, timeout=2)
    message = str(raised.value)
    assert "Still running: hung (pid" in message
    assert (
        "[hung] ready" in message and "most recent call first" in message and "in accept" in message
    )


def test_wait_until_gone_reports_survivors():
    specs = [
        harness.ProcessSpec("sleeper", [sys.executable, str(SCRIPTS / "block.py"), "-", "sleep"])
    ]
    with harness.start(specs) as processes:
        assert processes.wait_for_output("sleeper", "ready", 30)
        pid = processes.pids["sleeper"]
        assert harness.wait_until_gone([pid], timeout=0.2) == [pid]
        processes.send_signal("sleeper", signal.SIGTERM)
        harness.wait(processes, 30)
    assert harness.wait_until_gone([pid], timeout=10) == []
