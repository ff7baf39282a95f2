"""Where the batches of a coordinator `fit`/`evaluate` pass come from.

The chief accepts four forms of data and says so when it gets anything else:

- **arrays** (`x`, `y`: NumPy arrays, tensors, or dicts/lists of them): the
  chief cuts each epoch into batches (shuffled unless `shuffle=False`) and
  each closure carries its batches, so every example is seen once per epoch
  even when a closure runs again after a worker died;
- **a `dataset_fn`** — any callable returning an iterable, a generator
  function included, optionally taking a `kdist.InputContext` — or a
  `PerWorkerDataset`: each worker builds and iterates its own dataset, as
  TensorFlow's per-worker datasets do. The datasets should repeat forever, so
  `steps_per_epoch` (for `evaluate`, `steps`) is required;
- **a `keras.utils.PyDataset`**: the chief hands out batch *indices* (each
  index once per epoch, in shuffled order when `shuffle=True` and the dataset
  is finite, as Keras does) and each worker loads `dataset[index]` from its
  own copy, sent to it once. A dataset that overrides `on_epoch_end` is read
  on the chief instead (its batches travel in the closures), so the hook runs
  where the batches are read, as in Keras;
- a generator or iterator *object* cannot be shared by workers: pass the
  function that creates it.
"""

import math

import keras
import numpy as np

from kdist.coordinator import PerWorkerDataset
from kdist.errors import InvalidArgumentError
from kdist.validation import require_positive_integer

ACCEPTED_FORMS = (
    "arrays (x and y as NumPy arrays or tensors, or dicts/lists of them), a dataset_fn (a "
    "function returning an iterable, e.g. a generator function; it may take a kdist.InputContext), "
    "a keras.utils.PyDataset, or a kdist.coordinator.PerWorkerDataset"
)


class IndexedBatches:
    """Batches `dataset[index]` of a `PyDataset`, read on the worker that runs the closure.

    The dataset travels once per worker as a resource; a closure carries only
    this object's indices.
    """

    def __init__(self, dataset, indices):
        self.dataset = dataset
        self.indices = indices

    def __getitem__(self, step):
        batch = self.dataset[self.indices[step]]
        return tuple(batch) if isinstance(batch, list) else batch

    def __len__(self):
        return len(self.indices)


def _overrides_on_epoch_end(dataset):
    return type(dataset).on_epoch_end is not keras.utils.PyDataset.on_epoch_end


