"""`kdist server`: run one ps or worker task of a parameter-server cluster until stopped.

A `ps` task serves variables (the variable service); a `worker` task runs the
functions that the chief's `ClusterCoordinator` schedules onto it (the worker
service). The chief and the evaluator run programs, not servers.

`prepare(args)` turns the parsed arguments into a `ServerPlan` (every check
that can fail before anything starts, so mistakes are usage errors, exit 2);
`run_server(args, plan)` serves until SIGTERM or SIGINT and exits 0.
"""

import dataclasses
import os
import signal
import sys
import threading

from kdist.cluster import ClusterSpec, TFConfigClusterResolver
from kdist.cluster.address import bind_endpoint, is_loopback, resolve_bind_address
from kdist.cluster.tf_config import TF_CONFIG, load_tf_config
from kdist.errors import InvalidArgumentError, KdistError
from kdist.launch.cluster_file import add_cluster_argument, check_task, load_cluster

DEFAULT_STOP_GRACE_SECONDS = 5.0
# After stop(), the thread watching the server ends within moments; this bounds it.
JOIN_WATCHER_SECONDS = 5.0
EXIT_FAILURE = 1
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

SERVER_EPILOG = """\
examples:
  # parameter server 0 of the cluster in cluster.json, reachable from other hosts:
  kdist server --job ps --index 0 --cluster cluster.json --bind 0.0.0.0
  #   cluster.json: {"chief": ["10.0.0.9:2222"], "worker": ["10.0.0.1:2222"],
  #                  "ps": ["10.0.0.2:2222"]}
  #   (or a whole TF_CONFIG object; its "cluster" key is used)

  # worker 0 of the same cluster: runs what the chief's ClusterCoordinator schedules
  kdist server --job worker --index 0 --cluster cluster.json --bind 0.0.0.0

  # the task TF_CONFIG describes, with TLS and the cluster secret from a file:
  TF_CONFIG='{"cluster": {...}, "task": {"type": "ps", "index": 0}}' \\
    kdist server --bind 0.0.0.0 --token-file secret.txt --tls-cert ps.pem --tls-key ps.key

security:
  Every server needs the cluster secret, the same on every task: --token-file FILE,
  or the variable KDIST_SECRET_FILE (a file holding it; kdist launch sets it) or
  KDIST_SECRET. Servers and clients prove to each other that they hold it
  (HMAC challenge-response); it never crosses the network, and calls that do not
  prove it are refused before anything in them is read. --insecure serves anyone
  who can reach the server instead: on a worker that is running their code, on a
  ps reading and overwriting the variables. Without --bind the server listens on
  127.0.0.1 only (this host). --tls-cert/--tls-key turn TLS on; --tls-ca then also
  requires client certificates signed by that CA (mutual TLS). Without TLS the
  traffic can be read on the network.

output and exit:
  One line on stdout once serving: "[kdist] serving ps:0 at HOST:PORT (...)"
  (or "serving worker:0 ...").
  SIGTERM or Ctrl-C stops the server (calls in flight get --grace seconds) and
  exits 0; a configuration error exits 2, a failure to serve exits 1.
"""


@dataclasses.dataclass(frozen=True)
class ServerPlan:
    """Everything `kdist server` checked before starting: what to serve and how."""

    cluster_spec: ClusterSpec
    job_name: str
    task_index: int
    bind_address: str | None
    security: object
    options: object


