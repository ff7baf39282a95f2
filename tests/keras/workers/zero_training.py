"""One rank of a job training every optimizer configuration, with optimizer state sharded or whole.

Run as a script (`torchrun` environment): for each configuration of `CONFIGS`,
a fresh model is compiled in the scope of one `MultiWorkerMirroredStrategy`
(`--sharded` gives `shard_optimizer_state=True`), trained, and its weights,
History and the whole optimizer's variables (gathered from every rank when
sharded) are written to `<out>/rank<r>.npz`; with `--save`, the chief also
writes `<out>/<config>.keras`. With `--resume-from DIR`, each configuration
first loads `DIR/<config>.keras` (saved by another job) and then trains one
more epoch. Imported, `train_plain(name)` is the one-process plain-Keras
reference of one configuration.
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tests import seeding  # noqa: E402

SEED = 11
NUM_SAMPLES = 300  # 5 steps per epoch, the last one short
GLOBAL_BATCH = 64
EPOCHS = 3  # 15 steps: accumulation ends with pending gradients to fold in


def _schedule():
    return keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=3, decay_rate=0.5)


def _adamw():
    optimizer = keras.optimizers.AdamW(learning_rate=0.01, weight_decay=0.05)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


# Each returns a new optimizer; the names are the list.
CONFIGS = {
    "sgd_nesterov": lambda: keras.optimizers.SGD(learning_rate=0.05, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(learning_rate=0.01),
    "adamw_exclusions": _adamw,
    "adagrad": lambda: keras.optimizers.Adagrad(learning_rate=0.05),
    "rmsprop": lambda: keras.optimizers.RMSprop(learning_rate=0.01, momentum=0.5),
    "lion": lambda: keras.optimizers.Lion(learning_rate=0.001),
    "adam_clipnorm": lambda: keras.optimizers.Adam(learning_rate=0.01, clipnorm=0.05),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(learning_rate=0.01, global_clipnorm=0.1),
    "nadam_schedule": lambda: keras.optimizers.Nadam(learning_rate=_schedule()),
    "sgd_accumulation": lambda: keras.optimizers.SGD(learning_rate=0.05, momentum=0.9,
                                                     gradient_accumulation_steps=2),
    # Grows (every 2 finite steps) until the scaled loss overflows: 12 steps applied and
    # 3 skipped, on every rank alike (plain Keras does the same).
    "loss_scale": lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(learning_rate=0.01), initial_scale=2.0**122, dynamic_growth_steps=2),
    "adam_ema": lambda: keras.optimizers.Adam(learning_rate=0.01, use_ema=True, ema_overwrite_frequency=3),
}


def make_data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(NUM_SAMPLES, 10)).astype("float32")
    y = (x[:, :4].sum(axis=1) > 0).astype("int64") + (x[:, 4] > 1).astype("int64")
    return x, y


def build_model():
    # Odd sizes (a slice boundary inside a variable), a constraint (applied to
    # the whole variable after the slices are back) and a frozen layer (no gradient).
    return keras.Sequential([
        keras.Input((10,)),
        keras.layers.Dense(37, activation="relu", kernel_constraint=keras.constraints.MaxNorm(1.5)),
        keras.layers.Dense(19, activation="tanh", name="frozen", trainable=False),
        keras.layers.Dense(23, activation="relu"),
        keras.layers.Dense(3),
    ])


def compile_model(model, name):
    model.compile(optimizer=CONFIGS[name](), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])


def results(prefix, model, history, optimizer_values):
    out = {f"{prefix}/weight{i}": w for i, w in enumerate(model.get_weights())}
    out.update({f"{prefix}/optimizer{i}": np.asarray(v) for i, v in enumerate(optimizer_values)})
    out.update({f"{prefix}/history_{key}": np.asarray(value) for key, value in history.history.items()})
    return out


def train_plain(name, resume_from=None, epochs=EPOCHS):
    """One process, plain Keras: the reference of configuration `name`."""
    seeding.set_random_seed(SEED)
    x, y = make_data()
    model = build_model()
    compile_model(model, name)
    if resume_from is not None:
        model = keras.saving.load_model(resume_from)
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0)
    return results(name, model, history, [v.numpy() for v in model.optimizer.variables])


def check_refusals(kdist, strategy):
    """What cannot be sharded is refused with a typed error naming it, before Keras changes the model."""
    from kdist.errors import InvalidArgumentError, UnsupportedError

    def refused(error_type, call, *words):
        try:
            call()
        except error_type as error:
            for word in words:
                assert word in str(error), (word, str(error))
            return
        raise AssertionError(f"{call} was not refused with {error_type.__name__}")

    refused(InvalidArgumentError, lambda: kdist.MultiWorkerMirroredStrategy(shard_optimizer_state="yes"),
            "shard_optimizer_state", "'yes'")
    built = keras.optimizers.Adam()
    for optimizer, error_type, words in [
        (keras.optimizers.Adafactor(), UnsupportedError, ("Adafactor", "shard_optimizer_state=False")),
        (keras.optimizers.Ftrl(), UnsupportedError, ("Ftrl",)),
        (keras.optimizers.LossScaleOptimizer(keras.optimizers.Adafactor()), UnsupportedError, ("Adafactor",)),
        (keras.optimizers.SGD(clipnorm=1.0, gradient_accumulation_steps=2), UnsupportedError,
         ("gradient_accumulation_steps=2", "clipnorm=1.0")),
        (built, InvalidArgumentError, ("already built", "slot variables")),
    ]:
        with strategy.scope():
            model = build_model()
        if optimizer is built:
            built.build(model.trainable_variables)
        refused(error_type, lambda: model.compile(optimizer=optimizer, loss="mse"), *words)
        assert not model.compiled and getattr(model, "optimizer", None) is None, "a refused compile changed the model"
    print("REFUSALS OK", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sharded", action="store_true")
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--resume-from")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--refusals", action="store_true")
    parser.add_argument("--bucket-bytes", type=int, help="CommunicationOptions.bucket_bytes (the gather's chunk too)")
    parser.add_argument("--local-replicas", type=int, default=1, help="logical CPU replicas per process")
    parser.add_argument("--fault", choices=["optimizer_slice_applied_twice", "optimizer_slice_missed"])
    args = parser.parse_args()
    import kdist
    from kdist import faults
    from kdist.keras.replica import sharded_optimizer

    if args.fault:
        setattr(faults.ACTIVE, args.fault, True)

    options = kdist.CommunicationOptions(bucket_bytes=args.bucket_bytes) if args.bucket_bytes else None
    devices = [f"cpu:{i}" for i in range(args.local_replicas)] if args.local_replicas > 1 else None
    strategy = kdist.MultiWorkerMirroredStrategy(communication_options=options, devices=devices,
                                                 shard_optimizer_state=args.sharded)
    rank = strategy.extended.collectives.rank
    if args.refusals:
        check_refusals(kdist, strategy)
        return 0
    x, y = make_data()
    out = {}
    for name in args.configs.split(","):
        seeding.set_random_seed(SEED)
        with strategy.scope():
            model = build_model()
            compile_model(model, name)
            if args.resume_from:
                # Built first, as Keras needs to load an optimizer's state from a weights file.
                model.optimizer.build(model.trainable_variables)
                model.load_weights(os.path.join(args.resume_from, f"{name}.weights.h5"))
        epochs = 1 if args.resume_from else EPOCHS
        history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0)
        state = sharded_optimizer.state_of(sharded_optimizer.sharded_target(model.optimizer))
        if args.sharded:
            assert state is not None and state.shard is not None, "the optimizer's state was not sharded"
            values = state.whole_values()
            out[f"{name}/slot_elements"] = np.asarray(
                sum(int(np.prod(v.shape)) for v in state.shard.slot_variables if len(v.shape)))
        else:
            assert state is None
            values = [v.numpy() for v in model.optimizer.variables]
        out.update(results(name, model, history, values))
        if args.save:
            model.save(os.path.join(args.out, f"{name}.keras"))
            model.save_weights(os.path.join(args.out, f"{name}.weights.h5"))
    np.savez(os.path.join(args.out, f"rank{rank}.npz"), **out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
