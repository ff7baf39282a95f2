"""Runs a Keras model's own steps on several replicas in one process.

For each global batch:

1. split it into contiguous shards, as even as possible (replicas without
   samples sit the step out);
2. run the model's unmodified `train_step`/`test_step`/`predict_step` once per
   replica, inside `keras.device(replica device)`, a `ReplicaContext`, and a
   `keras.StatelessScope` so no replica changes the model's variables;
3. the model's optimizer `apply` only records each replica's gradients
   (`GradientRecorder`); afterwards they are combined as the mean weighted by
   local batch size, `Σ n_k g_k / Σ n_k` (a plain sum for `reduction="sum"`
   losses), and applied once to the canonical variables;
4. non-trainable state is reconciled (`kdist.keras.state_sync`).

Replicas on the canonical device read the canonical tensors directly (no
copies); replicas on other devices get copies made at the start of each step,
so weight changes made by callbacks between steps are always seen.

Replicas run one after another in the caller's thread. On GPUs they still
overlap, because nothing here waits for the device (no `.item()`, no host
copies) between launching one replica's kernels and the next.
"""

import dataclasses
import threading

import keras
import torch

from kdist.collectives.local import copy_to_device, weighted_sum
from kdist.distribute import context
from kdist.distribute.batching import split_batch
from kdist.errors import ReplicaGradientError, UnsupportedError
from kdist.keras import _compat, process_sync, state_sync


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
    """

    unweighted_gradient_mean: bool = False
    drop_replica_losses: bool = False
    drop_replica_gradients: bool = False
    unshared_random_state: bool = False
    ddp_averaged_gradients: bool = False
    upstream_metrics_result: bool = False


_TESTING_FAULTS = FaultInjection()
_recording = threading.local()


class GradientRecorder:
    """Collects the `optimizer.apply` calls one replica makes during its step."""

    def __init__(self):
        self.calls = []

    def record(self, optimizer, gradients, variables):
        self.calls.append((optimizer, list(gradients), list(variables)))


def wrap_optimizer(optimizer):
    """Makes `optimizer.apply` record gradients while a replica step is running.

    Outside replica steps the wrapper calls the real `apply`. Idempotent.
    """
    if optimizer is None or getattr(optimizer, "_kdist_original_apply", None) is not None:
        return
    original_apply = optimizer.apply

    def apply(grads, trainable_variables=None):
        recorder = getattr(_recording, "recorder", None)
        if recorder is None:
            return original_apply(grads, trainable_variables)
        if trainable_variables is None:
            trainable_variables = optimizer._trainable_variables
        recorder.record(optimizer, grads, trainable_variables)
        return None

    object.__setattr__(optimizer, "_kdist_original_apply", original_apply)
    object.__setattr__(optimizer, "apply", apply)


class ReplicaEngine:
    """Step functions that run a model data-parallel over a strategy's replicas.

    Not thread-safe: one engine per model, used by the thread that calls `fit`.
    """

    def __init__(self, model, strategy):
        self._model = model
        self._strategy = strategy
        self._devices = strategy.extended.replica_devices
        self._num_replicas = len(self._devices)
        # Set for a multi-worker strategy: the reductions between processes.
        self._processes = process_sync.for_strategy(strategy)
        self._state = None
        self._needs_broadcast = True
        # The engine is rebuilt by every compile(), so the compiled loss is fixed here.
        self._summed_loss = _all_losses_summed(model)

    # ----- Keras step-function entry points (receive a list of batches) -----
    def train_function(self, data):
        logs = None
        for batch in data:
            logs = self._train_batch(batch)
        return logs

    def test_function(self, data):
        logs = None
        with torch.no_grad():
            for batch in data:
                logs = self._test_batch(batch)
        return logs

    def predict_function(self, data):
        outputs = None
        with torch.no_grad():
            for batch in data:
                outputs = self._predict_batch(batch)
        return outputs

    # ----- steps -----------------------------------------------------------
    def _train_batch(self, batch):
        model = self._model
        state = self._state_variables()
        replicas, total = self._active_shards(batch)
        results = []
        for replica_id, shard, _ in replicas:
            recorder = GradientRecorder()
            _recording.recorder = recorder
            try:
                scope, logs = self._run_replica(replica_id, model.train_step, shard, state, training=True)
            finally:
                _recording.recorder = None
            results.append((scope, logs, recorder))
        self._check_summed_loss_has_no_penalties(state, [r[0] for r in results])
        weights = self._weights(replicas, total)
        updates, pending = self._combine_gradients(replicas, [r[2] for r in results], weights)
        # In a multi-worker job the gradient and state all-reduces run together;
        # this waits for both before anything is assigned.
        self._reconcile(state, [r[0] for r in results], weights, pending)
        for optimizer, variables, gradients in updates:
            with torch.no_grad():
                optimizer._kdist_original_apply(gradients, variables)
        return self._merge_logs([r[1] for r in results], weights)

    def _test_batch(self, batch):
        state = self._state_variables()
        replicas, total = self._active_shards(batch)
        results = [
            self._run_replica(replica_id, self._model.test_step, shard, state, training=False)
            for replica_id, shard, _ in replicas
        ]
        self._check_summed_loss_has_no_penalties(state, [r[0] for r in results])
        weights = self._weights(replicas, total)
        self._reconcile(state, [r[0] for r in results], weights)
        return self._merge_logs([r[1] for r in results], weights)

    def _predict_batch(self, batch):
        state = self._state_variables()
        replicas, _ = self._active_shards(batch)
        outputs = [
            self._run_replica(replica_id, self._model.predict_step, shard, state, training=False)[1]
            for replica_id, shard, _ in replicas
        ]
        if len(outputs) == 1:
            local = outputs[0]
        else:
            device = self._devices[0].torch_device
            local = keras.tree.map_structure(
                lambda *parts: torch.cat(copy_to_device(parts, device)), *outputs
            )
        if self._processes is None:
            return local
        if all(n == 0 for _, _, n in replicas):
            local = keras.tree.map_structure(lambda leaf: leaf[:0], local)
        return self._processes.gather_outputs(local, batch)

    # ----- helpers ---------------------------------------------------------
    def forget_layout(self):
        """Re-reads the model's variables at the next step (layers may have changed between calls).

        Also marks the start of a fit/evaluate/predict call: in a multi-worker
        job the next step first copies rank 0's variables to every rank.
        """
        self._state = None
        self._needs_broadcast = True

    def _state_variables(self):
        if self._state is None or not self._state.complete:
            self._state = state_sync.StateVariables(self._model, self._summed_loss)
        if self._needs_broadcast and self._processes is not None and self._model.built:
            self._processes.broadcast_variables(self._model)
            self._needs_broadcast = False
        return self._state

    def _active_shards(self, batch):
        """This process's non-empty shards `(local replica id, shard, size)` and the global batch size.

        In a multi-worker job a process whose replicas all get no sample runs
        replica 0 on the batch's first sample with size 0, so that it still
        takes part in every collective; its results carry no weight.
        """
        if self._processes is not None:
            return self._processes.local_shards(batch, self._num_replicas)
        shards = split_batch(batch, self._num_replicas)
        active = [(k, shard, n) for k, (shard, n) in enumerate(shards) if n > 0]
        return active, sum(n for _, _, n in active)

    def _weights(self, replicas, total):
        return [n / total for _, _, n in replicas]

    def _reconcile(self, state, scopes, weights, pending=()):
        if self._processes is None:
            state_sync.reconcile(state, scopes, weights)
            return
        plan, contributions = state_sync.plan_contributions(
            state, scopes, weights, self._processes.holds_first_replica, for_all_reduce=True
        )
        combined, works = self._processes.start_reduction(contributions, key="state")
        self._processes.wait(list(pending) + works)
        state_sync.assign(plan, combined)

    def _state_mapping(self, replica_id, state, training):
        """What each replica reads instead of the canonical variables."""
        model = self._model
        device = self._devices[replica_id].torch_device
        canonical_device = self._devices[0].torch_device
        if device == canonical_device:
            # Regularizers read trainable values through the scope, so map them
            # to the canonical Parameters themselves: no copy, still leaves.
            mapping = list(state.canonical_mapping)
        else:
            variables = list(model.variables) + state.metric_variables
            copies = copy_to_device([_compat.torch_tensor_of(v).detach() for v in variables], device)
            mapping = []
            for variable, copy in zip(variables, copies):
                if variable.trainable and training:
                    copy = copy.detach().requires_grad_(True)
                mapping.append((variable, copy))
        if replica_id:
            mapping.extend(
                (v, state_sync.seed_offset(_compat.torch_tensor_of(v), replica_id).to(device))
                for v in state.seed_states
            )
        return mapping

    def _run_replica(self, replica_id, step_fn, shard, state, training):
        model = self._model
        mapping = self._state_mapping(replica_id, state, training)
        collect_losses = not _TESTING_FAULTS.drop_replica_losses
        replica_context = context.ReplicaContext(
            self._strategy, replica_id, merge_handler=context.sequential_merge_handler
        )
        context.push(self._strategy, replica_context)
        try:
            with self._strategy.extended.replica_device_scope(replica_id):
                with keras.StatelessScope(mapping, collect_losses=collect_losses) as scope:
                    if training:
                        # A train_step that forgets zero_grad must not mix this
                        # replica's gradients into the previous replica's.
                        model.zero_grad(set_to_none=True)
                    logs = step_fn(shard)
        finally:
            context.pop(self._strategy)
        return scope, logs

    def _check_summed_loss_has_no_penalties(self, state, scopes):
        """Refuses `reduction="sum"` losses combined with per-model penalties, before any update.

        Every replica adds the whole penalty (weight regularizers, `add_loss`) to
        its loss. With per-sample-mean losses the weighted gradient mean counts it
        once; with summed losses the gradients are added, so it would count once
        per replica.
        """
        if not self._summed_loss:
            return
        if state.has_weight_regularizers or any(scope.losses for scope in scopes):
            raise UnsupportedError(
                "A loss with reduction='sum' cannot be combined with weight regularizers "
                "or add_loss() penalties under MirroredStrategy with several replicas: "
                "each replica adds the whole penalty, so summing the replicas' gradients "
                "would count it once per replica. Received: loss reduction 'sum' and "
                "model penalties. Use reduction='sum_over_batch_size' (the default), or "
                "scale the penalty into the summed loss yourself."
            )

    def _combine_gradients(self, replicas, recorders, weights):
        """Combines the replicas' gradients for each `optimizer.apply` call.

        Returns:
            `(updates, pending)`: `updates` lists `(optimizer, variables,
            gradients)` to apply; `pending` the all-reduces still running in a
            multi-worker job (their results land in those gradients).
        """
        calls_per_replica = [recorder.calls for recorder in recorders]
        num_calls = len(calls_per_replica[0])
        for replica_position, calls in enumerate(calls_per_replica):
            if len(calls) != num_calls:
                raise ReplicaGradientError(
                    f"Replica {replicas[replica_position][0]} called optimizer.apply "
                    f"{len(calls)} time(s) but replica {replicas[0][0]} called it "
                    f"{num_calls} time(s). train_step must apply gradients the same "
                    "number of times on every replica."
                )
        if _TESTING_FAULTS.unweighted_gradient_mean:
            num_global = self._strategy.num_replicas_in_sync
            weights = [1.0 / num_global if w > 0 else 0.0 for w in weights]
        if self._summed_loss:
            weights = [1.0 if w > 0 else 0.0 for w in weights]
        device = self._devices[0].torch_device
        updates, pending = [], []
        for call_index in range(num_calls):
            optimizer, _, variables = calls_per_replica[0][call_index]
            gradient_lists = [calls[call_index][1] for calls in calls_per_replica]
            if _TESTING_FAULTS.drop_replica_gradients:
                gradient_lists = gradient_lists[:1] + [[None] * len(g) for g in gradient_lists[1:]]
            if _TESTING_FAULTS.ddp_averaged_gradients and self._processes is not None:
                gradient_lists = [self._processes.ddp_average(grads) for grads in gradient_lists]
            self._check_gradients(replicas, variables, gradient_lists)
            present = [i for i, grad in enumerate(gradient_lists[0]) if grad is not None]
            lists = [[grads[i] for i in present] for grads in gradient_lists]
            if self._processes is None:
                combined = weighted_sum(lists, weights, device)
            else:
                # Written straight into the communication buckets: no extra copy.
                buffers = self._processes.buffers(lists[0], key=("gradients", call_index))
                combined = buffers.fill_weighted(lists, weights)
                pending.extend(self._processes.start(buffers, name="gradients"))
            full = [None] * len(variables)
            for position, grad in zip(present, combined):
                full[position] = grad
            updates.append((optimizer, variables, full))
        return updates, pending

    def _check_gradients(self, replicas, variables, gradient_lists):
        for position, grads in enumerate(gradient_lists[1:], start=1):
            for variable, reference, grad in zip(variables, gradient_lists[0], grads):
                if reference is not None and grad is None:
                    raise ReplicaGradientError(
                        f"Replica {replicas[position][0]} produced no gradient for "
                        f"variable '{variable.path}' but replica {replicas[0][0]} did; the "
                        "step would silently train on fewer replicas. Usual cause: a "
                        "tensor copied off the replica device (check device strings) or "
                        "a train_step whose control flow depends on the replica."
                    )

    def _merge_logs(self, replica_logs, weights):
        first = replica_logs[0]
        if not isinstance(first, dict) or (len(replica_logs) == 1 and self._processes is None):
            return first
        canonical = self._model.get_metrics_result()
        merged = {}
        for key, value in first.items():
            if key in canonical:
                merged[key] = canonical[key]
            else:
                merged[key] = _weighted_log_mean([logs[key] for logs in replica_logs], weights)
        if self._processes is not None:
            merged = self._processes.merge_extra_logs(merged, canonical)
        return merged


def _all_losses_summed(model):
    """True when every compiled loss uses `reduction="sum"` (gradients then add up, not average)."""
    losses = keras.tree.flatten(model.loss) if getattr(model, "loss", None) is not None else []
    return bool(losses) and {getattr(loss, "reduction", None) for loss in losses} == {"sum"}


def _weighted_log_mean(values, weights):
    try:
        return sum(torch.as_tensor(v).double().cpu() * w for v, w in zip(values, weights))
    except (TypeError, RuntimeError):
        return values[0]


def check_steps_per_execution(model):
    """Raises a clear error for `steps_per_execution > 1` where Keras itself rejects it."""
    if model.steps_per_execution > 1 and _compat.TORCH_TRAINER_REJECTS_STEPS_PER_EXECUTION:
        raise UnsupportedError(
            "steps_per_execution > 1 is not supported by Keras "
            f"{keras.version()} on the torch backend. Received: steps_per_execution="
            f"{model.steps_per_execution}. Compile with steps_per_execution=1 (kdist "
            "already runs all replicas of a step in one call)."
        )