def add_parser(commands, count_type, seconds_type):
    """Adds the `server` subcommand to the `kdist` subparsers `commands`."""
    import argparse

    parser = commands.add_parser(
        "server",
        help="serve one ps or worker task of a parameter-server cluster until stopped",
        description="Serve one task of a parameter-server cluster until SIGTERM or Ctrl-C.\n"
        "  --job ps      the variable service: holds variables, applies pushed gradients\n"
        "  --job worker  the worker service: runs the functions the chief's\n"
        "                ClusterCoordinator schedules onto it (model.fit or a custom loop)\n"
        "The chief runs the training program and the evaluator runs\n"
        "kdist.SidecarEvaluator; neither is a server.",
        epilog=SERVER_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    task = parser.add_argument_group("the task (default: TF_CONFIG's cluster and task)")
    task.add_argument("--job", metavar="JOB", help="this task's job: ps (variable service) or worker (runs a coordinator's functions)")
    task.add_argument(
        "--index", type=count_type(0), metavar="N", help="this task's index in its job"
    )
    add_cluster_argument(task)
    task.add_argument(
        "--bind",
        metavar="ADDRESS",
        help="listen on HOST (the task's port) or HOST:PORT, e.g. 0.0.0.0 (default: 127.0.0.1)",
    )
    security = parser.add_argument_group("security")
    security.add_argument(
        "--token-file", metavar="FILE",
        help="file holding the cluster secret (default: $KDIST_SECRET_FILE or $KDIST_SECRET)")
    security.add_argument(
        "--insecure", action="store_true",
        help="serve without the cluster secret: anyone who reaches it can run code on a worker "
        "or overwrite a ps's variables")
    security.add_argument("--tls-cert", metavar="FILE", help="PEM certificate of this server")
    security.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    security.add_argument(
        "--tls-ca", metavar="FILE", help="PEM CA that client certificates must chain to (mTLS)"
    )
    service = parser.add_argument_group("service")
    service.add_argument(
        "--max-staleness",
        type=count_type(0),
        metavar="N",
        help="reject gradients computed more than N versions ago (default: accept all)",
    )
    service.add_argument(
        "--grace",
        type=seconds_type,
        default=DEFAULT_STOP_GRACE_SECONDS,
        metavar="SECONDS",
        help="on SIGTERM/Ctrl-C, how long calls in flight may finish "
        f"(default: {DEFAULT_STOP_GRACE_SECONDS:g})",
    )
    return parser


def prepare(args, environ=None):
    """Checks the arguments of `kdist server`; returns a `ServerPlan`.

    Raises:
        kdist.errors.InvalidArgumentError: a missing or malformed cluster or
            task, unreadable security files, or a job that is not served.
    """
    cluster_spec, job_name, task_index = _task(args, environ)
    if job_name not in ("ps", "worker"):
        raise InvalidArgumentError(
            f"kdist server serves 'ps' and 'worker' tasks. Received: --job {job_name}. "
            "The chief runs the training program (with its ClusterCoordinator) and the "
            "evaluator runs kdist.SidecarEvaluator; neither serves."
        )
    from kdist.rpc.secret import SECRET_ENV, SECRET_FILE_ENV, environment_secret
    from kdist.rpc.security import Security, load_token

    task_address = cluster_spec.task_address(job_name, task_index)
    _, port = bind_endpoint(task_address, f"cluster[{job_name!r}][{task_index}]")
    resolve_bind_address(args.bind, port)  # Fails here (exit 2) rather than at start.
    if (args.tls_cert is None) != (args.tls_key is None):
        raise InvalidArgumentError(
            "--tls-cert and --tls-key go together. Received: "
            f"--tls-cert {args.tls_cert}, --tls-key {args.tls_key}."
        )
    if args.tls_ca is not None and args.tls_cert is None:
        raise InvalidArgumentError(
            "--tls-ca requires client certificates (mutual TLS), which needs the server's own "
            f"--tls-cert and --tls-key. Received: --tls-ca {args.tls_ca} alone."
        )
    tls = dict(certificate_file=args.tls_cert, private_key_file=args.tls_key, ca_file=args.tls_ca)
    if args.insecure:
        if args.token_file is not None:
            raise InvalidArgumentError(
                "--insecure turns the cluster secret off, so --token-file has no use. Received: "
                f"--insecure and --token-file {args.token_file}. Give one or the other."
            )
        security = Security.insecure(**tls)
    elif args.token_file is not None:
        security = Security(token=load_token(args.token_file), **tls)
    else:
        environ = os.environ if environ is None else environ
        token = environment_secret(environ)
        if token is None:
            raise InvalidArgumentError(
                "kdist server needs the cluster secret, the same on every task, so that strangers "
                f"cannot call it. Received: no --token-file, and neither {SECRET_FILE_ENV} nor "
                f"{SECRET_ENV} is set. Expected one of them (kdist launch sets {SECRET_FILE_ENV} "
                "for its tasks), or --insecure on a network where every process is trusted."
            )
        # Read now (exit 2 on a bad secret); the token is the environment's secret.
        security = Security(token=token, **tls)
    options = None
    if args.max_staleness is not None:
        from kdist.ps import ServiceOptions

        options = ServiceOptions(max_staleness=args.max_staleness)
    return ServerPlan(cluster_spec, job_name, task_index, args.bind, security, options)


def run_server(args, plan):
    """Serves `plan` until SIGTERM/SIGINT; returns the exit code (0 after a signal)."""
    import kdist
    from kdist.distribute.server import Server

    # A worker task rebuilds Keras models, optimizers and metrics for the closures it
    # runs: load kdist's public surface, which installs its Keras hooks and worker runtime.
    kdist._load()

    name = f"{plan.job_name}:{plan.task_index}"
    with _StopSignals() as stop:
        try:
            server = Server(
                plan.cluster_spec,
                plan.job_name,
                plan.task_index,
                bind_address=plan.bind_address,
                options=plan.options,
                security=plan.security,
            )
        except (KdistError, OSError, RuntimeError) as error:
            _say(f"{name} could not start serving: {error}", sys.stderr)
            return EXIT_FAILURE
        # The server stopping by itself (it should not) ends the wait as a signal would.
        def watch():
            server.join()
            stop.wake()

        watcher = threading.Thread(target=watch, name="kdist-server-watch", daemon=True)
        watcher.start()
        try:
            for warning in _exposure_warnings(plan, server):
                _say(warning, sys.stderr)
            serving = f"serving {name} at {server.bind_address} ({_describe(plan.security)})"
            _say(serving, sys.stdout)
            stop.wait()
        finally:
            server.stop(args.grace)
            # After stop() the watcher's join returns at once; it must be gone
            # before the wake-up pipe closes.
            watcher.join(args.grace + JOIN_WATCHER_SECONDS)
    if stop.received is None:
        _say(f"{name} stopped serving unexpectedly", sys.stderr)
        return EXIT_FAILURE
    _say(f"{name} stopped ({signal.Signals(stop.received).name})", sys.stderr)
    return 0


class _StopSignals:
    """Lets the main thread sleep until SIGINT/SIGTERM (or `wake()`), without polling.

    The handlers only record the signal: the C-level handler writes to a pipe
    (`signal.set_wakeup_fd`) that `wait()` reads. Handlers that took a lock
    (`threading.Event.set`) could deadlock against the interrupted main thread.
    Outside the main thread no handler can be installed; then only `wake()` ends
    the wait. Previous handlers are restored on exit.
    """

    def __init__(self):
        self.received = None
        self._previous = {}
        self._previous_wakeup_fd = None
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous_wakeup_fd = signal.set_wakeup_fd(
                self._write_fd, warn_on_full_buffer=False
            )
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self._previous_wakeup_fd is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd)
        os.close(self._read_fd)
        os.close(self._write_fd)
        return False

    def _handle(self, signum, frame):
        if self.received is None:
            self.received = signum

    def wake(self):
        """Ends `wait()` from any thread."""
        try:
            os.write(self._write_fd, b"\0")
        except BlockingIOError:
            pass  # The pipe is full: wait() will return anyway.

    def wait(self):
        """Blocks until a stop signal arrived or `wake()` was called."""
        # The wake-up byte of a signal is its number; wake() writes 0. Reading
        # it here records the signal even before the Python handler has run.
        # Other signals with Python handlers write their numbers too; they do not stop.
        while True:
            data = os.read(self._read_fd, 1)
            if not data or data[0] == 0:
                return
            if data[0] in STOP_SIGNALS:
                if self.received is None:
                    self.received = data[0]
                return


