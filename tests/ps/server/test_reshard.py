"""Parameter-server checkpoints written with 2 servers restore on 1 and on 3 (issue 24 point 4).

Real gRPC servers on loopback, each checkpointing itself into `root/ps-<i>`
with its layout. The old job holds a partitioned table (7 rows in parts of 4
and 3), an unpartitioned bias and a non-trainable counter, with Adam slots
after a few pushes; a new job of another number of servers creates the same
server keys, re-split, and must hold the old logical variables: values,
slots, iterations, versions.
"""

import logging
import shutil

import keras
import numpy as np
import pytest

from kdist.errors import InvalidArgumentError, ParameterServerError
from kdist.ps import Assignment, DenseGradient, ServiceOptions, VariableClient, VariableInit, create_server
from kdist.ps.server.reshard import CheckpointLayoutError, PREVIOUS_NAME
from kdist.ps.wire.values import ShardOrigin

pytestmark = pytest.mark.timeout(90)

CLIENT = ServiceOptions(rpc_timeout_seconds=30, connect_timeout_seconds=10)
TABLE = (7, 3)
ADAM = keras.optimizers.serialize(keras.optimizers.Adam(0.05))


def _servers(root, count):
    return [create_server(options=ServiceOptions(checkpoint_dir=str(root / f"ps-{index}"),
                                                 checkpoint_every="1"), layout=(index, count))
            for index in range(count)]


def _stop(servers):
    for server in servers:
        server.stop(0)


def _splits(count):
    # Row ranges of the table over `count` servers (uneven: a new shard can span two old parts).
    bounds = np.cumsum([0] + [len(part) for part in np.array_split(np.arange(TABLE[0]), count)])
    return list(zip(bounds[:-1], bounds[1:]))


def _layout(count):
    """`{ps: [(key, shard rows, ShardOrigin, trainable, dtype)]}` of the model's variables on `count` servers."""
    layout = {index: [] for index in range(count)}
    splits = _splits(count)
    for part, (start, stop) in enumerate(splits):
        key = "v0" if count == 1 else f"v0/part_{part}"
        layout[part % count].append((key, (stop - start, TABLE[1]), ShardOrigin(TABLE, int(start)),
                                     True, "float32"))
    layout[1 % count].append(("v1", (3,), ShardOrigin((3,), 0), True, "float32"))
    layout[0].append(("v2", (), ShardOrigin((), 0), False, "int64"))
    return layout


def _create(servers, layout, origins=True, offset_bug=False, rng=None):
    clients = [VariableClient(server.address, options=CLIENT) for server in servers]
    for index, items in layout.items():
        clients[index].create([
            VariableInit(key, np.zeros(shape, dtype) if rng is None else rng.normal(size=shape).astype(dtype),
                         trainable=trainable,
                         shard=None if not origins else (ShardOrigin(origin.full_shape, 0)
                                                         if offset_bug else origin))
            for key, shape, origin, trainable, dtype in items])
        trainables = [key for key, _, _, trainable, _ in items if trainable]
        clients[index].configure_optimizer(ADAM, trainables)
    return clients


def _old_job(root, pushes=3):
    """Trains the 2-server job; returns its logical variables `{key: (value, version, iterations, slots)}`."""
    servers = _servers(root, 2)
    layout = _layout(2)
    rng = np.random.default_rng(0)
    clients = _create(servers, layout, rng=rng)
    for step in range(pushes):
        for index, items in layout.items():
            clients[index].push([DenseGradient(key, rng.normal(size=shape).astype("float32"))
                                 for key, shape, _, trainable, _ in items if trainable])
    clients[0].assign([Assignment("v2", np.asarray(41, "int64"))])
    logical = _logical(clients, layout)
    for client in clients:
        client.close()
    _stop(servers)
    return logical


def _logical(clients, layout):
    """The logical variables the servers hold, the parts of `v0` concatenated in row order."""
    parts = {}
    for index, items in layout.items():
        keys = [key for key, *_ in items]
        states = {state.name: state for state in clients[index].pull(keys)}
        trainable = [key for key, _, _, t, _ in items if t]
        optimizer = clients[index].optimizer_state(trainable) if trainable else {}
        for key, _, origin, _, _ in items:
            state = optimizer.get(key)
            parts[key] = (origin.row_start, states[key].value, states[key].version, state)
    logical = {}
    for name in ("v0", "v1", "v2"):
        pieces = sorted((item for key, item in parts.items() if key.split("/")[0] == name),
                        key=lambda item: item[0])
        value = np.concatenate([p[1] for p in pieces]) if pieces[0][1].ndim else pieces[0][1]
        version = max(p[2] for p in pieces)
        if pieces[0][3] is None:
            logical[name] = (value, version, None, None)
            continue
        iterations = max(p[3].iterations for p in pieces)
        slots = {slot: np.concatenate([p[3].slots[slot] for p in pieces]) for slot in pieces[0][3].slots}
        logical[name] = (value, version, iterations, slots)
    return logical


