"""Loss scaling for custom training loops, as `tf.nn` has it.

In a custom loop each replica computes the loss of its own shard, and
`optimizer.apply_gradients` inside `strategy.run` **sums** the replicas'
gradients (TensorFlow's rule). For the sum to be the gradient of the mean loss
over the global batch, each replica divides its summed per-example loss by the
global batch size (`compute_average_loss`), and divides model-wide penalties
by the number of replicas (`scale_regularization_loss`), which every replica
adds in full.

Example (TensorFlow's "Custom training with tf.distribute.Strategy", renamed):

```python
strategy = kdist.MirroredStrategy()
GLOBAL_BATCH_SIZE = 64 * strategy.num_replicas_in_sync
with strategy.scope():
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(10)])
    optimizer = keras.optimizers.Adam()
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

def train_step(x, y):
    predictions = model(x, training=True)
    loss = kdist.nn.compute_average_loss(loss_object(y, predictions), global_batch_size=GLOBAL_BATCH_SIZE)
    if model.losses:
        loss += kdist.nn.scale_regularization_loss(keras.ops.sum(model.losses))
    model.zero_grad()
    loss.backward()
    optimizer.apply_gradients(zip([v.value.grad for v in model.trainable_variables],
                                  model.trainable_variables))
    return loss

per_replica_losses = strategy.run(train_step, args=(x_shards, y_shards))
```
"""

import keras

from kdist.distribute import context
from kdist.errors import InvalidArgumentError, StrategyScopeError
from kdist.validation import invalid, is_integer


def compute_average_loss(per_example_loss, sample_weight=None, global_batch_size=None):
    """Scales per-example losses by `sample_weight` and divides their sum by the global batch size.

    The argument order is `tf.nn.compute_average_loss`'s, so TensorFlow code
    ports with a rename; pass the optional arguments by keyword.

    Args:
        per_example_loss: the loss of each example of this replica's shard, a
            tensor of rank >= 1 (a Keras loss built with `reduction="none"`).
        sample_weight: optional weight per example (or broadcastable to
            `per_example_loss`); each loss is multiplied by its weight.
        global_batch_size: the number of examples in the global batch, a
            non-negative integer. Defaults to this shard's size times
            `num_replicas_in_sync`, which is exact only when every replica
            gets the same number of examples; pass it for partial batches.

    Returns:
        A scalar: `sum(per_example_loss * sample_weight) / global_batch_size`,
        0 when `global_batch_size` is 0.

    Raises:
        kdist.errors.InvalidArgumentError: `per_example_loss` is a scalar, or
            `global_batch_size` is not a non-negative integer.
        kdist.errors.StrategyScopeError: `global_batch_size` was omitted in a
            cross-replica context, where there is no shard to measure.

    Example:

    ```python
    loss_object = keras.losses.SparseCategoricalCrossentropy(reduction="none")
    loss = kdist.nn.compute_average_loss(loss_object(y, predictions), global_batch_size=64)
    ```
    """
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.nn.compute_average_loss(
            per_example_loss, sample_weight=sample_weight, global_batch_size=global_batch_size
        )
    per_example_loss = keras.ops.convert_to_tensor(per_example_loss)
    if len(per_example_loss.shape) == 0:
        raise InvalidArgumentError(
            "compute_average_loss needs one loss per example (rank >= 1). Received: "
            "per_example_loss of rank 0. Build the loss with reduction='none'."
        )
    dtype = per_example_loss.dtype
    if sample_weight is not None:
        sample_weight = keras.ops.cast(keras.ops.convert_to_tensor(sample_weight), dtype)
        # A weight per example scales every loss entry of that example.
        extra = len(per_example_loss.shape) - len(sample_weight.shape)
        if extra > 0:
            sample_weight = keras.ops.reshape(sample_weight, tuple(sample_weight.shape) + (1,) * extra)
        per_example_loss = per_example_loss * sample_weight
    if global_batch_size is None:
        if context.has_strategy() and context.in_cross_replica_context():
            raise StrategyScopeError(
                "compute_average_loss was called in a cross-replica context without "
                "global_batch_size. Call it inside the replica function passed to "
                "strategy.run, or pass global_batch_size."
            )
        global_batch_size = per_example_loss.shape[0] * _num_replicas_in_sync()
    _check_batch_size(global_batch_size)
    total = keras.ops.sum(per_example_loss)
    if int(global_batch_size) == 0:
        return total * 0
    return total / keras.ops.cast(global_batch_size, dtype)


def scale_regularization_loss(regularization_loss):
    """Divides the sum of a model-wide penalty by `num_replicas_in_sync`.

    Every replica adds the whole penalty (weight decay, `model.losses`) to its
    loss, and the replicas' gradients are summed, so without this it would
    count once per replica.

    Args:
        regularization_loss: a scalar or a tensor of penalties to sum.

    Returns:
        A scalar: `sum(regularization_loss) / num_replicas_in_sync`.

    Raises:
        kdist.errors.StrategyScopeError: called in a cross-replica context.

    Example:

    ```python
    loss += kdist.nn.scale_regularization_loss(keras.ops.sum(model.losses))
    ```
    """
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.nn.scale_regularization_loss(regularization_loss)
    if context.has_strategy() and context.in_cross_replica_context():
        raise StrategyScopeError(
            "scale_regularization_loss was called in a cross-replica context. Call it "
            "inside the replica function passed to strategy.run."
        )
    total = keras.ops.sum(keras.ops.convert_to_tensor(regularization_loss))
    return total / _num_replicas_in_sync()


def _num_replicas_in_sync():
    return context.get_strategy().num_replicas_in_sync


def _check_batch_size(global_batch_size):
    value = global_batch_size
    if hasattr(value, "shape") and len(value.shape) == 0 and "int" in str(value.dtype):
        value = int(value)
    if not is_integer(value, minimum=0):
        raise invalid("global_batch_size", global_batch_size, "a non-negative integer (a scalar)")


__all__ = ["compute_average_loss", "scale_regularization_loss"]
