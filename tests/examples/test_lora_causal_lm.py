"""`examples/lora_causal_lm.py`: keras.io's LoRA fine-tuning recipe under MirroredStrategy and `kdist launch`.

A keras-hub GPT-2 causal LM with `enable_lora(rank=4)`, AdamW with weight-decay
exclusions, padded sequences weighted by their padding mask, gradient
accumulation (2 micro-steps per update), a last batch that splits 3 + 2.

- float32: 2 replicas in one process and 2 processes under the real launcher
  equal plain Keras on the same global batches to 1e-5 (weights); a control with
  an unweighted replica mean is 8e-3 off.
- mixed_bfloat16: each replica rounds its shard's activations and sums to 8
  significant bits where one device rounds the whole batch's, and AdamW divides
  each gradient by its running RMS: where a gradient is rounding noise around 0
  (LoRA's zero-initialised B makes many), an update element can take either sign
  at full step size. So weights are bounded only by the optimizer's step
  (2 x learning rate x updates, measured 1.3e-2 against 2 x 5e-3 x 10 = 0.1), and
  the loss history to 1e-4 relative (measured 4e-6); the float32 runs are where
  the distribution's maths is checked exactly.
"""

import sys

import numpy as np
import pytest

from tests import harness
from tests.keras import _models as m

pytest.importorskip("keras_hub", reason="keras-hub is a test extra: pip install -e '.[test]'")
sys.path.insert(0, str(harness.REPO_ROOT / "examples"))
import lora_causal_lm as example  # noqa: E402

import kdist  # noqa: E402

pytestmark = pytest.mark.timeout(420)
SCRIPT = harness.REPO_ROOT / "examples" / "lora_causal_lm.py"
TOLERANCE = 1e-5


def _args(policy):
    return example.parse_args(["--small", "--policy", policy, "--verbose", "0"])


def _difference(weights, reference):
    return max(float(np.max(np.abs(np.asarray(a, "float64") - np.asarray(b, "float64"))))
               for a, b in zip(weights, reference, strict=True))


@pytest.fixture(scope="module")
def plain():
    """Plain Keras, one device: `{policy: (weights, history)}`."""
    results = {}
    for policy in ("float32", "mixed_bfloat16"):
        model, history = example.train(_args(policy))
        results[policy] = (model.get_weights(), history)
    return results


def test_two_replicas_in_float32_equal_plain_keras_and_a_weighting_bug_does_not(plain):
    model, history = example.train(_args("float32"), kdist.MirroredStrategy(["cpu:0", "cpu:1"]))
    weights, plain_history = plain["float32"]
    assert _difference(model.get_weights(), weights) < TOLERANCE
    np.testing.assert_allclose(history["loss"], plain_history["loss"], rtol=1e-6)
    with m.fault(unweighted_gradient_mean=True):
        broken, _ = example.train(_args("float32"), kdist.MirroredStrategy(["cpu:0", "cpu:1"]))
    assert _difference(broken.get_weights(), weights) > 100 * TOLERANCE


def test_two_replicas_in_mixed_bfloat16_stay_within_the_optimizers_step(plain):
    args = _args("mixed_bfloat16")
    model, history = example.train(args, kdist.MirroredStrategy(["cpu:0", "cpu:1"]))
    weights, plain_history = plain["mixed_bfloat16"]
    updates = args.epochs * -(-args.sequences // args.batch_size) // args.accumulation
    assert _difference(model.get_weights(), weights) <= 2 * args.learning_rate * updates
    np.testing.assert_allclose(history["loss"], plain_history["loss"], rtol=1e-4)
    assert all(w.dtype == np.float32 for w in model.get_weights())  # variables stay float32 under the policy


@pytest.mark.slow
def test_two_processes_under_kdist_launch_equal_plain_keras(plain, tmp_path):
    out = tmp_path / "weights.npz"
    argv = (sys.executable, "-m", "kdist", "launch", "--nproc", "2", "--timeout", "300", str(SCRIPT),
            "--small", "--multi-worker", "--policy", "float32", "--verbose", "0", "--out", str(out))
    result = harness.run([harness.ProcessSpec("launch", argv, {})], timeout=300)
    assert result.returncodes["launch"] == 0, harness.format_outputs(result.processes)
    assert '"replicas": 2' in result.output("launch")
    saved = np.load(out)
    weights = [saved[f"arr_{index}"] for index in range(len(saved.files))]
    assert _difference(weights, plain["float32"][0]) < TOLERANCE
