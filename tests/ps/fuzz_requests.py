"""Malformed requests for the variable service (used by `test_fuzz.py`).

Random bytes shaped like gRPC messages, and well-formed request messages of the
real types whose contents are wrong. Every well-formed request carries at least
one defect, so none may change a variable (or create one: a create that mixes
valid variables with a bad one creates nothing); `VARIABLES` is the state the
server holds while it is fuzzed. Defects include non-finite gradients, which
the server refuses by default.
"""

import json
import os

import numpy as np

from kdist.ps.wire._generated import variable_service_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["VariableService"]
# Payload bytes per stream message; the server under test uses the same chunk size.
CHUNK_BYTES = 4096
VARIABLES = {
    "weights": (np.arange(12, dtype="float32").reshape(4, 3), True),
    "embedding": (np.linspace(-1, 1, 20, dtype="float32").reshape(10, 2), True),
    "counter": (np.array(7, dtype="int64"), False),
}
NAMES = ("weights", "embedding", "counter", "missing", "", "w" * 5000, "wéights", "a/b:0")
BAD_DTYPES = ("", "complex64", "object", "float32 ", "<f4", "U8", "bfloat17", "\x00", "int128")
SGD = {"module": "keras.optimizers", "class_name": "SGD", "config": {"learning_rate": 0.1},
       "registered_name": None}


# -- Random bytes -------------------------------------------------------------------


def random_message_bytes(rng):
    """Random bytes, a third of them starting like the codec's framing."""
    length = rng.choice([0, 1, 2, 5, 17, 64, 300, 2000])
    data = bytearray(rng.getrandbits(8) for _ in range(length))
    style = rng.randrange(6)
    if style == 0 and data:
        data[0] = 0x12  # a payload-only frame...
    elif style == 1:
        data = bytearray([0x12]) + bytearray([0xFF] * rng.randrange(1, 12)) + data  # ...overlong
    elif style == 2 and data:
        data[0] = 0x0A  # a header...
    elif style == 3:
        data = bytearray([0x0A, 0x80, 0x80, 0x80, 0x80, 0x08]) + data  # ...claiming 2 GiB
    return bytes(data)


def is_checkpoint_path(method, data):
    """True when `data` parses as a Save/Restore request naming a directory."""
    if method.name not in ("Save", "Restore"):
        return False
    try:
        return bool(pb.CheckpointRequest.FromString(data).directory)
    except Exception:  # noqa: BLE001 — unparsable is what we want here
        return False


def random_raw_calls(rng, count):
    methods = list(SERVICE.methods)
    calls = []
    for index in range(count):
        method = methods[index % len(methods)]
        num_messages = rng.randrange(0, 4) if method.client_streaming else 1
        messages = []
        while len(messages) < max(num_messages, 0 if method.client_streaming else 1):
            data = random_message_bytes(rng)
            # Keep random bytes from saving or restoring somewhere real: a path
            # is only ever one the test chose (well-formed requests below).
            if not is_checkpoint_path(method, data):
                messages.append(data)
        calls.append((method, messages))
    return calls


# -- Well-formed messages with wrong contents -----------------------------------------


def meta(dtype, shape):
    return pb.TensorMeta(dtype=dtype, shape=list(shape))


def bad_tensor(rng, good_dtype="float32", good_shape=(4, 3), new_variable=False):
    """Returns `(TensorMeta, payload bytes)` with one defect.

    The last two defects (another shape or dtype, consistent with the payload)
    are defects only against an existing variable's layout.
    """
    nbytes = int(np.prod(good_shape)) * np.dtype(good_dtype).itemsize
    defect = rng.randrange(5 if new_variable else 7)
    if defect == 0:
        return meta(rng.choice(BAD_DTYPES), good_shape), b"\0" * nbytes
    if defect == 1:  # the payload disagrees with the shape
        wrong_size = rng.choice([0, 1, nbytes - 1, nbytes + 1, 2 * nbytes])
        return meta(good_dtype, good_shape), b"\1" * wrong_size
    if defect == 2:
        return meta(good_dtype, [-1, 3]), b""
    if defect == 3:  # huge: the server must not allocate it before the bytes arrive
        huge = rng.choice([[2**62], [2**31, 2**31], [2**28], [10**6, 10**6]])
        return meta(good_dtype, huge), b"\0" * 64
    if defect == 4:
        return meta(good_dtype, [1] * 40), b"\0" * 4
    if defect == 5:  # the right size, the wrong shape
        return meta(good_dtype, [int(np.prod(good_shape))]), b"\0" * nbytes
    return meta("float64", good_shape), b"\0" * nbytes * 2  # the wrong dtype


