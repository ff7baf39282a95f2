"""The Strategy API conformance checks, run in a process of one Keras backend.

`python tests/backends/conformance_worker.py` with `KERAS_BACKEND` set runs
every check against a two-replica `kdist.MirroredStrategy(["cpu:0", "cpu:1"])`
and prints one line per check:

    CHECK {"name": "...", "status": "passed" | "failed", "detail": "..."}

`tests/backends/test_conformance.py` runs this once per backend and turns each
line into a test. The expectations are the same on every backend; where a
backend documents a different behaviour (docs/backends.md), the check asserts
that behaviour instead (e.g. the clear error of `merge_call` on JAX).
"""

import json
import sys
import traceback

import kdist  # noqa: E402  (first: it settles the backend)

# The strategy comes first: several CPU replicas must be configured before
# TensorFlow's or JAX's first computation.
STRATEGY = kdist.MirroredStrategy(["cpu:0", "cpu:1"])

import keras  # noqa: E402
import numpy as np  # noqa: E402

BACKEND = keras.backend.backend()
CHECKS = []


def check(function):
    CHECKS.append(function)
    return function


def numpy(value):
    return np.asarray(keras.ops.convert_to_numpy(value))


def local(value):
    return [numpy(component) for component in STRATEGY.experimental_local_results(value)]


def per_replica(values):
    return STRATEGY.experimental_distribute_values_from_function(
        lambda context: values[context.replica_id_in_sync_group])


def expect_error(error_type, function, *words):
    try:
        function()
    except error_type as error:
        message = str(error)
        missing = [word for word in words if word not in message]
        assert not missing, f"{error_type.__name__} without {missing}: {message}"
        return
    raise AssertionError(f"expected {error_type.__name__}")


# ----- the class -------------------------------------------------------------------
@check
def the_strategy_is_a_kdist_strategy():
    # One base on every backend: kdist.Strategy, whose API and argument handling
    # the TensorFlow and JAX strategies inherit.
    assert isinstance(STRATEGY, kdist.Strategy), type(STRATEGY).__mro__
    assert isinstance(kdist.get_strategy(), kdist.Strategy)
    assert repr(STRATEGY) == "MirroredStrategy(devices=['cpu:0', 'cpu:1'])", repr(STRATEGY)
    expect_error(kdist.errors.InvalidArgumentError,
                 lambda: STRATEGY.distribute_datasets_from_function([1, 2]), "dataset_fn=")
    expect_error(kdist.errors.InvalidArgumentError,
                 lambda: STRATEGY.experimental_distribute_dataset(5), "Received: dataset of type int")


# ----- contexts --------------------------------------------------------------------
@check
def default_context_outside_any_scope():
    assert not kdist.has_strategy()
    assert not kdist.in_cross_replica_context()
    assert kdist.get_replica_context() is not None
    assert kdist.get_replica_context().num_replicas_in_sync == 1


@check
def scope_is_the_cross_replica_context():
    with STRATEGY.scope():
        assert kdist.get_strategy() is STRATEGY
        assert kdist.has_strategy()
        assert kdist.in_cross_replica_context()
        assert kdist.get_replica_context() is None
        assert kdist.get_cross_replica_context() is STRATEGY
    assert not kdist.has_strategy()


@check
def run_calls_each_replica_in_a_replica_context():
    seen = []

    def fn():
        context = kdist.get_replica_context()
        seen.append((context.replica_id_in_sync_group, context.num_replicas_in_sync,
                     kdist.in_cross_replica_context(), kdist.get_strategy() is STRATEGY))
        return keras.ops.convert_to_tensor(float(context.replica_id_in_sync_group))

    result = STRATEGY.run(fn)
    assert sorted(seen) == [(0, 2, False, True), (1, 2, False, True)], seen
    assert [float(value) for value in local(result)] == [0.0, 1.0]


@check
def cross_replica_apis_refuse_a_replica_context():
    def fn():
        expect_error(kdist.errors.StrategyScopeError,
                     lambda: STRATEGY.reduce("sum", 1.0, axis=None), "cross-replica")
        return keras.ops.convert_to_tensor(0.0)

    STRATEGY.run(fn)


@check
def merge_call_runs_once_across_replicas():
    def merge_fn(strategy, value):
        assert strategy is STRATEGY and kdist.in_cross_replica_context()
        return strategy.reduce("sum", value, axis=None)

    def fn():
        context = kdist.get_replica_context()
        value = keras.ops.convert_to_tensor(float(context.replica_id_in_sync_group + 1))
        return context.merge_call(merge_fn, args=(value,))

    if BACKEND == "jax":
        # Documented: replicas run one after another on JAX.
        expect_error(kdist.errors.UnsupportedError, lambda: STRATEGY.run(fn), "strategy.reduce")
        return
    # Every replica gets the merged value (torch hands back the one object).
    assert {float(value) for value in local(STRATEGY.run(fn))} == {3.0}


