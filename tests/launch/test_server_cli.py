"""Tests for `kdist server` (kdist.launch.server_cli).

Argument checks call `cli.main(argv)` (or `prepare`) in this process; serving,
signals and exit codes run the real `python -m kdist server` through the test
harness.
"""

import json
import re
import signal
import sys

import numpy as np
import pytest

from kdist.cluster import ClusterSpec
from kdist.errors import InvalidArgumentError
from kdist.launch import cli, server_cli
from tests import harness
from tests.rpc.certs_fixture import certificates  # noqa: F401 (a fixture)

TIMEOUT = 60.0
TOKEN = "cli-test-token"
SERVING = re.compile(r"\[kdist\] serving (\S+) at (\S+) \((.*)\)")


def write_cluster(tmp_path, cluster, name="cluster.json"):
    path = tmp_path / name
    path.write_text(json.dumps(cluster))
    return str(path)


def parse(argv, environ=None):
    args = cli.build_parser().parse_args(argv)
    environ = {"KDIST_SECRET": TOKEN} if environ is None else environ
    return server_cli.prepare(args, environ=environ)


def usage_error(argv, capsys, monkeypatch, tf_config=None):
    if tf_config is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    code = cli.main(argv)
    assert code == cli.EXIT_USAGE
    return capsys.readouterr().err


# -- Arguments ------------------------------------------------------------------------


def test_cluster_file_and_task(tmp_path):
    path = write_cluster(tmp_path, {"ps": ["127.0.0.1:2222", "127.0.0.1:2223"], "worker": ["h:1"]})
    plan = parse(["server", "--job", "ps", "--index", "1", "--cluster", path])
    assert plan.cluster_spec == ClusterSpec(
        {"ps": ["127.0.0.1:2222", "127.0.0.1:2223"], "worker": ["h:1"]}
    )
    assert (plan.job_name, plan.task_index, plan.bind_address) == ("ps", 1, None)
    assert plan.security.token == TOKEN and not plan.security.server_tls  # from KDIST_SECRET
    assert plan.options is None


def test_the_cluster_secret_is_required_unless_insecure(tmp_path):
    path = write_cluster(tmp_path, {"ps": ["127.0.0.1:2222"]})
    argv = ["server", "--job", "ps", "--index", "0", "--cluster", path]
    with pytest.raises(InvalidArgumentError, match="needs the cluster secret") as refused:
        parse(argv, environ={})
    assert "--insecure" in str(refused.value)
    secret_file = tmp_path / "secret"
    secret_file.write_text(TOKEN + "\n")
    assert parse(argv, environ={"KDIST_SECRET_FILE": str(secret_file)}).security.token == TOKEN
    insecure = parse([*argv, "--insecure"], environ={}).security
    assert not insecure.authenticate and insecure.secret() is None
    with pytest.raises(InvalidArgumentError, match="--insecure and --token-file"):
        parse([*argv, "--insecure", "--token-file", str(secret_file)], environ={})


def test_cluster_file_may_hold_a_whole_tf_config(tmp_path):
    path = write_cluster(
        tmp_path, {"cluster": {"ps": ["h:2222"]}, "task": {"type": "worker", "index": 7}}
    )
    plan = parse(["server", "--job", "ps", "--index", "0", "--cluster", path, "--bind", "0.0.0.0"])
    assert (plan.job_name, plan.task_index, plan.bind_address) == ("ps", 0, "0.0.0.0")


def test_tf_config_gives_cluster_and_task():
    tf_config = {"cluster": {"ps": ["h:2222", "h:2223"]}, "task": {"type": "ps", "index": 1}}
    environ = {"TF_CONFIG": json.dumps(tf_config), "KDIST_SECRET": TOKEN}
    plan = parse(["server"], environ)
    assert (plan.job_name, plan.task_index) == ("ps", 1)
    plan = parse(["server", "--index", "0"], environ)
    assert (plan.job_name, plan.task_index) == ("ps", 0)


