"""Runs a Keras model's own steps on several replicas in one process.

For each global batch:

1. split it into contiguous shards, as even as possible (replicas without
   samples sit the step out);
2. run the model's unmodified `train_step`/`test_step`/`predict_step` once per
   replica, inside `keras.device(replica device)`, a `ReplicaContext`, and a
   `keras.StatelessScope` so no replica changes the model's variables;
3. `optimizer.apply` only records each replica's gradients
   (`kdist.keras.replica.gradient_merge`); afterwards they are combined
   (`kdist.keras.replica.gradient_combine`: weighted by each replica's share of the
   loss's divisor) and applied once to the canonical variables. A step that
   applies twice or calls `merge_call` runs in merge mode instead
   (`kdist.keras.replica.merged_step`);
4. non-trainable state is reconciled (`kdist.keras.replica.state_sync`).

Replicas on the canonical device read the canonical tensors directly (no
copies); replicas on other devices get copies made at the start of each step,
so weight changes made by callbacks between steps are always seen.

Replicas run one after another in the caller's thread. On GPUs they still
overlap, because nothing here waits for the device (no `.item()`, no host
copies) between launching one replica's kernels and the next.
"""


import keras
import torch

from kdist import faults
from kdist.collectives.local import copy_to_device
from kdist.distribute import context
from kdist.distribute.batching import split_batch
from kdist.errors import UnsupportedError
from kdist.keras import _compat, adapters, sync_batchnorm
from kdist.keras.replica import (
    float8_sync,
    gradient_accumulation,
    gradient_combine,
    gradient_merge,
    gradient_overlap,
    loss_denominators,
    merged_step,
    per_rank_input,
    process_sync,
    replica_errors,
    state_sync,
    step_logs,
)


