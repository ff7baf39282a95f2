"""The store and servicer below gRPC: copy-on-write pulls, counters."""

import numpy as np
import pytest

from kdist.ps.server.servicer import VariableServicer
from kdist.ps.server.store import GradientSpec, VariableStore
from kdist.ps.wire import codec
from kdist.ps.wire._generated import variable_service_pb2 as pb
from tests.ps.conftest import sgd_config

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def servicer():
    store = VariableStore()
    store.create([("w", np.arange(1000, dtype="float32"), True)])
    store.configure_optimizer(sgd_config(1.0), ["w"])
    return VariableServicer(store, chunk_bytes=512)


def _push_ones(store):
    plan = store.plan_update([GradientSpec("w", False, np.dtype("float32"), (1000,))], [])
    return store.apply_update(plan, [np.ones(1000, "float32")])


def _assign(store, value):
    plan = store.plan_update([], [("w", value.dtype, value.shape)])
    return store.apply_update(plan, [value])


def _decode(messages):
    deserialize = codec.frame_deserializer(pb.VariablesResponse)
    header, arrays = codec.read_stream(
        [deserialize(message) for message in messages],
        lambda header: [codec.parse_meta(meta.value, meta.name) for meta in header.variables
                        if meta.has_value], "test")
    return header, arrays


@pytest.mark.parametrize("write", [_push_ones, lambda store: _assign(
    store, np.full(1000, 7.0, "float32"))])
def test_a_pull_in_flight_streams_the_value_of_its_version(servicer, write):
    stream = servicer.pull(pb.PullRequest(names=["w"]))
    first = next(stream)  # the stream has started; most of the value is unsent
    write(servicer.store)  # an update lands meanwhile
    header, [value] = _decode([first, *stream])
    assert header.variables[0].version == 0
    np.testing.assert_array_equal(value, np.arange(1000))
    # The update is not lost: the next pull sees it.
    header, [value] = _decode(list(servicer.pull(pb.PullRequest(names=["w"]))))
    assert header.variables[0].version == 1
    assert not np.array_equal(value, np.arange(1000))


def test_updates_without_readers_stay_in_place(servicer):
    [entry] = servicer.store.entries(["w"])
    before = entry.array
    list(servicer.pull(pb.PullRequest(names=["w"])))  # finished: no readers left
    _push_ones(servicer.store)
    assert entry.array is before  # no copy was made
    np.testing.assert_array_equal(entry.array, np.arange(1000) - 1.0)


def test_a_dropped_stream_releases_its_share(servicer):
    [entry] = servicer.store.entries(["w"])
    stream = servicer.pull(pb.PullRequest(names=["w"]))
    next(stream)
    stream = None  # gRPC dropped it (a cancelled call)
    before = entry.array
    _push_ones(servicer.store)
    assert entry.array is before


def test_assignment_adopts_the_received_array(servicer):
    value = np.full(1000, 3.0, "float32")
    _assign(servicer.store, value)
    [entry] = servicer.store.entries(["w"])
    assert np.shares_memory(entry.array, value)
    _push_ones(servicer.store)
    np.testing.assert_array_equal(entry.array, np.full(1000, 2.0))
