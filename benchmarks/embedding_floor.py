"""The least issue 23's parameter-server step can cost here: hand-written torch over bare gRPC, against TensorFlow.

Issue 23 asks kdist's coordinator `fit` for at least 1.0x TensorFlow's PS
steps/s at V = 10^6 (`embedding_scale.py`). This script measures how fast the
same step runs with every kdist and Keras layer removed, in the same process
layout, so a reader can tell what part of the gap any Python gRPC design pays:

| config | what runs |
|---|---|
| `tf_ps` | TensorFlow's `ParameterServerStrategy` (`embedding_scale.TfConfig`, unchanged) |
| `floor_3rt` | 2 bare gRPC servers, a chief and a worker process, kdist's wire pattern: per step the chief sends the batch to the worker; the worker pulls the dense variables, looks up the batch's distinct rows, runs the step in plain torch and pushes the row and dense gradients; 2 requests at a time (one per server, from a pool of 2 threads, as kdist's router does) |
| `floor_2rt` | the same with the pull fused into the lookup: 2 round trips per step instead of 3 |

The servers are `grpc.server` with generic handlers and raw `bytes` (no
protobuf, no authentication, no deadline watchdog; memory laid out as in
kdist's servers, `kdist.ps.server.memory`); each holds one half of the
table (rows split as `MinSizePartitioner(256 KiB, max_shards=2)` splits them)
and two of the 4 dense variables, and applies SGD or Adagrad with torch's
index ops (duplicates summed, touched rows only). The chief keeps 2 steps in
flight and the worker runs one at a time, as kdist's coordinator does. Every
process has one torch thread. Rounds are interleaved; one JSON line per
configuration (median ms per step over rounds, ratio to `tf_ps`).

    PYTHONPATH=. python benchmarks/embedding_floor.py --rows 1000000 --optimizers sgd,adagrad --rounds 3
"""

import argparse
import importlib.util
import json
import os
import statistics
import sys
import threading
import time
from concurrent import futures

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import embedding_scale as scale  # noqa: E402  (sets KERAS_BACKEND, spawns children)

RUN_SECONDS = 600
HIDDEN, DIM, IDS, BATCH = scale.HIDDEN, scale.DIM, scale.IDS_PER_EXAMPLE, scale.BATCH_SIZE
DENSE_SHAPES = {"k1": (DIM, HIDDEN), "b1": (HIDDEN,), "k2": (HIDDEN, 1), "b2": (1,)}
DENSE_HOME = {"k1": 0, "b1": 1, "k2": 0, "b2": 1}  # round-robin over the 2 servers, as kdist places them
IDENTITY = {"request_serializer": None, "response_deserializer": None}


def _pack(*tensors):
    import numpy as np

    parts = [np.ascontiguousarray(t.numpy() if hasattr(t, "numpy") else t) for t in tensors]
    header = np.array([len(parts)] + [p.nbytes for p in parts], dtype=np.int64).tobytes()
    return header + b"".join(p.tobytes() for p in parts)