def framed(header_message, header, payload, rng):
    """Splits a request into stream messages; sometimes with a framing defect too."""
    messages = [header_message(header=header)]
    for start in range(0, len(payload), CHUNK_BYTES):
        messages.append(header_message(payload=payload[start:start + CHUNK_BYTES]))
    style = rng.randrange(6)
    if style == 0:
        messages = messages[1:] or [header_message(payload=b"x")]  # no header
    elif style == 1:
        messages.append(header_message(header=header))  # a second header
    elif style == 2:
        messages = []  # an empty stream
    return [message.SerializeToString() for message in messages]


def good_gradient(name):
    value, _ = VARIABLES[name]
    return pb.GradientMeta(name=name, kind=pb.DENSE, values=meta("float32", value.shape),
                           version=0), np.ones_like(value).tobytes()


def bad_gradient(rng):
    """Returns `(GradientMeta, payload)` with one defect."""
    name = rng.choice(["weights", "embedding"])
    shape = VARIABLES[name][0].shape
    defect = rng.randrange(10)
    if defect == 0:
        values, payload = bad_tensor(rng, "float32", shape)
        return pb.GradientMeta(name=name, kind=pb.DENSE, values=values), payload
    if defect == 1:
        return pb.GradientMeta(name=rng.choice(["missing", "", "counter"]), kind=pb.DENSE,
                               values=meta("float32", shape)), b"\0" * 4 * int(np.prod(shape))
    if defect == 2:  # row ids out of range (negative or past the last row)
        ids = np.array([rng.choice([-1, shape[0], 2**62, -(2**63)]), 0], dtype="int64")
        rows = np.ones((2, shape[1]), dtype="float32")
        return pb.GradientMeta(name=name, kind=pb.ROWS, values=meta("float32", rows.shape),
                               num_row_ids=2), ids.tobytes() + rows.tobytes()
    if defect == 3:  # num_row_ids disagrees with the rows
        count = rng.choice([-1, 3, 2**40])
        return pb.GradientMeta(name=name, kind=pb.ROWS, values=meta("float32", (2, shape[1])),
                               num_row_ids=count), b"\0" * 64
    if defect == 4:
        return pb.GradientMeta(name=name, kind=rng.choice([2, 7, -1]),
                               values=meta("float32", shape)), b"\0" * 4 * int(np.prod(shape))
    if defect == 5:
        return pb.GradientMeta(name=name, kind=pb.DENSE, values=meta("float32", shape),
                               version=rng.choice([-1, 1, 2**62])), b"\0" * 4 * int(np.prod(shape))
    if defect == 6:  # a row gradient for a variable without rows
        return pb.GradientMeta(name="counter", kind=pb.ROWS, values=meta("int64", (1,)),
                               num_row_ids=1), b"\0" * 16
    if defect == 7:
        return pb.GradientMeta(name=name, kind=pb.ROWS, values=meta("float32", ()),
                               num_row_ids=0), b"\0" * 4
    # Well-formed but not finite: refused unless the server allows it.
    poisoned = np.ones(shape if defect == 8 else (2, shape[1]), "float32")
    poisoned.flat[rng.randrange(poisoned.size)] = rng.choice([np.nan, np.inf, -np.inf])
    if defect == 8:
        return pb.GradientMeta(name=name, kind=pb.DENSE, values=meta("float32", shape),
                               version=0), poisoned.tobytes()
    ids = np.array([0, shape[0] - 1], dtype="int64")
    return pb.GradientMeta(name=name, kind=pb.ROWS, values=meta("float32", poisoned.shape),
                           num_row_ids=2), ids.tobytes() + poisoned.tobytes()


def bad_assignment(rng):
    name = rng.choice(["weights", "embedding", "counter", "missing"])
    if name == "missing":
        return pb.AssignmentMeta(name=name, value=meta("float32", (2,))), b"\0" * 8
    value, _ = VARIABLES[name]
    tensor, payload = bad_tensor(rng, value.dtype.name, value.shape)
    return pb.AssignmentMeta(name=name, value=tensor), payload


def push_request(rng, assign_only):
    gradients, assignments, payload = [], [], b""
    if not assign_only:
        # A valid gradient next to a bad one: the whole request must fail.
        if rng.random() < 0.5:
            gradient, data = good_gradient(rng.choice(["weights", "embedding"]))
            gradients.append(gradient)
            payload += data
        gradient, data = bad_gradient(rng)
        gradients.append(gradient)
        payload += data
    elif rng.random() < 0.2:  # an assign request that carries a gradient
        gradient, data = good_gradient("weights")
        gradients.append(gradient)
        payload += data
    if assign_only or rng.random() < 0.3:
        assignment, data = bad_assignment(rng)
        assignments.append(assignment)
        payload += data
    if rng.random() < 0.1:  # the same variable twice
        gradient, data = good_gradient("weights")
        gradients.extend([gradient, gradient])
        payload = data + data
    header = pb.PushHeader(gradients=gradients, assignments=assignments)
    return framed(pb.PushRequest, header, payload, rng)