def test_security_and_staleness_options(tmp_path, certificates):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    path = write_cluster(tmp_path, {"ps": ["localhost:2222"]})
    plan = parse(
        ["server", "--job", "ps", "--index", "0", "--cluster", path,
         "--token-file", str(token_file), "--tls-cert", certificates.server_cert,
         "--tls-key", certificates.server_key, "--tls-ca", certificates.ca_cert,
         "--max-staleness", "3"]
    )
    assert plan.security.token == TOKEN
    assert plan.security.server_tls and plan.security.ca_file == certificates.ca_cert
    assert plan.options.max_staleness == 3


def test_no_cluster_is_a_usage_error(capsys, monkeypatch):
    err = usage_error(["server", "--job", "ps", "--index", "0"], capsys, monkeypatch)
    assert "No cluster" in err and "usage: kdist server" in err


def test_cluster_needs_job_and_index(tmp_path, capsys, monkeypatch):
    path = write_cluster(tmp_path, {"ps": ["h:2222"]})
    err = usage_error(["server", "--cluster", path, "--job", "ps"], capsys, monkeypatch)
    assert "--job and --index" in err


def test_task_must_exist(tmp_path, capsys, monkeypatch):
    path = write_cluster(tmp_path, {"ps": ["h:2222"]})
    argv = ["server", "--cluster", path, "--job", "ps", "--index", "1"]
    err = usage_error(argv, capsys, monkeypatch)
    assert "has 1 task(s)" in err
    err = usage_error(
        ["server"], capsys, monkeypatch,
        tf_config={"cluster": {"ps": ["h:2222"]}, "task": {"type": "ps", "index": 4}},
    )
    assert "task index is out of range" in err


def test_only_ps_and_workers_are_served(tmp_path, capsys, monkeypatch):
    path = write_cluster(tmp_path, {"ps": ["h:2222"], "worker": ["h:2223"], "chief": ["h:2224"]})
    err = usage_error(
        ["server", "--cluster", path, "--job", "chief", "--index", "0"], capsys, monkeypatch
    )
    assert "'ps' and 'worker'" in err and "ClusterCoordinator" in err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tls-cert", "CERT"], "--tls-cert and --tls-key go together"),
        (["--tls-ca", "CA"], "--tls-ca requires client certificates"),
        (["--token-file", "/nonexistent/token"], "Cannot read the token file"),
        (["--bind", "host:port"], "bind_address"),
        (["--max-staleness", "-1"], "must be at least 0"),
        (["--grace", "soon"], "expected a number of seconds"),
    ],
)
def test_bad_options_are_usage_errors(tmp_path, capsys, monkeypatch, certificates, extra, message):
    extra = [
        {"CERT": certificates.server_cert, "CA": certificates.ca_cert}.get(item, item)
        for item in extra
    ]
    path = write_cluster(tmp_path, {"ps": ["h:2222"]})
    err = usage_error(
        ["server", "--cluster", path, "--job", "ps", "--index", "0", *extra], capsys, monkeypatch
    )
    assert message in err


def test_help_describes_both_jobs(capsys):
    assert cli.main(["server", "--help"]) == 0
    server_help = " ".join(capsys.readouterr().out.split())
    assert "--job ps the variable service" in server_help
    assert "--job worker the worker service" in server_help
    assert "kdist server --job worker --index 0" in server_help  # An example for each job.
    assert "kdist server --job ps --index 0" in server_help
    assert cli.main(["--help"]) == 0
    assert "serve one ps or worker task" in capsys.readouterr().out


def test_launch_is_still_a_subcommand():
    args = cli.build_parser().parse_args(["launch", "--nproc", "2", "train.py"])
    assert args.command == "launch" and args.run is cli.run_launch


# -- Serving (real processes) ----------------------------------------------------------


def server_spec(argv, tf_config=None, name="ps-0"):
    env = {"TF_CONFIG": None if tf_config is None else json.dumps(tf_config)}
    return harness.ProcessSpec(name, [sys.executable, "-m", "kdist", "server", *argv], env)


