"""Tests for kdist.distribute.devices: spellings, validation and placement."""

import keras
import pytest
import torch

import kdist
from kdist.distribute.devices import Device, device_scope, parse_device, resolve_devices
from kdist.errors import InvalidArgumentError, InvalidDeviceError

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("cpu", Device("cpu", 0)),
        ("CPU:1", Device("cpu", 1)),
        ("/cpu:0", Device("cpu", 0)),
        ("/device:CPU:3", Device("cpu", 3)),
        ("/job:localhost/replica:0/task:0/device:CPU:0", Device("cpu", 0)),
        ("  cpu:2 ", Device("cpu", 2)),
        (torch.device("cpu"), Device("cpu", 0)),
        (Device("cpu", 5), Device("cpu", 5)),
    ],
)
def test_parse_cpu_spellings(spec, expected):
    assert parse_device(spec) == expected


@pytest.mark.parametrize(
    "spec", ["gpu:0", "GPU:0", "cuda:0", "/gpu:0", "/device:GPU:0", "/job:localhost/device:GPU:0"]
)
def test_parse_gpu_spellings(spec):
    if HAS_CUDA:
        assert parse_device(spec) == Device("cuda", 0)
    else:
        with pytest.raises(InvalidDeviceError) as info:
            parse_device(spec)
        message = str(info.value)
        assert "not visible" in message and repr(spec) in message
        assert "0 CUDA device(s)" in message


def test_a_gpu_beyond_the_visible_count_is_refused():
    spec = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(InvalidDeviceError, match="not visible"):
        parse_device(spec)


@pytest.mark.parametrize("spec", ["tpu:0", "banana", "cpu:", "", "cpu:-1", "/device:TPU:0"])
def test_unknown_spellings_raise_with_the_received_value(spec):
    with pytest.raises(InvalidDeviceError) as info:
        parse_device(spec)
    assert f"Received: devices entry {spec!r}" in str(info.value)


def test_non_string_devices_raise_naming_the_argument():
    with pytest.raises(InvalidDeviceError, match="Received: destinations entry 3 of type int"):
        parse_device(3, "destinations")
    with pytest.raises(InvalidDeviceError, match="device\\(type='meta'\\)"):
        parse_device(torch.device("meta"))


def test_device_names():
    logical = Device("cpu", 1)
    assert logical.name == str(logical) == "cpu:1"
    assert logical.torch_device == torch.device("cpu")  # torch has a single CPU device
    assert logical.keras_name == "cpu"
    assert Device("cuda", 1).name == "cuda:1"
    assert Device("cuda", 1).keras_name == "cuda:1"


# ----- resolve_devices / MirroredStrategy(devices=...) ------------------------------------
def test_resolve_devices_keeps_order():
    assert resolve_devices(["cpu:2", "cpu:0"]) == (Device("cpu", 2), Device("cpu", 0))
    assert resolve_devices("cpu:1") == (Device("cpu", 1),)


def test_empty_device_list_raises():
    with pytest.raises(InvalidDeviceError, match=r"Received: devices=\[\]"):
        kdist.MirroredStrategy(devices=[])


@pytest.mark.parametrize(
    "devices", [["cpu:0", "cpu:0"], ["cpu", "cpu:0"], ["cpu:1", "/device:CPU:1"]]
)
def test_duplicate_devices_raise(devices):
    with pytest.raises(InvalidDeviceError, match="Duplicate devices") as info:
        kdist.MirroredStrategy(devices=devices)
    assert repr(devices) in str(info.value)


@pytest.mark.parametrize("bad", ["tpu:0", "banana"])
def test_strategy_with_an_unknown_device_names_it(bad):
    with pytest.raises(InvalidDeviceError, match=repr(bad)):
        kdist.MirroredStrategy(devices=["cpu:0", bad])


def test_a_device_list_must_be_iterable():
    with pytest.raises(InvalidArgumentError, match="Received: devices=5"):
        kdist.MirroredStrategy(devices=5)


def test_cross_device_ops_must_be_an_instance():
    with pytest.raises(InvalidArgumentError, match="Received: cross_device_ops='nccl'"):
        kdist.MirroredStrategy(devices=["cpu:0", "cpu:1"], cross_device_ops="nccl")


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only default")
def test_default_mirrored_strategy_on_a_cpu_box_has_one_replica():
    strategy = kdist.MirroredStrategy()
    assert strategy.num_replicas_in_sync == 1
    assert strategy.extended.worker_devices == ("cpu:0",)
    assert strategy.run(lambda: kdist.get_replica_context().replica_id_in_sync_group) == 0


def test_logical_cpu_replicas():
    strategy = kdist.MirroredStrategy(devices=["/cpu:0", "CPU:1", "cpu:2"])
    assert strategy.extended.worker_devices == ("cpu:0", "cpu:1", "cpu:2")
    assert strategy.num_replicas_in_sync == 3


# ----- placement --------------------------------------------------------------------------
def test_device_scope_of_a_logical_cpu_replica_places_on_the_cpu():
    with device_scope(Device("cpu", 1)):
        tensor = keras.ops.ones((2,))
        variable = keras.Variable([1.0, 2.0])
    assert tensor.device == torch.device("cpu")
    assert variable.value.device == torch.device("cpu")


def test_replica_functions_run_on_their_replica_device():
    strategy = kdist.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    result = strategy.run(lambda: keras.ops.ones((1,)).device)
    assert set(strategy.experimental_local_results(result)) == {torch.device("cpu")}


@pytest.mark.gpu
@needs_cuda
def test_gpu_replicas_place_and_reduce_on_their_devices():
    count = torch.cuda.device_count()
    devices = [f"gpu:{i}" for i in range(count)]
    strategy = kdist.MirroredStrategy(devices=devices)
    assert strategy.extended.worker_devices == tuple(f"cuda:{i}" for i in range(count))
    assert kdist.MirroredStrategy().num_replicas_in_sync == count
    result = strategy.run(lambda: keras.ops.ones((2,)))
    components = strategy.experimental_local_results(result)
    assert [c.device for c in components] == [torch.device("cuda", i) for i in range(count)]
    total = strategy.reduce("sum", result, axis=None) if count > 1 else components[0]
    assert total.device == (torch.device("cpu") if count > 1 else torch.device("cuda", 0))
    assert total.tolist() == [float(count)] * 2
