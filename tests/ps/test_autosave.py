"""A parameter server that checkpoints itself and comes back (issue 24 point 3), in one process.

Real gRPC servers on loopback: a server is stopped (or only its gRPC server
is stopped, leaving the push counter and the last checkpoint as `kill -9`
would) and a new one is started on the same port from the same directory;
the client carries on by itself.
"""

import threading
import time

import keras
import numpy as np
import pytest

from kdist.errors import InvalidArgumentError, ParameterServerUnavailableError
from kdist.ps import DenseGradient, ServiceOptions, VariableClient, VariableInit, create_server
from kdist.ps import autosave
from kdist.ps.server.autosaver import CHECKPOINT_NAME, COUNTER_NAME
from kdist.ps.server.checkpoint import MANIFEST_NAME

pytestmark = pytest.mark.timeout(60)

CLIENT = ServiceOptions(rpc_timeout_seconds=30, connect_timeout_seconds=10,
                        recovery_timeout_seconds=20)
VALUE = np.arange(12, dtype="float32").reshape(4, 3)


def _serving(directory, every="1", address="127.0.0.1:0"):
    return create_server(address, options=ServiceOptions(checkpoint_dir=str(directory),
                                                         checkpoint_every=every))


def _crash(server):
    # Only the gRPC server stops: no checkpoint at stop, the counter stays as
    # the page cache keeps it after `kill -9` (test only: a private attribute).
    server._server.stop(0).wait(10)


def _setup(client):
    client.create([VariableInit("w", VALUE)])
    adam = keras.optimizers.serialize(keras.optimizers.Adam(0.1))
    client.configure_optimizer(adam, ["w"])


def _push(client, update_id=None, scale=1.0):
    return client.push([DenseGradient("w", np.full((4, 3), scale, "float32"))], update_id=update_id)


def _reference(num_pushes):
    """The values of an uninterrupted server after `num_pushes` pushes."""
    with create_server() as server, VariableClient(server.address, options=CLIENT) as client:
        _setup(client)
        for step in range(num_pushes):
            _push(client, scale=step + 1.0)
        [state] = client.pull(["w"])
        return state.value, client.optimizer_state(["w"])["w"]


def test_a_server_restarted_on_its_port_restores_and_the_client_carries_on(tmp_path):
    server = _serving(tmp_path)
    address = server.address
    with VariableClient(address, options=CLIENT) as client:
        _setup(client)
        for step in range(3):
            _push(client, scale=step + 1.0)
        _crash(server)
        # The client waits for the server to come back (started 1.5 s later).
        restarted = []
        timer = threading.Timer(1.5, lambda: restarted.append(_serving(tmp_path, address=address)))
        timer.start()
        try:
            _push(client, scale=4.0)
            [state] = client.pull(["w"])
            slots = client.optimizer_state(["w"])["w"]
        finally:
            timer.join(10)
        assert "push 3" in restarted[0].autosaver.restored, restarted[0].autosaver.restored
        assert "0 pushes applied after it are lost" in restarted[0].autosaver.restored
        restarted[0].stop(0)
    value, reference_slots = _reference(4)
    np.testing.assert_array_equal(state.value, value)
    assert slots.iterations == reference_slots.iterations == 4
    for name, slot in reference_slots.slots.items():
        np.testing.assert_array_equal(slots.slots[name], slot)


def test_a_push_retried_after_the_restore_is_applied_once(tmp_path):
    server = _serving(tmp_path)
    address = server.address
    with VariableClient(address, options=CLIENT) as client:
        _setup(client)
        _push(client, "closure-1/0")
        _crash(server)  # as if the answer to closure-1/0 had been lost with the server
        server = _serving(tmp_path, address=address)
        again = _push(client, "closure-1/0")
        _push(client, "closure-2/0", scale=2.0)
        [state] = client.pull(["w"])
        assert again.versions == {"w": 1}
        assert client.stats().deduplicated_updates == 1
    server.stop(0)
    value, _ = _reference(2)
    np.testing.assert_array_equal(state.value, value)


def test_lost_pushes_are_counted_and_cached_versions_are_not_trusted(tmp_path):
    server = _serving(tmp_path, every="1000")  # only Create and ConfigureOptimizer saved
    address = server.address
    with VariableClient(address, options=CLIENT) as client:
        _setup(client)
        for _ in range(3):
            _push(client)
        [before] = client.pull(["w"])
        assert before.version == 3
        _crash(server)
        server = _serving(tmp_path, address=address)
        assert "push 0" in server.autosaver.restored
        assert "3 pushes applied after it are lost" in server.autosaver.restored
        # The version moved past every version handed out: a pull that knows
        # version 3 gets the restored value, not "unchanged".
        [after] = client.pull(["w"], known_versions={"w": before.version})
        assert after.version == 4 and after.value is not None
        np.testing.assert_array_equal(after.value, VALUE)
        # A gradient computed at the cached version is still accepted.
        _push(client)
    server.stop(0)


def test_a_graceful_stop_saves_what_the_interval_had_not(tmp_path):
    server = _serving(tmp_path, every="3600s")
    with VariableClient(server.address, options=CLIENT) as client:
        _setup(client)
        _push(client)
    server.stop(0)
    server = _serving(tmp_path, every="3600s")
    assert "push 1" in server.autosaver.restored and " 0 pushes" in server.autosaver.restored
    server.stop(0)


