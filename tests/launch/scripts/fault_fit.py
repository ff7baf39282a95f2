"""One process of a job in which a process is SIGKILLed at a chosen step, for tests/launch/test_fault_matrix.py.

fault_fit.py OUTDIR --mode mwms|ps|coordinator --kill-task NAME --kill-step K [--save-freq epoch|S]
             [--epochs E] [--fault SWITCH]

Every run writes OUTDIR/<pid>.pid (and, with `TF_CONFIG`, OUTDIR/task-<name>.pid).
`--mode mwms`: one rank of a `MultiWorkerMirroredStrategy` job (names "worker-R");
`--mode mwms_sharded`: the same with `shard_optimizer_state=True` (the whole
optimizer state, gathered from the ranks, is what it writes).
`--mode ps`: a task of a between-graph parameter-server job: a ps serves, a
worker trains with `ParameterServerStrategy`. `--mode coordinator`: ps and
workers serve, the chief trains with a `ClusterCoordinator` (one closure in
flight) and kills the task named by `--kill-task` (a ps, a worker, or itself).
The trainers run `train()` with
`keras.callbacks.BackupAndRestore(OUTDIR/backup, save_freq=...)`; on its first
run only (OUTDIR/killed does not exist yet), the process named `--kill-task`
writes the step to OUTDIR/killed and SIGKILLs itself right after global step K
(counted from 1 across epochs), after that step's backup if one falls there.
The launcher restarts it; the script has no restart logic beyond the marker.
At the end each trainer writes OUTDIR/<name>.npz (weights, optimizer variables,
History, evaluate, predict) and prints "<name> finished".

`--fault SWITCH` turns on a `kdist.faults` switch (a negative control).
Imported, `train()` with no strategy is the plain-Keras reference.
"""

import argparse
import os
import signal
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402

SEED = 11
NUM_SAMPLES = 384
GLOBAL_BATCH = 32
STEPS_PER_EPOCH = NUM_SAMPLES // GLOBAL_BATCH  # 12
EPOCHS = 3
COLLECTIVE_TIMEOUT_SECONDS = 60.0


def make_data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(NUM_SAMPLES, 10)).astype("float32")
    y = (x[:, :3].sum(axis=1) > 0).astype("int64") + (x[:, 3] > 1).astype("int64")
    return x, y


