"""Tests for `kdist launch` (kdist.launch.cli and kdist.launch.plans).

Most tests call `cli.main(argv)` in this process; the ones about signals and
orphans start the real `python -m kdist launch` through the test harness.
"""

import json
import signal
import sys
import threading
from pathlib import Path

import pytest

from kdist.launch import cli
from tests import harness

SCRIPTS = Path(__file__).parent / "scripts"
REPORT_ENV = str(SCRIPTS / "report_env.py")
BY_RANK = str(SCRIPTS / "by_rank.py")
TIMEOUT = 60.0


def read_reports(directory):
    return {
        path.stem: json.loads(path.read_text()) for path in sorted(Path(directory).glob("*.json"))
    }


def test_nproc_sets_torchrun_variables_and_removes_tf_config(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(
        "TF_CONFIG", '{"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0}}'
    )
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    code = cli.main(
        ["launch", "--nproc", "2", REPORT_ENV, str(tmp_path), "--epochs", "3", "--grace", "1"]
    )

    assert code == 0
    reports = read_reports(tmp_path)
    assert sorted(reports) == ["worker-0", "worker-1"]
    port = reports["worker-0"]["MASTER_PORT"]
    assert port.isdigit() and 0 < int(port) < 65536
    for rank in range(2):
        env = reports[f"worker-{rank}"]
        assert {name: env[name] for name in ("RANK", "LOCAL_RANK", "ROLE_RANK")} == dict.fromkeys(
            ("RANK", "LOCAL_RANK", "ROLE_RANK"), str(rank)
        )
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "1"
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", port)
        assert env["TF_CONFIG"] is None
        assert env["KDIST_LAUNCHER"] == env["PYTHONFAULTHANDLER"] == env["PYTHONUNBUFFERED"] == "1"
        assert int(env["OMP_NUM_THREADS"]) >= 1
        assert env["argv"] == ["--epochs", "3", "--grace", "1"]
    captured = capsys.readouterr()
    assert "[worker-0] hello from worker-0 on stdout" in captured.out
    assert "[worker-1] hello from worker-1 on stderr" in captured.err


def test_nproc_honours_master_address_and_port(tmp_path):
    port = harness.free_port()

    code = cli.main(
        [
            "launch",
            "--nproc",
            "1",
            "--master-addr",
            "localhost",
            "--master-port",
            str(port),
            REPORT_ENV,
            str(tmp_path),
        ]
    )

    assert code == 0
    env = read_reports(tmp_path)["worker-0"]
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["WORLD_SIZE"]) == (
        "localhost",
        str(port),
        "1",
    )


def test_module_mode_runs_python_dash_m(tmp_path, monkeypatch):
    monkeypatch.chdir(harness.REPO_ROOT)

    code = cli.main(
        ["launch", "--nproc", "1", "-m", "tests.launch.scripts.report_env", str(tmp_path)]
    )

    assert code == 0
    assert sorted(read_reports(tmp_path)) == ["worker-0"]


def test_exit_code_is_the_first_failing_process_and_survivors_show_stacks(capsys):
    code = cli.main(
        ["launch", "--nproc", "3", "--grace", "1", BY_RANK, "block", "exit:3:0.5", "exit:0:0"]
    )

    assert code == 3
    err = capsys.readouterr().err
    assert "[kdist] worker-1 failed first: it exited with code 3; exit code 3" in err
    assert "[worker-0] Current thread" in err and "most recent call first" in err
    assert '[worker-0]   File "' in err and "by_rank.py" in err


def test_timeout_stops_the_job_with_exit_code_124(capsys):
    code = cli.main(["launch", "--nproc", "1", "--timeout", "1.5", BY_RANK, "block"])

    assert code == cli.EXIT_TIMEOUT
    err = capsys.readouterr().err
    assert "Still running: worker-0" in err and "[worker-0]   File" in err