def _differences(expected, actual):
    problems = []
    for name, (value, version, iterations, slots) in expected.items():
        got = actual[name]
        if not np.array_equal(value, got[0]):
            problems.append(f"{name} value")
        if version != got[1]:
            problems.append(f"{name} version {got[1]} != {version}")
        if iterations != got[2]:
            problems.append(f"{name} iterations {got[2]} != {iterations}")
        if slots is not None and (got[3] is None or any(
                not np.array_equal(slots[s], got[3][s]) for s in slots)):
            problems.append(f"{name} slots")
    return problems


@pytest.mark.parametrize("count", [1, 3])
def test_a_two_server_checkpoint_restores_exactly_on_another_number_of_servers(tmp_path, count):
    old = _old_job(tmp_path)
    assert old["v0"][2] == 3 and old["v0"][1] > 0
    servers = _servers(tmp_path, count)
    try:
        clients = _create(servers, _layout(count))
        assert _differences(old, _logical(clients, _layout(count))) == []
    finally:
        _stop(servers)
    # The new layout wins on the next restart, and a push carries on from the old state.
    servers = _servers(tmp_path, count)
    try:
        clients = _create(servers, _layout(count))
        assert _differences(old, _logical(clients, _layout(count))) == []
        key = "v1"
        owner = clients[1 % count]
        owner.push([DenseGradient(key, np.ones(3, "float32"))])
        [state] = owner.pull([key])
        assert state.version == old[key][1] + 1
        assert owner.optimizer_state([key])[key].iterations == old[key][2] + 1
    finally:
        _stop(servers)
    assert (tmp_path / "ps-0" / PREVIOUS_NAME).is_dir()  # the old checkpoint is kept


def test_offsets_ignored_would_be_detected(tmp_path):
    # Negative control: shards filled from row 0 (offsets dropped) differ from the old table.
    old = _old_job(tmp_path)
    servers = _servers(tmp_path, 3)
    try:
        clients = _create(servers, _layout(3), offset_bug=True)
        assert "v0 value" in _differences(old, _logical(clients, _layout(3)))
    finally:
        _stop(servers)


def test_the_same_number_of_servers_restores_its_own_checkpoint(tmp_path):
    old = _old_job(tmp_path)
    servers = _servers(tmp_path, 2)
    try:
        assert all(server.autosaver.reshard is None for server in servers)
        assert "restored its checkpoint" in servers[0].autosaver.restored
        clients = _create(servers, _layout(2))
        assert _differences(old, _logical(clients, _layout(2))) == []
    finally:
        _stop(servers)
    assert not (tmp_path / "ps-0" / PREVIOUS_NAME).exists()


def test_a_missing_server_checkpoint_is_refused_before_serving(tmp_path):
    _old_job(tmp_path)
    shutil.rmtree(tmp_path / "ps-1")
    with pytest.raises(CheckpointLayoutError, match="ps-1"):
        create_server(options=ServiceOptions(checkpoint_dir=str(tmp_path / "ps-0"),
                                             checkpoint_every="1"), layout=(0, 3))


def test_inconsistent_parts_are_refused_naming_the_directory(tmp_path):
    _old_job(tmp_path)
    # ps-1's part of v0 claims another dtype: the parts no longer fit together.
    manifest = tmp_path / "ps-1" / "checkpoint" / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text.replace('"name": "v0/part_1"', '"name": "v0/part_2"'))
    with pytest.raises(CheckpointLayoutError, match="part"):
        _servers(tmp_path, 3)


def test_a_shard_that_does_not_fit_or_has_no_offset_is_refused(tmp_path):
    _old_job(tmp_path)
    servers = _servers(tmp_path, 3)
    try:
        client = VariableClient(servers[0].address, options=CLIENT)
        with pytest.raises(ParameterServerError, match="no row offset"):
            client.create([VariableInit("v0/part_0", np.zeros((3, 3), "float32"))])
        with pytest.raises(ParameterServerError, match="does not fit"):
            client.create([VariableInit("v0/part_0", np.zeros((3, 3), "float32"),
                                        shard=ShardOrigin((9, 3), 0))])
    finally:
        _stop(servers)


def test_variables_the_new_job_never_creates_are_logged_once(tmp_path, caplog):
    _old_job(tmp_path)
    layout = _layout(3)
    layout[1] = [item for item in layout[1] if item[0] != "v1"]  # the bias is gone
    servers = _servers(tmp_path, 3)
    try:
        clients = _create(servers, layout)
        with caplog.at_level(logging.WARNING, logger="kdist.ps.server.reshard"):
            clients[0].push([DenseGradient("v0/part_0", np.ones((3, 3), "float32"))])
            clients[0].push([DenseGradient("v0/part_0", np.ones((3, 3), "float32"))])
        lines = [r.getMessage() for r in caplog.records if "created by no server" in r.getMessage()]
        assert len(lines) == 1 and "v1" in lines[0] and "v0" not in lines[0].split(": ")[-1]
    finally:
        _stop(servers)


def test_a_bad_layout_is_refused(tmp_path):
    with pytest.raises(InvalidArgumentError, match="layout"):
        create_server(options=ServiceOptions(checkpoint_dir=str(tmp_path / "ps-0"),
                                             checkpoint_every="1"), layout=(2, 2))
