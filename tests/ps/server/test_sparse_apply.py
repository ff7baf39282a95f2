"""Row gradients on the servers: touched rows only where exact (or opted into), else Keras' dense update."""

import grpc
import keras
from tests import seeding
import numpy as np
import pytest

import kdist
from kdist import faults
from kdist.cluster import SimpleClusterResolver
from kdist.errors import InvalidArgumentError
from kdist.ps import RowGradient, Security, VariableInit, create_server
from kdist.ps.wire.conventions import check_sparse_updates
from kdist.ps.server.store import GradientSpec, VariableStore
from kdist.ps.wire import codec
from kdist.ps.wire._generated import variable_service_pb2 as pb
from kdist.ps.wire.methods import METHODS
from kdist.rpc.dtypes import to_numpy as from_torch
from tests import harness

pytestmark = pytest.mark.timeout(180)

NUM_PUSHES = 50
NUM_ROWS, WIDTH, BATCH = 40, 3, 12


def _schedule():
    return keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=10, decay_rate=0.5)


SPARSE_EXACT = {
    "sgd": lambda: keras.optimizers.SGD(0.05),
    "sgd_schedule": lambda: keras.optimizers.SGD(_schedule()),
    "sgd_nesterov_no_momentum": lambda: keras.optimizers.SGD(0.05, nesterov=True),
    "sgd_clipvalue": lambda: keras.optimizers.SGD(0.05, clipvalue=0.3),
    "sgd_clipnorm": lambda: keras.optimizers.SGD(0.05, clipnorm=1.0),
    "sgd_loss_scale_factor": lambda: keras.optimizers.SGD(0.05, loss_scale_factor=4.0),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "adagrad_options": lambda: keras.optimizers.Adagrad(
        0.2, initial_accumulator_value=0.3, epsilon=1e-4),
    "adagrad_zero_accumulator": lambda: keras.optimizers.Adagrad(
        0.1, initial_accumulator_value=0.0, epsilon=1e-7),
    "adagrad_schedule": lambda: keras.optimizers.Adagrad(_schedule()),
}
DENSE = {
    "adam": lambda: keras.optimizers.Adam(0.01, beta_1=0.8, amsgrad=True),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "sgd_weight_decay": lambda: keras.optimizers.SGD(0.05, weight_decay=0.01),
    "adagrad_weight_decay": lambda: keras.optimizers.Adagrad(0.1, weight_decay=0.01),
    "sgd_ema": lambda: keras.optimizers.SGD(0.05, use_ema=True),
}


def _store(optimizer, initial, mode=None, name="table"):
    store = VariableStore()
    store.create([(name, initial.copy(), True)])
    config = keras.optimizers.serialize(optimizer)
    if mode is not None:
        config = {**config, "sparse_updates": mode}
    store.configure_optimizer(config, [name])
    return store


def _push_rows(store, ids, rows, name="table"):
    spec = GradientSpec(name, True, rows.dtype, rows.shape, ids.size)
    store.apply_update(store.plan_update([spec], []), [ids.astype(np.int64), rows])