def _task(args, environ):
    if args.cluster is not None:
        if args.job is None or args.index is None:
            raise InvalidArgumentError(
                "With --cluster, name this task with --job and --index. Received: "
                f"--job {args.job}, --index {args.index}. Expected e.g. --job ps --index 0."
            )
        cluster = load_cluster(args.cluster)
        check_task(cluster, args.job, args.index)
        return ClusterSpec(cluster), args.job, args.index
    config = load_tf_config(None if environ is None else environ.get(TF_CONFIG, ""))
    if not config.get("cluster"):
        raise InvalidArgumentError(
            "No cluster: pass --cluster FILE (with --job and --index), or set TF_CONFIG. "
            "Received: no --cluster, and TF_CONFIG has no cluster."
        )
    resolver = TFConfigClusterResolver(task_type=args.job, task_id=args.index, tf_config=config)
    return resolver.cluster_spec(), resolver.task_type, resolver.task_id


def _exposure_warnings(plan, server):
    host, _ = bind_endpoint(server.bind_address, "bind_address")
    task_address = plan.cluster_spec.task_address(plan.job_name, plan.task_index)
    task_host, _ = bind_endpoint(task_address, "task address")
    if is_loopback(host):
        if not is_loopback(task_host):
            yield (
                f"listening on {host} only, but the cluster names this task {task_host}: other "
                "hosts cannot connect; pass --bind 0.0.0.0 to accept them"
            )
        return
    # Running without the secret, or beyond this host without TLS, is logged by the
    # server itself (kdist.ps.Security.check_exposure), for every way of starting one.


def _describe(security):
    tls = "TLS off"
    if security.server_tls:
        tls = "mutual TLS" if security.ca_file is not None else "TLS"
    return f"{tls}, cluster secret {'on' if security.authenticate else 'OFF (--insecure)'}"


def _say(message, stream):
    print(f"[kdist] {message}", file=stream, flush=True)
