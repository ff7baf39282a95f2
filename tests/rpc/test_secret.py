"""Where the cluster secret comes from (`kdist.rpc.secret`): a cluster inside one process
needs no configuration and no other process can call it; `KDIST_SECRET` and
`KDIST_SECRET_FILE` give a cluster of processes one secret."""

import os
import subprocess
import sys

import numpy as np
import pytest

from kdist.errors import InvalidArgumentError
from kdist.ps import VariableClient, VariableInit, create_server
from kdist.rpc import secret
from kdist.rpc.security import Security
from tests import harness

VALUE = np.arange(4, dtype="float32")
# A client in another process: pulls "w" and assigns zeros to it.
_OTHER_PROCESS = """
import sys, numpy as np
from kdist.ps import Assignment, ServiceOptions, VariableClient
options = ServiceOptions(rpc_timeout_seconds=10, connect_timeout_seconds=2)
with VariableClient(sys.argv[1], options=options) as client:
    try:
        client.assign([Assignment("w", np.zeros(4, "float32"))])
    except Exception as error:
        print(type(error).__name__, error)
        sys.exit(3)
print("assigned")
"""


def _other_process(address, **env_changes):
    env = {key: value for key, value in os.environ.items() if not key.startswith("KDIST_SECRET")}
    env.update(env_changes)
    env["PYTHONPATH"] = str(harness.REPO_ROOT)
    return subprocess.run([sys.executable, "-c", _OTHER_PROCESS, address], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def no_environment_secret(monkeypatch):
    monkeypatch.delenv("KDIST_SECRET", raising=False)
    monkeypatch.delenv("KDIST_SECRET_FILE", raising=False)


def test_an_in_process_cluster_needs_no_configuration_and_refuses_other_processes(no_environment_secret):
    with create_server() as server, VariableClient(server.address) as client:
        client.create([VariableInit("w", VALUE)])
        outsider = _other_process(server.address)
        assert outsider.returncode == 3, outsider.stdout + outsider.stderr
        assert "PeerAuthenticationError" in outsider.stdout
        [state] = client.pull(["w"])
    np.testing.assert_array_equal(state.value, VALUE)
    assert state.version == 0


def test_processes_given_the_same_secret_file_work_together(no_environment_secret, monkeypatch, tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text("a-shared-cluster-secret\n")
    secret_file.chmod(0o600)
    monkeypatch.setenv("KDIST_SECRET_FILE", str(secret_file))
    with create_server() as server, VariableClient(server.address) as client:
        client.create([VariableInit("w", VALUE)])
        insider = _other_process(server.address, KDIST_SECRET_FILE=str(secret_file))
        assert insider.returncode == 0, insider.stdout + insider.stderr
        [state] = client.pull(["w"])
    np.testing.assert_array_equal(state.value, np.zeros(4, "float32"))


def test_the_secret_variable_wins_over_the_file(no_environment_secret, monkeypatch, tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-the-file\n")
    monkeypatch.setenv("KDIST_SECRET_FILE", str(secret_file))
    assert secret.cluster_secret() == b"from-the-file"
    monkeypatch.setenv("KDIST_SECRET", "from-the-variable")
    assert secret.cluster_secret() == b"from-the-variable"
    assert Security(token="explicit").secret() == b"explicit"


def test_without_the_environment_the_process_secret_is_drawn_once(no_environment_secret):
    first = secret.cluster_secret()
    assert len(first) == 32 and secret.cluster_secret() is first


@pytest.mark.parametrize("case", ["missing-file", "empty-file", "spaces-in-variable"])
def test_a_bad_secret_is_a_typed_error_that_does_not_echo_it(no_environment_secret, monkeypatch, tmp_path, case):
    if case == "missing-file":
        monkeypatch.setenv("KDIST_SECRET_FILE", str(tmp_path / "missing"))
        match = "Cannot read the token file"
    elif case == "empty-file":
        (tmp_path / "empty").write_text("\n")
        monkeypatch.setenv("KDIST_SECRET_FILE", str(tmp_path / "empty"))
        match = "non-empty"
    else:
        monkeypatch.setenv("KDIST_SECRET", "two secret words")
        match = "KDIST_SECRET"
    with pytest.raises(InvalidArgumentError, match=match) as caught:
        Security().secret()
    assert "secret words" not in str(caught.value)
    with pytest.raises(InvalidArgumentError):
        create_server()