def _pushes(rng, num_rows=NUM_ROWS, num_pushes=NUM_PUSHES):
    pushes = []
    for _ in range(num_pushes):
        ids = rng.integers(0, num_rows // 2, BATCH)  # half the rows: some never touched
        ids[1] = ids[0]  # a duplicate in every push
        pushes.append((ids, rng.standard_normal((BATCH, WIDTH)).astype("float32")))
    return pushes


def _keras_dense(optimizer, initial, pushes):
    """Single-device Keras: the dense gradient of ops.take (duplicate ids summed)."""
    variable = keras.Variable(initial.copy(), name="table")
    optimizer.build([variable])
    for ids, rows in pushes:
        dense = np.zeros_like(initial)
        np.add.at(dense, ids, rows)
        optimizer.apply([keras.ops.convert_to_tensor(dense)], [variable])
    slots = [slot for slot in optimizer.variables
             if slot is not optimizer.iterations and "learning_rate" not in slot.path
             and tuple(slot.shape) == initial.shape]
    return (from_torch(variable.value).copy(), [from_torch(slot.value).copy() for slot in slots],
            int(optimizer.iterations.numpy()))


def _served(store, name="table"):
    [entry] = store.entries([name])
    iterations, slots = entry.optimizer.state()
    return entry.array.copy(), [value for _, value in slots if value.shape == entry.shape], iterations


def _max_difference(make_optimizer, rng, mode=None):
    initial = rng.standard_normal((NUM_ROWS, WIDTH)).astype("float32")
    pushes = _pushes(rng)
    store = _store(make_optimizer(), initial, mode)
    for ids, rows in pushes:
        _push_rows(store, ids, rows)
    value, slots, iterations = _served(store)
    local_value, local_slots, local_iterations = _keras_dense(make_optimizer(), initial, pushes)
    assert iterations == local_iterations == NUM_PUSHES
    assert len(slots) == len(local_slots)
    differences = [np.abs(value - local_value).max()]
    differences += [np.abs(served - local).max() for served, local in zip(slots, local_slots)]
    return max(differences), store.update_counts()["table"]


@pytest.mark.parametrize("name", sorted(SPARSE_EXACT))
def test_sparse_exact_optimizers_equal_keras_dense_update(name, rng):
    difference, counts = _max_difference(SPARSE_EXACT[name], rng)
    # Bit for bit: the same Keras code runs on the touched rows. clipnorm sums
    # the squares of the rows alone, in another order than over the whole table.
    assert difference <= 1e-6 if name == "sgd_clipnorm" else difference == 0
    assert counts["sparse_applies"] == NUM_PUSHES and counts["dense_applies"] == 0
    assert 0 < counts["rows_updated"] < NUM_PUSHES * BATCH  # duplicates counted once


@pytest.mark.parametrize("name", sorted(DENSE))
def test_other_optimizers_keep_keras_dense_update(name, rng):
    difference, counts = _max_difference(DENSE[name], rng)
    assert difference == 0  # the same Keras code on the same dense gradient
    assert counts["dense_applies"] == NUM_PUSHES and counts["sparse_applies"] == 0


@pytest.mark.parametrize("fault", ["dropped_row_gradient", "row_applied_twice",
                                   "unsummed_duplicate_ids"])
@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_negative_controls_break_the_equivalence(fault, name, rng):
    with faults.injected(**{fault: True}):
        difference, counts = _max_difference(SPARSE_EXACT[name], rng)
    assert counts["sparse_applies"] == NUM_PUSHES
    assert difference > 1e-3


def test_a_sparse_apply_touches_only_its_rows_of_a_large_table():
    num_rows = 2_000_000
    initial = np.random.default_rng(1).standard_normal((num_rows, 2)).astype("float32")
    store = _store(keras.optimizers.Adagrad(0.1), initial)
    [entry] = store.entries(["table"])
    ids = np.array([5, 1_999_999, 5, 123_456, 0, 7, 8, 9, 10, 11])
    _push_rows(store, ids, np.ones((10, 2), "float32"))
    touched = np.unique(ids)
    changed = np.flatnonzero((entry.array != initial).any(axis=1))
    np.testing.assert_array_equal(changed, touched)
    [accumulator] = [slot for slot in entry.optimizer.slots]
    slot_changed = np.flatnonzero((from_torch(accumulator.value) != np.float32(0.1)).any(axis=1))
    np.testing.assert_array_equal(slot_changed, touched)
    assert entry.optimizer.rows._zeros is None  # no table-sized gradient was made
    assert store.update_counts()["table"] == {
        "sparse_applies": 1, "dense_applies": 0, "rows_updated": touched.size}


def test_dense_path_reuses_one_zeroed_gradient_buffer(rng):
    initial = rng.standard_normal((NUM_ROWS, WIDTH)).astype("float32")
    store = _store(keras.optimizers.Adam(0.01), initial)
    [entry] = store.entries(["table"])
    buffers = set()
    for ids, rows in _pushes(rng, num_pushes=3):
        _push_rows(store, ids, rows)
        buffers.add(id(entry.optimizer.rows._zeros))
        assert not entry.optimizer.rows._zeros.count_nonzero()  # Keras left it unchanged
    assert len(buffers) == 1


def _lazy_adam_reference(initial, pushes, learning_rate, beta_1, beta_2, epsilon):
    """TensorFlow Addons' LazyAdam, as documented: only the touched rows' slots move."""
    value = initial.astype("float64")
    m, v = np.zeros_like(value), np.zeros_like(value)
    for step, (ids, rows) in enumerate(pushes, start=1):
        unique, inverse = np.unique(ids, return_inverse=True)
        gradient = np.zeros((unique.size, value.shape[1]))
        np.add.at(gradient, inverse, rows)
        lr = learning_rate * np.sqrt(1 - beta_2**step) / (1 - beta_1**step)
        m[unique] = beta_1 * m[unique] + (1 - beta_1) * gradient
        v[unique] = beta_2 * v[unique] + (1 - beta_2) * gradient**2
        value[unique] -= lr * m[unique] / (np.sqrt(v[unique]) + epsilon)
    return value, m, v


def test_lazy_adam_equals_the_lazy_adam_formula(rng):
    initial = rng.standard_normal((NUM_ROWS, WIDTH)).astype("float32")
    pushes = _pushes(rng)
    store = _store(keras.optimizers.Adam(0.01, beta_1=0.8, beta_2=0.95, epsilon=1e-6),
                   initial, mode="lazy")
    for ids, rows in pushes:
        _push_rows(store, ids, rows)
    value, (m, v), iterations = _served(store)
    expected_value, expected_m, expected_v = _lazy_adam_reference(
        initial, pushes, 0.01, 0.8, 0.95, 1e-6)
    assert iterations == NUM_PUSHES
    np.testing.assert_allclose(value, expected_value, rtol=0, atol=2e-5)
    np.testing.assert_allclose(m, expected_m, rtol=0, atol=1e-5)
    np.testing.assert_allclose(v, expected_v, rtol=0, atol=1e-5)
    untouched = np.setdiff1d(np.arange(NUM_ROWS), np.concatenate([ids for ids, _ in pushes]))
    assert untouched.size
    np.testing.assert_array_equal(value[untouched], initial[untouched])
    assert store.update_counts()["table"]["sparse_applies"] == NUM_PUSHES
    # And it differs from one device (dense Adam decays every row's slots).
    dense_value, _, _ = _keras_dense(
        keras.optimizers.Adam(0.01, beta_1=0.8, beta_2=0.95, epsilon=1e-6), initial, pushes)
    assert np.abs(dense_value - value).max() > 1e-4


def test_lazy_sgd_momentum_equals_its_formula(rng):
    initial = rng.standard_normal((NUM_ROWS, WIDTH)).astype("float32")
    pushes = _pushes(rng)
    store = _store(keras.optimizers.SGD(0.05, momentum=0.9), initial, mode="lazy")
    value, momentum = initial.astype("float64"), np.zeros((NUM_ROWS, WIDTH))
    for ids, rows in pushes:
        _push_rows(store, ids, rows)
        unique, inverse = np.unique(ids, return_inverse=True)
        gradient = np.zeros((unique.size, WIDTH))
        np.add.at(gradient, inverse, rows)
        momentum[unique] = 0.9 * momentum[unique] - 0.05 * gradient
        value[unique] += momentum[unique]
    served, (served_momentum,), _ = _served(store)
    np.testing.assert_allclose(served, value, rtol=0, atol=1e-5)
    np.testing.assert_allclose(served_momentum, momentum, rtol=0, atol=1e-5)


@pytest.mark.parametrize("make_optimizer", [
    lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
])
def test_lazy_updates_leave_untouched_rows_and_slots(make_optimizer, rng):
    initial = rng.standard_normal((NUM_ROWS, WIDTH)).astype("float32")
    store = _store(make_optimizer(), initial, mode="lazy")
    ids = np.array([3, 3, 9])
    _push_rows(store, ids, np.ones((3, WIDTH), "float32"))
    value, slots, _ = _served(store)
    untouched = np.setdiff1d(np.arange(NUM_ROWS), ids)
    np.testing.assert_array_equal(value[untouched], initial[untouched])
    assert (value[[3, 9]] != initial[[3, 9]]).all()
    for slot in slots:
        assert not slot[untouched].any()
    assert store.update_counts()["table"]["sparse_applies"] == 1


@pytest.mark.parametrize("make_optimizer", [
    lambda: keras.optimizers.Ftrl(0.1),
    lambda: keras.optimizers.Adam(0.01, use_ema=True),
])
def test_lazy_refuses_optimizers_it_cannot_run_on_rows(make_optimizer):
    with pytest.raises(InvalidArgumentError, match="sparse_updates='lazy'"):
        _store(make_optimizer(), np.zeros((4, 2), "float32"), mode="lazy")


@pytest.mark.parametrize("value", ["sparse", None, 1])
def test_sparse_updates_values_are_checked(value):
    with pytest.raises(InvalidArgumentError, match=r"one of \['exact', 'lazy'\]\. Received: sparse_updates="):
        check_sparse_updates(value)
    store = VariableStore()
    store.create([("table", np.zeros((4, 2), "float32"), True)])
    config = {**keras.optimizers.serialize(keras.optimizers.SGD(0.1)), "sparse_updates": value}
    with pytest.raises(InvalidArgumentError, match="'exact', 'lazy'"):
        store.configure_optimizer(config, ["table"])


def test_a_second_worker_with_another_mode_is_refused():
    store = _store(keras.optimizers.Adam(0.01), np.zeros((4, 2), "float32"), mode="lazy")
    with pytest.raises(Exception, match="sparse_updates"):
        store.configure_optimizer(keras.optimizers.serialize(keras.optimizers.Adam(0.01)),
                                  ["table"])


# ----- through a real gRPC server ----------------------------------------------------

def test_row_pushes_through_the_service_are_sparse_and_exact(client, server, rng):
    initial = rng.standard_normal((NUM_ROWS, WIDTH)).astype("float32")
    pushes = _pushes(rng, num_pushes=10)
    client.create([VariableInit("table", initial)])
    client.configure_optimizer(keras.optimizers.serialize(SPARSE_EXACT["adagrad_options"]()),
                               ["table"])
    for ids, rows in pushes:
        client.push([RowGradient("table", ids, rows)])
    [state] = client.pull(["table"])
    local_value, local_slots, _ = _keras_dense(SPARSE_EXACT["adagrad_options"](), initial, pushes)
    np.testing.assert_allclose(state.value, local_value, rtol=0, atol=1e-6)
    served = client.optimizer_state(["table"])["table"]
    assert served.iterations == 10
    np.testing.assert_allclose(served.slots["accumulator"], local_slots[0], rtol=0, atol=1e-6)
    assert server.store.update_counts()["table"]["sparse_applies"] == 10
    # The same counters over the wire (what benchmarks read from a ps process).
    table = client.stats().variables["table"]
    assert (table.sparse_applies, table.dense_applies) == (10, 0)
    assert table.rows_updated == server.store.update_counts()["table"]["rows_updated"] > 0


def _push_past_the_client(server, options, items):
    """A Push of `[(name, ids array, rows)]` as given: none of the client's own checks run."""
    metas, arrays = [], []
    for name, ids, rows in items:
        metas.append(pb.GradientMeta(name=name, kind=pb.ROWS, values=codec.tensor_meta(rows),
                                     num_row_ids=len(ids)))
        arrays += [np.ascontiguousarray(ids), rows]
    frames = codec.encode_stream(pb.PushHeader(gradients=metas),
                                 [codec.byte_view(array) for array in arrays], options.chunk_bytes)
    with Security().channel(server.address) as channel:
        return METHODS["Push"].callable(channel)(iter(frames), timeout=30)


def _snapshot(client, names):
    states = client.pull(names)
    optimizer = client.optimizer_state(names)
    return ([(state.version, state.value.copy()) for state in states],
            {name: (optimizer[name].iterations, {key: value.copy() for key, value
                                                 in optimizer[name].slots.items()})
             for name in names})


@pytest.mark.parametrize("bad_ids, shown", [
    (np.array([2, 50]), "row id 50"),
    (np.array([-3, 1]), "row id -3"),
    (np.array([0.5, 1.0]), "row id 4602678819172646912"),  # float64 ids: no row's bits
])
def test_bad_row_ids_are_refused_naming_id_and_rows_and_change_nothing(
        client, server, options, bad_ids, shown):
    for name in ("a_table", "b_table"):
        client.create([VariableInit(name, np.ones((50, 2), "float32"))])
        client.configure_optimizer(keras.optimizers.serialize(keras.optimizers.Adagrad(0.1)),
                                   [name])
    client.push([RowGradient("a_table", np.array([1]), np.ones((1, 2), "float32"))])
    before = _snapshot(client, ["a_table", "b_table"])
    rows = np.ones((2, 2), "float32")
    with pytest.raises(grpc.RpcError) as refused:
        # "a_table" is valid and comes first: it must not be applied either.
        _push_past_the_client(server, options, [("a_table", np.array([1, 2]), rows),
                                                ("b_table", bad_ids, rows)])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    message = refused.value.details()
    assert "'b_table'" in message and shown in message and "V=50" in message
    after = _snapshot(client, ["a_table", "b_table"])
    for (version, value), (version_after, value_after) in zip(before[0], after[0]):
        assert version == version_after
        np.testing.assert_array_equal(value, value_after)
    for name in ("a_table", "b_table"):
        assert before[1][name][0] == after[1][name][0]
        for slot, value in before[1][name][1].items():
            np.testing.assert_array_equal(value, after[1][name][1][slot])


@pytest.mark.parametrize("ids, shown", [
    (np.array([7, 50]), "row id 50"), (np.array([-1]), "row id -1"),
    (np.array([0.5]), "dtype float64"),
])
def test_bad_lookup_ids_name_the_id_and_rows(client, server, options, ids, shown):
    client.create([VariableInit("table", np.zeros((50, 2), "float32"))])
    header = pb.LookupHeader(items=[pb.LookupItem(name="table", ids=codec.tensor_meta(ids))])
    frames = codec.encode_stream(header, [codec.byte_view(ids)], options.chunk_bytes)
    with Security().channel(server.address) as channel, pytest.raises(grpc.RpcError) as refused:
        list(METHODS["Lookup"].callable(channel)(iter(frames), timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert shown in refused.value.details() and "V=50" in refused.value.details()


# ----- the strategy's argument reaches the servers ----------------------------------

def _train_on_servers(sparse_updates):
    server = create_server("127.0.0.1:0")
    try:
        [port] = harness.free_ports(1)
        resolver = SimpleClusterResolver(
            {"worker": [f"127.0.0.1:{port}"], "ps": [server.address]}, task_type="worker", task_id=0)
        strategy = kdist.ParameterServerStrategy(resolver, sparse_updates=sparse_updates)
        with strategy.scope():
            seeding.set_random_seed(1)
            model = keras.Sequential([keras.Input((3,), dtype="int64"), keras.layers.Embedding(500, 4),
                                      keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
            model.compile(keras.optimizers.Adam(0.01), "mse")
        ids = np.random.default_rng(0).integers(0, 500, (8, 3))
        model.train_on_batch(ids, np.ones((8, 1), "float32"))
        model.train_on_batch(ids, np.ones((8, 1), "float32"))
        counts = server.store.update_counts()
        [table] = [name for name, entry in counts.items() if entry["rows_updated"]]
        return counts[table]
    finally:
        server.stop(0)


@pytest.mark.parametrize("sparse_updates, sparse", [("exact", False), ("lazy", True)])
def test_strategy_sparse_updates_reaches_the_servers(sparse_updates, sparse):
    counts = _train_on_servers(sparse_updates)
    assert counts["sparse_applies" if sparse else "dense_applies"] == 2
    assert counts["dense_applies" if sparse else "sparse_applies"] == 0


def test_strategy_refuses_an_unknown_sparse_updates():
    resolver = SimpleClusterResolver({"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]},
                                     task_type="worker", task_id=0)
    with pytest.raises(InvalidArgumentError, match=r"sparse_updates='lazzy'"):
        kdist.ParameterServerStrategy(resolver, sparse_updates="lazzy")