@check
def all_reduce_and_all_gather_in_a_replica():
    def fn():
        context = kdist.get_replica_context()
        replica = context.replica_id_in_sync_group
        total = context.all_reduce("sum", keras.ops.convert_to_tensor(float(replica + 1)))
        gathered = context.all_gather(keras.ops.convert_to_tensor([[float(replica)]]), axis=0)
        return total, gathered

    if BACKEND == "jax":
        expect_error(kdist.errors.UnsupportedError, lambda: STRATEGY.run(fn), "strategy.gather")
        return
    total, gathered = STRATEGY.run(fn)
    assert {float(value) for value in local(total)} == {3.0}
    for component in local(gathered):
        np.testing.assert_array_equal(component, [[0.0], [1.0]])


# ----- reduce and gather -----------------------------------------------------------
@check
def reduce_axis_none_combines_replicas_elementwise():
    value = per_replica([np.array([1.0, 2.0]), np.array([3.0, 4.0])])
    np.testing.assert_allclose(numpy(STRATEGY.reduce("sum", value, axis=None)), [4.0, 6.0])
    np.testing.assert_allclose(numpy(STRATEGY.reduce("mean", value, axis=None)), [2.0, 3.0])


@check
def reduce_axis_0_uses_the_global_denominator():
    # A partial batch of 6 split 4/2: the mean is over 6 examples, not a mean of 2 means.
    value = per_replica([np.array([1.0, 2.0, 3.0, 4.0]), np.array([5.0, 6.0])])
    assert float(numpy(STRATEGY.reduce("sum", value, axis=0))) == 21.0
    assert float(numpy(STRATEGY.reduce("mean", value, axis=0))) == 3.5


@check
def reduce_mean_of_integer_flags_does_not_truncate():
    value = per_replica([np.array([1, 0, 1, 1]), np.array([0, 1])])
    np.testing.assert_allclose(float(numpy(STRATEGY.reduce("mean", value, axis=0))), 4 / 6, rtol=1e-6)


@check
def reduce_accepts_op_names_in_any_case():
    value = per_replica([np.array(1.0), np.array(2.0)])
    for op in ("sum", "SUM", "Sum", kdist.ReduceOp.SUM):
        assert float(numpy(STRATEGY.reduce(op, value, axis=None))) == 3.0, op
    expect_error(kdist.errors.InvalidArgumentError, lambda: STRATEGY.reduce("max", value, axis=None), "max")


@check
def reduce_refuses_to_sum_a_plain_value():
    expect_error(kdist.errors.InvalidArgumentError,
                 lambda: STRATEGY.reduce("sum", np.ones(2), axis=None), "would count 2 times")
    np.testing.assert_allclose(numpy(STRATEGY.reduce("mean", np.ones(2), axis=None)), [1.0, 1.0])


@check
def reduce_a_structure_leaf_by_leaf():
    value = {"a": per_replica([np.array(1.0), np.array(2.0)]), "b": per_replica([np.array(3.0), np.array(5.0)])}
    reduced = STRATEGY.reduce("sum", value, axis=None)
    assert (float(numpy(reduced["a"])), float(numpy(reduced["b"]))) == (3.0, 8.0)


@check
def gather_concatenates_replicas_along_axis():
    value = per_replica([np.array([[0.0], [10.0]]), np.array([[1.0], [11.0]])])
    np.testing.assert_array_equal(numpy(STRATEGY.gather(value, axis=0)), [[0.0], [10.0], [1.0], [11.0]])
    np.testing.assert_array_equal(numpy(STRATEGY.gather(value, axis=1)), [[0.0, 1.0], [10.0, 11.0]])


# ----- distributed input --------------------------------------------------------------
@check
def distribute_dataset_splits_each_global_batch():
    batches = [np.arange(8).reshape(8, 1), np.arange(8, 15).reshape(7, 1)]
    shards = [local(STRATEGY.run(lambda x: x, args=(element,)))
              for element in STRATEGY.experimental_distribute_dataset(batches)]
    np.testing.assert_array_equal(shards[0][0].ravel(), [0, 1, 2, 3])
    np.testing.assert_array_equal(shards[0][1].ravel(), [4, 5, 6, 7])
    # kdist's rule for a partial batch: as even as possible, the first replicas one more.
    np.testing.assert_array_equal(shards[1][0].ravel(), [8, 9, 10, 11])
    np.testing.assert_array_equal(shards[1][1].ravel(), [12, 13, 14])


