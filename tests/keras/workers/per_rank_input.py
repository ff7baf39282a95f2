"""Input already split per rank: one rank of a 2-process job, or (imported) the reference's batches.

Run as a script (`--job equivalence` or `--job errors`) under the test
harness. `equivalence` trains each scenario below with
`MultiWorkerMirroredStrategy` and writes weights, optimizer slots, metric
variables, History, evaluate and predict results to
`<out>/<scenario>-rank<r>.npz`; `--fault` turns on one negative-control switch
of `kdist.faults` for every scenario. `errors` feeds undeclared per-rank input
and prints `CAUGHT <case> <error class>: <message>` (or `SKIP <case>: <why>`).

Scenarios (each rank reads its own batches; the reference is plain Keras on
the ranks' batches concatenated in rank order, `global_batches`):

- `sampler`: a `DataLoader` whose sampler is a `DistributedSampler` (101
  samples, batch 8 per rank, the last padded), unshuffled;
- `sampler_shuffled`: the same shuffled, as the sampler of a `BatchSampler`
  (the batch sampler's case), with `set_epoch` called by a callback (Keras
  3.16 calls `set_epoch` itself, with its own count, only on a loader's
  `sampler`);
- `from_function`: `strategy.distribute_datasets_from_function` with an
  `InputContext` (rank r keeps `x[r::2]`: 51 and 50 samples, so the last
  global batch is 3 + 2);
- `declared`: `kdist.distribute.per_rank` on a `PyDataset` whose ranks yield
  batches of 5 and 8 with sample weights (8 batches each), per-rank
  validation data, and per-rank generators (lengths unknown) with different
  numbers of batches for evaluate (5 and 9: the last 4 steps hold rank 1's
  batch alone) and predict (5 and 3).

Error cases (`errors`): undeclared per-rank input (a `PyDataset`, a `tf.data`
`.shard()`), a `DistributedSampler` for another job on every rank or (built
with the local rank on a second node) on rank 1 only, per-rank input declared
on one rank only, per-rank `PyDataset`s of 3 and 4 batches (known lengths
that differ: refused before the first step), undeclared input that agrees in epoch 1 and differs from
epoch 2 (`unchanged` then means: the weights after epoch 1), and torch
BatchNorm given a 1-sample shard on rank 0 only.
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
from tests import seeding  # noqa: E402
import numpy as np  # noqa: E402

SEED = 3
NUM_SAMPLES = 101
EPOCHS = 2
WORLD_SIZE = 2
SAMPLER_BATCH = 8
GLOBAL_BATCH = 16  # distribute_datasets_from_function: 8 per replica
SCENARIOS = ("sampler", "sampler_shuffled", "from_function", "declared")
ERROR_CASES = (
    "undeclared_pydataset", "tf_shard", "sampler_for_another_job", "sampler_rank_on_one_rank",
    "declared_on_one_rank", "uneven_known_lengths", "differs_from_epoch_2", "batchnorm_on_one_rank",
)


def make_data():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(NUM_SAMPLES, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1)) + 0.1 * rng.normal(size=(NUM_SAMPLES, 1))).astype("float32")
    weights = rng.uniform(0.5, 2.0, size=(NUM_SAMPLES,)).astype("float32")
    return x, y, weights


def build_model():
    seeding.set_random_seed(SEED)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse", metrics=["mae"])
    return model


# ----- what each rank reads (shared with the reference) ------------------------------
def _chunks(indices, size):
    return [indices[start : start + size] for start in range(0, len(indices), size)]


def _sampler_indices(rank, shuffle, epoch):
    import torch
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(torch.arange(NUM_SAMPLES), num_replicas=WORLD_SIZE, rank=rank, shuffle=shuffle, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


# Contiguous regions of the data each rank reads in the `declared` scenario, and its batch size.
DECLARED = {
    "fit": [(0, 40, 5), (40, 101, 8)],
    "validation": [(0, 21, 7), (21, 33, 4)],
    "evaluate": [(50, 80, 6), (0, 45, 5)],
    "predict": [(0, 20, 4), (12, 30, 6)],
}


def rank_batches(scenario, rank, epoch=0, part="fit"):
    """The batches (tuples of NumPy arrays) rank `rank` reads in `scenario`."""
    x, y, weights = make_data()
    if scenario in ("sampler", "sampler_shuffled"):
        indices = _sampler_indices(rank, scenario == "sampler_shuffled", epoch)
        return [(x[chunk], y[chunk]) for chunk in _chunks(indices, SAMPLER_BATCH)]
    if scenario == "from_function":
        indices = list(range(NUM_SAMPLES))[rank::WORLD_SIZE]
        return [(x[chunk], y[chunk]) for chunk in _chunks(indices, GLOBAL_BATCH // WORLD_SIZE)]
    if scenario == "declared":
        start, stop, size = DECLARED[part][rank]
        chunks = _chunks(list(range(start, stop)), size)
        if part == "predict":
            return [(x[chunk],) for chunk in chunks]
        return [(x[chunk], y[chunk], weights[chunk]) for chunk in chunks]
    raise ValueError(f"unknown scenario {scenario!r}")


def global_batches(scenario, epoch=0, part="fit"):
    """The reference's batches: the ranks' batches concatenated in rank order.

    Steps run while any rank has a batch: a rank that ran out adds nothing.
    """
    per_rank = [rank_batches(scenario, rank, epoch, part) for rank in range(WORLD_SIZE)]
    steps = max(len(batches) for batches in per_rank)
    return [
        tuple(np.concatenate(leaves) for leaves in zip(*(b[step] for b in per_rank if step < len(b))))
        for step in range(steps)
    ]


class Batches(keras.utils.PyDataset):
    """A list of batches as a PyDataset."""

    def __init__(self, batches):
        super().__init__()
        self._batches = batches

    def __len__(self):
        return len(self._batches)

    def __getitem__(self, index):
        return self._batches[index]


def collect(model, history, evaluation, predictions):
    results = {}
    for i, v in enumerate(model.weights):
        results[f"weight/{i}"] = np.asarray(keras.ops.convert_to_numpy(v))
    for i, v in enumerate(model.optimizer.variables):
        results[f"optimizer/{i}"] = np.asarray(keras.ops.convert_to_numpy(v))
    for i, v in enumerate(model.metrics_variables):
        results[f"metric/{i}"] = np.asarray(keras.ops.convert_to_numpy(v))
    for key, values in history.items():
        results[f"history/{key}"] = np.asarray(values, dtype="float64")
    for key, value in evaluation.items():
        results[f"evaluate/{key}"] = np.asarray(value, dtype="float64")
    results["predict"] = np.asarray(predictions)
    return results


def reference(scenario):
    """Plain Keras on the global batches, one `fit` call per epoch (the shuffled sampler's change per epoch)."""
    model = build_model()
    history = {}
    validation = Batches(global_batches(scenario, part="validation")) if scenario == "declared" else None
    for epoch in range(EPOCHS):
        run = model.fit(
            Batches(global_batches(scenario, epoch)), initial_epoch=epoch, epochs=epoch + 1, verbose=0,
            validation_data=validation, shuffle=False,
        )
        for key, values in run.history.items():
            history.setdefault(key, []).extend(values)
    last = EPOCHS - 1
    evaluate_part, predict_part = ("evaluate", "predict") if scenario == "declared" else ("fit", "fit")
    evaluation = model.evaluate(Batches(global_batches(scenario, last, evaluate_part)), verbose=0, return_dict=True)
    predictions = model.predict(
        Batches([batch[:1] for batch in global_batches(scenario, last, predict_part)]), verbose=0
    )
    return collect(model, history, evaluation, predictions)


# ----- one rank ------------------------------------------------------------------------
class SetSamplerEpoch(keras.callbacks.Callback):
    """What a torch training loop does before each epoch: `sampler.set_epoch(epoch)`."""

    def __init__(self, sampler):
        super().__init__()
        self._sampler = sampler

    def on_epoch_begin(self, epoch, logs=None):
        self._sampler.set_epoch(epoch)


def _generator(batches):
    yield from batches


def train_rank(scenario, strategy, rank):
    import torch
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

    from kdist.distribute.input import per_rank

    x, y, _ = make_data()
    with strategy.scope():
        model = build_model()
    callbacks, fit_kwargs = [], {}
    if scenario == "sampler":
        dataset = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        sampler = DistributedSampler(dataset, shuffle=False)
        train = evaluate = predict = DataLoader(dataset, batch_size=SAMPLER_BATCH, sampler=sampler)
    elif scenario == "sampler_shuffled":
        dataset = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        sampler = DistributedSampler(dataset, shuffle=True, seed=0)
        batches = BatchSampler(sampler, SAMPLER_BATCH, drop_last=False)
        train = evaluate = predict = DataLoader(dataset, batch_sampler=batches)
        callbacks.append(SetSamplerEpoch(sampler))
    elif scenario == "from_function":

        def dataset_fn(context):
            indices = np.arange(NUM_SAMPLES)[context.input_pipeline_id :: context.num_input_pipelines]
            size = context.get_per_replica_batch_size(GLOBAL_BATCH)
            return [(x[chunk], y[chunk]) for chunk in _chunks(indices, size)]

        train = evaluate = predict = strategy.distribute_datasets_from_function(dataset_fn)
    else:
        train = per_rank(Batches(rank_batches(scenario, rank)))
        fit_kwargs["validation_data"] = per_rank(Batches(rank_batches(scenario, rank, part="validation")))
        evaluate = per_rank(_generator(rank_batches(scenario, rank, part="evaluate")))
        predict = per_rank(_generator(rank_batches(scenario, rank, part="predict")))
    # shuffle=False: Keras would shuffle a PyDataset's batch order (the same on every rank).
    history = model.fit(train, epochs=EPOCHS, verbose=0, callbacks=callbacks, shuffle=False, **fit_kwargs)
    evaluation = model.evaluate(evaluate, verbose=0, return_dict=True)
    predictions = model.predict(predict, verbose=0)
    return collect(model, history.history, evaluation, predictions)


class SameInEpoch1Only(keras.utils.PyDataset):
    """Every rank reads the same batches in epoch 1; from epoch 2 on, its own rows (undeclared)."""

    def __init__(self, rank):
        super().__init__()
        self.rank, self.epoch = rank, 0
        self._x, self._y, _ = make_data()

    def __len__(self):
        return 4

    def __getitem__(self, index):
        start = (self.rank * 50 if self.epoch else 0) + index * SAMPLER_BATCH
        return self._x[start : start + SAMPLER_BATCH], self._y[start : start + SAMPLER_BATCH]


class EpochTracker(keras.callbacks.Callback):
    """Tells the dataset the epoch, and keeps the weights after epoch 1."""

    def __init__(self, dataset):
        super().__init__()
        self._dataset, self.after_epoch_1 = dataset, None

    def on_epoch_begin(self, epoch, logs=None):
        self._dataset.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            self.after_epoch_1 = [np.array(keras.ops.convert_to_numpy(w)) for w in self.model.weights]


def _batchnorm_model():
    import torch

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4))
    model = keras.Sequential([keras.Input((6,)), keras.layers.TorchModuleWrapper(module), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    return model


def error_case(case, strategy, rank):
    """Runs one error case; returns `(error, weights unchanged, extra)` (extra: text for the test)."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from kdist.distribute.input import per_rank

    x, y, _ = make_data()
    with strategy.scope():
        model = _batchnorm_model() if case == "batchnorm_on_one_rank" else build_model()
    before = [np.array(keras.ops.convert_to_numpy(w)) for w in model.weights]
    callbacks, epochs, extra = [], 1, ""
    if case == "undeclared_pydataset":
        data = Batches([batch[:2] for batch in rank_batches("declared", rank)])
    elif case == "tf_shard":
        import tensorflow as tf

        data = tf.data.Dataset.from_tensor_slices((x, y)).shard(WORLD_SIZE, rank).batch(SAMPLER_BATCH)
    elif case in ("sampler_for_another_job", "sampler_rank_on_one_rank"):
        dataset = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        # The second: DistributedSampler(ds, rank=local_rank) on 2 nodes of 1 process each.
        num_replicas, sampler_rank = (3, rank) if case == "sampler_for_another_job" else (WORLD_SIZE, 0)
        sampler = DistributedSampler(dataset, num_replicas=num_replicas, rank=sampler_rank)
        data = DataLoader(dataset, batch_size=SAMPLER_BATCH, sampler=sampler)
    elif case == "differs_from_epoch_2":
        data = SameInEpoch1Only(rank)
        tracker = EpochTracker(data)
        callbacks, epochs = [tracker], 3
    elif case == "batchnorm_on_one_rank":
        # Rank 0's batch of 1 gives its replica one sample; rank 1's batch of 4 is fine.
        size = 1 if rank == 0 else 4
        data = per_rank(Batches([(x[:size], y[:size])]))
    elif case == "uneven_known_lengths":
        data = per_rank(Batches(rank_batches("declared", rank)[: 3 + rank]))
    else:  # declared_on_one_rank
        data = Batches([batch[:2] for batch in rank_batches("declared", rank)])
        data = per_rank(data) if rank == 0 else data
    try:
        model.fit(data, epochs=epochs, verbose=0, callbacks=callbacks, shuffle=False)
    except Exception as error:  # noqa: BLE001 - reported to the test
        if case == "differs_from_epoch_2":
            trained = not all(np.array_equal(a, b) for a, b in zip(before, tracker.after_epoch_1))
            before, extra = tracker.after_epoch_1, f"trained_in_epoch_1={trained} "
        unchanged = all(np.array_equal(a, keras.ops.convert_to_numpy(w)) for a, w in zip(before, model.weights))
        return error, unchanged, extra
    return None, False, extra


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", choices=["equivalence", "errors"], required=True)
    parser.add_argument("--out")
    parser.add_argument("--fault")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--cases", default=",".join(ERROR_CASES))
    args = parser.parse_args()

    import kdist
    from kdist import faults

    if args.fault:
        setattr(faults.ACTIVE, args.fault, True)
    strategy = kdist.MultiWorkerMirroredStrategy(communication_options=kdist.CommunicationOptions(timeout_seconds=30))
    rank = strategy.extended.collectives.rank
    if args.job == "equivalence":
        for scenario in args.scenarios.split(","):
            results = train_rank(scenario, strategy, rank)
            np.savez(os.path.join(args.out, f"{scenario}-rank{rank}.npz"), **results)
            print(f"DONE {scenario}", flush=True)
        return 0
    for case in args.cases.split(","):
        if case == "tf_shard":
            try:
                import tensorflow  # noqa: F401
            except ImportError:
                print(f"SKIP {case}: tensorflow is not installed in this environment", flush=True)
                continue
        error, unchanged, extra = error_case(case, strategy, rank)
        message = " ".join(str(error).split())
        print(f"CAUGHT {case} {type(error).__name__} unchanged={unchanged}: {extra}{message}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
