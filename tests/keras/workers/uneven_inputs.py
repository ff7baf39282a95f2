"""One rank whose input has a different length than the other ranks' (never hangs).

- a generator (length unknown to Keras): rank r yields 5 + 2r global batches;
- a PyDataset with a known length: rank r has 6 - r batches per epoch.
Every rank must run as many steps as the shortest rank, in every epoch, and
end with the same weights. Prints `STEPS generator=<n> pydataset=<a,b>` and
`UNEVEN OK`.
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
from tests import seeding  # noqa: E402
import numpy as np  # noqa: E402

from tests.keras.workers.fit_equivalence import build_model, make_data  # noqa: E402


class CountSteps(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.per_epoch = []

    def on_epoch_begin(self, epoch, logs=None):
        self.per_epoch.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.per_epoch[-1] += 1


class Batches(keras.utils.PyDataset):
    def __init__(self, x, y, num_batches):
        super().__init__()
        self._x, self._y, self._num_batches = x, y, num_batches

    def __len__(self):
        return self._num_batches

    def __getitem__(self, index):
        start = index * 32
        return self._x[start : start + 32], self._y[start : start + 32]


def main():
    import kdist

    strategy = kdist.MultiWorkerMirroredStrategy(communication_options=kdist.CommunicationOptions(timeout_seconds=30))
    rank = strategy.extended.collectives.rank
    x, y = make_data()
    seeding.set_random_seed(1)
    with strategy.scope():
        model = build_model()

    def batches(count):
        for index in range(count):
            yield x[index * 32 : (index + 1) * 32], y[index * 32 : (index + 1) * 32]

    generator_steps = CountSteps()
    model.fit(batches(5 + 2 * rank), epochs=1, verbose=0, callbacks=[generator_steps])
    evaluation = model.evaluate(batches(4 + rank), verbose=0, return_dict=True)

    dataset_steps = CountSteps()
    # shuffle=False: PyDatasets of different lengths would be shuffled into different
    # batch orders per rank, which is rank-specific input (refused by the first-batch check).
    model.fit(Batches(x, y, 6 - rank), epochs=2, verbose=0, shuffle=False, callbacks=[dataset_steps])

    assert generator_steps.per_epoch == [5], generator_steps.per_epoch
    assert dataset_steps.per_epoch == [6 - (strategy.extended.collectives.world_size - 1)] * 2, dataset_steps.per_epoch
    weights = np.concatenate([np.ravel(keras.ops.convert_to_numpy(w)) for w in model.weights])
    digest = float(np.sum(weights * np.arange(weights.size) % 97))
    print(f"STEPS generator={generator_steps.per_epoch} pydataset={dataset_steps.per_epoch}", flush=True)
    print(f"DIGEST {digest!r} LOSS {float(evaluation['loss'])!r}", flush=True)
    print("UNEVEN OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
