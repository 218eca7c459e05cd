"""A small character-level transformer trained with accumulation, on 1 device or on N.

The same program runs on one device and on a mesh: only where the arrays lie changes
(``--devices N`` puts the batch over N host devices and the parameters on them, replicated).
Scan mode takes a batch of 32 sequences as K=4 microbatches; stream mode feeds the same rows
one microbatch per call. Both print their losses, which are the same on 1 device and on N
(float32 sums in another order), and a checkpoint saved on N devices mid-window restores on
one (``accumjax.restore_checkpoint``).

    python examples/transformer_lm.py                  # one device
    python examples/transformer_lm.py --devices 8      # 8 host CPU devices (sets XLA_FLAGS)
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile

TEXT = (
    "accumulate the gradients of small microbatches and apply them once: the update of one "
    "big batch, with the memory of one microbatch, on one device or on many. "
) * 8
K = 4
SEQ = 16
BATCH = 32
STEPS = 2


def _setup_devices(n: int) -> None:
    """Host CPU devices for the run (before JAX starts)."""
    if n > 1:
        flag = f"--xla_force_host_platform_device_count={n}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


@functools.cache
def build():
    """``(model, loss_fn, params, batches)``: the model and its data (host arrays), made once
    (the steps copy the parameters into states of their own)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    vocab = sorted(set(TEXT))
    ids = np.array([vocab.index(c) for c in TEXT], np.int32)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h):
            mask = nn.make_causal_mask(jnp.ones(h.shape[:2]))
            # No biases: a key bias gets no gradient (softmax ignores it), so Adam would turn
            # rounding noise into updates of its full step size.
            attention = nn.MultiHeadDotProductAttention(2, qkv_features=32, use_bias=False)
            h = h + attention(nn.LayerNorm()(h), mask=mask)
            return h + nn.Dense(32)(nn.gelu(nn.Dense(64)(nn.LayerNorm()(h))))

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            h = nn.Embed(len(vocab), 32)(tokens) + self.param(
                "pos", nn.initializers.normal(0.02), (SEQ, 32)
            )
            h = Block()(h)
            return nn.Dense(len(vocab))(nn.LayerNorm()(h))

    model = LM()

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(ids) - SEQ - 1, size=(STEPS, BATCH))
    batches = [np.stack([ids[s : s + SEQ + 1] for s in row]) for row in starts]
    # Jitted: one compiled program, not one per initializer.
    params = jax.jit(model.init)(jax.random.key(0), batches[0][:1, :-1])["params"]
    return model, loss_fn, params, batches


@functools.cache
def make_step(mode: str):
    """``(step, tx)``: the train step for ``mode`` and its optimizer, made once. Every run in
    the mode calls this step, on 1 device or on N (each placement is compiled once)."""
    import optax

    import accumjax

    _, loss_fn, _, _ = build()
    return accumjax.make_train_step(loss_fn, mode=mode), accumjax.accumulate(optax.adam(3e-3), K)


def train(mode: str, mesh=None, checkpoint_at: int | None = None):
    """Trains in ``mode`` on one device (``mesh`` None) or on ``mesh`` (its data axis
    ``"data"``): ``(state, losses, metrics)``. With ``checkpoint_at``, the state is saved
    after that many calls and training goes on from its restored copy (on one device)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    _, _, params, batches = build()
    if mode == "stream":  # the same rows, one microbatch per call
        batches = [b[i::K] for b in batches for i in range(K)]
    step, tx = make_step(mode)
    # Where the arrays lie, the only change for N devices: the first device (where a restored
    # checkpoint lies too: the same compiled program goes on) or the mesh.
    if mesh is None:
        params = jax.device_put(params, jax.devices()[0])
    else:
        params = jax.device_put(params, NamedSharding(mesh, P()))
        batches = [jax.device_put(b, NamedSharding(mesh, P("data"))) for b in batches]
    state = step.init(params, tx)
    losses = []
    for i, batch in enumerate(batches):
        if i == checkpoint_at:  # from here on, one device
            state = _save_and_restore(state, step, tx)
        if checkpoint_at is not None and i >= checkpoint_at:
            batch = jax.device_get(batch)
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses, metrics


def _save_and_restore(state, step, tx):
    """The state saved with orbax and restored on one device (another number of devices)."""
    import jax
    import orbax.checkpoint as ocp

    import accumjax

    path = os.path.join(tempfile.mkdtemp(), "ckpt")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, state)
    _, _, params, _ = build()
    one = jax.devices()[0]
    target = step.init(jax.device_put(params, one), tx)
    return accumjax.restore_checkpoint(path, target)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args(argv)
    _setup_devices(args.devices)
    import jax

    mesh = None
    if args.devices > 1:
        assert jax.device_count() >= args.devices, jax.devices()
        mesh = jax.make_mesh((args.devices,), ("data",), devices=jax.devices()[: args.devices])
    for mode in ("scan", "stream"):
        _, losses, metrics = train(mode, mesh)
        shapes = {k: tuple(v.shape) for k, v in metrics.items()}
        print(f"{mode} on {args.devices} device(s): losses {[round(x, 4) for x in losses]}")
        print(f"{mode} metrics: {shapes}")
    if mesh is not None:  # saved mid-window on N devices, finished on one
        state, _, _ = train("stream", mesh, checkpoint_at=K + 2)
        print(f"restored on one device after {K + 2} calls: step {int(state.step)}")


if __name__ == "__main__":
    main(sys.argv[1:])