def serving_address(processes, name="ps-0"):
    if not processes.wait_for_output(name, "[kdist] serving", TIMEOUT):
        pytest.fail(f"the server never said it serves:\n{harness.format_outputs(processes)}")
    match = SERVING.search(processes.output(name, "stdout"))
    assert match is not None, harness.format_outputs(processes)
    return match.group(2), match.group(3)


def make_client(address, security=None):
    from kdist.ps import ServiceOptions, VariableClient

    options = ServiceOptions(rpc_timeout_seconds=10, connect_timeout_seconds=5)
    return VariableClient(address, options=options, security=security)


def test_server_serves_until_sigterm(tmp_path):
    from kdist.ps import VariableInit

    port = harness.free_port()
    path = write_cluster(tmp_path, {"ps": [f"localhost:{port}"], "worker": ["localhost:1"]})
    spec = server_spec(["--job", "ps", "--index", "0", "--cluster", path, "--max-staleness", "2"])
    with harness.start([spec]) as processes:
        address, description = serving_address(processes)
        assert address == f"127.0.0.1:{port}"
        assert description == "TLS off, cluster secret on"
        with make_client(address) as client:
            client.create([VariableInit("w", np.arange(4, dtype="float32"))])
            [state] = client.pull(["w"])
        np.testing.assert_array_equal(state.value, np.arange(4, dtype="float32"))
        processes.send_signal("ps-0", signal.SIGTERM)
        result = harness.wait(processes, TIMEOUT)
    assert result.returncodes["ps-0"] == 0, harness.format_outputs(processes)
    assert "ps:0 stopped (SIGTERM)" in result.output("ps-0", "stderr")


def test_server_from_tf_config_with_token_and_tls(tmp_path, certificates):
    from kdist.errors import UnauthenticatedError
    from kdist.ps import Security, VariableInit

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    port = harness.free_port()
    tf_config = {"cluster": {"ps": [f"localhost:{port}"]}, "task": {"type": "ps", "index": 0}}
    spec = server_spec(
        ["--bind", "0.0.0.0", "--token-file", str(token_file), "--tls-cert",
         certificates.server_cert, "--tls-key", certificates.server_key],
        tf_config,
    )
    with harness.start([spec]) as processes:
        address, description = serving_address(processes)
        assert address == f"0.0.0.0:{port}" and description == "TLS, cluster secret on"
        target = f"localhost:{port}"
        with make_client(target, Security.insecure(ca_file=certificates.ca_cert)) as anonymous:
            with pytest.raises(UnauthenticatedError):
                anonymous.create([VariableInit("w", np.zeros(2, dtype="float32"))])
        with make_client(target, Security(token=TOKEN, ca_file=certificates.ca_cert)) as client:
            [state] = client.create([VariableInit("w", np.ones(2, dtype="float32"))])
        np.testing.assert_array_equal(state.value, np.ones(2, dtype="float32"))
        processes.send_signal("ps-0", signal.SIGINT)
        result = harness.wait(processes, TIMEOUT)
    assert result.returncodes["ps-0"] == 0, harness.format_outputs(processes)
    assert "ps:0 stopped (SIGINT)" in result.output("ps-0", "stderr")


def test_exposed_server_without_protection_warns_and_taken_port_fails(tmp_path):
    port = harness.free_port()
    path = write_cluster(tmp_path, {"ps": [f"localhost:{port}"]})
    argv = ["--job", "ps", "--index", "0", "--cluster", path]
    with harness.start([server_spec([*argv, "--bind", "0.0.0.0", "--insecure"])]) as processes:
        serving_address(processes)
        second = harness.run([server_spec(argv, name="ps-again")], timeout=TIMEOUT)
        processes.send_signal("ps-0", signal.SIGTERM)
        result = harness.wait(processes, TIMEOUT)
    assert result.returncodes["ps-0"] == 0, harness.format_outputs(processes)
    err = result.output("ps-0", "stderr")
    assert "without the cluster secret" in err and "anyone who can reach it" in err
    assert "beyond this machine without TLS" in err
    assert second.returncodes["ps-again"] == server_cli.EXIT_FAILURE
    assert "could not start serving" in second.output("ps-again", "stderr")