@pytest.mark.parametrize("whole_tf_config", [True, False], ids=["tf-config-file", "cluster-file"])
def test_cluster_tasks_get_their_tf_config(tmp_path, monkeypatch, whole_tf_config):
    monkeypatch.setenv("RANK", "7")
    cluster = {
        "worker": ["10.0.0.1:2222", "10.0.0.2:2222", "10.0.0.3:2222"],
        "ps": ["10.0.0.4:2222"],
    }
    content = (
        {"cluster": cluster, "task": {"type": "worker", "index": 0}} if whole_tf_config else cluster
    )
    cluster_path = tmp_path / "cluster.json"
    cluster_path.write_text(json.dumps(content))
    out = tmp_path / "out"
    out.mkdir()

    code = cli.main(
        [
            "launch",
            "--cluster",
            str(cluster_path),
            "--task",
            "worker:1",
            "--task",
            "ps:0",
            "--task",
            "worker:2",
            REPORT_ENV,
            str(out),
        ]
    )

    assert code == 0
    reports = read_reports(out)
    assert sorted(reports) == ["ps-0", "worker-1", "worker-2"]
    for name, env in reports.items():
        task_type, task_index = name.split("-")
        assert json.loads(env["TF_CONFIG"]) == {
            "cluster": cluster,
            "task": {"type": task_type, "index": int(task_index)},
        }
        assert env["RANK"] is None and env["MASTER_PORT"] is None
        assert env["KDIST_LAUNCHER"] == "1"


def test_local_ps_cluster_gives_every_task_its_port_and_stops_the_ps(tmp_path, capsys):
    code = cli.main(
        [
            "launch",
            "--ps",
            "2",
            "--workers",
            "2",
            "--chief",
            "--grace",
            "5",
            str(SCRIPTS / "tf_task.py"),
            str(tmp_path),
        ]
    )

    assert code == 0
    reports = read_reports(tmp_path)
    assert sorted(reports) == ["chief-0", "ps-0", "ps-1", "worker-0", "worker-1"]
    cluster = reports["chief-0"]["TF_CONFIG"]["cluster"]
    assert list(cluster) == ["chief", "worker", "ps"]
    assert [len(cluster[job]) for job in cluster] == [1, 2, 2]
    addresses = [address for job in cluster.values() for address in job]
    assert len(set(addresses)) == 5 and all(
        address.startswith("127.0.0.1:") for address in addresses
    )
    for name, report in reports.items():
        task_type, task_index = name.split("-")
        assert report["TF_CONFIG"] == {
            "cluster": cluster,
            "task": {"type": task_type, "index": int(task_index)},
        }
    assert (
        harness.wait_until_gone([reports["ps-0"]["pid"], reports["ps-1"]["pid"]], timeout=10) == []
    )
    out = capsys.readouterr().out
    assert "[ps-1] serving" in out and "[chief-0] chief-0 done" in out


def _cluster_file(tmp_path, content):
    path = tmp_path / "cluster.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


GOOD_CLUSTER = {"worker": ["127.0.0.1:1111", "127.0.0.1:2222"]}

