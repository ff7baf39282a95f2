"""A coordinator `fit` that a restarted chief resumes from `BackupAndRestore`: fence, then the data position.

A chief that dies leaves the parameter servers and workers running (`kdist
launch --chief --max-restarts K` restarts the chief alone). Its rerun `fit`:

1. **Fences the workers** (`before_restore`), before `BackupAndRestore`
   restores: it opens its session on every worker that answers. A worker
   runs its work in arrival order and skips a closure whose caller is gone,
   so the dead chief's closures there have ended when the session is open;
   without this, one still running could push after the restore.
2. **Starts at the saved step** (`resume_epoch`). `kdist.keras.step_resume`
   restores the backup (epoch, step, metrics, random state); this module
   drops the saved steps from the resumed epoch's closures:

   - arrays and a `PyDataset` (finite, `steps_per_epoch` a multiple of its
     batches): the epoch's shuffle is drawn again from the random state the
     backup recorded at the epoch's start, and its first steps are dropped;
   - a `dataset_fn` read by one worker: the first closure first reads and
     drops the batches the uninterrupted `fit` had taken from the worker's
     stream (each earlier epoch's `steps_per_epoch`, then the saved steps),
     which assumes `dataset_fn` yields the same stream each time it is built;
   - a `dataset_fn` read by several workers: which batches each worker read
     is not recorded, so the backup's epoch starts again from its first step
     (Keras' own behaviour: those steps train twice), and the resume line
     says so. Each worker's stream starts again from its beginning.
"""

from kdist import faults
from kdist.keras import step_resume
from kdist.keras.parameter_server import save_points
from kdist.keras.parameter_server.chief_data import IndexedBatches


def before_restore(coordinator, source):
    """Fences the workers and says whether the input can resume mid-epoch; before `on_train_begin`.

    Args:
        coordinator: the fit's `ClusterCoordinator`.
        source: the fit's `chief_data.EpochSource`.
    """
    if not faults.ACTIVE.unfenced_chief_restart:
        coordinator.open_worker_sessions()
    reason = _epoch_start_reason(coordinator, source)
    if reason is not None:
        step_resume.resume_from_epoch_start(reason)


def _epoch_start_reason(coordinator, source):
    if source.iterator is not None:
        if coordinator.num_workers > 1:
            return (f"the {coordinator.num_workers} workers each read their own dataset_fn stream and how "
                    "many batches each read is not recorded: the epoch starts again from its first step")
        return None
    if source.num_batches is None:
        return "the position in an endless PyDataset is not recorded: the epoch starts again from its first step"
    if source.steps % source.num_batches:
        return (f"steps_per_epoch={source.steps} is not a multiple of the {source.num_batches} batches of one "
                "pass, so the epoch's shuffle continues an earlier one: the epoch starts again from its first step")
    return None


def stream_batches_before(coordinator, source, epoch, first_epoch, initial_epoch):
    """Batches the uninterrupted `fit` read from the one worker's stream before `epoch`'s first step."""
    if source.iterator is None or coordinator.num_workers != 1 or epoch != first_epoch:
        return 0
    return (first_epoch - initial_epoch) * source.steps


def resume_epoch(chunks, skip, stream_skip, reads_stream):
    """The closures of an epoch after a resume, and the batches its first closure drops first.

    Args:
        chunks: `(first step, steps, source)` per closure (`EpochSource.epoch_sources`).
        skip: the epoch's `step_resume` skip (`step_resume.take_skip()`), or None.
        stream_skip: batches of the worker's stream read before this epoch
            (`stream_batches_before`).
        reads_stream: the sources are a per-worker iterator (a `dataset_fn`).

    Returns:
        `(chunks, batches)`: the closures from the saved step on (numbered as
        in the uninterrupted `fit`), and how many batches the first one reads
        from the worker's stream and drops before training.
    """
    steps = 0 if skip is None else skip.steps
    kept = []
    for begin, count, source in chunks:
        end = begin + count
        if end <= steps:
            continue
        if begin < steps:  # saved inside this closure: `steps_per_execution` changed since
            cut = steps - begin
            if isinstance(source, IndexedBatches):
                source = IndexedBatches(source.dataset, source.indices[cut:])
            elif isinstance(source, list):
                source = source[cut:]
            begin, count = steps, end - steps
        kept.append((begin, count, source))
    if skip is not None:
        save_points.resume_at(skip.callback, steps - 1)
        skip.finished(keras_epoch=False)
    return kept, stream_skip + (steps if reads_stream else 0)