def _unpack(data, dtypes):
    import numpy as np
    import torch

    count = int(np.frombuffer(data, np.int64, 1)[0])
    sizes = np.frombuffer(data, np.int64, count, 8)
    offset, out = 8 * (count + 1), []
    for size, dtype in zip(sizes, dtypes):
        out.append(torch.from_numpy(np.frombuffer(data, dtype, int(size) // np.dtype(dtype).itemsize, offset).copy()))
        offset += int(size)
    return out


def serve_ps(index, rows, optimizer, lr):
    import grpc
    import torch

    from kdist.ps.server import memory

    memory.keep_freed_memory()  # as kdist's servers do: the floor pays no page faults they avoid
    torch.set_num_threads(1)
    torch.manual_seed(index)
    half = (rows + 1) // 2
    shard_rows = half if index == 0 else rows - half
    table = memory.moved(torch.empty(shard_rows, DIM).uniform_(-0.05, 0.05))  # huge pages, as kdist's
    dense = {name: torch.empty(shape).uniform_(-0.2, 0.2) for name, shape in DENSE_SHAPES.items()
             if DENSE_HOME[name] == index}
    slots = {}
    if optimizer == "adagrad":
        slots = {"table": memory.moved(torch.full_like(table, 0.1)),
                 **{name: torch.full_like(value, 0.1) for name, value in dense.items()}}
    lock = threading.Lock()

    def apply(name, variable, ids, gradient):
        if optimizer == "sgd":
            if ids is None:
                variable.sub_(lr * gradient)
            else:
                variable.index_add_(0, ids, gradient, alpha=-lr)
            return
        accumulator = slots[name]
        if ids is None:
            accumulator.add_(gradient * gradient)
            variable.sub_(lr * gradient / (accumulator.sqrt() + 1e-7))
        else:
            accumulator.index_add_(0, ids, gradient * gradient)
            variable.index_add_(0, ids, gradient / (accumulator.index_select(0, ids).sqrt() + 1e-7), alpha=-lr)

    def pull(request, context):
        with lock:
            return _pack(*dense.values())

    def lookup(request, context):
        (ids,) = _unpack(request, ["int64"])
        with lock:
            return _pack(table.index_select(0, ids))

    def read(request, context):
        (ids,) = _unpack(request, ["int64"])
        with lock:
            return _pack(table.index_select(0, ids), *dense.values())

    def push(request, context):
        ids, rows_grad, *dense_grads = _unpack(request, ["int64"] + ["float32"] * (1 + len(dense)))
        with lock:
            apply("table", table, ids, rows_grad.reshape(-1, DIM))
            for (name, variable), gradient in zip(dense.items(), dense_grads):
                apply(name, variable, None, gradient.reshape(variable.shape))
        return b""

    handlers = {name: grpc.unary_unary_rpc_method_handler(function)
                for name, function in (("Pull", pull), ("Lookup", lookup), ("Read", read), ("Push", push))}
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("floor.Ps", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


class FloorWorker:
    """The worker's step in plain torch, over bare gRPC to the 2 servers."""

    def __init__(self, ports, rows, fused):
        import grpc

        self.half, self.fused = (rows + 1) // 2, fused
        self.channels = [grpc.insecure_channel(f"127.0.0.1:{port}") for port in ports]
        self.calls = [{name: channel.unary_unary(f"/floor.Ps/{name}", **IDENTITY)
                       for name in ("Pull", "Lookup", "Read", "Push")} for channel in self.channels]
        self.pool = futures.ThreadPoolExecutor(2)
        self.lock = threading.Lock()

    def _both(self, name, requests):
        answers = [self.pool.submit(self.calls[i][name], requests[i], timeout=60) for i in range(2)]
        return [answer.result() for answer in answers]

    def step(self, batch):
        import torch

        with self.lock:
            ids, y = _unpack(batch, ["int32", "float32"])
            unique, inverse = torch.unique(ids.to(torch.int64), return_inverse=True)
            split = int(torch.searchsorted(unique, self.half))
            shard_ids = [unique[:split], unique[split:] - self.half]
            dense_names = [[n for n in DENSE_SHAPES if DENSE_HOME[n] == i] for i in range(2)]
            if self.fused:
                answers = self._both("Read", [_pack(s) for s in shard_ids])
            else:
                pulled = self._both("Pull", [b"", b""])
                answers = self._both("Lookup", [_pack(s) for s in shard_ids])
            rows, dense = [], {}
            for i, answer in enumerate(answers):
                parts = _unpack(answer, ["float32"] * 3)
                rows.append(parts[0].reshape(-1, DIM))
                values = parts[1:] if self.fused else _unpack(pulled[i], ["float32"] * 2)
                for name, value in zip(dense_names[i], values):
                    dense[name] = value.reshape(DENSE_SHAPES[name]).requires_grad_(True)
            table_rows = torch.cat(rows).requires_grad_(True)
            pooled = table_rows[inverse].reshape(-1, IDS, DIM).mean(dim=1)
            hidden = torch.relu(pooled @ dense["k1"] + dense["b1"])
            loss = torch.mean(torch.square((hidden @ dense["k2"] + dense["b2"])[:, 0] - y))
            loss.backward()
            grads = [table_rows.grad[:split], table_rows.grad[split:]]
            self._both("Push", [_pack(shard_ids[i], grads[i], *[dense[n].grad for n in dense_names[i]])
                                for i in range(2)])
            return _pack(loss.detach().reshape(1))


def serve_worker(ps_ports, rows, fused):
    import grpc

    worker = FloorWorker(ps_ports, rows, fused)
    handler = grpc.method_handlers_generic_handler(
        "floor.Worker", {"Step": grpc.unary_unary_rpc_method_handler(lambda request, context: worker.step(request))})
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def chief_round(worker_port, rows, steps, warmup_steps, seed):
    """Sends `steps` batches, 2 in flight; times from the end of step `warmup_steps` to the last."""
    import grpc
    import numpy as np

    rng = np.random.default_rng(seed)
    batches = [_pack(rng.integers(0, rows, size=(BATCH, IDS), dtype=np.int32),
                     rng.standard_normal(BATCH).astype(np.float32)) for _ in range(steps)]
    with grpc.insecure_channel(f"127.0.0.1:{worker_port}") as channel:
        step = channel.unary_unary("/floor.Worker/Step", **IDENTITY)
        ends, errors, next_batch, lock = [], [], iter(range(steps)), threading.Lock()

        def sender():
            while not errors:
                with lock:
                    index = next(next_batch, None)
                if index is None:
                    return
                try:
                    step(batches[index], timeout=60)
                except grpc.RpcError as error:
                    errors.append(error)
                    return
                with lock:
                    ends.append(time.monotonic())

        threads = [threading.Thread(target=sender) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]
    ends.sort()
    return {"timed_steps": steps - warmup_steps, "seconds": ends[-1] - ends[warmup_steps - 1]}


def child_main(role, arguments):
    """`--role ps|worker|chief`: serves, or runs rounds, on JSON commands from stdin."""
    import torch

    torch.set_num_threads(1)
    reply = {"ps": lambda: serve_ps(arguments["index"], arguments["rows"], arguments["optimizer"], arguments["lr"]),
             "worker": lambda: serve_worker(arguments["ps_ports"], arguments["rows"], arguments["fused"])}
    server = None
    if role in reply:
        server, port = reply[role]()
        print(scale.MESSAGE_MARKER + json.dumps({"port": port}), flush=True)
    else:
        print(scale.MESSAGE_MARKER + json.dumps({}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("op") == "quit":
            break
        result = chief_round(arguments["worker_port"], arguments["rows"], **command["arguments"])
        print(scale.MESSAGE_MARKER + json.dumps(result), flush=True)
    if server is not None:
        server.stop(0)


class FloorConfig:
    def __init__(self, name, rows, optimizer, fused):
        self.name, self.rows, self.optimizer, self.fused = name, rows, optimizer, fused

    def _child(self, name, role, **arguments):
        child = scale.Child(name, [sys.executable, os.path.abspath(__file__), "--role", role,
                                   "--arguments", json.dumps(arguments)])
        return child, child.receive(scale.STARTUP_SECONDS)

    def start(self, args):
        lr = scale.OPTIMIZERS[self.optimizer][1]
        started = [self._child(f"ps-{i}", "ps", index=i, rows=self.rows, optimizer=self.optimizer, lr=lr)
                   for i in range(2)]
        ports = [reply["port"] for _, reply in started]
        worker, reply = self._child("worker", "worker", ps_ports=ports, rows=self.rows, fused=self.fused)
        self.chief, _ = self._child("chief", "chief", worker_port=reply["port"], rows=self.rows)
        self.children = [child for child, _ in started] + [worker, self.chief]
        self.seed = 0

    def fit(self, steps, warmup_steps):
        self.seed += 1
        self.chief.send(op="round", arguments={"steps": steps, "warmup_steps": warmup_steps, "seed": self.seed})
        return [self.chief.receive(RUN_SECONDS)]

    def close(self):
        for child in reversed(self.children):
            child.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["ps", "worker", "chief"])
    parser.add_argument("--arguments", default="{}")
    parser.add_argument("--rows", type=int, default=10**6)
    parser.add_argument("--optimizers", default="sgd,adagrad")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--no-tf", action="store_true", help="leave out the TensorFlow baseline")
    args = parser.parse_args()
    if not 1 <= args.warmup_steps < args.steps:
        parser.error(f"--warmup-steps must be at least 1 and below --steps ({args.steps}). "
                     f"Received: {args.warmup_steps}.")
    if args.role:
        return child_main(args.role, json.loads(args.arguments))
    for optimizer in args.optimizers.split(","):
        configs = [FloorConfig("floor_3rt", args.rows, optimizer, False),
                   FloorConfig("floor_2rt", args.rows, optimizer, True)]
        if not args.no_tf and importlib.util.find_spec("tensorflow") is not None:
            configs.insert(0, scale.TfConfig("tf_ps", "tf", args.rows, optimizer, 1))
        for config in configs:
            config.start(args)
        times = {config.name: [] for config in configs}
        cpu = {config.name: {} for config in configs}
        try:
            for round_index in range(args.rounds):
                for config in configs if round_index % 2 == 0 else configs[::-1]:
                    before = {child.name: child.cpu_seconds() for child in config.children}
                    (result,) = config.fit(args.steps, args.warmup_steps)
                    times[config.name].append(1000 * result["seconds"] / result["timed_steps"])
                    for child in config.children:  # the whole round, warm-up included
                        cpu[config.name].setdefault(child.name, []).append(
                            1000 * (child.cpu_seconds() - before[child.name]) / args.steps)
        finally:
            for config in configs:
                config.close()
        tf_ms = statistics.median(times["tf_ps"]) if "tf_ps" in times else None
        for name, values in times.items():
            ms = statistics.median(values)
            print(json.dumps({"benchmark": "embedding_floor", "config": name, "optimizer": optimizer,
                              "rows": args.rows, "ms_per_step": round(ms, 2),
                              "ms_per_step_by_round": [round(v, 2) for v in values],
                              "ratio_vs_tf_ps": round(tf_ms / ms, 3) if tf_ms else None,
                              "cpu_ms_per_step": {process: round(statistics.median(per_round), 2)
                                                  for process, per_round in cpu[name].items()},
                              "commit": scale.git_commit(), **scale.environment()}), flush=True)


if __name__ == "__main__":
    main()
