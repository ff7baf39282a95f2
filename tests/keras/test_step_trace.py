"""The kdist modules one `fit` step visits under MirroredStrategy (2 logical CPU replicas).

Issue 26 asks that a change which sends the step through a new module, or back
and forth between modules more often, be seen in review. This test traces one
train step with `sys.setprofile` (and `threading.setprofile`, so replica
threads of merge mode would be traced too), keeps only the frames whose code
lives under `kdist/`, and compares the result with pinned values.

What is measured, from the `call`/`return` events of kdist frames only (Keras,
torch and test frames are invisible; a kdist frame's *caller* is the nearest
kdist frame below it on the same thread's stack, however many other frames lie
between):

- `modules`: the distinct kdist modules (paths relative to `kdist/`) entered,
  in the order of their first `call` event;
- `calls`: the `call` events of kdist frames (a generator's resumption counts);
- `cross_module_calls`: calls whose kdist caller is in another module;
- `returns_to_a_module_left`: `return` events (a generator's `yield` counts)
  of a frame whose kdist caller is in another module: control goes back to a
  module the step had left. Returns of frames entered before tracing began
  (their caller is unknown) are not counted;
- `returns_not_to_the_engine`: those of the above whose destination is not
  `keras/replica/engine.py`.

The step traced is the third of a `fit` run (the first two build the model,
its optimizer and the engine's layout): tracing starts in
`on_train_batch_begin` and stops in `on_train_batch_end`, so it covers exactly
Keras' `train_function(data)` call for that batch.

When a change moves the step on purpose, update `EXPECTED_MODULES` and the
limits from `python -m tests.keras.test_step_trace` (which prints the trace)
and say so in the change. Lower a limit when the step gets shorter.
"""

import dataclasses
import json
import os
import subprocess
import sys
import threading

import kdist  # noqa: I001  (before keras: sets KERAS_BACKEND when run as a script)
import keras

from tests.keras import _models as m

KDIST_ROOT = os.path.dirname(os.path.abspath(kdist.__file__)) + os.sep
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE = "keras/replica/engine.py"

# Measured after issue 26's one optimizer step, identical on Keras 3.15.1 and 3.16
# (the step never reaches version-specific kdist code). Before it (3e40a9a): 19
# modules (no adapters), 240 calls, 83 cross-module calls, 83 returns to a module
# left, 38 of them not to the engine. Issue 37 item 5 adds keras/_compat/scopes.py:
# the replicas' StatelessScope starts from Keras' conversion of the canonical
# Parameters, made once per layout instead of at every step.
EXPECTED_MODULES = frozenset(
    {
        "collectives/local.py",
        "distribute/batching.py",
        "distribute/context.py",
        "distribute/devices.py",
        "distribute/extended.py",
        "distribute/nest.py",
        "distribute/strategy.py",
        "keras/_compat/__init__.py",
        "keras/_compat/losses.py",
        "keras/_compat/scopes.py",
        "keras/adapters.py",
        "keras/replica/adapter.py",
        "keras/replica/engine.py",
        "keras/replica/float8_sync.py",
        "keras/replica/gradient_accumulation.py",
        "keras/replica/gradient_combine.py",
        "keras/replica/gradient_merge.py",
        "keras/replica/gradient_overlap.py",
        "keras/replica/loss_denominators.py",
        "keras/replica/state_sync.py",
        "keras/replica/step_logs.py",
        "keras/replica/torch_buffers.py",
    }
)
# Upper limits (measured after issue 37 item 5: 214 calls, 80 cross-module calls,
# 80 returns to a module left, 33 of them not to the engine, on Keras 3.15.1 and
# 3.16; before it 240, 81, 81 and 36). That change builds the state plan and the
# scope's canonical entries once per layout and reconciles the metric state in
# one pass. The variable-write hook is installed only once a parameter-server
# strategy holds a variable, so it is not in this step.
MAX_CALLS = 214
MAX_CROSS_MODULE_CALLS = 80
MAX_RETURNS_TO_A_MODULE_LEFT = 80
MAX_RETURNS_NOT_TO_THE_ENGINE = 33

TRACED_STEP = 2  # zero-based: the third batch of the first epoch


@dataclasses.dataclass(frozen=True)
class Event:
    """One profiler event of a kdist frame."""

    thread: str
    kind: str  # "call" or "return"
    frame: int  # id() of the frame, to pair a return with its call
    module: str  # path relative to kdist/
    function: str