def create_request(rng):
    if rng.random() < 0.3:
        return mixed_create_request(rng)
    items, payload = [], b""
    for _ in range(rng.randrange(1, 4)):
        name = rng.choice(NAMES)
        if name in VARIABLES and rng.random() < 0.5:  # an existing name, another layout
            value = VARIABLES[name][0]
            tensor = meta(value.dtype.name, (value.size + 1,))
            data = b"\0" * (value.size + 1) * value.itemsize
        else:
            tensor, data = bad_tensor(rng, new_variable=True)
        items.append(pb.CreateItem(name=name, value=tensor, trainable=rng.random() < 0.5))
        payload += data
    if rng.random() < 0.2:
        items.append(items[0])  # a name twice
    return framed(pb.CreateRequest, pb.CreateHeader(items=items), payload, rng)


def mixed_create_request(rng):
    """Valid new variables, then one that may not be created: nothing may be created."""
    items, payload = [], b""
    for index in range(rng.randrange(1, 4)):
        value = np.full((2, 3), index, "float32")
        items.append(pb.CreateItem(name=f"fresh_{index}", value=meta("float32", value.shape),
                                   trainable=True))
        payload += value.tobytes()
    dtype = rng.choice(["int64", "int32", "bool", "uint8"])
    bad = np.zeros(3, dtype)  # a trainable variable must be floating point
    items.append(pb.CreateItem(name="fresh_bad", value=meta(dtype, bad.shape), trainable=True))
    payload += bad.tobytes()
    return framed(pb.CreateRequest, pb.CreateHeader(items=items), payload, rng)


def lookup_request(rng):
    name = rng.choice(["weights", "embedding", "counter", "missing", ""])
    defect = rng.randrange(4)
    if defect == 0:
        ids = np.array([0, rng.choice([-1, 10, 2**62])], dtype="int64")
        tensor, data = meta("int64", ids.shape), ids.tobytes()
    elif defect == 1:
        tensor, data = meta(rng.choice(["int32", "float32", "uint8"]), (2,)), b"\0" * 8
    else:
        tensor, data = bad_tensor(rng, "int64", (3,))
    header = pb.LookupHeader(items=[pb.LookupItem(name=name, ids=tensor)])
    return framed(pb.LookupRequest, header, data, rng)


def pull_request(rng):
    names = [rng.choice(NAMES) for _ in range(rng.randrange(0, 4))]
    if not any(name not in VARIABLES for name in names):
        names.append(rng.choice(["missing", ""]))
    known = {rng.choice(NAMES): rng.choice([-1, 0, 2**63 - 1, -(2**63)])}
    return [pb.PullRequest(names=names, known_versions=known).SerializeToString()]


HOSTILE_CONFIGS = (
    "", "{", "null", "[1, 2]", "\"SGD\"", "[" * 50_000, "{\"a\": " * 20_000,
    json.dumps({"class_name": "NoSuchOptimizer", "config": {}}),
    json.dumps({"module": "os", "class_name": "system", "config": {"command": "touch PWNED"}}),
    json.dumps({"module": "builtins", "class_name": "exec", "config": "open('PWNED', 'w')"}),
    json.dumps({**SGD, "config": {"learning_rate": "fast"}}),
    json.dumps({**SGD, "config": {"learning_rate": float("nan")}}),
    json.dumps({**SGD, "config": {"learning_rate": {"class_name": "Lambda", "config": {}}}}),
    json.dumps({**SGD, "class_name": "Adam"}),  # differs from the configured SGD
)


def configure_request(rng):
    config = rng.choice(HOSTILE_CONFIGS)
    names = rng.choice([["weights"], ["embedding", "weights"], ["missing"], ["counter"], [""]])
    if rng.random() < 0.2:  # a valid config, but for a name that fails
        config, names = json.dumps(SGD), rng.choice([["weights", "missing"], ["counter"], [""]])
    return [pb.ConfigureOptimizerRequest(config_json=config, names=names).SerializeToString()]


def optimizer_state_request(rng):
    names = rng.choice([["missing"], ["counter"], [""], ["weights", "missing"]])
    return [pb.OptimizerStateRequest(names=names).SerializeToString()]


