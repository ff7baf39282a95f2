"""MirroredStrategy on real CUDA devices. Skipped (with the reason) where none is visible."""

import keras
import numpy as np
import pytest
import torch

import kdist
from tests.keras import _models as m

pytestmark = pytest.mark.gpu

needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@pytest.fixture(autouse=True)
def exact_matmul():
    # TF32 would make the plain and the distributed runs differ by ~1e-3.
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def devices_seen_by_replicas(strategy):
    seen = []

    class Probe(keras.layers.Layer):
        def call(self, x, training=None):
            if training:
                seen.append(str(x.device))
            return x

    def builder():
        m.seeded()
        model = keras.Sequential([keras.Input((12,)), Probe(), keras.layers.Dense(4)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    model = m.build_in_scope(builder, strategy)
    x, _ = m.classification_data(64)
    model.train_on_batch(x, np.zeros((64, 4), "float32"))
    return model, seen


def test_default_strategy_uses_every_visible_gpu():
    strategy = kdist.MirroredStrategy()
    assert strategy.num_replicas_in_sync == torch.cuda.device_count()
    assert strategy.extended.worker_devices[0] == "cuda:0"


def test_variables_live_on_the_first_device_and_replicas_compute_on_theirs():
    strategy = kdist.MirroredStrategy()
    model, seen = devices_seen_by_replicas(strategy)
    assert all(str(v.value.device) == "cuda:0" for v in model.variables)
    assert seen == [f"cuda:{i}" for i in range(strategy.num_replicas_in_sync)]


@pytest.mark.parametrize("spelling", ["gpu:0", "/device:GPU:0", "cuda:0"])
def test_single_gpu_replica_matches_plain_keras(spelling):
    x, y = m.classification_data()
    reference = m.mlp_l2()
    distributed = m.build_in_scope(m.mlp_l2, kdist.MirroredStrategy([spelling]))
    for model in (reference, distributed):
        model.fit(x, y, batch_size=64, epochs=2, verbose=0, shuffle=False)
    m.assert_same_state(reference, distributed, atol=1e-5)


@needs_two
@pytest.mark.parametrize("builder", [m.mlp_l2, m.two_input_two_output, m.custom_step])
def test_two_gpu_replicas_match_plain_keras(builder):
    data = {
        m.mlp_l2: m.classification_data,
        m.two_input_two_output: lambda: m.two_input_data()[:2],
        m.custom_step: m.regression_data,
    }[builder]()
    x, y = data
    reference = builder()
    distributed = m.build_in_scope(builder, kdist.MirroredStrategy(["cuda:0", "cuda:1"]))
    for model in (reference, distributed):
        model.fit(x, y, batch_size=64, epochs=2, verbose=0, shuffle=False)
    m.assert_same_state(reference, distributed, atol=1e-4)
    m.assert_same_outputs(
        reference.predict(x, batch_size=64, verbose=0), distributed.predict(x, batch_size=64, verbose=0), atol=1e-4
    )


@needs_two
def test_gpu_replica_gradients_are_checked():
    from kdist.errors import ReplicaGradientError
    from tests.keras._models import fault

    model = m.build_in_scope(m.mlp_l2, kdist.MirroredStrategy(["cuda:0", "cuda:1"]))
    x, y = m.classification_data(128)
    with fault(drop_replica_gradients=True), pytest.raises(ReplicaGradientError):
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