# (id, argv after "launch" with {script}/{cluster:...} placeholders, expected text in the error)
BAD_ARGUMENTS = [
    ("nproc-zero", ["--nproc", "0", "{script}"], "argument --nproc: must be at least 1"),
    ("nproc-word", ["--nproc", "two", "{script}"], "argument --nproc: expected a whole number"),
    ("no-script", ["--nproc", "2"], "the following arguments are required: script"),
    ("missing-script", ["--nproc", "2", "no_such_script.py"], "argument script: no such file"),
    ("no-mode", ["{script}"], "argument --nproc: choose how to launch"),
    (
        "task-without-cluster",
        ["--nproc", "1", "--task", "worker:0", "{script}"],
        "argument --task: only allowed with --cluster",
    ),
    (
        "malformed-task",
        ["--cluster", "{cluster:good}", "--task", "worker1", "{script}"],
        "argument --task: expected TYPE:INDEX",
    ),
    (
        "cluster-without-task",
        ["--cluster", "{cluster:good}", "{script}"],
        "argument --task: --cluster needs at least one",
    ),
    (
        "unknown-job",
        ["--cluster", "{cluster:good}", "--task", "ps:0", "{script}"],
        "argument --task: job 'ps' is not in the cluster",
    ),
    (
        "index-out-of-range",
        ["--cluster", "{cluster:good}", "--task", "worker:2", "{script}"],
        "argument --task: job 'worker' has 2 task(s)",
    ),
    (
        "duplicate-task",
        ["--cluster", "{cluster:good}", "--task", "worker:0", "--task", "worker:0", "{script}"],
        "argument --task: worker:0 was given twice",
    ),
    (
        "unreadable-cluster",
        ["--cluster", "/nonexistent/cluster.json", "--task", "worker:0", "{script}"],
        "argument --cluster: cannot read",
    ),
    (
        "cluster-not-json",
        ["--cluster", "{cluster:not-json}", "--task", "worker:0", "{script}"],
        "argument --cluster: '",
    ),
    (
        "cluster-list",
        ["--cluster", "{cluster:list}", "--task", "worker:0", "{script}"],
        "must hold a JSON object",
    ),
    (
        "cluster-bad-address",
        ["--cluster", "{cluster:bad-address}", "--task", "worker:0", "{script}"],
        "[\"cluster\"]['worker'][1]",
    ),
    (
        "cluster-job-not-list",
        ["--cluster", "{cluster:job-not-list}", "--task", "worker:0", "{script}"],
        "cluster['worker'] in",
    ),
    (
        "nproc-and-cluster",
        ["--nproc", "2", "--cluster", "{cluster:good}", "--task", "worker:0", "{script}"],
        "argument --cluster: not allowed with argument --nproc",
    ),
    (
        "nproc-and-workers",
        ["--nproc", "2", "--workers", "2", "{script}"],
        "argument --workers: not allowed with argument --nproc",
    ),
    ("ps-without-workers", ["--ps", "2", "{script}"], "argument --ps: needs --workers"),
    (
        "chief-with-nproc",
        ["--nproc", "2", "--chief", "{script}"],
        "argument --chief: only allowed with --workers",
    ),
    (
        "master-port-with-workers",
        ["--workers", "1", "--master-port", "1234", "{script}"],
        "argument --master-port: only allowed with --nproc",
    ),
    (
        "port-out-of-range",
        ["--nproc", "1", "--master-port", "70000", "{script}"],
        "argument --master-port: must be a TCP port",
    ),
    (
        "negative-grace",
        ["--nproc", "1", "--grace", "-1", "{script}"],
        "argument --grace: must be >= 0",
    ),
    (
        "zero-timeout",
        ["--nproc", "1", "--timeout", "0", "{script}"],
        "argument --timeout: must be more than 0",
    ),
    (
        "unknown-daemon-job",
        ["--workers", "1", "--daemon-jobs", "ps", "{script}"],
        "argument --daemon-jobs: ps is not a job",
    ),
    ("no-workers", ["--workers", "0", "{script}"], "argument --workers: needs at least one worker"),
]

CLUSTER_FILES = {
    "good": GOOD_CLUSTER,
    "not-json": "{worker: nope",
    "list": ["127.0.0.1:1111"],
    "bad-address": {"cluster": {"worker": ["127.0.0.1:1111", "no-port"]}},
    "job-not-list": {"worker": "127.0.0.1:1111"},
}


@pytest.mark.parametrize(
    "argv, expected", [case[1:] for case in BAD_ARGUMENTS], ids=[case[0] for case in BAD_ARGUMENTS]
)
def test_bad_arguments_exit_2_naming_the_argument_and_start_nothing(
    tmp_path, capsys, argv, expected
):
    out = tmp_path / "out"
    out.mkdir()
    script = [REPORT_ENV, str(out)]
    expanded = []
    for arg in argv:
        if arg == "{script}":
            expanded += script
        elif arg.startswith("{cluster:"):
            expanded.append(_cluster_file(tmp_path, CLUSTER_FILES[arg[len("{cluster:") : -1]]))
        else:
            expanded.append(arg)

    code = cli.main(["launch", *expanded])

    assert code == 2
    err = capsys.readouterr().err
    assert "usage: kdist launch" in err
    assert expected in err
    assert list(out.iterdir()) == []