def load_optimizer_state_request(rng):
    """Optimizer state no variable accepts: nothing may change (all or nothing)."""
    states, payload = [], b""
    if rng.random() < 0.5:  # a state that would be accepted alone, next to a bad one
        states.append(pb.VariableOptimizerState(name="weights", iterations=7))
    name = rng.choice(["weights", "embedding", "counter", "missing", ""])
    value = VARIABLES.get(name, (np.zeros((4, 3), "float32"),))[0]
    tensor, data = bad_tensor(rng, value.dtype.name, value.shape)
    slots = rng.choice([[], [pb.SlotMeta(name="momentum", value=tensor)],
                        [pb.SlotMeta(name="", value=tensor)]])
    # The fuzzed optimizers are slot-free SGD: a named slot, or no slot and
    # negative iterations, is a defect for every variable.
    iterations = -1 if not slots and name in ("weights", "embedding") else 3
    states.append(pb.VariableOptimizerState(name=name, iterations=iterations, slots=slots))
    payload += data if slots else b""
    return framed(pb.LoadOptimizerStateRequest, pb.OptimizerStateHeader(states=states), payload, rng)


def checkpoint_request(rng, directories):
    return [pb.CheckpointRequest(directory=rng.choice(directories)).SerializeToString()]


def empty_request(message_class, rng):
    # Unknown fields in an otherwise empty request: harmless, answered normally.
    return [message_class().SerializeToString() + b"\x08\x01" * rng.randrange(3)]


def proto_calls(rng, count, save_directories, restore_directories):
    methods = {method.name: method for method in SERVICE.methods}
    builders = {
        "Create": lambda: create_request(rng),
        "Pull": lambda: pull_request(rng),
        "Push": lambda: push_request(rng, assign_only=False),
        "Assign": lambda: push_request(rng, assign_only=True),
        "Lookup": lambda: lookup_request(rng),
        "ConfigureOptimizer": lambda: configure_request(rng),
        "OptimizerState": lambda: optimizer_state_request(rng),
        "LoadOptimizerState": lambda: load_optimizer_state_request(rng),
        "Save": lambda: checkpoint_request(rng, save_directories),
        "Restore": lambda: checkpoint_request(rng, restore_directories),
        "Stats": lambda: empty_request(pb.StatsRequest, rng),
        "Health": lambda: empty_request(pb.HealthRequest, rng),
    }
    assert sorted(builders) == sorted(methods), "a method of the service is not fuzzed"
    # Most calls go to the methods that change state.
    weighted = ["Create", "Push", "Push", "Push", "Assign", "Assign", "Lookup", "Pull",
                "ConfigureOptimizer", "OptimizerState", "LoadOptimizerState", "Save", "Restore", "Restore", "Stats",
                "Health"]
    calls = []
    for index in range(count):
        name = weighted[index % len(weighted)]
        calls.append((methods[name], builders[name]()))
    return calls


def damaged_checkpoints(client, root):
    """Restore directories the server must refuse: missing, empty, damaged."""
    client.save(str(root / "good"))
    manifest = json.loads((root / "good" / "manifest.json").read_text())
    directories = [str(root / "missing"), str(root / "empty"), str(root / "file"), "\0bad"]
    (root / "empty").mkdir()
    (root / "file").write_text("not a directory")

    def variant(name, change):
        directory = root / name
        directory.mkdir()
        for path in (root / "good").iterdir():
            (directory / path.name).write_bytes(path.read_bytes())
        change(directory, json.loads(json.dumps(manifest)))
        directories.append(str(directory))

    def write_manifest(directory, data):
        (directory / "manifest.json").write_text(json.dumps(data))

    def truncate_value(directory, data):
        path = directory / data["variables"][0]["file"]
        path.write_bytes(path.read_bytes()[:-5])

    def reshape(directory, data):
        data["variables"][0]["shape"] = [3, 4]
        write_manifest(directory, data)

    def escape(directory, data):
        data["variables"][0]["file"] = "../../../../../../etc/passwd"
        write_manifest(directory, data)

    def other_layout(directory, data):
        np.save(directory / data["variables"][0]["file"], np.zeros((5, 5), "float64"))

    def garbage_manifest(directory, data):
        (directory / "manifest.json").write_bytes(os.urandom(64))

    def wrong_format(directory, data):
        write_manifest(directory, {**data, "format": "other/9"})

    def no_variables(directory, data):
        write_manifest(directory, {"format": data["format"]})

    def pickled(directory, data):
        path = directory / data["variables"][0]["file"]
        np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)

    for name, change in [("truncated", truncate_value), ("reshaped", reshape),
                         ("escape", escape), ("other_layout", other_layout),
                         ("garbage_manifest", garbage_manifest), ("wrong_format", wrong_format),
                         ("no_variables", no_variables), ("pickled", pickled)]:
        variant(name, change)
    return directories