def test_seconds_interval_saves_in_the_background(tmp_path):
    server = _serving(tmp_path, every="0.2s")
    with VariableClient(server.address, options=CLIENT) as client:
        _setup(client)
        saves = server.autosaver.num_saves  # Create and ConfigureOptimizer
        _push(client)
        _push(client)
        deadline = time.monotonic() + 10
        while server.autosaver.num_saves == saves and time.monotonic() < deadline:
            time.sleep(0.05)  # a background thread of the server: nothing to wait on
    _crash(server)
    server = _serving(tmp_path, every="0.2s")
    assert "push 2" in server.autosaver.restored and " 0 pushes" in server.autosaver.restored
    server.stop(0)


def test_no_checkpoint_starts_empty_and_a_damaged_one_is_refused(tmp_path):
    server = _serving(tmp_path)
    assert server.autosaver.restored is None and len(server.store) == 0
    with VariableClient(server.address, options=CLIENT) as client:
        _setup(client)
    server.stop(0)
    manifest = tmp_path / CHECKPOINT_NAME / MANIFEST_NAME
    manifest.write_text(manifest.read_text()[:40])
    with pytest.raises(InvalidArgumentError, match="is damaged"):
        _serving(tmp_path)


def test_a_save_interrupted_between_its_renames_restores_the_previous_checkpoint(tmp_path):
    server = _serving(tmp_path)
    with VariableClient(server.address, options=CLIENT) as client:
        _setup(client)
        _push(client)
    server.stop(0)
    # checkpoint.save moves the previous checkpoint aside, then renames the new one in.
    aside = tmp_path / f".{CHECKPOINT_NAME}.old-x"
    aside.mkdir()
    (tmp_path / CHECKPOINT_NAME).rename(aside / CHECKPOINT_NAME)
    (tmp_path / f".{CHECKPOINT_NAME}.tmp-y").mkdir()  # a save killed half-way
    server = _serving(tmp_path)
    assert "push 1" in server.autosaver.restored
    assert not list(tmp_path.glob(".checkpoint.tmp-*"))
    server.stop(0)


def test_a_torn_counter_says_the_loss_is_unknown(tmp_path):
    server = _serving(tmp_path, every="1000")
    with VariableClient(server.address, options=CLIENT) as client:
        _setup(client)
    server.stop(0)
    (tmp_path / COUNTER_NAME).write_bytes(b"\x01" * 16)
    server = _serving(tmp_path, every="1000")
    assert "an unknown number of pushes" in server.autosaver.restored
    assert server.stats().variables["w"].version == 1 << 20
    server.stop(0)


def test_a_server_that_does_not_come_back_fails_the_call_in_time(tmp_path):
    server = _serving(tmp_path)
    options = ServiceOptions(rpc_timeout_seconds=30, connect_timeout_seconds=5,
                             recovery_timeout_seconds=2)
    with VariableClient(server.address, options=options) as client:
        _setup(client)
        server.stop(0)
        started = time.monotonic()
        with pytest.raises(ParameterServerUnavailableError, match="did not come back") as raised:
            client.pull(["w"])
        elapsed = time.monotonic() - started
        assert raised.value.address == server.address and raised.value.retryable
        assert 1.5 <= elapsed < 6, elapsed
        # A Health probe is not held up.
        started = time.monotonic()
        with pytest.raises(ParameterServerUnavailableError):
            client.health()
        assert time.monotonic() - started < 5


def test_recovery_off_fails_as_fast_as_before(tmp_path):
    server = create_server()
    options = ServiceOptions(rpc_timeout_seconds=30, recovery_timeout_seconds=0)
    with VariableClient(server.address, options=options) as client:
        client.create([VariableInit("w", VALUE)])
        server.stop(0)
        started = time.monotonic()
        with pytest.raises(ParameterServerUnavailableError):
            client.pull(["w"])
        assert time.monotonic() - started < 8


def test_checkpoint_options_and_the_launcher_variables():
    every, directory = autosave.CHECKPOINT_EVERY_VARIABLE, autosave.CHECKPOINT_DIR_VARIABLE
    options = autosave.with_environment(ServiceOptions(), {every: "5", directory: "/c/ps-0"})
    assert options.checkpoint_dir == "/c/ps-0"
    assert options.checkpoint_every == autosave.CheckpointEvery(steps=5)
    own = ServiceOptions(checkpoint_dir="/mine", checkpoint_every="2s")
    assert autosave.with_environment(own, {every: "5", directory: "/c"}) is own
    assert autosave.with_environment(ServiceOptions(), {}) == ServiceOptions()
    with pytest.raises(InvalidArgumentError, match="go together"):
        autosave.with_environment(ServiceOptions(), {every: "5"})
    with pytest.raises(InvalidArgumentError, match="go together"):
        ServiceOptions(checkpoint_dir="/c")
    with pytest.raises(InvalidArgumentError, match="checkpoint_every must be"):
        ServiceOptions(checkpoint_dir="/c", checkpoint_every="0")
    with pytest.raises(InvalidArgumentError, match="recovery_timeout_seconds"):
        ServiceOptions(recovery_timeout_seconds=-1)


def test_a_ps_server_takes_the_launcher_variables(tmp_path, monkeypatch):
    import kdist

    monkeypatch.setenv(autosave.CHECKPOINT_EVERY_VARIABLE, "1")
    monkeypatch.setenv(autosave.CHECKPOINT_DIR_VARIABLE, str(tmp_path / "ps-0"))
    server = kdist.distribute.Server.create_local_server()
    try:
        with VariableClient(server.target, options=CLIENT) as client:
            client.create([VariableInit("w", VALUE)])
        assert (tmp_path / "ps-0" / CHECKPOINT_NAME / MANIFEST_NAME).is_file()
    finally:
        server.stop(0)
