"""kdist.keras.adapters: each strategy brings its Keras adapter, found by its class's MRO."""

import keras
import numpy as np
import pytest
import torch

import kdist
from kdist.distribute.parameter_server.strategy import ParameterServerStrategy
from kdist.distribute.strategy import Strategy
from kdist.keras import adapters
from kdist.keras.parameter_server.adapter import ParameterServerAdapter
from kdist.keras.replica.adapter import ReplicaAdapter
from tests.keras import _models as m


class _Unregistered:
    """Not a kdist Strategy: nobody registered an adapter for it."""


def test_synchronous_strategies_get_the_replica_adapter():
    for strategy in (kdist.get_strategy(), kdist.MirroredStrategy(devices=["cpu:0", "cpu:1"])):
        adapter = adapters.adapter_for(strategy)
        assert type(adapter) is ReplicaAdapter and adapter.strategy is strategy


def test_the_nearest_registration_in_the_mro_wins():
    class MyParameterServerStrategy(ParameterServerStrategy):
        def __init__(self):  # no cluster needed: the lookup reads the class only
            pass

    assert type(adapters.adapter_for(MyParameterServerStrategy())) is ParameterServerAdapter
    assert ParameterServerAdapter.__mro__[1] is ReplicaAdapter


def test_register_overrides_for_a_subclass_only():
    class Custom(kdist.MirroredStrategy):
        pass

    class CustomAdapter(adapters.KerasAdapter):
        pass

    adapters.register(Custom, CustomAdapter)
    try:
        assert type(adapters.adapter_for(Custom(devices=["cpu:0"]))) is CustomAdapter
        assert type(adapters.adapter_for(kdist.MirroredStrategy(devices=["cpu:0"]))) is ReplicaAdapter
    finally:
        adapters._registry.pop(Custom)
    assert adapters._registry[Strategy] is ReplicaAdapter


def test_an_unregistered_class_gets_the_plain_adapter():
    adapter = adapters.adapter_for(_Unregistered())
    assert type(adapter) is adapters.KerasAdapter
    calls = []
    assert adapter.route_call(lambda model, *a, **k: calls.append((model, a, k)) or "done", "m", "fit", (1,), {"x": 2}) == "done"
    assert calls == [("m", (1,), {"x": 2})]


# ----- one optimizer step: every apply is routed once, every update made once ----------
class _CountingAdapter(ReplicaAdapter):
    """What an optimizer-state sharding (ZeRO-1) would be: one subclass overriding `apply_gradients`."""

    routed = []
    updates = []

    def optimizer_step(self, optimizer, gradients, variables):
        type(self).routed.append(optimizer)
        return super().optimizer_step(optimizer, gradients, variables)

    def apply_gradients(self, optimizer, gradients, variables):
        type(self).updates.append(optimizer)
        return super().apply_gradients(optimizer, gradients, variables)


class _CountingMirrored(kdist.MirroredStrategy):
    pass


@pytest.fixture
def counting_strategy():
    adapters.register(_CountingMirrored, _CountingAdapter)
    _CountingAdapter.routed, _CountingAdapter.updates = [], []
    try:
        yield _CountingMirrored(devices=["cpu:0", "cpu:1"])
    finally:
        adapters._registry.pop(_CountingMirrored)


def _iterations(optimizer):
    return int(keras.ops.convert_to_numpy(optimizer.iterations))


