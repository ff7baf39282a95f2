"""One rank of a multi-worker training run, or (imported) the plain-Keras reference.

Run as a script under `kdist launch`, `torchrun` or with `TF_CONFIG`: trains,
evaluates and predicts with `MultiWorkerMirroredStrategy` and writes
everything the equivalence tests compare to `<out>/rank<r>.npz`.

Every rank seeds its random state with `SEED + rank`, so only rank 0's state
equals the reference's: results match the reference only if kdist shares rank
0's shuffle order (the negative control turns that off).
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
from tests import seeding  # noqa: E402
import numpy as np  # noqa: E402

SEED = 7
NUM_SAMPLES = 1000
GLOBAL_BATCH = 64
EPOCHS = 2


def make_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_SAMPLES, 12)).astype("float32")
    y = (x[:, :3].sum(axis=1) > 0).astype("int64") + (x[:, 3] > 1).astype("int64")
    return x, y


class SampleCount(keras.metrics.Metric):
    """How many samples the metric saw: a sum, not a ratio.

    A metric reduced across processes twice doubles; ratio metrics (a mean,
    accuracy) would hide that, since their totals and counts double together.
    """

    def __init__(self, name="sample_count", **kwargs):
        super().__init__(name=name, **kwargs)
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        del y_pred, sample_weight
        self.count.assign_add(keras.ops.cast(keras.ops.shape(y_true)[0], self.count.dtype))

    def result(self):
        return keras.ops.copy(self.count)  # not the variable itself: evaluate resets it later


MODEL_KINDS = ("sequential", "library")


def build_model(model_kind="sequential"):
    if model_kind == "library":
        # Built as keras-hub builds its models (tests/keras/library_models.py).
        from tests.keras import library_models

        model = library_models.classifier(features=12, num_classes=3)
    else:
        model = keras.Sequential(
            [
                keras.Input((12,)),
                keras.layers.Dense(32, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3)),
                keras.layers.Dense(3),
            ]
        )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["sparse_categorical_accuracy", SampleCount()],
    )
    return model


INPUT_KINDS = ("arrays", "loader")


def train(strategy=None, callbacks=(), epochs=EPOCHS, initial_seed=SEED, input_kind="arrays", model_kind="sequential"):
    """Builds, trains, evaluates and predicts; returns a dict of numpy results.

    `input_kind="loader"` trains from a shuffling `torch.utils.data.DataLoader`
    (its `RandomSampler` draws its seed from torch's global generator) instead
    of shuffled arrays.
    """
    seeding.set_random_seed(initial_seed)
    x, y = make_data()
    if strategy is None:
        model = build_model(model_kind)
    else:
        with strategy.scope():
            model = build_model(model_kind)
    if input_kind == "arrays":
        inputs = dict(x=x, y=y, batch_size=GLOBAL_BATCH, shuffle=True)
    elif input_kind == "loader":
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        dataset = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        inputs = dict(x=DataLoader(dataset, batch_size=GLOBAL_BATCH, shuffle=True))
    else:
        raise ValueError(f"input_kind must be one of {INPUT_KINDS}. Received: input_kind={input_kind!r}")
    history = model.fit(
        **inputs, epochs=epochs, verbose=0,
        validation_data=(x[:200], y[:200]), callbacks=list(callbacks),
    )
    evaluation = model.evaluate(x[:300], y[:300], batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
    predictions = model.predict(x[:333], batch_size=GLOBAL_BATCH, verbose=0)
    return collect(model, history, evaluation, predictions)


def collect(model, history, evaluation, predictions):
    results = {}
    # Keyed by position: variable paths carry per-process name counters (adam_3, dense_7).
    for i, v in enumerate(model.weights):
        results[f"weight/{i}"] = np.asarray(keras.ops.convert_to_numpy(v))
    for i, v in enumerate(model.optimizer.variables):
        results[f"optimizer/{i}"] = np.asarray(keras.ops.convert_to_numpy(v))
    for i, v in enumerate(model.metrics_variables):
        results[f"metric/{i}"] = np.asarray(keras.ops.convert_to_numpy(v))
    for key, values in (history.history if history is not None else {}).items():
        results[f"history/{key}"] = np.asarray(values, dtype="float64")
    for key, value in evaluation.items():
        results[f"evaluate/{key}"] = np.asarray(value, dtype="float64")
    results["predict"] = np.asarray(predictions)
    return results


def simulate_upstream_metric_reduction():
    """Patches Keras the way later releases behave under torch.distributed.

    They sum every metric variable over the process group inside
    `get_metrics_result`, assuming each rank only saw its own samples.
    """
    import torch
    import torch.distributed as dist
    from keras.src.trainers import trainer

    original = trainer.Trainer.get_metrics_result

    def get_metrics_result(self):
        if dist.is_initialized():
            for variable in self.metrics_variables:
                value = variable.value.detach().clone().to(torch.float64)
                dist.all_reduce(value)
                variable.assign(value.to(variable.value.dtype))
        return original(self)

    trainer.Trainer.get_metrics_result = get_metrics_result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--fault", choices=["unshared_random_state", "ddp_averaged_gradients", "upstream_metrics_result"]
    )
    parser.add_argument(
        "--simulate-upstream-ddp-metrics",
        action="store_true",
        help="make Trainer.get_metrics_result all-reduce metric variables, as Keras releases after 3.15 do",
    )
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--local-devices", type=int, default=1)
    parser.add_argument("--input", choices=INPUT_KINDS, default="arrays", help="what fit trains from")
    parser.add_argument("--model", choices=MODEL_KINDS, default="sequential", help="how the model is built")
    args = parser.parse_args()

    import kdist
    from kdist import faults

    if args.fault:
        setattr(faults.ACTIVE, args.fault, True)
    if args.simulate_upstream_ddp_metrics:
        simulate_upstream_metric_reduction()
    devices = [f"cpu:{i}" for i in range(args.local_devices)] if args.local_devices > 1 else None
    strategy = kdist.MultiWorkerMirroredStrategy(
        communication_options=kdist.CommunicationOptions(timeout_seconds=args.timeout), devices=devices
    )
    rank = strategy.extended.collectives.rank
    results = train(strategy, initial_seed=SEED + rank, input_kind=args.input, model_kind=args.model)
    np.savez(os.path.join(args.out, f"rank{rank}.npz"), **results)
    print(f"rank {rank} of {strategy.extended.collectives.world_size} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