def test_help_exits_0_and_documents_every_option():
    launch_parser = cli.build_parser()._subparsers._group_actions[0].choices["launch"]
    options = [option for action in launch_parser._actions for option in action.option_strings]

    result = harness.run(
        [
            harness.ProcessSpec(
                "help",
                [sys.executable, "-m", "kdist", "launch", "--help"],
                cwd=str(harness.REPO_ROOT),
            )
        ],
        timeout=TIMEOUT,
    )

    assert result.returncodes == {"help": 0}
    text = result.output("help", "stdout")
    assert "usage: kdist launch" in text and "examples:" in text
    missing = [option for option in options if option not in text]
    assert missing == [] and len(options) > 10


def test_top_level_usage_errors_exit_2(capsys):
    assert cli.main([]) == 2
    assert cli.main(["launc"]) == 2
    assert "invalid choice: 'launc'" in capsys.readouterr().err


def _start_launcher(tmp_path):
    argv = [
        sys.executable,
        "-m",
        "kdist",
        "launch",
        "--nproc",
        "2",
        "--grace",
        "5",
        str(SCRIPTS / "block.py"),
        str(tmp_path),
        "sleep",
    ]
    return harness.start([harness.ProcessSpec("launcher", argv, cwd=str(harness.REPO_ROOT))])


def _wait_until_ready(processes, tmp_path):
    for rank in range(2):
        assert processes.wait_for_output(
            "launcher", f"[worker-{rank}] ready", TIMEOUT
        ), processes.output("launcher")
    pids = [int(path.read_text()) for path in tmp_path.glob("*.pid")]
    assert len(pids) == 2
    return pids


@pytest.mark.parametrize(
    "signum, exit_code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"]
)
def test_stop_signal_to_the_launcher_stops_every_child(tmp_path, signum, exit_code):
    with _start_launcher(tmp_path) as processes:
        pids = _wait_until_ready(processes, tmp_path)
        processes.send_signal("launcher", signum)
        result = harness.wait(processes, TIMEOUT)

    assert result.returncodes == {"launcher": exit_code}, result.output("launcher")
    assert harness.wait_until_gone(pids, timeout=10) == []
    assert f"received {signal.Signals(signum).name}" in result.output("launcher")


def test_children_die_when_the_launcher_is_killed(tmp_path):
    with _start_launcher(tmp_path) as processes:
        pids = _wait_until_ready(processes, tmp_path)
        processes.send_signal("launcher", signal.SIGKILL)
        result = harness.wait(processes, TIMEOUT)

    assert result.returncodes == {"launcher": -signal.SIGKILL}
    assert harness.wait_until_gone(pids, timeout=10) == []


def test_a_stop_signal_landing_between_the_policy_and_the_wait_is_not_lost():
    # A signal handler runs in the main thread at any bytecode: here right after the
    # set applied its policy and before it waits (with no deadline). The stop must
    # still reach the processes (it once notified nobody and the launcher hung).
    from kdist.launch.processes import ProcessSet
    from kdist.launch.spec import ProcessSpec

    spec = ProcessSpec("sleeper", [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"])
    processes = ProcessSet([spec], grace_seconds=1, kill_after_seconds=1)
    stopper = cli._StopOnSignal(processes, 1)
    apply_policy = processes._apply_policy
    landed = []

    def apply_then_signal(now):
        wake_at = apply_policy(now)
        if not landed and processes.wait_for_output("sleeper", "up", 0):
            landed.append(True)
            stopper._handle(signal.SIGTERM, None)
        return wake_at

    processes._apply_policy = apply_then_signal
    processes.start()
    try:
        assert processes.wait_for_output("sleeper", "up", 60)
        waiter = threading.Thread(target=processes.wait, daemon=True)
        waiter.start()
        waiter.join(30)
        assert landed and not waiter.is_alive(), "the stop was lost: the set still waits"
        assert processes.returncodes["sleeper"] == -signal.SIGTERM
    finally:
        processes.kill_all()
