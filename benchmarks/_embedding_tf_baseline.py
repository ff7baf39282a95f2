"""`embedding_scale.py`'s TensorFlow baseline: TensorFlow's own parameter-server training.

Run by `embedding_scale.py` in its own process (`KERAS_BACKEND=tensorflow`, so
torch and TensorFlow never share a process), commanded by JSON lines on stdin
and answering marked JSON lines on stdout, like the benchmark's other children.

The cluster is TensorFlow's in-process one, as in TensorFlow's parameter-server
tutorial (`create_in_process_cluster`): `tf.distribute.Server`s for 2 ps and N
workers in this process, `tf.distribute.experimental.ParameterServerStrategy`
with `MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2)`, and a
`ClusterCoordinator` scheduling one training step per closure.

Keras 3 on the TensorFlow backend does not run under TensorFlow's
`ParameterServerStrategy` (and `tf_keras` is not installed), so the model is
written with TensorFlow ops: `tf.nn.embedding_lookup` on the `ShardedVariable`
(the div strategy, as TensorFlow's Keras `Embedding` does), mean over the 20
ids, Dense(64, relu), Dense(1), mean squared error. The updates are TensorFlow's
own sparse applies, run on the parameter servers (ops on a variable's handle run
where the variable lives), as TensorFlow's Keras 2 optimizers issue them:

- SGD: `scatter_sub` of `lr * rows` on each shard (duplicate ids add up in the
  scatter), `assign_sub` for the dense layers.
- Adagrad: duplicate ids summed (`unique` + `unsorted_segment_sum`, as Keras 2's
  `_deduplicate_indexed_slices`), then `ResourceSparseApplyAdagradV2` on each shard
  with its accumulator shard (created next to it with `colocate_vars_with`);
  `ResourceApplyAdagradV2` for the dense layers. Keras' Adagrad defaults:
  `initial_accumulator_value=0.1`, `epsilon=1e-7`.

Adam has no sparse apply in TensorFlow's raw ops; this baseline does not run it.

Threads: every server gets `intra_op_parallelism_threads=1` (kdist's processes use
one torch thread each) and, as in the tutorial, enough inter-op threads for the
closures in flight.
"""

import json
import os
import socket
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MESSAGE_MARKER = "@@embedding_scale "
SUPPORTED_OPTIMIZERS = ("sgd", "adagrad")
ADAGRAD_INITIAL_ACCUMULATOR = 0.1
ADAGRAD_EPSILON = 1e-7
DATA_POOL_BATCHES = 64


def _reply(message):
    print(MESSAGE_MARKER + json.dumps(message), flush=True)


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def create_in_process_cluster(num_workers, num_ps):
    """TensorFlow's tutorial recipe, with one intra-op thread per server."""
    import tensorflow as tf

    worker_ports, ps_ports = _free_ports(num_workers), _free_ports(num_ps)
    spec = tf.train.ClusterSpec({"worker": [f"localhost:{port}" for port in worker_ports],
                                 "ps": [f"localhost:{port}" for port in ps_ports]})
    worker_config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                             inter_op_parallelism_threads=num_workers + 1)
    ps_config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=2)
    servers = [tf.distribute.Server(spec, job_name="worker", task_index=i, config=worker_config, protocol="grpc")
               for i in range(num_workers)]
    servers += [tf.distribute.Server(spec, job_name="ps", task_index=i, config=ps_config, protocol="grpc")
                for i in range(num_ps)]
    return tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc"), servers


