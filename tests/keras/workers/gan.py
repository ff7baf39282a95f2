"""keras.io's torch GAN (`train_step` with two optimizers) for the merge-mode tests.

Imported, it gives the model and the training run the tests compare; run as a
script (under `kdist launch` or the test harness) it trains under
`MultiWorkerMirroredStrategy` and writes `<out>/rank<r>.npz`.
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import kdist  # noqa: E402
import keras  # noqa: E402
from tests import seeding  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

LATENT = 4


class GAN(keras.Model):
    """keras.io's "DCGAN overriding Model.train_step" for torch, with the latent
    vectors read from the batch instead of drawn in the step (random draws differ
    per replica, as Dropout masks do)."""

    def __init__(self, discriminator, generator):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.built = True

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, data):
        real_images, random_latent_vectors, more_latent_vectors = data[0]
        batch_size = real_images.shape[0]
        generated_images = self.generator(random_latent_vectors)
        combined_images = torch.concat([generated_images, real_images], axis=0)
        labels = torch.concat([torch.ones((batch_size, 1)), torch.zeros((batch_size, 1))], axis=0)

        # Train the discriminator
        self.zero_grad()
        predictions = self.discriminator(combined_images)
        d_loss = self.loss_fn(labels, predictions)
        d_loss.backward()
        grads = [v.value.grad for v in self.discriminator.trainable_weights]
        with torch.no_grad():
            self.d_optimizer.apply(grads, self.discriminator.trainable_weights)

        # Train the generator (through the discriminator just updated)
        misleading_labels = torch.zeros((batch_size, 1))
        self.zero_grad()
        predictions = self.discriminator(self.generator(more_latent_vectors))
        g_loss = self.loss_fn(misleading_labels, predictions)
        g_loss.backward()
        grads = [v.value.grad for v in self.generator.trainable_weights]
        with torch.no_grad():
            self.g_optimizer.apply(grads, self.generator.trainable_weights)

        # Weighted by the batch size, so the replicas' updates add up to one device's.
        self.d_loss_tracker.update_state(d_loss, sample_weight=batch_size)
        self.g_loss_tracker.update_state(g_loss, sample_weight=batch_size)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def build_gan():
    seeding.set_random_seed(5)
    discriminator = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    )
    generator = keras.Sequential(
        [keras.Input((LATENT,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(6)]
    )
    gan = GAN(discriminator, generator)
    gan.compile(
        d_optimizer=keras.optimizers.Adam(3e-3),
        g_optimizer=keras.optimizers.Adam(3e-3),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    return gan


def gan_data():
    rng = np.random.default_rng(1)
    real = (rng.normal(size=(300, 6)) + np.arange(6)).astype("float32")
    return real, rng.normal(size=(300, LATENT)).astype("float32"), rng.normal(size=(300, LATENT)).astype("float32")


def fit_gan(gan):
    history = gan.fit(gan_data(), batch_size=64, epochs=2, shuffle=False, verbose=0)  # 300 = 4 * 64 + 44
    state = {f"weight/{i}": v.numpy() for i, v in enumerate(gan.weights)}
    for name in ("d_optimizer", "g_optimizer"):
        optimizer = getattr(gan, name)
        state.update({f"{name}/{i}": np.asarray(v.numpy()) for i, v in enumerate(optimizer.variables)})
    state.update({f"history/{k}": np.asarray(v) for k, v in history.history.items()})
    return state




def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    strategy = kdist.MultiWorkerMirroredStrategy()
    with strategy.scope():
        gan = build_gan()
    results = fit_gan(gan)
    np.savez(os.path.join(args.out, f"rank{strategy.extended.collectives.rank}.npz"), **results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
