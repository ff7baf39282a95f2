"""save/restore on the server's file system: complete, atomic, all-or-nothing."""

import json

import keras
import ml_dtypes
import numpy as np
import pytest

from kdist.errors import ParameterServerError
from kdist.ps import DenseGradient, VariableClient, VariableInit, create_server
from kdist.ps.server.checkpoint import MANIFEST_NAME

pytestmark = pytest.mark.timeout(120)


def _adam_config():
    return keras.optimizers.serialize(keras.optimizers.Adam(0.05))


def _train(client, rng):
    client.create([
        VariableInit("dense/kernel", rng.standard_normal((6, 4)).astype("float32")),
        VariableInit("half", np.arange(5).astype(ml_dtypes.bfloat16)),
        VariableInit("steps", np.array(3, "int64"), trainable=False),
    ])
    client.configure_optimizer(_adam_config(), ["dense/kernel"])
    for version in range(3):
        client.push([DenseGradient("dense/kernel", rng.standard_normal((6, 4)).astype("float32"),
                                   version)])


def _snapshot(client):
    names = ["dense/kernel", "half", "steps"]
    states = {state.name: (state.value, state.version) for state in client.pull(names)}
    return states, client.optimizer_state(["dense/kernel"])["dense/kernel"]


def _assert_same(left, right):
    (left_states, left_optimizer), (right_states, right_optimizer) = left, right
    assert left_states.keys() == right_states.keys()
    for name, (value, version) in left_states.items():
        assert right_states[name][1] == version
        assert right_states[name][0].dtype == value.dtype
        np.testing.assert_array_equal(right_states[name][0], value)
    assert left_optimizer.iterations == right_optimizer.iterations
    assert list(left_optimizer.slots) == list(right_optimizer.slots)
    for name, value in left_optimizer.slots.items():
        np.testing.assert_array_equal(right_optimizer.slots[name], value)


def test_save_then_restore_on_a_fresh_server(client, options, tmp_path, rng):
    _train(client, rng)
    before = _snapshot(client)
    client.save(str(tmp_path / "checkpoint"))
    assert json.loads((tmp_path / "checkpoint" / MANIFEST_NAME).read_text())["variables"]
    with create_server(options=options) as fresh, VariableClient(fresh.address) as other:
        other.restore(str(tmp_path / "checkpoint"))
        _assert_same(before, _snapshot(other))
        # Training continues from the restored optimizer state.
        result = other.push([DenseGradient("dense/kernel", np.ones((6, 4), "float32"), 3)])
        assert result.versions == {"dense/kernel": 4}


def test_save_replaces_an_existing_checkpoint_atomically(client, tmp_path, rng):
    _train(client, rng)
    target = tmp_path / "checkpoint"
    client.save(str(target))
    client.push([DenseGradient("dense/kernel", np.ones((6, 4), "float32"))])
    client.save(str(target))
    manifest = json.loads((target / MANIFEST_NAME).read_text())
    versions = {record["name"]: record["version"] for record in manifest["variables"]}
    assert versions["dense/kernel"] == 4
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint"]  # no leftovers


def test_restore_rolls_back_variables_to_the_checkpoint(client, tmp_path, rng):
    _train(client, rng)
    before = _snapshot(client)
    client.save(str(tmp_path / "checkpoint"))
    client.push([DenseGradient("dense/kernel", np.ones((6, 4), "float32"))])
    client.restore(str(tmp_path / "checkpoint"))
    _assert_same(before, _snapshot(client))


def test_restore_of_a_damaged_checkpoint_changes_nothing(client, tmp_path, rng):
    _train(client, rng)
    target = tmp_path / "checkpoint"
    client.save(str(target))
    client.push([DenseGradient("dense/kernel", np.ones((6, 4), "float32"))])
    before = _snapshot(client)
    # The last variable's file is damaged: the first ones must not be restored either.
    manifest = json.loads((target / MANIFEST_NAME).read_text())
    (target / manifest["variables"][-1]["file"]).write_bytes(b"not an npy file")
    with pytest.raises(ParameterServerError) as caught:
        client.restore(str(target))
    assert caught.value.code_name == "INVALID_ARGUMENT"
    _assert_same(before, _snapshot(client))


def test_restore_conflicting_with_an_existing_variable_changes_nothing(options, tmp_path, rng):
    with create_server(options=options) as first, VariableClient(first.address) as client:
        _train(client, rng)
        client.save(str(tmp_path / "checkpoint"))
    with create_server(options=options) as second, VariableClient(second.address) as client:
        client.create([VariableInit("steps", np.zeros(2, "int64"), trainable=False)])
        with pytest.raises(ParameterServerError, match="steps"):
            client.restore(str(tmp_path / "checkpoint"))
        assert client.health()["num_variables"] == 1


def test_restore_of_a_missing_checkpoint_is_not_found(client, tmp_path):
    with pytest.raises(ParameterServerError) as caught:
        client.restore(str(tmp_path / "nothing-here"))
    assert caught.value.code_name == "NOT_FOUND"


def test_save_to_an_unwritable_place_is_an_error(client, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a directory")
    with pytest.raises(ParameterServerError) as caught:
        client.save(str(blocker / "checkpoint"))
    assert caught.value.code_name == "INVALID_ARGUMENT"
    assert client.health()["status"] == "SERVING"


def test_save_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path):
    from kdist.errors import ParameterServerError
    from kdist.ps import VariableClient, VariableInit, create_server

    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with create_server() as server, VariableClient(server.address) as client:
        client.create([VariableInit("w", np.zeros(2, "float32"))])
        with pytest.raises(ParameterServerError) as error:
            client.save(str(precious))
        assert error.value.code_name == "INVALID_ARGUMENT"
        assert (precious / "notes.txt").read_text() == "keep me"
        client.save(str(tmp_path / "ckpt"))
        client.save(str(tmp_path / "ckpt"))  # an earlier checkpoint is replaced