def test_fit_on_replicas_routes_each_replica_apply_once_and_updates_once(counting_strategy):
    x, y = m.classification_data()
    with counting_strategy.scope():
        model = m.mlp_l2()
    model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    steps = _iterations(model.optimizer)
    assert steps == -(-len(x) // 64)
    # Each replica's apply is intercepted once (recorded); the engine's combined
    # update reaches the adapter's apply_gradients, not optimizer.apply again.
    assert _CountingAdapter.routed == [model.optimizer] * (2 * steps)
    assert _CountingAdapter.updates == [model.optimizer] * steps


def test_merge_mode_updates_through_the_adapter(counting_strategy):
    from tests.keras.workers.gan import build_gan, fit_gan

    with counting_strategy.scope():
        gan = build_gan()
    fit_gan(gan)
    for optimizer in (gan.d_optimizer, gan.g_optimizer):
        steps = _iterations(optimizer)
        assert steps > 0
        assert _CountingAdapter.updates.count(optimizer) == steps
        # The first step starts sequential: the discriminator's apply is recorded,
        # the generator's switches the engine to merge mode (one probe each) and
        # the step runs again. From then on each replica's apply is routed once.
        assert _CountingAdapter.routed.count(optimizer) == 2 * steps + 1


def test_a_custom_loop_merge_updates_through_the_adapter(counting_strategy):
    from tests.keras.workers import custom_loop_tutorial as tutorial

    results = tutorial.train(counting_strategy, epochs=1)
    steps = int(results["steps"])
    assert int(results["iterations"]) == steps
    assert len(_CountingAdapter.updates) == steps
    assert len(_CountingAdapter.routed) == 2 * steps


def test_the_parameter_server_update_is_the_adapters_push(monkeypatch):
    from tests.keras import _ps

    pushes = []
    original = ParameterServerAdapter.apply_gradients

    def counting(self, optimizer, gradients, variables):
        pushes.append(optimizer)
        return original(self, optimizer, gradients, variables)

    monkeypatch.setattr(ParameterServerAdapter, "apply_gradients", counting)
    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver(), devices=["cpu:0", "cpu:1"])
        with strategy.scope():
            variable = keras.Variable(np.ones((3,), "float32"))
            optimizer = keras.optimizers.SGD(0.5)
        strategy.run(lambda: optimizer.apply_gradients([(torch.ones(3), variable)]))
        # Outside the scope and any replica function: a custom loop's own apply pushes too.
        optimizer.apply([torch.ones(3)], [variable])
        assert pushes == [optimizer, optimizer]
        assert cluster.stats()[0].requests.get("push", 0) == 2
    # 1 - 0.5 * (1 + 1) (two replicas, summed), then - 0.5 * 1.
    np.testing.assert_allclose(keras.ops.convert_to_numpy(variable), np.full(3, -0.5))


def test_optimizer_apply_is_intercepted_in_one_module_only():
    """No other kdist module replaces an optimizer's `apply` (the one interception is adapters.py's)."""
    import pathlib
    import re

    package = pathlib.Path(kdist.__file__).parent
    pattern = re.compile(r"""(\.apply\s*=[^=])|(setattr\([^)]*["']apply["'])""")
    offenders = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path.name != "adapters.py" and pattern.search(path.read_text())
    )
    assert offenders == []


def test_an_optimizer_made_outside_a_parameter_server_scope_is_refused_on_server_variables():
    from kdist.errors import UnsupportedError
    from tests.keras import _ps

    outside = keras.optimizers.SGD(0.5)
    local = keras.Variable(np.ones((3,), "float32"))
    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        with strategy.scope():
            remote = keras.Variable(np.ones((3,), "float32"))
            with pytest.raises(UnsupportedError, match="outside strategy.scope"):
                outside.apply([torch.ones(3)], [remote])
            # Variables the servers do not hold: a local update, as Keras does.
            outside.apply([torch.ones(3)], [local])
        assert cluster.stats()[0].requests.get("push", 0) == 0
        np.testing.assert_allclose(keras.ops.convert_to_numpy(remote), np.ones(3))
    np.testing.assert_allclose(keras.ops.convert_to_numpy(local), np.full(3, 0.5))


def test_an_optimizer_subclass_with_its_own_apply_runs_it_once_per_update():
    """`MultiOptimizer` and a user's subclass define `apply`: the outermost one is the step."""
    strategy = kdist.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        v = keras.Variable(np.ones(3, "float32"), name="v")
        w = keras.Variable(np.ones(2, "float32"), name="w")
        first, second = keras.optimizers.SGD(0.5), keras.optimizers.SGD(0.25)
        multi = keras.optimizers.MultiOptimizer(lambda variable: first if variable.path == v.path else second)
        multi.build([v, w])

    class Counting(keras.optimizers.SGD):  # defined after kdist routed the classes
        calls = 0

        def apply(self, grads, trainable_variables=None):
            Counting.calls += 1
            return super().apply(grads, trainable_variables)

    with strategy.scope():
        counting = Counting(0.5)
    for _ in range(2):
        strategy.run(lambda: multi.apply([torch.ones(3), torch.ones(2)], [v, w]))
    # Two replicas' gradients summed, two steps. Unrouted, each replica ran
    # MultiOptimizer.apply and counted its iterations: 4.
    assert [int(o.iterations.numpy()) for o in (multi, first, second)] == [2, 2, 2]
    np.testing.assert_allclose(keras.ops.convert_to_numpy(v), np.full(3, 1 - 2 * 0.5 * 2))
    np.testing.assert_allclose(keras.ops.convert_to_numpy(w), np.full(2, 1 - 2 * 0.25 * 2))
    strategy.run(lambda: counting.apply([torch.ones(3)], [v]))
    assert Counting.calls == 1 and int(counting.iterations.numpy()) == 1
