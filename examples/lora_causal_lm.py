"""Fine-tune a keras-hub causal LM with LoRA, as keras.io teaches it, on every replica or process.

One program, three ways to run it:

    python examples/lora_causal_lm.py --small                       # MirroredStrategy: every GPU, or 2 CPU replicas
    kdist launch --nproc 2 examples/lora_causal_lm.py --small --multi-worker
    python examples/lora_causal_lm.py --small --plain               # plain Keras, one device: the reference

What it does is keras.io's "Parameter-efficient fine-tuning of GPT-2 with LoRA"
recipe: a GPT-2 causal LM (built from its config with random weights here, so
nothing is downloaded; `keras_hub.models.GPT2CausalLM.from_preset("gpt2_base_en")`
in real use), `backbone.enable_lora(rank=4)`, the `mixed_bfloat16` policy, AdamW
with weight decay off for biases and LayerNorm scales, padded sequences whose
padding mask is the labels' sample weight, and gradient accumulation. The model is
built and compiled inside `strategy.scope()`; `batch_size` is the GLOBAL batch.

The result equals plain Keras on the same global batches: to float32 rounding
under `--policy float32`, and under `mixed_bfloat16` to bfloat16's resolution
(each replica rounds its own shard's activations and sums to 8 significant bits,
one device rounds the whole batch's; AdamW then divides by the gradients' RMS, so
an update can move by a few percent of the learning rate;
`tests/examples/test_lora_causal_lm.py` states the bound and checks it). Prints
one JSON line; `--out` also saves the weights for that comparison.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import kdist  # noqa: E402  (before keras: kdist checks the backend)
import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

from mirrored_digits import replica_devices  # noqa: E402  (same directory: every GPU, else 2 CPU replicas)

VOCABULARY = 64
SEED = 5


def make_sequences(num_sequences, length, seed=0):
    """Synthetic token ids (a repeating pattern plus noise) and a padding mask: every third sequence is short."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(1, VOCABULARY, size=(num_sequences, 1))
    tokens = (starts + np.arange(length)[None, :] * 3) % (VOCABULARY - 1) + 1
    noise = rng.random(tokens.shape) < 0.1
    tokens = np.where(noise, rng.integers(1, VOCABULARY, size=tokens.shape), tokens).astype("int32")
    padding_mask = np.ones_like(tokens, dtype=bool)
    padding_mask[::3, length * 2 // 3:] = False
    tokens[~padding_mask] = 0
    # Causal LM: predict token t+1 from tokens up to t; padded targets weigh nothing.
    x = {"token_ids": tokens[:, :-1], "padding_mask": padding_mask[:, :-1]}
    return x, tokens[:, 1:], padding_mask[:, 1:].astype("float32")


def build(args):
    """The causal LM with LoRA on, compiled as keras.io does (call inside the strategy's scope)."""
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY, num_layers=args.layers, num_heads=2, hidden_dim=args.hidden,
        intermediate_dim=2 * args.hidden, max_sequence_length=args.length, dropout=0.0)
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    backbone.enable_lora(rank=4)
    optimizer = keras.optimizers.AdamW(learning_rate=args.learning_rate, weight_decay=0.01,
                                       gradient_accumulation_steps=args.accumulation)
    optimizer.exclude_from_weight_decay(var_names=["bias", "gamma", "beta"])
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=["accuracy"])
    return model


def train(args, strategy=None):
    """Builds in `strategy`'s scope (plain Keras when None), fits; returns `(model, history)`."""
    previous_policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(args.policy)
    keras.utils.set_random_seed(SEED)
    x, y, sample_weight = make_sequences(args.sequences, args.length + 1)
    try:
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            model = build(args)
    finally:
        keras.mixed_precision.set_global_policy(previous_policy)  # the model keeps its own
    history = model.fit(x, y, sample_weight=sample_weight, batch_size=args.batch_size, epochs=args.epochs,
                        shuffle=False, verbose=args.verbose)
    return model, history.history


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--multi-worker", action="store_true", help="MultiWorkerMirroredStrategy (under a launcher)")
    parser.add_argument("--plain", action="store_true", help="plain Keras on one device (the reference)")
    parser.add_argument("--policy", default="mixed_bfloat16", choices=["mixed_bfloat16", "float32"])
    parser.add_argument("--sequences", type=int, default=512)
    parser.add_argument("--length", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32, help="GLOBAL batch size")
    parser.add_argument("--accumulation", type=int, default=2, help="gradient_accumulation_steps")
    parser.add_argument("--learning-rate", type=float, default=5e-3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default=None, help="save the weights (rank 0) to this .npz file")
    parser.add_argument("--small", action="store_true", help="CI size")
    parser.add_argument("--verbose", type=int, default=2)
    args = parser.parse_args(argv)
    if args.small:
        # 37 = 4 * 8 + 5: the last batch splits 3 + 2, so replicas are weighted.
        args.sequences, args.length, args.layers, args.hidden, args.batch_size = 37, 12, 2, 16, 8
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.plain:
        strategy, rank = None, 0
    elif args.multi_worker:
        strategy = kdist.MultiWorkerMirroredStrategy()
        rank = strategy.extended.collectives.rank
    else:
        strategy, rank = kdist.MirroredStrategy(replica_devices()), 0
    model, history = train(args, strategy)
    trainable = sum(int(np.prod(v.shape)) for v in model.trainable_weights)
    if rank == 0:
        if args.out:
            np.savez(args.out, *[np.asarray(w, dtype="float32") for w in model.get_weights()])
        print(json.dumps({"example": "lora_causal_lm", "policy": args.policy, "final_loss": history["loss"][-1],
                          "trainable_parameters": trainable,
                          "replicas": 1 if strategy is None else strategy.num_replicas_in_sync}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
