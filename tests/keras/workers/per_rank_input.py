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
  batches of 5 and 11 with sample weights (6 and 8 batches: the ranks agree on
  6), per-rank validation data, and per-rank generators for evaluate/predict.
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402

SEED = 3
NUM_SAMPLES = 101
EPOCHS = 2
WORLD_SIZE = 2
SAMPLER_BATCH = 8
GLOBAL_BATCH = 16  # distribute_datasets_from_function: 8 per replica
SCENARIOS = ("sampler", "sampler_shuffled", "from_function", "declared")
ERROR_CASES = ("undeclared_pydataset", "tf_shard", "sampler_for_another_job", "declared_on_one_rank")


def make_data():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(NUM_SAMPLES, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1)) + 0.1 * rng.normal(size=(NUM_SAMPLES, 1))).astype("float32")
    weights = rng.uniform(0.5, 2.0, size=(NUM_SAMPLES,)).astype("float32")
    return x, y, weights


def build_model():
    keras.utils.set_random_seed(SEED)
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
    "fit": [(0, 40, 5), (40, 101, 11)],
    "validation": [(0, 21, 7), (21, 33, 4)],
    "evaluate": [(50, 80, 6), (0, 45, 9)],
    "predict": [(0, 12, 4), (12, 30, 6)],
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
    """The reference's batches: the ranks' batches concatenated in rank order (the shortest rank wins)."""
    per_rank = [rank_batches(scenario, rank, epoch, part) for rank in range(WORLD_SIZE)]
    steps = min(len(batches) for batches in per_rank)
    return [
        tuple(np.concatenate(leaves) for leaves in zip(*(batches[step] for batches in per_rank)))
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


def error_case(case, strategy, rank):
    """Runs one case of undeclared (or misdeclared) per-rank input; returns the error it raised."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from kdist.distribute.input import per_rank

    x, y, _ = make_data()
    with strategy.scope():
        model = build_model()
    before = [np.array(keras.ops.convert_to_numpy(w)) for w in model.weights]
    if case == "undeclared_pydataset":
        data = Batches([batch[:2] for batch in rank_batches("declared", rank)])
    elif case == "tf_shard":
        import tensorflow as tf

        data = tf.data.Dataset.from_tensor_slices((x, y)).shard(WORLD_SIZE, rank).batch(SAMPLER_BATCH)
    elif case == "sampler_for_another_job":
        dataset = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        data = DataLoader(dataset, batch_size=SAMPLER_BATCH, sampler=DistributedSampler(dataset, num_replicas=3, rank=rank))
    else:  # declared_on_one_rank
        data = Batches([batch[:2] for batch in rank_batches("declared", rank)])
        data = per_rank(data) if rank == 0 else data
    try:
        model.fit(data, epochs=1, verbose=0)
    except Exception as error:  # noqa: BLE001 - reported to the test
        unchanged = all(np.array_equal(a, keras.ops.convert_to_numpy(w)) for a, w in zip(before, model.weights))
        return error, unchanged
    return None, False


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", choices=["equivalence", "errors"], required=True)
    parser.add_argument("--out")
    parser.add_argument("--fault")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
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
    for case in ERROR_CASES:
        if case == "tf_shard":
            try:
                import tensorflow  # noqa: F401
            except ImportError:
                print(f"SKIP {case}: tensorflow is not installed in this environment", flush=True)
                continue
        error, unchanged = error_case(case, strategy, rank)
        message = " ".join(str(error).split())
        print(f"CAUGHT {case} {type(error).__name__} unchanged={unchanged}: {message}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
