"""What an error raised inside one replica's step says about that replica."""

import keras

from kdist.keras.replica import gradient_merge


def note(error, replica_id, devices, shard):
    """Adds a note naming the replica and its shard's size to `error` (once), without changing its type.

    Each replica runs the model on its shard of the global batch, where one
    device runs the whole batch: an op that fails only on small batches (torch's
    CPU `slow_conv2d` backward on one sample with one output channel) fails here
    at the shard's size. The note says so; the exception stays what Keras or
    torch raised, so code that catches it still does.
    """
    if isinstance(error, gradient_merge.MergeModeNeeded) or not hasattr(error, "add_note"):
        return
    if any(n.startswith("kdist:") for n in getattr(error, "__notes__", ())):
        return
    leaves = [leaf for leaf in keras.tree.flatten(shard) if getattr(leaf, "shape", None)]
    samples = f"{int(leaves[0].shape[0])} sample(s)" if leaves else "its inputs"
    error.add_note(
        f"kdist: raised by replica {replica_id} of {len(devices)} ({devices[replica_id]}), running the step on its shard of the "
        f"global batch ({samples}); one device runs the whole batch at once. An error that plain Keras also raises "
        f"at that batch size comes from the shard's size: use a larger global batch."
    )