@dataclasses.dataclass(frozen=True)
class TraceSummary:
    """What one traced step did; the fields are defined in the module docstring."""

    modules: tuple
    threads: tuple
    calls: int
    cross_module_calls: int
    returns_to_a_module_left: int
    returns_not_to_the_engine: int
    returns_by_destination: dict


class KdistProfiler:
    """Records the `call`/`return` events of frames whose code is under `kdist/`."""

    def __init__(self):
        self.events = []

    def __call__(self, frame, kind, arg):
        if kind not in ("call", "return"):
            return
        filename = frame.f_code.co_filename
        if filename.startswith(KDIST_ROOT):
            self.events.append(
                Event(
                    threading.current_thread().name,
                    kind,
                    id(frame),
                    filename[len(KDIST_ROOT) :].replace(os.sep, "/"),
                    frame.f_code.co_name,
                )
            )

    def start(self):
        threading.setprofile(self)
        sys.setprofile(self)

    def stop(self):
        sys.setprofile(None)
        threading.setprofile(None)


class TraceOneStep(keras.callbacks.Callback):
    """Profiles kdist frames from `on_train_batch_begin` to `on_train_batch_end` of one batch."""

    def __init__(self, profiler, step=TRACED_STEP):
        super().__init__()
        self.profiler = profiler
        self.step = step
        self.traced = False

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.step and not self.traced:
            self.profiler.start()

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.step and not self.traced:
            self.profiler.stop()
            self.traced = True


def summarize(events):
    """Reduces an event list to a `TraceSummary` (definitions in the module docstring)."""
    stacks = {}  # thread -> [(frame id, module)], kdist frames entered while tracing
    modules, threads = [], []
    calls = cross_calls = cross_returns = not_engine = 0
    by_destination = {}
    for event in events:
        if event.thread not in threads:
            threads.append(event.thread)
        stack = stacks.setdefault(event.thread, [])
        if event.kind == "call":
            if event.module not in modules:
                modules.append(event.module)
            calls += 1
            if stack and stack[-1][1] != event.module:
                cross_calls += 1
            stack.append((event.frame, event.module))
        elif stack and stack[-1][0] == event.frame:
            stack.pop()
            if stack and stack[-1][1] != event.module:
                destination = stack[-1][1]
                cross_returns += 1
                not_engine += destination != ENGINE
                by_destination[destination] = by_destination.get(destination, 0) + 1
    return TraceSummary(
        modules=tuple(modules),
        threads=tuple(threads),
        calls=calls,
        cross_module_calls=cross_calls,
        returns_to_a_module_left=cross_returns,
        returns_not_to_the_engine=not_engine,
        returns_by_destination=dict(sorted(by_destination.items())),
    )


def problems(summary, expected_modules=EXPECTED_MODULES):
    """Every way `summary` differs from the pinned trace, as sentences; empty when it matches."""
    found = []
    visited = set(summary.modules)
    for module in sorted(visited - expected_modules):
        found.append(f"the step now visits {module}, which it did not")
    for module in sorted(expected_modules - visited):
        found.append(f"the step no longer visits {module}: update EXPECTED_MODULES")
    limits = (
        ("calls", summary.calls, MAX_CALLS),
        ("cross_module_calls", summary.cross_module_calls, MAX_CROSS_MODULE_CALLS),
        ("returns_to_a_module_left", summary.returns_to_a_module_left, MAX_RETURNS_TO_A_MODULE_LEFT),
        ("returns_not_to_the_engine", summary.returns_not_to_the_engine, MAX_RETURNS_NOT_TO_THE_ENGINE),
    )
    for name, value, limit in limits:
        if value > limit:
            found.append(f"{name} = {value}, more than the pinned {limit}")
    return found


def trace_one_fit_step():
    """Fits a small classifier on 2 logical CPU replicas and returns the events of its third step."""
    strategy = m.mirrored(2)
    with strategy.scope():
        model = m.compile_classifier(
            keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])
        )
    x, y = m.classification_data(num_samples=4 * m.GLOBAL_BATCH)
    profiler = KdistProfiler()
    tracer = TraceOneStep(profiler)
    try:
        model.fit(x, y, batch_size=m.GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[tracer])
    finally:
        profiler.stop()
    assert tracer.traced, "the traced batch never ran"
    return profiler.events


