"""Every input kind `fit`/`evaluate`/`predict` accept, distributed: same result as plain Keras."""

import keras
import numpy as np
import pytest
import torch

from tests.keras import _models as m

BATCH = 48  # 300 samples -> 6 batches of 48 + one of 12


class ArraySequence(keras.utils.PyDataset):
    def __init__(self, x, y, batch_size):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, index):
        window = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[window], self.y[window]


def generator(x, y, batch_size):
    def produce():
        for start in range(0, len(x), batch_size):
            yield x[start : start + batch_size], y[start : start + batch_size]

    return produce


def data_loader(x, y, batch_size):
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False)


def fit_both(make_input, builder=m.mlp_l2, data=None, epochs=2):
    x, y = data or m.classification_data(300)
    reference = builder()
    distributed = m.build_in_scope(builder, m.mirrored(3))
    for model in (reference, distributed):
        args, kwargs = make_input(x, y)
        model.fit(*args, epochs=epochs, verbose=0, shuffle=False, **kwargs)
    m.assert_same_state(reference, distributed)
    return reference, distributed, x, y


@pytest.mark.parametrize(
    "make_input, epochs",
    [
        pytest.param(lambda x, y: ((x, y), {"batch_size": BATCH}), 2, id="numpy"),
        pytest.param(lambda x, y: ((ArraySequence(x, y, BATCH),), {}), 2, id="pydataset"),
        pytest.param(lambda x, y: ((data_loader(x, y, BATCH),), {}), 2, id="dataloader"),
        # A generator is consumed once: one epoch of `steps_per_epoch` batches.
        pytest.param(
            lambda x, y: ((generator(x, y, BATCH)(),), {"steps_per_epoch": 7}), 1, id="generator"
        ),
    ],
)
def test_input_kind_trains_like_plain_keras(make_input, epochs):
    reference, distributed, _, _ = fit_both(make_input, epochs=epochs)
    # 300 samples in batches of 48: 7 steps per epoch, every epoch really ran.
    assert int(reference.optimizer.iterations) == int(distributed.optimizer.iterations) == 7 * epochs


def test_dict_inputs_and_tuple_targets():
    x, y, _ = m.two_input_data(300)
    fit_both(lambda x, y: ((x, y), {"batch_size": BATCH}), builder=m.two_input_two_output, data=(x, y))


def test_predict_keeps_input_order_and_count_for_every_input_kind():
    x, y = m.classification_data(301)
    reference = m.mlp_l2()
    distributed = m.build_in_scope(m.mlp_l2, m.mirrored(3))
    distributed.set_weights(reference.get_weights())
    expected = reference.predict(x, batch_size=BATCH, verbose=0)
    for inputs, kwargs in [
        (x, {"batch_size": BATCH}),
        (ArraySequence(x, y, BATCH), {}),
        (data_loader(x, y, BATCH), {}),
    ]:
        out = distributed.predict(inputs, verbose=0, **kwargs)
        assert out.shape == expected.shape
        np.testing.assert_allclose(out, expected, atol=1e-6)


def test_predict_multi_output_dict_structure():
    x, y, _ = m.two_input_data(101)
    reference = m.two_input_two_output()
    distributed = m.build_in_scope(m.two_input_two_output, m.mirrored(2))
    m.assert_same_outputs(
        reference.predict(x, batch_size=32, verbose=0), distributed.predict(x, batch_size=32, verbose=0)
    )


def test_evaluate_counts_every_sample_once():
    x, y = m.classification_data(301)
    model = m.build_in_scope(m.mlp_l2, m.mirrored(3))
    model.evaluate(x, y, batch_size=BATCH, verbose=0)
    accuracy = next(metric for metric in model.metrics if metric.name == "compile_metrics")
    counts = [v for v in model.metrics_variables if v.path.endswith("count")]
    assert counts, [v.path for v in model.metrics_variables]
    assert all(float(v.numpy()) == 301.0 for v in counts), [float(v.numpy()) for v in counts]
    assert accuracy is not None
