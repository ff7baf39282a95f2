"""TensorFlow's "Parameter server training with ParameterServerStrategy" tutorial, with renames only.

https://www.tensorflow.org/tutorials/distribute/parameter_server_training, cell by
cell: `tf.distribute.X` is `kdist.X`, `tf.keras` is `keras`, `tf.data` pipelines are
Python generators. Every other changed line is marked `# kdist:` and listed in
docs/parameter_server.md ("TensorFlow's tutorial, line by line").

In one process, as the tutorial runs (an in-process cluster of kdist servers):

    python examples/ps_tutorial.py --working-dir /tmp/my_working_dir

As a real cluster (the tutorial's "same binary for all tasks" branch):

    kdist launch --ps 1 --workers 2 --chief examples/ps_tutorial.py --working-dir /tmp/my_working_dir

The coordinator prints one line `result {...}` (JSON). `--part fit|loop|all` runs the
Model.fit part, the custom-loop part or both; `--preempt-after-epoch N` (for tests)
stops the program after epoch N with exit code 3, as a preempted coordinator would,
so that running it again shows the tutorial's resume recipes at work.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402,F401  (the tutorial imports it for its ConfigProto)
import random  # noqa: E402
import sys  # noqa: E402

import kdist  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from kdist.launch.ports import free_port as pick_unused_port  # noqa: E402  kdist: portpicker.pick_unused_port

PREEMPTED = 3


class Preempted(Exception):
    """Raised after `--preempt-after-epoch` epochs (tests only)."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The tutorial's own path: a fixed one, so that a rerun resumes from its backup.
    parser.add_argument("--working-dir", default="/tmp/my_working_dir")
    parser.add_argument("--part", choices=("fit", "loop", "all"), default="all")
    parser.add_argument("--preempt-after-epoch", type=int, default=0)
    return parser.parse_args(argv)


# ----- Cluster setup: in-process cluster ---------------------------------------------------
def create_in_process_cluster(num_workers, num_ps):
    """Creates and starts local servers and returns the cluster_resolver."""
    worker_ports = [pick_unused_port() for _ in range(num_workers)]
    ps_ports = [pick_unused_port() for _ in range(num_ps)]

    cluster_dict = {}
    cluster_dict["worker"] = ["localhost:%s" % port for port in worker_ports]
    if num_ps > 0:
        cluster_dict["ps"] = ["localhost:%s" % port for port in ps_ports]

    cluster_spec = kdist.cluster.ClusterSpec(cluster_dict)

    # kdist: no worker_config (a tf.compat.v1.ConfigProto tunes TensorFlow's runtime).
    for i in range(num_workers):
        kdist.distribute.Server(
            cluster_spec,
            job_name="worker",
            task_index=i,
            protocol="grpc")

    for i in range(num_ps):
        kdist.distribute.Server(
            cluster_spec,
            job_name="ps",
            task_index=i,
            protocol="grpc")

    cluster_resolver = kdist.cluster.SimpleClusterResolver(
        cluster_spec, rpc_layer="grpc")
    return cluster_resolver


# ----- Training with Model.fit ---------------------------------------------------------------
def dataset_fn(input_context):
    global_batch_size = 64
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)

    x = keras.random.uniform((10, 10))
    y = keras.random.uniform((10, 1))  # kdist: (10,) in TensorFlow; Keras 3's mse needs (10, 1)

    # tf.data.Dataset.from_tensor_slices((x, y)).shuffle(10).repeat()
    #     .shard(num_input_pipelines, input_pipeline_id).batch(batch_size).prefetch(2)
    def dataset():
        rows = (row for _ in itertools.count() for row in np.random.permutation(10))
        shard = itertools.islice(rows, input_context.input_pipeline_id, None, input_context.num_input_pipelines)
        while True:
            batch = np.fromiter(itertools.islice(shard, batch_size), dtype=np.int64)
            yield x[batch], y[batch]

    return dataset()


