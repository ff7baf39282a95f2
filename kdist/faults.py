"""Deliberate bugs for kdist's negative-control tests, in one place.

Every switch here breaks one thing kdist is careful about, so that a test can
show its equivalence check would catch that bug. Never set them in user code.

The switches live on one object, `ACTIVE`. Readers look it up through this
module on every use (`faults.ACTIVE.name`), so a test may replace the object
(`injected(...)`) or set one switch on it (`monkeypatch.setattr(faults.ACTIVE,
name, True)`) and every layer sees the change. This module is layer 0: it
imports nothing from kdist, so the distribute layer and the Keras layer both
read it without importing upward.
"""

import contextlib
import dataclasses


@dataclasses.dataclass
class FaultInjection:
    """The negative-control switches, all off by default.

    Attributes:
        unweighted_gradient_mean: average gradients without weighting by
            local batch size (wrong whenever the shards are uneven).
        drop_replica_losses: run replicas with `collect_losses=False`, which
            silently drops `add_loss` and activity-regularizer losses.
        drop_replica_gradients: pretend replicas k >= 1 produced no gradients.
        unshared_random_state: in a multi-worker job, let every rank shuffle
            with its own random state instead of rank 0's.
        ddp_averaged_gradients: in a multi-worker job, first replace every
            replica's gradients by their plain mean over ranks, as a
            `DistributedDataParallel` wrap would during backward, so gradients
            are reduced twice.
        upstream_metrics_result: in a multi-worker job, keep Keras' own
            `get_metrics_result` (later Keras releases reduce metrics across
            processes there, so they would be reduced twice).
        sample_count_weights: weight replicas by sample count n_k / N even
            where their losses divided by other counts (masked entries,
            ignored labels, sample-weight sums; see `loss_denominators`).
        float8_mean: combine float8 scales and amax histories like ordinary
            gradients (a weighted mean) instead of by maximum.
        unflattened_logs: merge nested step logs without flattening them
            (History then shows replica 0's values for the nested metrics).
        upstream_ddp_wrap: let Keras (>= 3.16) wrap a kdist model in
            `DistributedDataParallel` when `torch.distributed` is initialized.
        unmerged_replica_apply: let `optimizer.apply` called by the replicas
            of `strategy.run` update the variables once per replica, one after
            another, instead of summing the gradients and applying once.
        no_merge_mode: keep recording a `train_step` that applies twice, so
            its second gradients are computed before the first update lands.
        overlap_ignores_changed_gradients: in a multi-worker job, apply the
            gradients reduced during backward even when `train_step` changed
            them before `optimizer.apply`.
        dropped_pending_gradients: in a multi-worker job with gradient
            accumulation, leave the micro-steps' pending gradients out of the
            update step's all-reduce.
        local_statistics: synchronized BatchNormalization layers use each
            replica's own batch statistics, as unsynchronized ones do.
        skip_pull: asynchronous parameter-server workers train on their local
            copies without reading the servers' values before each step
            (every step then computes gradients at stale weights).
        coordinator_not_chief: the coordinator is not treated as the chief,
            so `model.save`, `ModelCheckpoint` and `BackupAndRestore` there
            write nothing (the bug TensorFlow's tutorial hit before).
        optimizer_slice_applied_twice: with sharded optimizer state, rank 0
            applies the optimizer to its slice twice per step.
        optimizer_slice_missed: with sharded optimizer state, the all-gather
            leaves out the last rank's updated slice (the others keep their
            old values of its elements).
        sliced_per_rank_input: in a multi-worker job, slice input that is
            already split per rank (a `DistributedSampler`, `per_rank`,
            `distribute_datasets_from_function`) as if every rank read the
            whole global batch, so each epoch trains on 1/N of the data.
        unsynced_torch_buffers: let every replica update the buffers of torch
            modules inside `TorchModuleWrapper` layers (BatchNorm running
            statistics) in place, one after another, with no reconciliation.
        dropped_row_gradient: a parameter server's sparse row update leaves
            out the first touched row.
        row_applied_twice: a parameter server's sparse row update counts the
            first touched row's gradient twice.
        unsummed_duplicate_ids: a parameter server's sparse row update keeps
            one occurrence of a repeated id instead of summing them.
        unskipped_resume_steps: a `fit` resumed from a mid-epoch
            `BackupAndRestore` backup trains the resumed epoch's steps that
            the backup already holds again (Keras' own behaviour).
        resume_without_iterations: a resumed `fit` restores the optimizer's
            slots but starts its `iterations` counter again from 0.
        unfenced_chief_restart: a coordinator `fit` restores its backup
            without first opening its session on every worker, so a closure
            a dead chief left running there may push after the restore.
    """


    unweighted_gradient_mean: bool = False
    drop_replica_losses: bool = False
    drop_replica_gradients: bool = False
    unshared_random_state: bool = False
    ddp_averaged_gradients: bool = False
    upstream_metrics_result: bool = False
    sample_count_weights: bool = False
    float8_mean: bool = False
    unflattened_logs: bool = False
    upstream_ddp_wrap: bool = False
    unmerged_replica_apply: bool = False
    no_merge_mode: bool = False
    overlap_ignores_changed_gradients: bool = False
    dropped_pending_gradients: bool = False

    local_statistics: bool = False
    skip_pull: bool = False
    coordinator_not_chief: bool = False
    sliced_per_rank_input: bool = False
    unsynced_torch_buffers: bool = False
    dropped_row_gradient: bool = False
    row_applied_twice: bool = False
    unsummed_duplicate_ids: bool = False
    unskipped_resume_steps: bool = False
    resume_without_iterations: bool = False
    unfenced_chief_restart: bool = False
    optimizer_slice_applied_twice: bool = False
    optimizer_slice_missed: bool = False


ACTIVE = FaultInjection()


@contextlib.contextmanager
def injected(**switches):
    """Turns on the named switches (and only those) for the block.

    Raises:
        TypeError: a name is not a switch of `FaultInjection`.
    """
    global ACTIVE
    saved = ACTIVE
    ACTIVE = FaultInjection(**switches)
    try:
        yield ACTIVE
    finally:
        ACTIVE = saved