class EpochSource:
    """One pass's data; `epoch_sources(pack)` gives `(first step, steps, source)` per closure."""

    def __init__(self, coordinator, x, y, batch_size, steps, shuffle, what, steps_name):
        self.iterator = None
        self._dataset = None
        self._arrays = None
        self.shuffle = shuffle
        self._order = None
        self._cursor = 0
        if isinstance(x, keras.utils.PyDataset):
            self._init_py_dataset(coordinator, x, y, steps, steps_name)
        elif callable(x) or isinstance(x, PerWorkerDataset):
            self._init_dataset_fn(coordinator, x, y, steps, what, steps_name)
        else:
            self._init_arrays(x, y, batch_size, steps, what, steps_name)

    def _init_dataset_fn(self, coordinator, x, y, steps, what, steps_name):
        _no_targets(x, y, "a dataset_fn")
        if steps is None:
            raise InvalidArgumentError(
                f"{steps_name} is required when {what} reads per-worker datasets: each worker's dataset "
                "should repeat forever, so nothing else says where an epoch ends. Received: "
                f"{steps_name}=None. Pass e.g. {steps_name}=100."
            )
        self.iterator = iter(coordinator.create_per_worker_dataset(x))
        self.steps = require_positive_integer(steps_name, steps)

    def _init_py_dataset(self, coordinator, dataset, y, steps, steps_name):
        _no_targets(dataset, y, "a PyDataset")
        self._dataset = dataset
        self.num_batches = dataset.num_batches
        if self.num_batches is None and steps is None:
            raise InvalidArgumentError(
                f"{steps_name} is required for a PyDataset without num_batches (an endless one). "
                f"Received: {steps_name}=None. Pass e.g. {steps_name}=100."
            )
        self.steps = self.num_batches if steps is None else require_positive_integer(steps_name, steps)
        self._on_chief = _overrides_on_epoch_end(dataset)
        if not self._on_chief:
            # Sent once to every worker; closures then refer to it by id.
            coordinator.share_with_workers(dataset)

    def _init_arrays(self, x, y, batch_size, steps, what, steps_name):
        arrays = (x, y) if y is not None else (x,)
        leaves = keras.tree.flatten(arrays)
        if x is None or not leaves or not all(hasattr(leaf, "shape") and hasattr(leaf, "__len__") for leaf in leaves):
            raise InvalidArgumentError(
                f"{what} with a coordinator takes {ACCEPTED_FORMS}. Received: x of type {type(x).__name__}."
                + (" A generator or iterator cannot be shared by the workers: pass the function that "
                   "creates it (each worker then makes its own)." if hasattr(x, "__next__") else "")
            )
        lengths = {len(array) for array in leaves}
        if len(lengths) != 1:
            raise InvalidArgumentError(f"x and y must have the same number of samples. Received lengths {sorted(lengths)}.")
        self._arrays = keras.tree.map_structure(np.asarray, arrays)
        self.num_samples = lengths.pop()
        self.batch_size = 32 if batch_size is None else require_positive_integer("batch_size", batch_size)
        self.num_batches = math.ceil(self.num_samples / self.batch_size)
        self.steps = self.num_batches if steps is None else require_positive_integer(steps_name, steps)

    def epoch_sources(self, pack):
        """(first step, steps, source) per closure of one epoch."""
        chunks = []
        for begin in range(0, self.steps, pack):
            count = min(pack, self.steps - begin)
            chunks.append((begin, count, self.iterator if self.iterator is not None else self._batches(count)))
        return chunks

    def on_epoch_end(self):
        """Keras calls `PyDataset.on_epoch_end` after each epoch; so does the chief (where it reads)."""
        if self._dataset is not None and self._on_chief:
            self._dataset.on_epoch_end()

    def _next_positions(self, count):
        positions = []
        for _ in range(count):
            if self.num_batches is None:  # an endless PyDataset: 0, 1, 2, ...
                positions.append(self._cursor)
                self._cursor += 1
                continue
            if self._order is None or self._cursor >= self.num_batches:
                self._order = self._epoch_order()
                self._cursor = 0
            positions.append(int(self._order[self._cursor]))
            self._cursor += 1
        return positions

    def _epoch_order(self):
        if self._arrays is not None:
            return np.random.permutation(self.num_samples) if self.shuffle else np.arange(self.num_samples)
        return np.random.permutation(self.num_batches) if self.shuffle else np.arange(self.num_batches)

    def _batches(self, count):
        if self._dataset is not None:
            indices = self._next_positions(count)
            batches = IndexedBatches(self._dataset, indices)
            return [batches[step] for step in range(count)] if self._on_chief else batches
        batches = []
        for _ in range(count):
            if self._order is None or self._cursor >= self.num_batches:
                self._order, self._cursor = self._epoch_order(), 0
            rows = self._order[self._cursor * self.batch_size:(self._cursor + 1) * self.batch_size]
            self._cursor += 1
            batch = keras.tree.map_structure(lambda array: array[rows], self._arrays)
            batches.append(tuple(batch) if len(batch) > 1 else (batch[0],))
        return batches


def _no_targets(x, y, form):
    if y is not None:
        raise InvalidArgumentError(
            f"y must be None when x is {form} (it yields (x, y) batches). Received: y of type {type(y).__name__}.")


def split_validation(validation_data):
    """`(x, y)` of `validation_data`: arrays, or a dataset_fn / PyDataset / PerWorkerDataset with y None."""
    if (callable(validation_data) or isinstance(validation_data, (PerWorkerDataset, keras.utils.PyDataset))):
        return validation_data, None
    if isinstance(validation_data, (tuple, list)) and len(validation_data) == 2:
        return validation_data[0], validation_data[1]
    raise InvalidArgumentError(
        f"validation_data must be (x_val, y_val) arrays, a dataset_fn or a keras.utils.PyDataset. Received: "
        f"{type(validation_data).__name__}."
    )