def build_model():
    model = keras.Sequential(
        [keras.Input((10,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["sparse_categorical_accuracy"],
    )
    return model


def seed_everything(seed):
    """`keras.utils.set_random_seed` without its TensorFlow seeding.

    Keras seeds TensorFlow too when it is installed, importing it (seconds at
    every process start, restarts included); its torch backend draws its seeds
    from Python's generator, which this seeds.
    """
    import random

    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train(strategy=None, callbacks=(), epochs=EPOCHS, shuffle=True, seed=SEED, before_collect=None):
    """Builds, trains, evaluates and predicts; returns a dict of numpy results."""
    seed_everything(seed)
    x, y = make_data()
    if strategy is None:
        model = build_model()
    else:
        with strategy.scope():
            model = build_model()
    history = model.fit(
        x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=shuffle, verbose=0,
        validation_data=(x[:96], y[:96]), callbacks=list(callbacks),
    )
    evaluation = model.evaluate(x[:128], y[:128], batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
    predictions = model.predict(x[:100], batch_size=GLOBAL_BATCH, verbose=0)
    if before_collect is not None:
        before_collect(model)
    results = {}
    # Keyed by position: variable paths carry per-process name counters.
    for i, variable in enumerate(model.weights):
        results[f"weight/{i}"] = np.asarray(keras.ops.convert_to_numpy(variable))
    for i, value in enumerate(_optimizer_values(model, strategy)):
        results[f"optimizer/{i}"] = np.asarray(value)
    for key, values in history.history.items():
        results[f"history/{key}"] = np.asarray(values, dtype="float64")
    for key, value in evaluation.items():
        results[f"evaluate/{key}"] = np.asarray(value, dtype="float64")
    results["predict"] = np.asarray(predictions)
    return results


def _optimizer_values(model, strategy):
    """The optimizer's variables; with sharded state, the whole state gathered from every rank (a collective)."""
    if getattr(getattr(strategy, "extended", None), "shard_optimizer_state", False):
        from kdist.keras.replica import sharded_optimizer

        return sharded_optimizer.state_of(sharded_optimizer.sharded_target(model.optimizer)).whole_values()
    return [keras.ops.convert_to_numpy(variable) for variable in model.optimizer.variables]


class KillAtStep(keras.callbacks.Callback):
    """SIGKILLs a process after global step `step`, once per job (the marker file says it happened).

    The process is this one, or (`pid_file`) the one whose pid that file holds.
    """

    def __init__(self, step, marker, pid_file=None):
        super().__init__()
        self.step, self.marker, self.pid_file, self.seen = step, marker, pid_file, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.step:
            with open(self.marker, "x") as file:  # "x": a second kill would mean a second first run
                file.write(str(self.step))
            if self.pid_file is None:
                os.kill(os.getpid(), signal.SIGKILL)
            with open(self.pid_file) as file:
                os.kill(int(file.read()), signal.SIGKILL)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mode", choices=["mwms", "mwms_sharded", "ps", "coordinator"], required=True)
    parser.add_argument("--kill-task", required=True)
    parser.add_argument("--kill-step", type=int, required=True)
    parser.add_argument("--save-freq", default="epoch")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--fault")
    args = parser.parse_args()
    with open(os.path.join(args.out, f"{os.getpid()}.pid"), "w") as file:
        file.write(str(os.getpid()))

    import kdist
    from kdist import faults

    if args.fault:
        setattr(faults.ACTIVE, args.fault, True)
    if args.mode.startswith("mwms"):
        strategy = kdist.MultiWorkerMirroredStrategy(
            communication_options=kdist.CommunicationOptions(timeout_seconds=COLLECTIVE_TIMEOUT_SECONDS),
            shard_optimizer_state=args.mode == "mwms_sharded",
        )
        rank = strategy.extended.collectives.rank
        name, shuffle = f"worker-{rank}", True
    else:
        resolver = kdist.cluster.TFConfigClusterResolver()
        name = f"{resolver.task_type}-{resolver.task_id}"
        with open(os.path.join(args.out, f"task-{name}.pid"), "w") as file:  # this run's pid, by task
            file.write(str(os.getpid()))
        serves = ("ps", "worker") if args.mode == "coordinator" else ("ps",)
        if resolver.task_type in serves:
            kdist.distribute.Server(resolver.cluster_spec(), resolver.task_type, resolver.task_id).join()
            return 0
        strategy = kdist.ParameterServerStrategy(resolver)
        if args.mode == "coordinator":
            # One closure in flight: a step's push is applied before the next step's pull.
            kdist.coordinator.ClusterCoordinator(strategy, closures_in_flight_per_worker=1)
        rank = 0
        # A parameter-server fit resumes at an epoch's start (Keras' behaviour): the
        # same epoch order needs no shuffle.
        shuffle = False
    save_freq = args.save_freq if args.save_freq == "epoch" else int(args.save_freq)
    callbacks = [keras.callbacks.BackupAndRestore(os.path.join(args.out, "backup"), save_freq=save_freq)]
    marker = os.path.join(args.out, "killed")
    if args.mode == "coordinator":  # the chief kills the task named, itself included
        if not os.path.exists(marker):
            pid_file = None if args.kill_task == name else os.path.join(args.out, f"task-{args.kill_task}.pid")
            callbacks.append(KillAtStep(args.kill_step, marker, pid_file))
    elif name == args.kill_task and not os.path.exists(marker):
        callbacks.append(KillAtStep(args.kill_step, marker))
    read_back = None
    if args.mode == "coordinator":
        # A save on the chief reads every variable, slot and the iterations back from the servers.
        def read_back(model):
            model.save_weights(os.path.join(args.out, "final.weights.h5"))

    results = train(strategy, callbacks=callbacks, epochs=args.epochs, shuffle=shuffle,
                    seed=SEED + rank,  # only rank 0's seed is the reference's: kdist shares its state
                    before_collect=read_back)
    np.savez(os.path.join(args.out, f"{name}.npz"), **results)
    print(f"{name} finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