# Runs a server in its own process whose file size limit (RLIMIT_FSIZE) is then
# lowered to a third of the largest file: the second save fails partway, for real.
_SAVE_PAST_THE_FILE_SIZE_LIMIT = """
import json, os, resource, signal, sys
import numpy as np
from kdist.errors import ParameterServerError
from kdist.ps import Assignment, VariableClient, VariableInit, create_server
target = sys.argv[1]
with create_server() as server, VariableClient(server.address) as client:
    client.create([VariableInit("big", np.arange(150_000, dtype="float32")), VariableInit("small", np.ones(3, "float32"))])
    client.save(target)
    client.assign([Assignment("big", np.zeros(150_000, "float32"))])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    limit = os.path.getsize(os.path.join(target, "variable_0.npy")) // 3
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        client.save(target)
        code = None
    except ParameterServerError as error:
        code = error.code_name
    print(json.dumps({"code": code, "serving": client.health()["status"]}))
"""


def test_a_save_that_fails_partway_keeps_the_previous_checkpoint(options, tmp_path):
    import subprocess
    import sys

    from tests import harness

    target = tmp_path / "checkpoint"
    result = subprocess.run([sys.executable, "-c", _SAVE_PAST_THE_FILE_SIZE_LIMIT, str(target)], capture_output=True,
                            text=True, timeout=60, check=True, cwd=harness.REPO_ROOT)
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    # No room to write is RESOURCE_EXHAUSTED (not INVALID_ARGUMENT), and the server still serves.
    assert outcome == {"code": "RESOURCE_EXHAUSTED", "serving": "SERVING"}, result.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint"]  # no temporary directory left
    with create_server(options=options) as fresh, VariableClient(fresh.address, options=options) as client:
        client.restore(str(target))
        (big,) = client.pull(["big"])
        np.testing.assert_array_equal(big.value, np.arange(150_000, dtype="float32"))


@keras.saving.register_keras_serializable(package="kdist_tests")
class _TwoAccumulators(keras.optimizers.Optimizer):
    """Gives each variable two slots of one short name, "accumulator", holding different sums."""

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._sums = [self.add_variable_from_reference(variable, "accumulator") for variable in variables]
        self._squares = [self.add_variable_from_reference(variable, "accumulator") for variable in variables]

    def update_step(self, gradient, variable, learning_rate):
        index = self._get_variable_index(variable)
        self.assign_add(self._sums[index], gradient)
        self.assign_add(self._squares[index], gradient * gradient)
        self.assign_sub(variable, learning_rate * gradient)


def test_two_slots_with_one_short_name_restore_through_a_checkpoint(client, options, tmp_path):
    client.create([VariableInit("w", np.zeros(3, "float32"))])
    client.configure_optimizer(keras.optimizers.serialize(_TwoAccumulators(learning_rate=0.5)), ["w"])
    for _ in range(2):
        client.push([DenseGradient("w", np.array([1.0, 2.0, 3.0], "float32"))])
    before = client.optimizer_state(["w"])["w"]
    assert list(before.slots) == ["accumulator", "accumulator_1"]
    np.testing.assert_array_equal(before.slots["accumulator"], [2.0, 4.0, 6.0])
    np.testing.assert_array_equal(before.slots["accumulator_1"], [2.0, 8.0, 18.0])
    client.save(str(tmp_path / "checkpoint"))
    with create_server(options=options) as fresh, VariableClient(fresh.address) as other:
        other.restore(str(tmp_path / "checkpoint"))
        after = other.optimizer_state(["w"])["w"]
        assert after.iterations == before.iterations == 2
        assert list(after.slots) == ["accumulator", "accumulator_1"]
        for name, value in before.slots.items():
            np.testing.assert_array_equal(after.slots[name], value)


def test_a_bfloat16_variable_and_its_slots_restore_exactly(client, options, tmp_path):
    value = np.array([1.0, -2.5, 3.140625], ml_dtypes.bfloat16)
    client.create([VariableInit("half", value)])
    client.configure_optimizer(keras.optimizers.serialize(keras.optimizers.SGD(0.5, momentum=0.9)), ["half"])
    client.push([DenseGradient("half", np.array([0.5, 1.0, -1.0], ml_dtypes.bfloat16))])
    [before] = client.pull(["half"])
    slots_before = client.optimizer_state(["half"])["half"].slots
    assert before.value.dtype == np.dtype(ml_dtypes.bfloat16)
    assert [slot.dtype for slot in slots_before.values()] == [np.dtype(ml_dtypes.bfloat16)]
    client.save(str(tmp_path / "checkpoint"))
    with create_server(options=options) as fresh, VariableClient(fresh.address) as other:
        other.restore(str(tmp_path / "checkpoint"))
        [after] = other.pull(["half"])
        assert after.value.dtype == before.value.dtype and after.version == before.version
        assert after.value.tobytes() == before.value.tobytes()
        for name, slot in other.optimizer_state(["half"])["half"].slots.items():
            assert slot.dtype == slots_before[name].dtype and slot.tobytes() == slots_before[name].tobytes()
