"""Three workers and two parameter servers, all in their own processes, training asynchronously.

Every push must be applied exactly once (each trainable variable's update
count on the servers equals the steps of all workers together), pushes must
interleave (some gradients arrive stale, and the servers say how stale), the
loss must fall on every worker, and the model the chief saves afterwards must
load in plain Keras and hold exactly the servers' state.
"""

import json
from pathlib import Path

import keras
import numpy as np
import pytest

import kdist
from kdist.launch import task_env
from tests import harness
from tests.keras import _models, _ps
from tests.keras.workers import ps_async

pytestmark = pytest.mark.timeout(300)

SCRIPT = Path(ps_async.__file__)
NUM_WORKERS = 3


def test_three_async_workers_two_ps(tmp_path):
    with _ps.server_processes(2, num_workers=NUM_WORKERS, tmp_path=tmp_path) as cluster:
        envs = [(f"worker-{i}", task_env.tf_config_env(cluster.spec, "worker", i)) for i in range(NUM_WORKERS)]
        harness.run(harness.python_specs(envs, SCRIPT, "--out", tmp_path), timeout=240).check()
        results = [json.loads((tmp_path / f"worker-{i}.json").read_text()) for i in range(NUM_WORKERS)]
        total_steps = sum(result["steps"] for result in results)

        # The chief (worker 0) saves after the others finished.
        strategy = kdist.ParameterServerStrategy(cluster.resolver("worker", 0))
        model = _models.build_in_scope(_models.mlp_dropout_batchnorm, strategy)
        path = str(tmp_path / "final.keras")
        model.save(path)
        stats = cluster.stats()
        clients = cluster.clients()
        routes = strategy.extended.variable_router.routes(model.weights)
        server_values = []
        for route in routes:
            (state,) = clients[route.placement.shards[0].ps_index].pull([route.keys[0]])
            server_values.append(state.value)

    for result in results:
        assert result["loss"][-1] < result["loss"][0], result
    trainable_keys = {route.keys[0] for route in routes if route.trainable}
    for server in stats:
        for key, variable_stats in server.variables.items():
            if key in trainable_keys:
                assert variable_stats.applied_updates == total_steps, (key, variable_stats)
                assert variable_stats.version >= total_steps
    # One push per worker step per server, each applied: nothing lost, nothing twice.
    assert sum(server.applied_pushes for server in stats) == total_steps * len(stats)
    staleness = stats[0].staleness
    assert staleness.count >= total_steps
    assert staleness.max >= 1, "pushes never interleaved"
    assert staleness.mean > 0

    loaded = keras.saving.load_model(path)
    # Keras variable paths carry per-process counters: match weights by position.
    assert len(loaded.weights) == len(server_values)
    for weight, server_value in zip(loaded.weights, server_values):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(weight), server_value)
    assert int(keras.ops.convert_to_numpy(loaded.optimizer.iterations)) == total_steps