class Baseline:
    def setup(self, rows, dim, ids_per_example, hidden, batch_size, optimizer, learning_rate, num_workers,
              num_ps, min_shard_bytes, max_shards):
        import numpy as np
        import tensorflow as tf

        if optimizer not in SUPPORTED_OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {SUPPORTED_OPTIMIZERS}. Received: optimizer={optimizer!r}.")
        tf.config.threading.set_intra_op_parallelism_threads(1)
        resolver, self._servers = create_in_process_cluster(num_workers, num_ps)
        partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=min_shard_bytes, max_shards=max_shards)
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        lr = tf.constant(learning_rate, tf.float32)

        def uniform(scale, full_shape):
            # Called once per shard with its shape: no table-sized tensor on the coordinator.
            def init(partition_shape=None, partition_offset=None):
                return tf.random.uniform(partition_shape or full_shape, -scale, scale, seed=1)
            return init

        with strategy.scope():
            table = tf.Variable(uniform(0.05, (rows, dim)), shape=(rows, dim), dtype=tf.float32, name="embedding")
            dense = [tf.Variable(uniform(0.2, (dim, hidden)), shape=(dim, hidden), dtype=tf.float32, name="k1"),
                     tf.Variable(tf.zeros([hidden]), name="b1"),
                     tf.Variable(uniform(0.3, (hidden, 1)), shape=(hidden, 1), dtype=tf.float32, name="k2"),
                     tf.Variable(tf.zeros([1]), name="b2")]
        shards = list(table.variables) if hasattr(table, "variables") else [table]
        accumulators = []
        if optimizer == "adagrad":
            for variable in shards + dense:
                with strategy.scope(), strategy.extended.colocate_vars_with(variable):
                    shape = variable.shape
                    accumulators.append(tf.Variable(
                        lambda shape=shape: tf.fill(shape, ADAGRAD_INITIAL_ACCUMULATOR), shape=shape,
                        dtype=tf.float32, trainable=False))
        self.num_shards = len(shards)
        self.shard_devices = [variable.device for variable in shards]
        self.accumulator_devices = [variable.device for variable in accumulators[: len(shards)]]

        def sparse_apply(index, variable, gradient):
            if optimizer == "sgd":
                variable.scatter_sub(tf.IndexedSlices(lr * gradient.values, gradient.indices))
                return
            unique, positions = tf.unique(gradient.indices)
            summed = tf.math.unsorted_segment_sum(gradient.values, positions, tf.shape(unique)[0])
            tf.raw_ops.ResourceSparseApplyAdagradV2(
                var=variable.handle, accum=accumulators[index].handle, lr=lr, epsilon=ADAGRAD_EPSILON,
                grad=summed, indices=unique)

        def dense_apply(index, variable, gradient):
            if optimizer == "sgd":
                variable.assign_sub(lr * gradient)
                return
            tf.raw_ops.ResourceApplyAdagradV2(var=variable.handle, accum=accumulators[index].handle, lr=lr,
                                              epsilon=ADAGRAD_EPSILON, grad=gradient)

        variables = shards + dense
        # Filled while tracing: "sparse" or "dense" per variable, so the report shows the applies really are sparse.
        self.apply_kinds = []

        def replica_fn(ids, y):
            with tf.GradientTape() as tape:
                pooled = tf.reduce_mean(tf.nn.embedding_lookup(table, ids), axis=1)
                hidden_out = tf.nn.relu(tf.matmul(pooled, dense[0]) + dense[1])
                prediction = tf.matmul(hidden_out, dense[2]) + dense[3]
                loss = tf.reduce_mean(tf.square(prediction[:, 0] - y))
            gradients = tape.gradient(loss, variables)
            kinds = []
            for index, (variable, gradient) in enumerate(zip(variables, gradients)):
                if isinstance(gradient, tf.IndexedSlices):
                    sparse_apply(index, variable, gradient)
                    kinds.append("sparse")
                else:
                    dense_apply(index, variable, gradient)
                    kinds.append("dense")
            self.apply_kinds = kinds
            return loss

        @tf.function
        def worker_fn(iterator):
            ids, y = next(iterator)
            return strategy.run(replica_fn, args=(ids, y))

        def dataset_fn(input_context=None):
            rng = np.random.default_rng(0 if input_context is None else input_context.input_pipeline_id)
            ids = rng.integers(0, rows, size=(DATA_POOL_BATCHES * batch_size, ids_per_example), dtype=np.int64)
            y = rng.standard_normal(len(ids)).astype(np.float32)
            return tf.data.Dataset.from_tensor_slices((ids, y)).batch(batch_size, drop_remainder=True).repeat()

        self.worker_fn = worker_fn
        self.iterator = iter(self.coordinator.create_per_worker_dataset(dataset_fn))
        return {"pid": os.getpid(), "num_shards": self.num_shards, "shard_devices": self.shard_devices,
                "accumulator_devices": self.accumulator_devices}

    def round(self, steps, warmup_steps):
        """Schedules `steps` steps; times from the end of step `warmup_steps` to the end of the last."""
        values = [self.coordinator.schedule(self.worker_fn, args=(self.iterator,)) for _ in range(steps)]
        # Closures finish roughly in order; once the warm-up's last one is back, time the rest.
        for value in values[:warmup_steps]:
            value.fetch()
        start = time.perf_counter()
        self.coordinator.join()
        seconds = time.perf_counter() - start
        loss = float(values[-1].fetch())
        return {"timed_steps": steps - warmup_steps, "seconds": seconds, "loss": loss,
                "apply_kinds": {"table_shards": self.apply_kinds[: self.num_shards],
                                "dense_layers": self.apply_kinds[self.num_shards :]}}


def main():
    baseline = Baseline()
    _reply({"event": "hello", "pid": os.getpid()})
    for line in sys.stdin:
        command = json.loads(line)
        if command.pop("op") == "quit":
            break
        method = command.pop("method")
        _reply({"event": "done", **getattr(baseline, method)(**command)})


if __name__ == "__main__":
    main()
