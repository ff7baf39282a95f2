"""The custom training loop of TensorFlow's parameter-server tutorial, ported by renames.

https://www.tensorflow.org/tutorials/distribute/parameter_server_training,
"Training with a custom training loop". The renames: `tf.distribute.X` ->
`kdist.X`, `tf.keras` -> `keras`, `tf.reduce_mean`/`tf.cast`/`tf.greater` ->
`keras.ops`, `tf.nn.compute_average_loss`/`scale_regularization_loss` ->
`kdist.nn.*`, `tf.add_n` -> `sum`, `with tf.GradientTape() as tape: ...;
tape.gradient(loss, model.trainable_variables)` -> `torch.autograd.grad(loss,
[v.value for v in model.trainable_variables])`, `@tf.function` dropped,
`accuracy.reset_states()` -> `reset_state()`. `tf.keras.layers.StringLookup`
and `tf.data` are examples/ps_tutorial.py's stand-ins (a dict lookup, a
generator), seeded so that every run sees the same batches.

The model's `Embedding` table lives on the parameter servers and is read by
rows, so its gradient is the sparse row gradient the servers apply as rows.

`train(strategy, coordinator)` runs it: scheduled on the workers
(`ClusterCoordinator`), by this process against the servers (between-graph:
`coordinator=None`), or with `kdist.get_strategy()` (plain Keras, one device:
the reference). It returns the trained weights and the epochs' accuracies.
"""

import os
import random

os.environ.setdefault("KERAS_BACKEND", "torch")

import kdist  # noqa: E402
import keras  # noqa: E402
from tests import seeding  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

feature_vocab = ["avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman"]
label_vocab = ["yes", "no"]
NUM_EPOCHS = 4
STEPS_PER_EPOCH = 5
SEED = 5


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


def feature_and_label_gen(num_examples=200):
    examples = {"features": [], "label": []}
    for _ in range(num_examples):
        features = random.sample(feature_vocab, 3)
        label = ["yes"] if "avenger" in features else ["no"]
        examples["features"].append(features)
        examples["label"].append(label)
    return examples


def train(strategy, coordinator=None):
    """The tutorial's custom loop; returns `{"weights": [...], "accuracies": [...], "iterations": n}`."""
    random.seed(SEED)
    seeding.set_random_seed(SEED)
    with strategy.scope():
        feature_lookup_layer = DictLookup(vocabulary=feature_vocab, mask_token=None)
        label_lookup_layer = DictLookup(vocabulary=label_vocab, num_oov_indices=0, mask_token=None)
        feature_preprocess_stage = feature_lookup_layer
        label_preprocess_stage = label_lookup_layer

    examples = feature_and_label_gen()

    def dataset_fn(_):
        # tf.data.Dataset.from_tensor_slices(examples).map(...).shuffle(200).batch(32).repeat()
        features, labels = np.array(examples["features"]), np.array(examples["label"])

        def train_dataset():
            order_rng = np.random.default_rng(SEED)
            while True:
                order = order_rng.permutation(len(features))
                for start in range(0, len(order), 32):
                    rows = order[start:start + 32]
                    yield ({"features": feature_preprocess_stage(features[rows])},
                           label_preprocess_stage(labels[rows]))
        return train_dataset()

    # These variables created under the `Strategy.scope` will be placed on parameter
    # servers in a round-robin fashion.
    with strategy.scope():
        # Create the model. The input needs to be compatible with Keras processing layers.
        model_input = keras.layers.Input(shape=(3,), dtype="int64", name="model_input")

        emb_layer = keras.layers.Embedding(input_dim=len(feature_lookup_layer.get_vocabulary()), output_dim=16384)
        emb_output = keras.ops.mean(emb_layer(model_input), axis=1)
        dense_output = keras.layers.Dense(
            units=1,
            activation="sigmoid",
            kernel_regularizer=keras.regularizers.L2(1e-4),
        )(emb_output)
        model = keras.Model({"features": model_input}, dense_output)

        optimizer = keras.optimizers.RMSprop(learning_rate=0.1)
        accuracy = keras.metrics.Accuracy()

    def step_fn(iterator):

        def replica_fn(batch_data, labels):
            pred = model(batch_data, training=True)
            per_example_loss = keras.losses.BinaryCrossentropy(reduction=None)(labels, pred)
            loss = kdist.nn.compute_average_loss(per_example_loss)
            model_losses = model.losses
            if model_losses:
                loss += kdist.nn.scale_regularization_loss(sum(model_losses))
            gradients = torch.autograd.grad(loss, [v.value for v in model.trainable_variables])
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))

            actual_pred = keras.ops.cast(keras.ops.greater(pred, 0.5), "int64")
            accuracy.update_state(labels, actual_pred)
            return loss.detach()

        batch_data, labels = next(iterator)
        losses = strategy.run(replica_fn, args=(batch_data, labels))
        return strategy.reduce(kdist.ReduceOp.SUM, losses, axis=None)

    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    if coordinator is not None:
        per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
        per_worker_iterator = iter(per_worker_dataset)
        schedule, join = coordinator.schedule, coordinator.join
    else:  # between-graph, or plain Keras: this process runs each step itself
        per_worker_iterator = iter(per_worker_dataset_fn())

        def schedule(function, args):
            return function(*args)

        def join():
            pass

    accuracies = []
    for i in range(NUM_EPOCHS):
        accuracy.reset_state()
        for _ in range(STEPS_PER_EPOCH):
            schedule(step_fn, args=(per_worker_iterator,))
        # Wait at epoch boundaries.
        join()
        print("Finished epoch %d, accuracy is %f." % (i, float(accuracy.result())), flush=True)
        accuracies.append(float(accuracy.result()))

    loss = schedule(step_fn, args=(per_worker_iterator,))
    final_loss = float(loss.fetch() if coordinator is not None else loss)
    print("Final loss is %f" % final_loss, flush=True)
    # Not the tutorial's: the chief's copies of the dense variables are refreshed by join().
    join()
    return {"weights": model.get_weights(), "accuracies": accuracies, "final_loss": final_loss,
            "iterations": int(optimizer.iterations.numpy()), "model": model, "optimizer": optimizer}
