"""kdist.keras.adapters: each strategy brings its Keras adapter, found by its class's MRO."""

import kdist
from kdist.distribute.parameter_server.strategy import ParameterServerStrategy
from kdist.distribute.strategy import Strategy
from kdist.keras import adapters
from kdist.keras.parameter_server.adapter import ParameterServerAdapter
from kdist.keras.replica.adapter import ReplicaAdapter


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
