"""Tables initialised on their parameter servers (`kdist.ps.server.server_init`): same numbers as one device, no value sent."""

import json

import keras
import numpy as np
import pytest

from kdist.errors import InvalidArgumentError, ParameterServerError
from kdist.ps import VariableInit
from kdist.ps.server.server_init import initial_shard
from kdist.ps.wire.conventions import initializer_config
from kdist.ps.wire.values import ServerInitializer

SHAPE = (50, 6)


def _shard_inits(name, initializer, shape, bounds, dtype="float32"):
    config = initializer_config(initializer)
    return [VariableInit(f"{name}/part_{k}", np.broadcast_to(np.zeros((), dtype), (stop - start,) + shape[1:]),
                         initializer=ServerInitializer(config, shape, start))
            for k, (start, stop) in enumerate(bounds)]


@pytest.mark.parametrize("make", [
    lambda: keras.initializers.get("uniform"),
    lambda: keras.initializers.RandomNormal(stddev=0.3),
    lambda: keras.initializers.GlorotUniform(seed=7),
    lambda: keras.initializers.TruncatedNormal(),
    lambda: keras.initializers.Zeros(),
    lambda: keras.initializers.Constant(0.25),
])
def test_shards_computed_on_the_server_equal_the_initializer_on_one_device(client, server, make):
    initializer = make()
    expected = keras.ops.convert_to_numpy(initializer(SHAPE, dtype="float32"))
    received_before = client.stats().bytes_received
    states = client.create(_shard_inits("table", initializer, SHAPE, [(0, 20), (20, 50)]))
    # Nothing travels either way: the creator holds no copy.
    assert [state.value for state in states] == [None, None]
    assert client.stats().bytes_received == received_before
    pulled = [state.value for state in client.pull(["table/part_0", "table/part_1"])]
    np.testing.assert_array_equal(np.concatenate(pulled), expected)


def test_a_second_creator_keeps_the_first_value_and_computes_nothing(client):
    first = keras.initializers.RandomUniform(seed=1)
    client.create(_shard_inits("t", first, SHAPE, [(0, 50)]))
    # Another seed: were it computed and kept, the value would change.
    client.create(_shard_inits("t", keras.initializers.RandomUniform(seed=2), SHAPE, [(0, 50)]))
    [state] = client.pull(["t/part_0"])
    np.testing.assert_array_equal(state.value, keras.ops.convert_to_numpy(first(SHAPE, dtype="float32")))


def test_custom_and_generator_seeded_initializers_stay_on_the_creator():
    class Custom(keras.initializers.Initializer):
        def __call__(self, shape, dtype=None):
            return keras.ops.ones(shape, dtype)

    assert initializer_config(Custom()) is None
    assert initializer_config(keras.initializers.RandomUniform(seed=keras.random.SeedGenerator(3))) is None
    assert json.loads(initializer_config(keras.initializers.RandomUniform()))["config"]["seed"] > 0


@pytest.mark.parametrize("config, full_shape, row_start, shard", [
    ('{"module": "os", "class_name": "system", "config": {}}', SHAPE, 0, (10, 6)),
    ("not json", SHAPE, 0, (10, 6)),
    (None, SHAPE, 45, (10, 6)),  # past the table's end
    (None, SHAPE, 0, (10, 5)),  # another row width
])
def test_bad_server_initializers_are_refused_and_create_nothing(client, server, config, full_shape, row_start, shard):
    config = config or initializer_config(keras.initializers.Zeros())
    with pytest.raises(InvalidArgumentError):
        initial_shard(config, full_shape, row_start, shard, np.dtype("float32"))
    item = VariableInit("bad", np.broadcast_to(np.zeros((), "float32"), shard),
                        initializer=ServerInitializer(config, full_shape, row_start))
    with pytest.raises(ParameterServerError, match="INVALID_ARGUMENT"):
        client.create([item])
    assert len(server.store) == 0
