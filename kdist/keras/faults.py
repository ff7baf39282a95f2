"""Deliberate bugs for the negative-control tests: each switch turns one correct rule off.

The tests set them (on `kdist.keras.replica_engine._TESTING_FAULTS`, the same
object) to prove that their comparisons can fail. Never set them in user code.
"""

import dataclasses


@dataclasses.dataclass
class FaultInjection:
    """Deliberate bugs for the negative-control tests. Never set these in user code.

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


_TESTING_FAULTS = FaultInjection()