@check
def distribute_dataset_splits_tuples_leaf_by_leaf():
    batch = (np.arange(4, dtype="float32"), np.arange(10, 14))
    [element] = list(STRATEGY.experimental_distribute_dataset([batch]))
    x_shards, y_shards = STRATEGY.run(lambda x, y: (x, y), args=element)
    np.testing.assert_array_equal(local(x_shards)[1], [2.0, 3.0])
    np.testing.assert_array_equal(local(y_shards)[0], [10, 11])


@check
def distribute_datasets_from_function_takes_one_element_per_replica():
    contexts = []

    def dataset_fn(context):
        contexts.append(context)
        batch = context.get_per_replica_batch_size(8)
        return [np.full((batch,), float(step)) for step in range(5)]

    steps = [[float(component[0]) for component in local(element)]
             for element in STRATEGY.distribute_datasets_from_function(dataset_fn)]
    [context] = contexts
    assert (context.num_input_pipelines, context.input_pipeline_id, context.num_replicas_in_sync) == (1, 0, 2)
    # Five elements over two replicas: two steps; the fifth alone is dropped.
    assert steps == [[0.0, 1.0], [2.0, 3.0]], steps


@check
def distribute_values_from_function_calls_each_replica():
    value = STRATEGY.experimental_distribute_values_from_function(
        lambda context: np.array([10.0 * context.replica_id_in_sync_group, context.num_replicas_in_sync]))
    components = local(value)
    np.testing.assert_array_equal(components[0], [0.0, 2.0])
    np.testing.assert_array_equal(components[1], [10.0, 2.0])
    assert len(STRATEGY.experimental_local_results(np.ones(3))) == 1


@check
def tf_data_dataset_uses_tensorflow_input_pipeline():
    if BACKEND != "tensorflow":
        return  # a tf.data.Dataset is TensorFlow's own input; other backends take any iterable
    import tensorflow as tf

    dataset = tf.data.Dataset.range(8).batch(8)
    [element] = list(STRATEGY.experimental_distribute_dataset(dataset))
    components = local(element)
    np.testing.assert_array_equal(components[0], [0, 1, 2, 3])
    np.testing.assert_array_equal(components[1], [4, 5, 6, 7])


# ----- Keras ------------------------------------------------------------------------
@check
def model_created_in_scope_trains_in_and_out_of_scope():
    x = np.random.default_rng(0).standard_normal((64, 4)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int64")
    with STRATEGY.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert model.predict(x, batch_size=16, verbose=0).shape == (64, 2)
    assert STRATEGY.num_replicas_in_sync == 2
    assert list(STRATEGY.extended.worker_devices) == ["cpu:0", "cpu:1"]


@check
def a_model_called_inside_run_computes_each_replicas_shard():
    x = np.random.default_rng(1).standard_normal((8, 4)).astype("float32")
    with STRATEGY.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    [element] = list(STRATEGY.experimental_distribute_dataset([x]))
    outputs = local(STRATEGY.run(lambda batch: model(batch, training=False), args=(element,)))
    expected = numpy(model.predict(x, batch_size=8, verbose=0))
    np.testing.assert_allclose(np.concatenate(outputs), expected, rtol=1e-5, atol=1e-6)


@check
def updating_variables_inside_run_on_jax_is_refused():
    if BACKEND != "jax":
        return  # torch and TensorFlow apply updates made in replicas (their own rules)
    with STRATEGY.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    before = numpy(model.layers[0].kernel)

    def fn():
        model.layers[0].kernel.assign(keras.ops.zeros((2, 1)))
        return keras.ops.convert_to_tensor(0.0)

    expect_error(kdist.errors.UnsupportedError, lambda: STRATEGY.run(fn), "model.fit", "stateless")
    np.testing.assert_array_equal(numpy(model.layers[0].kernel), before)


@check
def parameter_server_strategy_names_its_backend():
    if BACKEND == "torch":
        assert kdist.ParameterServerStrategy.SUPPORTED_BACKENDS == ("torch",)
        return
    expect_error(kdist.errors.BackendError, kdist.ParameterServerStrategy, "'torch' backend", BACKEND)


def main():
    failures = 0
    for function in CHECKS:
        try:
            function()
            status, detail = "passed", ""
        except Exception:
            status, detail = "failed", traceback.format_exc()
            failures += 1
        print("CHECK " + json.dumps({"name": function.__name__, "status": status, "detail": detail}), flush=True)
    print(f"backend {BACKEND}: {len(CHECKS) - failures}/{len(CHECKS)} checks passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