class _PreemptAfterEpoch(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self._epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 == self._epoch:
            raise Preempted(f"preempted after epoch {epoch + 1}")


def train_with_fit(strategy, working_dir, preempt_after_epoch):
    dc = dataset_fn  # kdist: tf.keras.utils.experimental.DatasetCreator(dataset_fn)

    with strategy.scope():
        # kdist: keras.Input added; Keras 3's BackupAndRestore (and the coordinator) need a built model.
        model = keras.models.Sequential([keras.Input((10,)), keras.layers.Dense(10)])

        model.compile(keras.optimizers.SGD(), loss='mse', steps_per_execution=10)

    log_dir = os.path.join(working_dir, 'log')
    ckpt_filepath = os.path.join(working_dir, 'ckpt.keras')  # kdist: Keras 3 names the format
    backup_dir = os.path.join(working_dir, 'backup')

    callbacks = [
        keras.callbacks.TensorBoard(log_dir=log_dir),
        keras.callbacks.ModelCheckpoint(filepath=ckpt_filepath),
        keras.callbacks.BackupAndRestore(backup_dir=backup_dir),
    ]
    if preempt_after_epoch:
        callbacks.append(_PreemptAfterEpoch(preempt_after_epoch))

    history = model.fit(dc, epochs=5, steps_per_epoch=20, callbacks=callbacks, verbose=0)
    return {"fit_epochs": history.epoch, "fit_loss": history.history["loss"],
            "fit_iterations": int(model.optimizer.iterations.numpy()),
            "fit_checkpoint": os.path.exists(ckpt_filepath)}


# ----- Training with a custom training loop -----------------------------------------------------
feature_vocab = [
    "avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman"
]
label_vocab = ["yes", "no"]


def feature_and_label_gen(num_examples=200):
    examples = {"features": [], "label": []}
    for _ in range(num_examples):
        features = random.sample(feature_vocab, 3)
        label = ["yes"] if "avenger" in features else ["no"]
        examples["features"].append(features)
        examples["label"].append(label)
    return examples


class DictLookup:
    """`StringLookup`'s mapping (out-of-vocabulary entries first) without TensorFlow."""

    def __init__(self, vocabulary, num_oov_indices=1, mask_token=None):
        del mask_token
        self._vocabulary = ["[UNK]"] * num_oov_indices + list(vocabulary)
        self._index = {token: i for i, token in enumerate(self._vocabulary) if i >= num_oov_indices}

    def get_vocabulary(self):
        return list(self._vocabulary)

    def __call__(self, strings):
        strings = np.asarray(strings)
        ids = (self._index.get(token, 0) for token in strings.ravel())
        return np.fromiter(ids, dtype=np.int64, count=strings.size).reshape(strings.shape)


def string_lookup(**kwargs):
    try:
        return keras.layers.StringLookup(**kwargs)
    except ImportError:  # kdist: Keras' StringLookup needs TensorFlow installed, on every backend
        return DictLookup(**kwargs)


def train_with_custom_loop(strategy, num_ps, working_dir, preempt_after_epoch):
    with strategy.scope():
        feature_lookup_layer = string_lookup(  # kdist: keras.layers.StringLookup
            vocabulary=feature_vocab,
            mask_token=None)
        label_lookup_layer = string_lookup(  # kdist: keras.layers.StringLookup
            vocabulary=label_vocab,
            num_oov_indices=0,
            mask_token=None)
        # kdist: a Keras model with string inputs runs on TensorFlow only; the
        # tutorial's preprocessing stages are the lookup layers themselves.
        feature_preprocess_stage = feature_lookup_layer
        label_preprocess_stage = label_lookup_layer

    examples = feature_and_label_gen()

    def dataset_fn(_):
        # tf.data.Dataset.from_tensor_slices(examples).map(...).shuffle(200).batch(32).repeat()
        features, labels = np.array(examples["features"]), np.array(examples["label"])

        def train_dataset():
            while True:
                order = np.random.permutation(len(features))
                for start in range(0, len(order), 32):
                    rows = order[start:start + 32]
                    yield ({"features": feature_preprocess_stage(features[rows])},
                           label_preprocess_stage(labels[rows]))
        return train_dataset()

    # These variables created under the `Strategy.scope` will be placed on parameter
    # servers in a round-robin fashion.
    with strategy.scope():
        # Create the model. The input needs to be compatible with Keras processing layers.
        model_input = keras.layers.Input(
            shape=(3,), dtype="int64", name="model_input")

        emb_layer = keras.layers.Embedding(
            input_dim=len(feature_lookup_layer.get_vocabulary()), output_dim=16384)
        emb_output = keras.ops.mean(emb_layer(model_input), axis=1)
        dense_output = keras.layers.Dense(units=1, activation="sigmoid")(emb_output)
        model = keras.Model({"features": model_input}, dense_output)

        optimizer = keras.optimizers.RMSprop(learning_rate=0.1)
        accuracy = keras.metrics.Accuracy()

    # kdist: the shards are reached through remote_view (emb_layer.weights holds one Keras variable).
    if num_ps == 2:  # the tutorial's cluster; with one ps the table stays whole
        shards = strategy.extended.remote_view(emb_layer.weights[0]).variables
        assert len(shards) == 2
        assert shards[0].shape == (4, 16384)
        assert shards[1].shape == (4, 16384)
        assert shards[0].device == "/job:ps/replica:0/task:0/device:CPU:0"
        assert shards[1].device == "/job:ps/replica:0/task:1/device:CPU:0"

    def step_fn(iterator):  # kdist: no @tf.function

        def replica_fn(batch_data, labels):
            # kdist: torch's autograd in place of tf.GradientTape
            pred = model(batch_data, training=True)
            per_example_loss = keras.losses.BinaryCrossentropy(
                reduction=None)(labels, pred)
            loss = kdist.nn.compute_average_loss(per_example_loss)
            model.zero_grad()
            loss.backward()
            gradients = [variable.value.grad for variable in model.trainable_variables]

            optimizer.apply_gradients(zip(gradients, model.trainable_variables))

            actual_pred = keras.ops.cast(keras.ops.greater(pred, 0.5), "int64")
            accuracy.update_state(labels, actual_pred)
            return loss.detach()

        batch_data, labels = next(iterator)
        losses = strategy.run(replica_fn, args=(batch_data, labels))
        return strategy.reduce(kdist.ReduceOp.SUM, losses, axis=None)

    coordinator = kdist.coordinator.ClusterCoordinator(strategy)

    def per_worker_dataset_fn():  # kdist: no @tf.function
        return strategy.distribute_datasets_from_function(dataset_fn)

    per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
    per_worker_iterator = iter(per_worker_dataset)

    # Handling task failure: checkpoint, restore, and infer the progress from
    # `optimizer.iterations` (the tutorial's recipe).
    # kdist: tf.train.CheckpointManager(tf.train.Checkpoint(model=model, optimizer=optimizer), ...)
    # is a Keras weights file of the model compiled with the optimizer.
    checkpoint_dir = os.path.join(working_dir, "loop_checkpoints")
    os.makedirs(checkpoint_dir, exist_ok=True)
    checkpoint_path = os.path.join(checkpoint_dir, "ckpt.weights.h5")
    with strategy.scope():
        model.compile(optimizer=optimizer)
    if os.path.exists(checkpoint_path):
        model.load_weights(checkpoint_path)

    num_epoches = 4
    steps_per_epoch = 5
    global_steps = int(optimizer.iterations.numpy())
    starting_epoch = global_steps // steps_per_epoch
    epoch_accuracies = []
    for i in range(starting_epoch, num_epoches):
        accuracy.reset_state()
        for _ in range(steps_per_epoch):
            coordinator.schedule(step_fn, args=(per_worker_iterator,))
        # Wait at epoch boundaries.
        coordinator.join()
        model.save_weights(checkpoint_path)  # checkpoint_manager.save()
        print("Finished epoch %d, accuracy is %f." % (i, accuracy.result()), flush=True)
        epoch_accuracies.append(float(accuracy.result()))
        if preempt_after_epoch and i + 1 == preempt_after_epoch:
            raise Preempted(f"preempted after epoch {i + 1}")
    loop_iterations = int(optimizer.iterations.numpy())

    loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
    print("Final loss is %f" % loss.fetch(), flush=True)

    # Inline evaluation, direct: on the coordinator.
    eval_examples = feature_and_label_gen(num_examples=16)
    eval_features, eval_labels = np.array(eval_examples["features"]), np.array(eval_examples["label"])
    # tf.data.Dataset.from_tensor_slices(...).map(...).batch(8)
    eval_dataset = [({"features": feature_preprocess_stage(eval_features[start:start + 8])},
                     label_preprocess_stage(eval_labels[start:start + 8])) for start in range(0, 16, 8)]

    eval_accuracy = keras.metrics.Accuracy()

    for batch_data, labels in eval_dataset:
        pred = model(batch_data, training=False)
        actual_pred = keras.ops.cast(keras.ops.greater(pred, 0.5), "int64")
        eval_accuracy.update_state(labels, actual_pred)

    print("Evaluation accuracy: %f" % eval_accuracy.result(), flush=True)
    direct_accuracy = float(eval_accuracy.result())

    # Inline evaluation, distributed: on the workers.
    with strategy.scope():
        # Define the eval metric on parameter servers.
        eval_accuracy = keras.metrics.Accuracy()

    def eval_step(iterator):  # kdist: no @tf.function
        def replica_fn(batch_data, labels):
            pred = model(batch_data, training=False)
            actual_pred = keras.ops.cast(keras.ops.greater(pred, 0.5), "int64")
            eval_accuracy.update_state(labels, actual_pred)
        batch_data, labels = next(iterator)
        strategy.run(replica_fn, args=(batch_data, labels))

    def eval_dataset_fn():
        # tf.data.Dataset.from_tensor_slices(feature_and_label_gen(num_examples=16)).map(...)
        #     .shuffle(16).repeat().batch(8)
        examples = feature_and_label_gen(num_examples=16)
        features, labels = np.array(examples["features"]), np.array(examples["label"])
        while True:
            order = np.random.permutation(16)
            for start in range(0, 16, 8):
                rows = order[start:start + 8]
                yield ({"features": feature_preprocess_stage(features[rows])},
                       label_preprocess_stage(labels[rows]))

    per_worker_eval_dataset = coordinator.create_per_worker_dataset(eval_dataset_fn)
    per_worker_eval_iterator = iter(per_worker_eval_dataset)

    eval_steps_per_epoch = 2
    for _ in range(eval_steps_per_epoch):
        coordinator.schedule(eval_step, args=(per_worker_eval_iterator,))
    coordinator.join()
    print("Evaluation accuracy: %f" % eval_accuracy.result(), flush=True)
    return {"loop_starting_epoch": starting_epoch, "loop_accuracies": epoch_accuracies,
            "loop_iterations": loop_iterations, "loop_direct_eval_accuracy": direct_accuracy,
            "loop_distributed_eval_accuracy": float(eval_accuracy.result()),
            "loop_final_loss": float(loss.fetch())}


# ----- Clusters in the real world: the same binary for all tasks ----------------------------------
def main(argv=None):
    args = parse_args(argv)
    # Set the environment variable to allow reporting worker and ps failure to the
    # coordinator. This is a workaround and won't be necessary in the future.
    os.environ["GRPC_FAIL_FAST"] = "use_caller"

    if "TF_CONFIG" in os.environ:
        cluster_resolver = kdist.cluster.TFConfigClusterResolver()
        if cluster_resolver.task_type in ("worker", "ps"):
            # Start a server and wait.
            server = kdist.distribute.Server(
                cluster_resolver.cluster_spec(),
                job_name=cluster_resolver.task_type,
                task_index=cluster_resolver.task_id,
                protocol=cluster_resolver.rpc_layer or "grpc",
                start=True)
            server.join()
            return 0
        if cluster_resolver.task_type == "evaluator":
            return 0  # Side-car evaluation: see examples/ps_coordinator_fit.py.
        NUM_PS = cluster_resolver.cluster_spec().num_tasks("ps")
    else:
        NUM_WORKERS = 3
        NUM_PS = 2
        cluster_resolver = create_in_process_cluster(NUM_WORKERS, NUM_PS)

    variable_partitioner = (
        kdist.partitioners.MinSizePartitioner(
            min_shard_bytes=(256 << 10),
            max_shards=NUM_PS))

    strategy = kdist.ParameterServerStrategy(
        cluster_resolver,
        variable_partitioner=variable_partitioner)

    result = {"is_chief": strategy.extended.is_chief}
    try:
        if args.part in ("fit", "all"):
            result.update(train_with_fit(strategy, args.working_dir, args.preempt_after_epoch))
        if args.part in ("loop", "all"):
            preempt = args.preempt_after_epoch if args.part == "loop" else 0
            result.update(train_with_custom_loop(strategy, NUM_PS, args.working_dir, preempt))
    except Preempted as error:
        print(f"preempted: {error}", flush=True)
        return PREEMPTED
    print("result " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
