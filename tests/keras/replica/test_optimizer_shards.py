"""ZeRO-1's arithmetic (`kdist.keras.replica.optimizer_shards`): N slices applied apart equal one whole apply.

In one process, N `OptimizerShard`s (one per simulated rank) each update their
slices of copies of the same variables from the same whole gradients; the slices
put together must equal, bit for bit, Keras' own optimizer applied to the whole
variables, step after step, slots included. Negative controls: a slice applied
twice, and a slice missed.
"""

import keras
import numpy as np
import pytest

from kdist.errors import UnsupportedError
from kdist.keras.replica import optimizer_shards
from kdist.keras.replica.optimizer_shards import OptimizerShard, Piece, plan_shards

pytestmark = pytest.mark.timeout(300)

SHAPES = [(37,), (64,), (130, 7), (3, 3, 4, 8), (1,), (200,), (300, 301)]  # the last: split across threads
STEPS = 4

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.05),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "adam_amsgrad": lambda: keras.optimizers.Adam(1e-2, amsgrad=True),
    "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.05),
    "adamw_excluding": lambda: _excluding(keras.optimizers.AdamW(1e-2, weight_decay=0.05)),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(1e-2, momentum=0.5, centered=True),
    "lion": lambda: keras.optimizers.Lion(1e-3),
    "nadam": lambda: keras.optimizers.Nadam(1e-2),
    "adamax": lambda: keras.optimizers.Adamax(1e-2),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "global_clipnorm": lambda: keras.optimizers.Adam(1e-2, global_clipnorm=0.5),
    "clipnorm": lambda: keras.optimizers.SGD(0.05, momentum=0.9, clipnorm=0.1),
    "clipvalue": lambda: keras.optimizers.Adam(1e-2, clipvalue=0.01),
    "schedule": lambda: keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(1e-2, 2, 0.5)),
    "accumulation": lambda: keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2),
    "ema": lambda: keras.optimizers.AdamW(1e-2, use_ema=True, ema_overwrite_frequency=3),
    "loss_scale_factor": lambda: keras.optimizers.SGD(0.05, momentum=0.9, loss_scale_factor=128.0),
}


def _excluding(optimizer):
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


def _variables(seed=0):
    rng = np.random.default_rng(seed)
    return [keras.Variable(rng.normal(size=shape).astype("float32"), name="bias" if i == 1 else f"w{i}")
            for i, shape in enumerate(SHAPES)]


def _gradients(step):
    rng = np.random.default_rng(100 + step)
    return [rng.normal(size=shape).astype("float32") for shape in SHAPES]


def _values(variables):
    return [np.asarray(keras.ops.convert_to_numpy(v)) for v in variables]


def _whole(make):
    variables, optimizer = _variables(), make()
    for step in range(STEPS):
        optimizer.apply([keras.ops.convert_to_tensor(g) for g in _gradients(step)], variables)
    return _values(variables), optimizer


def _put_back(variables, pieces, values):
    """What the all-gather does for one rank's pieces: writes `values` (flat, one per piece) into `variables`."""
    for piece, value in zip(pieces, values):
        variable = variables[piece.index]
        flat = keras.ops.reshape(variable.value, (-1,))
        flat = keras.ops.slice_update(flat, (piece.start,), keras.ops.cast(value, flat.dtype))
        variable.assign(keras.ops.reshape(flat, variable.shape))


