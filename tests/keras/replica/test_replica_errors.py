"""An error raised inside one replica's step names the replica and its shard's size.

The case found by keras-hub's own tests (`basnet_test::test_basics`, issue 36):
torch's CPU `slow_conv2d` backward fails on a one-sample batch through a convolution
with one output channel. Plain Keras fails the same way with `batch_size=1`; two
replicas given a global batch of 2 run one sample each and meet it there.
"""

import keras
from tests import seeding
import numpy as np
import pytest

from tests.keras import _models as m

MESSAGE = "grad_weight must be contiguous"


def one_channel_conv(seed=3):
    seeding.set_random_seed(seed)
    model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(1, 3, padding="same")])
    model.compile(optimizer="sgd", loss="mse")
    return model


def data(n):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 8, 8, 3)).astype("float32"), rng.normal(size=(n, 8, 8, 1)).astype("float32")


def test_plain_keras_fails_on_one_sample_so_a_replica_on_one_sample_fails_alike_and_says_so():
    x, y = data(2)
    with pytest.raises(RuntimeError, match=MESSAGE) as plain:
        one_channel_conv().fit(x, y, batch_size=1, epochs=1, verbose=0)
    assert not any(note.startswith("kdist:") for note in getattr(plain.value, "__notes__", ()))

    distributed = m.build_in_scope(one_channel_conv, m.mirrored(2))
    before = [v.numpy().copy() for v in distributed.weights]
    with pytest.raises(RuntimeError, match=MESSAGE) as replica:
        distributed.fit(x, y, batch_size=2, epochs=1, verbose=0)
    # The same type and message (a `except RuntimeError` still catches it), and one note.
    notes = [note for note in replica.value.__notes__ if note.startswith("kdist:")]
    assert len(notes) == 1
    assert "replica 0 of 2" in notes[0] and "1 sample(s)" in notes[0]
    for value, variable in zip(before, distributed.weights):
        np.testing.assert_array_equal(value, variable.numpy())  # nothing was applied


def test_two_samples_per_replica_train_like_one_device():
    x, y = data(8)
    reference = one_channel_conv()
    reference.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
    distributed = m.build_in_scope(one_channel_conv, m.mirrored(2))
    distributed.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
    m.assert_same_state(reference, distributed)
