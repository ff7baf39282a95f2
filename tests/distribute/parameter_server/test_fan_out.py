"""`fan_out.started`: a step's requests to several servers go out together from the calling thread.

Real variable servers on loopback ports, in this process, for the router's step.
"""

import threading

import keras
import numpy as np
import pytest

import kdist
from kdist.distribute.parameter_server import fan_out
from kdist.ps.client import retry as client_retry
from tests.keras import _ps

pytestmark = pytest.mark.timeout(120)


class _Call:
    """A started call: `finish()` returns its answer or raises its error, and records that it ran."""

    def __init__(self, log, name, answer):
        self.log, self.name, self.answer = log, name, answer

    def __call__(self):
        self.log.append(f"finish {self.name}")
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def _starter(log, answers):
    def start(client, payload):
        log.append(f"start {client}")
        answer = answers[client]
        if isinstance(answer, KeyError):  # refused before anything was sent
            raise answer
        return _Call(log, client, answer)

    return start


def test_every_request_is_sent_before_any_answer_is_read():
    log = []
    results = fan_out.started(["a", "b", "c"], {0: "x", 2: "z"}, _starter(log, {"a": 1, "c": 3}))
    assert results == {0: 1, 2: 3}
    assert log == ["start a", "start c", "finish a", "finish c"]


def test_every_sent_call_is_read_before_the_first_error_is_raised():
    log = []
    first, second = RuntimeError("a failed"), RuntimeError("b failed")
    with pytest.raises(RuntimeError, match="a failed"):
        fan_out.started(["a", "b", "c"], {0: "", 1: "", 2: ""}, _starter(log, {"a": first, "b": second, "c": 3}))
    assert log == ["start a", "start b", "start c", "finish a", "finish b", "finish c"]


def test_a_request_refused_before_sending_stops_the_rest_and_ends_those_sent():
    log = []
    with pytest.raises(KeyError, match="bad name"):
        fan_out.started(["a", "b", "c"], {0: "", 1: "", 2: ""}, _starter(log, {"a": 1, "b": KeyError("bad name")}))
    assert log == ["start a", "start b", "finish a"]


def _threads_of_a_step(monkeypatch, pooled=False):
    """`[(rpc name, thread name)]` of one pull, lookup, push and read of two variables on two servers."""
    threads = []
    original = client_retry.start

    def recording(client, name, *args, **kwargs):
        threads.append((name, threading.current_thread().name))
        return original(client, name, *args, **kwargs)

    with _ps.in_process_servers(2) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        with strategy.scope():
            dense = [keras.Variable(np.zeros(3, "float32")) for _ in range(2)]
        router = strategy.extended.variable_router
        routes = router.routes(dense)
        assert sorted(route.placement.shards[0].ps_index for route in routes) == [0, 1]
        router.configure_optimizer(keras.optimizers.serialize(keras.optimizers.SGD(1.0)), routes)
        monkeypatch.setattr(client_retry, "start", recording)
        if pooled:  # the router before: each server's call on a pool thread
            monkeypatch.setattr(fan_out, "started", lambda clients, requests, start: fan_out.pooled(
                router._pool, clients, requests, lambda client, payload: start(client, payload)()))
        router.pull(routes, only_changed=False)
        router.lookup_shards(routes[0], [(0, np.array([0, 2]))])
        router.send_gradients([(route, np.ones(3, "float32")) for route in routes])
        [value] = router.read_shards(routes[1], [0])
    np.testing.assert_array_equal(value, np.full(3, -1.0))  # SGD(1.0), one push of ones
    return threads


def test_a_steps_pull_lookup_and_push_run_in_the_calling_thread(monkeypatch):
    threads = _threads_of_a_step(monkeypatch)
    assert [name for name, _ in threads] == ["Pull", "Pull", "Lookup", "Push", "Push", "Pull"]
    assert {thread for _, thread in threads} == {threading.current_thread().name}


def test_negative_control_calls_on_a_pool_are_seen(monkeypatch):
    threads = _threads_of_a_step(monkeypatch, pooled=True)
    assert {thread for _, thread in threads} - {threading.current_thread().name}
