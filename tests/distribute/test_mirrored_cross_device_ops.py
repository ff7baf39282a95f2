"""What `MirroredStrategy(cross_device_ops=...)` drives, and what it does not (issue 26 item 2).

It drives the Strategy API's reductions: `Strategy.reduce`, `extended.reduce_to`,
`batch_reduce_to`, `broadcast_to` and `ReplicaContext.all_reduce` (also one a
user's `train_step` calls under `fit`). It does not drive the reductions of
`model.fit`, `evaluate` or `predict` themselves, in recorded or merge mode: the
replica engine combines gradients and state with `kdist.collectives.local` (see
`docs/mirrored.md`, "Reductions and `cross_device_ops`"). Each test counts the
calls a recording `CrossDeviceOps` receives.
"""

import keras
import numpy as np
import torch

import kdist
from kdist.collectives.local import CrossDeviceOps, reduce_tensors
from tests.keras import _models as m


class CountingOps(CrossDeviceOps):
    """Reduces as `ReductionToOneDevice` does and counts every call it receives."""

    def __init__(self):
        self.reductions = 0
        self.broadcasts = 0

    def reduce_to_device(self, reduce_op, tensors, device):
        self.reductions += 1
        return reduce_tensors(reduce_op, tensors, device)

    def broadcast(self, tensor, destinations):
        self.broadcasts += 1
        return super().broadcast(tensor, destinations)

    @property
    def calls(self):
        return self.reductions + self.broadcasts


class ShardSizes(keras.layers.Layer):
    """Identity layer that notes the batch size of every call (one per replica per step)."""

    def __init__(self, sizes, **kwargs):
        super().__init__(**kwargs)
        self.note = sizes.append  # not the list itself: Keras would track a copy

    def call(self, inputs):
        self.note(int(inputs.shape[0]))
        return inputs


def strategy_with_counter():
    ops = CountingOps()
    return kdist.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=ops), ops


def classifier(sizes):
    return m.compile_classifier(
        keras.Sequential([keras.Input((12,)), ShardSizes(sizes), keras.layers.Dense(4)])
    )


def test_strategy_reductions_go_through_the_given_cross_device_ops():
    strategy, ops = strategy_with_counter()
    values = kdist.PerReplica([torch.tensor(1.0), torch.tensor(2.0)])
    devices = strategy.extended.worker_devices

    assert strategy.reduce("sum", values, axis=None).item() == 3.0
    assert ops.reductions == 1
    assert strategy.extended.reduce_to("mean", values, devices[0]).item() == 1.5
    assert ops.reductions == 2
    strategy.extended.batch_reduce_to("sum", [(values, devices[0]), (values, devices[0])])
    assert ops.reductions == 4
    before = ops.broadcasts
    strategy.extended.broadcast_to(torch.tensor(5.0), devices)
    assert ops.broadcasts == before + 1

    def replica_fn():
        context = kdist.get_replica_context()
        return context.all_reduce("sum", torch.tensor(float(context.replica_id_in_sync_group)))

    reductions = ops.reductions
    result = strategy.run(replica_fn)
    assert [v.item() for v in strategy.experimental_local_results(result)] == [1.0, 1.0]
    assert ops.reductions == reductions + 1  # one all_reduce, one reduction of 2 components


def test_fit_evaluate_and_predict_do_not_call_cross_device_ops():
    strategy, ops = strategy_with_counter()
    sizes = []
    with strategy.scope():
        model = classifier(sizes)
    x, y = m.classification_data(num_samples=4 * m.GLOBAL_BATCH)
    before = [w.copy() for w in model.get_weights()]

    history = model.fit(x, y, batch_size=m.GLOBAL_BATCH, epochs=2, verbose=0)
    model.evaluate(x, y, batch_size=m.GLOBAL_BATCH, verbose=0)
    model.predict(x, batch_size=m.GLOBAL_BATCH, verbose=0)

    # Both replicas ran every step of the three calls (2 * 4 + 4 + 4 steps, 32 samples
    # per replica; the calls before them build the model) and the model trained...
    assert sizes[-32:] == [m.GLOBAL_BATCH // 2] * 32
    assert not all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assert history.history["loss"][1] < history.history["loss"][0]
    # ...without one call to the strategy's cross_device_ops.
    assert ops.calls == 0


class ReduceAtEpochEnd(keras.callbacks.Callback):
    def __init__(self, strategy):
        super().__init__()
        self.strategy = strategy

    def on_epoch_end(self, epoch, logs=None):
        values = kdist.PerReplica([torch.tensor(1.0), torch.tensor(2.0)])
        self.strategy.reduce("sum", values, axis=None)


def test_negative_control_a_reduction_during_fit_is_counted():
    # The counter is live while fit runs: a Strategy.reduce from a callback is seen.
    strategy, ops = strategy_with_counter()
    with strategy.scope():
        model = classifier([])
    x, y = m.classification_data(num_samples=2 * m.GLOBAL_BATCH)
    model.fit(
        x, y, batch_size=m.GLOBAL_BATCH, epochs=2, verbose=0, callbacks=[ReduceAtEpochEnd(strategy)]
    )
    assert ops.reductions == 2


class AllReduceInTrainStep(keras.Sequential):
    """A `train_step` that calls `ReplicaContext.all_reduce` itself."""

    def train_step(self, data):
        logs = super().train_step(data)
        total = kdist.get_replica_context().all_reduce("sum", torch.tensor(1.0))
        return {**logs, "replicas": total}


def test_an_all_reduce_of_the_users_train_step_under_fit_uses_cross_device_ops():
    strategy, ops = strategy_with_counter()
    with strategy.scope():
        model = m.compile_classifier(AllReduceInTrainStep([keras.Input((12,)), keras.layers.Dense(4)]))
    x, y = m.classification_data(num_samples=2 * m.GLOBAL_BATCH)
    history = model.fit(x, y, batch_size=m.GLOBAL_BATCH, epochs=1, verbose=0)
    assert history.history["replicas"] == [2.0]
    assert ops.reductions == 2  # the user's all_reduce, once per step; fit's own: none
