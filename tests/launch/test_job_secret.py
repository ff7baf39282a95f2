"""Tests for kdist.launch.job_secret: the per-job secret `kdist launch` hands to its children."""

import json
import os
import signal
import stat
import sys
from pathlib import Path

import pytest

from kdist.launch import cli
from kdist.launch.job_secret import SECRET_FILE_VARIABLE, SECRET_VARIABLE, JobSecret
from tests import harness

SCRIPTS = Path(__file__).parent / "scripts"
REPORT_SECRET = str(SCRIPTS / "report_secret.py")
TIMEOUT = 60.0


@pytest.fixture(autouse=True)
def no_user_secret(monkeypatch):
    monkeypatch.delenv(SECRET_FILE_VARIABLE, raising=False)
    monkeypatch.delenv(SECRET_VARIABLE, raising=False)


def read_reports(directory):
    return {path.stem: json.loads(path.read_text()) for path in Path(directory).glob("*.json")}


def launch(out_dir, *mode):
    code = cli.main(["launch", *mode, "--grace", "5", REPORT_SECRET, str(out_dir)])
    assert code == 0
    return read_reports(out_dir)


def test_job_secret_file_is_private_and_removed_on_close():
    with JobSecret.create({}) as secret:
        path = Path(secret.path)
        assert secret.generated and secret.env == {SECRET_FILE_VARIABLE: str(path)}
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        text = path.read_text()
        assert text.endswith("\n") and text.count("\n") == 1 and len(text.strip()) >= 32
    assert not path.exists() and not path.parent.exists()
    secret.close()  # A second close does nothing.


@pytest.mark.parametrize("variable", [SECRET_FILE_VARIABLE, SECRET_VARIABLE])
def test_a_users_secret_is_kept_and_nothing_is_made(variable):
    with JobSecret.create({variable: "/somewhere/secret"}) as secret:
        assert not secret.generated and secret.path is None and secret.env == {}


def test_every_child_gets_the_secret_file_and_never_the_secret_itself(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()

    reports = launch(first, "--workers", "2", "--ps", "1", "--chief")
    other = launch(second, "--nproc", "2")

    assert sorted(reports) == ["chief-0", "ps-0", "worker-0", "worker-1"]
    paths = {report[SECRET_FILE_VARIABLE] for report in reports.values()}
    texts = {report["text"] for report in reports.values()}
    assert len(paths) == 1 and len(texts) == 1
    secret = texts.pop().strip()
    assert len(secret) >= 32
    for name, report in reports.items():
        assert (report["file_mode"], report["dir_mode"]) == (0o600, 0o700), name
        assert report[SECRET_VARIABLE] is None
        assert secret not in report["cmdline"] and secret not in report["parent_cmdline"]
    # Removed when the launcher exits.
    path = Path(paths.pop())
    assert not path.exists() and not path.parent.exists()
    # A fresh secret for every launch.
    other_texts = {report["text"] for report in other.values()}
    assert len(other_texts) == 1 and other_texts.pop().strip() != secret


@pytest.mark.parametrize("variable", [SECRET_FILE_VARIABLE, SECRET_VARIABLE])
def test_a_preset_secret_is_passed_through_unchanged(tmp_path, monkeypatch, variable):
    user_file = tmp_path / "cluster-secret"
    user_file.write_text("the cluster's own secret, shared by every host\n")
    value = str(user_file) if variable == SECRET_FILE_VARIABLE else "inline-secret-" + "x" * 32
    monkeypatch.setenv(variable, value)

    reports = launch(tmp_path, "--nproc", "2")

    for report in reports.values():
        assert report[variable] == value
        other = SECRET_VARIABLE if variable == SECRET_FILE_VARIABLE else SECRET_FILE_VARIABLE
        assert report[other] is None
    assert user_file.exists()


def test_a_cluster_with_tasks_on_other_hosts_gets_no_made_up_secret(tmp_path, capsys):
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"worker": ["127.0.0.1:1", "10.0.0.2:1"]}))
    out = tmp_path / "out"
    out.mkdir()

    reports = launch(out, "--cluster", str(cluster), "--task", "worker:0")

    assert reports["worker-0"][SECRET_FILE_VARIABLE] is None
    assert "no secret is made here" in capsys.readouterr().err


def test_the_secret_file_is_removed_when_the_launcher_is_stopped(tmp_path):
    argv = [sys.executable, "-m", "kdist", "launch", "--nproc", "1", "--grace", "5"]
    argv += [REPORT_SECRET, str(tmp_path), "block"]
    env = {SECRET_FILE_VARIABLE: None, SECRET_VARIABLE: None}
    spec = harness.ProcessSpec("launcher", argv, env, cwd=str(harness.REPO_ROOT))
    with harness.start([spec]) as processes:
        assert processes.wait_for_output("launcher", "[worker-0] ready", TIMEOUT)
        path = Path(read_reports(tmp_path)["worker-0"][SECRET_FILE_VARIABLE])
        assert path.exists()
        processes.send_signal("launcher", signal.SIGTERM)
        result = harness.wait(processes, TIMEOUT)

    assert result.returncodes == {"launcher": 128 + signal.SIGTERM}, result.output("launcher")
    assert not path.exists() and not path.parent.exists()
    assert os.path.basename(path.parent).startswith("kdist-secret-")