class ReplicaEngine:
    """Step functions that run a model data-parallel over a strategy's replicas.

    Not thread-safe: one engine per model, used by the thread that calls `fit`.

    Attributes (read by the step helpers of `kdist.keras.replica`):
        model, strategy: what the engine trains, and with what.
        devices, num_replicas: this process's replica devices and their count.
        processes: the `ProcessSync` of a multi-worker strategy, else None.
        state: the replicas' copies of the model's state, once laid out.
        summed_loss: whether the compiled loss sums (not averages) its terms.
        overlap, accumulation: reductions during backward, and deferred micro-steps.
    """

    def __init__(self, model, strategy):
        self.model = model
        self.strategy = strategy
        self.devices = strategy.extended.replica_devices
        self.num_replicas = len(self.devices)
        # Set for a multi-worker strategy: the reductions between processes.
        self.processes = process_sync.for_strategy(strategy)
        self.state = None
        self._needs_broadcast = True
        # The engine is rebuilt by every compile(), so the compiled loss is fixed here.
        self.summed_loss = _all_losses_summed(model)
        # Merge mode runs each replica in its own thread and stops them all at
        # every `optimizer.apply` or merge: from the start for synchronized
        # BatchNormalization, else from the first step that applies twice.
        # Decided by `forget_layout`, at the start of every call: an engine made
        # when a model is attached at creation exists before Keras has tracked the
        # model's layers (a subclass's own `__setattr__` may not have let it yet).
        self._merge_mode = False
        # Multi-worker only: reduce during backward, and defer accumulation micro-steps.
        self.overlap = gradient_overlap.GradientOverlap(self)
        self._overlapped = None
        self.accumulation = gradient_accumulation.DeferredAccumulation(self)
        previous = getattr(model, "_kdist_engine", None)
        if previous is not None:  # a recompile: the old engine's hooks go with it
            previous.overlap.remove_hooks()
        object.__setattr__(model, "_kdist_engine", self)

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
        state = self._state_variables()
        replicas, total = self._active_shards(batch)
        if not self._merge_mode:
            try:
                return self._train_batch_recorded(state, replicas, total)
            except gradient_merge.MergeModeNeeded:
                # Nothing was applied or assigned yet (every change lives in the
                # replicas' scopes), so the batch can run again in merge mode.
                self._merge_mode = True
        return merged_step.train_batch(self, state, replicas, total)

    def _train_batch_recorded(self, state, replicas, total):
        """Runs the replicas one after another, recording their one `apply` each, then applies once.

        In a multi-worker job the gradients are reduced while backward runs
        where the step allows it (`gradient_overlap`), and not at all on
        accumulation micro-steps (`gradient_accumulation`).
        """
        model = self.model
        deferral = self.accumulation.step_kind(state)
        overlapped = None if deferral is not None else self.overlap.begin(state, replicas, total)
        self._overlapped = overlapped
        scopes, replica_logs, recorders = [], [], []
        combined = control = None
        try:
            for replica_id, shard, size in replicas:
                recorder = gradient_merge.GradientRecorder(single_call=not faults.ACTIVE.no_merge_mode)
                with gradient_merge.recording(recorder):
                    scope, logs, _ = self._run_replica(replica_id, model.train_step, shard, state, True, size / total)
                scopes.append(scope)
                replica_logs.append(logs)
                recorders.append(recorder)
            gradient_combine.check_summed_loss_has_no_penalties(self, state, scopes)
            if overlapped is not None:
                combined, control = overlapped.finish(recorders)
        except gradient_merge.MergeModeNeeded:
            if overlapped is not None:
                # Every rank got here alike; the buckets already on their way must land first.
                overlapped.drain()
            raise
        finally:
            self._overlapped = None
            self.overlap.disarm()
        if control is not None:
            # Reduced during backward; the overlap's control vector travels with the state.
            weights = control.weights
            self.reconcile(state, scopes, weights, control.pending, control)
            updates = control.updates()
            if updates is None:  # some process could not overlap this step
                updates, pending, _ = self.accumulation.combine(replicas, total, recorders, deferral)
                self.processes.wait(pending)
        else:
            if combined is None:
                combined = self.accumulation.combine(replicas, total, recorders, deferral)
            updates, pending, weights = combined
            # In a multi-worker job the gradient and state all-reduces run together;
            # this waits for both before anything is assigned.
            self.reconcile(state, scopes, weights, pending)
        # Combined: the replicas' gradients are freed before the optimizer's temporaries take memory.
        for recorder in recorders:
            recorder.calls.clear()
        with torch.no_grad():
            for optimizer, variables, gradients in updates:
                adapters.apply_update(optimizer, gradients, variables)
        return self.merge_logs(replica_logs, weights)

    def _test_batch(self, batch):
        state = self._state_variables()
        replicas, total = self._active_shards(batch)
        results = [
            self._run_replica(replica_id, self.model.test_step, shard, state, False, size / total)
            for replica_id, shard, size in replicas
        ]
        scopes = [scope for scope, _, _ in results]
        gradient_combine.check_summed_loss_has_no_penalties(self, state, scopes)
        weights = gradient_combine.weights_for_call(self, replicas, total, [d for _, _, d in results])
        self.reconcile(state, scopes, weights)
        return self.merge_logs([logs for _, logs, _ in results], weights)

    def _predict_batch(self, batch):
        state = self._state_variables()
        replicas, _ = self._active_shards(batch)
        outputs = [
            self._run_replica(replica_id, self.model.predict_step, shard, state, False)[1]
            for replica_id, shard, _ in replicas
        ]
        if len(outputs) == 1:
            local = outputs[0]
        else:
            device = self.devices[0].torch_device
            local = keras.tree.map_structure(
                lambda *parts: torch.cat(copy_to_device(parts, device)), *outputs
            )
        if self.processes is None:
            return local
        if per_rank_input.uses_batch_whole():
            return per_rank_input.gather_outputs(self, local)
        if all(n == 0 for _, _, n in replicas):
            local = keras.tree.map_structure(lambda leaf: leaf[:0], local)
        return self.processes.gather_outputs(local, batch)

    # ----- helpers ---------------------------------------------------------
    def forget_layout(self):
        """Re-reads the model's variables at the next step (layers may have changed between calls).

        Also marks the start of a fit/evaluate/predict call: in a multi-worker
        job the next step first copies rank 0's variables to every rank.
        """
        self.state = None
        self._needs_broadcast = True
        # `sync_batchnorm.convert(model)` may have run since compile.
        self._merge_mode = self._merge_mode or sync_batchnorm.needs_merge_mode(self.model)

    def _state_variables(self):
        if self.state is None or not self.state.complete:
            self.state = state_sync.StateVariables(self.model, self.summed_loss)
        if self._needs_broadcast and self.processes is not None and self.model.built:
            self.processes.broadcast_variables(self.model)
            self._needs_broadcast = False
        return self.state

    def _active_shards(self, batch):
        """This process's non-empty shards `(local replica id, shard, size)` and the global batch size.

        In a multi-worker job a process whose replicas all get no sample runs
        replica 0 on the batch's first sample with size 0, so that it still
        takes part in every collective; its results carry no weight. A batch
        of input split per rank is this process's part whole
        (`per_rank_input`), and the global batch size is summed over processes.
        """
        if self.processes is not None:
            if per_rank_input.uses_batch_whole():
                return per_rank_input.local_shards(self, batch)
            return self.processes.local_shards(batch, self.num_replicas)
        shards = split_batch(batch, self.num_replicas)
        active = [(k, shard, n) for k, (shard, n) in enumerate(shards) if n > 0]
        return active, sum(n for _, _, n in active)

    @property
    def faults(self):
        """The negative-control switches in force (`FaultInjection`)."""
        return faults.ACTIVE

    def reconcile(self, state, scopes, weights, pending=(), control=None):
        """Combines the non-trainable state; in a multi-worker job after `pending` has arrived.

        `control`: an overlapped step's control vector (`gradient_overlap`),
        summed in the same all-reduce and read before anything is assigned.
        """
        if self.processes is None:
            state_sync.reconcile(state, scopes, weights)
            return
        plan, contributions = state_sync.plan_contributions(
            state, scopes, weights, self.processes.holds_first_replica, for_all_reduce=True
        )
        if control is not None:
            contributions = list(contributions) + [control.tensor]
        combined, works = self.processes.start_reduction(contributions, key="state")
        self.processes.wait(list(pending) + works)
        if control is not None:
            control.arrive(combined[-1])
            combined = combined[:-1]
        state_sync.assign(plan, combined)

    def _state_mapping(self, replica_id, state, training):
        """What each replica reads instead of the canonical variables: `(pairs, canonical pairs)`.

        The canonical pairs are converted once per layout (`_compat.stateless_scope`)."""
        model = self.model
        device = self.devices[replica_id].torch_device
        canonical_device = self.devices[0].torch_device
        canonical = ()
        if device == canonical_device:
            # Regularizers read trainable values through the scope, so map them
            # to the canonical Parameters themselves: no copy, still leaves.
            canonical = state.canonical_mapping
            mapping = []
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
        return mapping, canonical

    def _run_replica(self, replica_id, step_fn, shard, state, training, share=None):
        """Runs one replica's step in this thread (sequential mode).

        Returns:
            `(scope, logs, denominator)`: the divisor of the losses computed
            after the step's last `apply` (all of them in `test_step`).
        """
        # A training step that needs its replicas to meet runs again in merge mode.
        merge_handler = _request_merge_mode if training else context.sequential_merge_handler
        replica_context = context.ReplicaContext(self.strategy, replica_id, merge_handler=merge_handler)
        context.push(self.strategy, replica_context)
        loss_denominators.begin()
        try:
            with self.strategy.extended.replica_device_scope(replica_id):
                scope, logs = self.run_in_scope(
                    replica_id, step_fn, shard, state, training, self.replica_on_enter(replica_id, state, share, training)
                )
            return scope, logs, loss_denominators.take()
        finally:
            loss_denominators.end()
            context.pop(self.strategy)

    def replica_on_enter(self, replica_id, state, share, training):
        """What runs as a replica's scope opens (None: nothing).

        float8 output-gradient scales for its share; an overlapped step reads
        the loss divisors recorded from here on.
        """
        overlapped = self._overlapped if training else None
        prescale = training and state.float8.output_gradient_variables and not faults.ACTIVE.float8_mean
        if not prescale and overlapped is None:
            return None
        device = self.devices[replica_id].torch_device

        def on_enter(scope):
            if overlapped is not None:
                overlapped.capture_denominators()
            if prescale:
                float8_sync.prescale(scope, state.float8, share, device)

        return on_enter

    def run_in_scope(self, replica_id, step_fn, shard, state, training, on_enter=None):
        """Runs `step_fn(shard)` inside the replica's `StatelessScope`: `(scope, logs)`.

        The caller has entered the replica's context and device scope.
        `on_enter(scope)` is told the scope before the step starts.
        """
        model = self.model
        mapping, canonical = self._state_mapping(replica_id, state, training)
        collect_losses = not faults.ACTIVE.drop_replica_losses
        with _compat.stateless_scope(mapping, collect_losses, canonical, state.converted_canonical) as scope:
            if on_enter is not None:
                on_enter(scope)
            if training and not state.train_step_zeroes_gradients:
                # A train_step that forgets zero_grad must not mix this
                # replica's gradients into the previous replica's.
                model.zero_grad(set_to_none=True)
            state.torch_buffers.start_replica(replica_id, training)  # torch modules' own buffers
            try:
                logs = step_fn(shard)
            except Exception as error:
                replica_errors.note(error, replica_id, self.devices, shard)
                raise
        return scope, logs

    def merge_logs(self, logs, weights):
        return step_logs.merge(self, logs, weights)


def _request_merge_mode(merge_fn, args, kwargs):
    del merge_fn, args, kwargs
    if faults.ACTIVE.no_merge_mode:
        return context.sequential_merge_handler(None, (), {})
    raise gradient_merge.MergeModeNeeded()


def _all_losses_summed(model):
    """True when every compiled loss uses `reduction="sum"` (gradients then add up, not average)."""
    losses = keras.tree.flatten(model.loss) if getattr(model, "loss", None) is not None else []
    return bool(losses) and {getattr(loss, "reduction", None) for loss in losses} == {"sum"}


def check_steps_per_execution(model):
    """Raises a clear error for `steps_per_execution > 1` where Keras itself rejects it."""
    if model.steps_per_execution > 1 and _compat.TORCH_TRAINER_REJECTS_STEPS_PER_EXECUTION:
        raise UnsupportedError(
            "steps_per_execution > 1 is not supported by Keras "
            f"{keras.version()} on the torch backend. Received: steps_per_execution="
            f"{model.steps_per_execution}. Compile with steps_per_execution=1 (kdist "
            "already runs all replicas of a step in one call)."
        )