def format_summary(summary):
    lines = [f"modules ({len(summary.modules)}, in order of first entry):"]
    lines += [f"  {module}" for module in summary.modules]
    lines += [
        f"threads: {', '.join(summary.threads)}",
        f"calls: {summary.calls}",
        f"cross-module calls: {summary.cross_module_calls}",
        f"returns to a module left: {summary.returns_to_a_module_left}",
        f"  of them not to the engine: {summary.returns_not_to_the_engine}",
        "returns by destination:",
    ]
    lines += [f"  {module}: {count}" for module, count in summary.returns_by_destination.items()]
    return "\n".join(lines)


# ----- tests -------------------------------------------------------------------


def _trace_in_a_new_process():
    """The summary of `trace_one_fit_step` in a process of its own.

    What a process did before changes what its steps visit: once a
    parameter-server strategy has held a variable, every variable write passes
    kdist's write hook (`kdist.keras.parameter_server.variable_writes`). The
    pinned trace is a MirroredStrategy program's, so it is taken in a new process.
    """
    completed = subprocess.run([sys.executable, "-m", "tests.keras.test_step_trace", "--json"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=240,
                               env={**os.environ, "KERAS_BACKEND": "torch", "PYTHONPATH": str(REPO_ROOT)})
    assert completed.returncode == 0, completed.stdout + completed.stderr
    fields = json.loads(completed.stdout.splitlines()[-1])
    return TraceSummary(**{key: tuple(value) if isinstance(value, list) else value for key, value in fields.items()})


def test_one_fit_step_visits_the_pinned_modules_and_no_more_detours():
    summary = _trace_in_a_new_process()
    assert summary.calls > 0 and summary.returns_to_a_module_left > 0, "nothing was traced"
    assert summary.modules[0] == ENGINE, summary.modules
    assert problems(summary) == [], format_summary(summary)


def test_summary_counts_returns_to_a_module_left_as_documented():
    # engine.a -> batching.b -> nest.c (returns to batching) ; batching.b returns to engine ;
    # engine.a -> engine.d (same module: not counted) ; a frame entered before tracing
    # returns (unpaired: not counted).
    events = [
        Event("T", "return", 99, "keras/hooks.py", "outer"),
        Event("T", "call", 1, ENGINE, "a"),
        Event("T", "call", 2, "distribute/batching.py", "b"),
        Event("T", "call", 3, "distribute/nest.py", "c"),
        Event("T", "return", 3, "distribute/nest.py", "c"),
        Event("T", "return", 2, "distribute/batching.py", "b"),
        Event("T", "call", 4, ENGINE, "d"),
        Event("T", "return", 4, ENGINE, "d"),
        Event("T", "return", 1, ENGINE, "a"),
    ]
    summary = summarize(events)
    assert summary.modules == (ENGINE, "distribute/batching.py", "distribute/nest.py")
    assert summary.calls == 4
    assert summary.cross_module_calls == 2
    assert summary.returns_to_a_module_left == 2
    assert summary.returns_not_to_the_engine == 1
    assert summary.returns_by_destination == {"distribute/batching.py": 1, ENGINE: 1}


def test_negative_control_an_extra_module_and_more_returns_are_reported():
    pinned = sorted(EXPECTED_MODULES)
    events = []
    frame = 0
    for module in pinned:  # the engine calls every pinned module once
        frame += 1
        events += [Event("T", "call", frame, module, "f")]
    # A new detour: the last module calls a module the step never visited, many times.
    for _ in range(MAX_RETURNS_TO_A_MODULE_LEFT + 1):
        frame += 1
        events += [
            Event("T", "call", frame, "keras/replica/detour.py", "g"),
            Event("T", "return", frame, "keras/replica/detour.py", "g"),
        ]
    found = problems(summarize(events))
    assert "the step now visits keras/replica/detour.py, which it did not" in found
    assert any(p.startswith("returns_to_a_module_left = ") for p in found)
    assert any(p.startswith("returns_not_to_the_engine = ") for p in found)
    assert not any("no longer visits" in p for p in found)


def test_negative_control_a_module_left_out_is_reported():
    events = [Event("T", "call", 1, ENGINE, "a"), Event("T", "return", 1, ENGINE, "a")]
    found = problems(summarize(events))
    assert "the step no longer visits distribute/batching.py: update EXPECTED_MODULES" in found


if __name__ == "__main__":  # python -m tests.keras.test_step_trace [--json]
    if "--json" in sys.argv:
        print(json.dumps(dataclasses.asdict(summarize(trace_one_fit_step()))))
        sys.exit(0)
    print(f"keras {keras.__version__}")
    traced = summarize(trace_one_fit_step())
    print(format_summary(traced))
    print("differences from the pinned trace:", problems(traced) or "none")