def _sharded(make, num_ranks, fault=None):
    """Rank 0's variables after STEPS steps of `num_ranks` simulated ranks, the shards and their optimizers.

    Each rank has its own copy of the variables and of the user's optimizer, as
    processes do; after each step every rank's slices are put into every copy
    (what the all-gather does).
    """
    copies = [_variables() for _ in range(num_ranks)]
    optimizers = [make() for _ in range(num_ranks)]
    plan = plan_shards([int(np.prod(shape)) for shape in SHAPES], num_ranks)
    shards = [OptimizerShard(optimizers[rank], copies[rank], plan[rank]) for rank in range(num_ranks)]
    for step in range(STEPS):
        gradients = [keras.ops.convert_to_tensor(g) for g in _gradients(step)]
        updates = []
        for rank, shard in enumerate(shards):
            values = shard.apply(gradients)
            if fault == "twice" and rank == 0:
                values = shard.apply(gradients)
            updates.append([keras.ops.copy(value) for value in values])
        for rank in range(num_ranks):
            if fault == "missed" and rank == num_ranks - 1 and step == STEPS - 1:
                continue
            for variables in copies:
                _put_back(variables, plan[rank], updates[rank])
        for variables in copies:
            optimizer_shards.apply_constraints(variables)
    # (A missed slice is still in its own rank's copy: the slices are views of it.)
    for variables in copies[1:] if fault != "missed" else ():
        assert all(np.array_equal(a, b) for a, b in zip(_values(variables), _values(copies[0])))
    return _values(copies[0]), shards, optimizers[0]


@pytest.mark.parametrize("num_ranks", [2, 3])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_slices_applied_apart_equal_the_whole_apply_bit_for_bit(name, num_ranks):
    expected, whole_optimizer = _whole(OPTIMIZERS[name])
    got, shards, optimizer = _sharded(OPTIMIZERS[name], num_ranks)
    for index, (a, b) in enumerate(zip(got, expected)):
        np.testing.assert_array_equal(a, b, err_msg=f"variable {index}")
    assert int(optimizer.iterations) == int(whole_optimizer.iterations)
    # Each rank holds the slots of its slices only: together, the whole optimizer's.
    slot_elements = sum(int(np.prod(v.shape)) for shard in shards for v in shard.slot_variables if v.shape)
    whole_slots = sum(int(np.prod(v.shape)) for v in whole_optimizer.variables if v.shape)
    assert slot_elements == whole_slots


@pytest.mark.parametrize("fault", ["twice", "missed"])
def test_control_a_slice_applied_twice_or_missed_differs(fault):
    expected, _ = _whole(OPTIMIZERS["adam"])
    got, _, _ = _sharded(OPTIMIZERS["adam"], 2, fault=fault)
    assert any(not np.array_equal(a, b) for a, b in zip(got, expected))


def test_the_plan_owns_every_element_once_aligned_and_balanced():
    sizes = [37, 64, 910, 288, 1, 200, 100_003]
    for num_ranks in (1, 2, 3, 4, 8):
        plan = plan_shards(sizes, num_ranks)
        owned = [np.zeros(size, int) for size in sizes]
        for pieces in plan:
            for piece in pieces:
                assert piece.start % optimizer_shards.ALIGN == 0
                owned[piece.index][piece.start:piece.stop] += 1
        assert all((counts == 1).all() for counts in owned)
        loads = [sum(p.stop - p.start for p in pieces) for pieces in plan]
        assert max(loads) - min(loads) <= optimizer_shards.ALIGN * (len(sizes) + 1)
    assert plan_shards([200, 10], 2, align=64) == [
        [Piece(0, 0, 192)], [Piece(0, 192, 200), Piece(1, 0, 10)]]


@pytest.mark.parametrize("make, match", [
    (lambda: keras.optimizers.Adafactor(), "Adafactor"),
    (lambda: keras.optimizers.Ftrl(), "Ftrl"),
    (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()), "LossScaleOptimizer"),
    (lambda: keras.optimizers.Adam(global_clipnorm=1.0, gradient_accumulation_steps=2),
     "gradient_accumulation_steps=2 with global_clipnorm=1.0"),
])
def test_optimizers_that_cannot_be_split_by_elements_are_refused(make, match):
    with pytest.raises(UnsupportedError, match=match):
        OptimizerShard(make(), _variables(), plan_shards([int(np.prod(s)) for s in SHAPES], 2)[0])
