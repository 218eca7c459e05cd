"""Tests for accumjax.clipping: norms, adaptive gradient clipping and its placement."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.transforms
import pytest
from flax import linen as nn

import accumjax
from accumjax._norms import global_norm
from accumjax.clipping import (
    adaptive_clip,
    adaptive_clip_grad,
    compute_norm,
    squared_norm,
    unitwise_norm,
)

# float32 results compared with float64 numpy references. A float32 sum of n positive terms has
# relative error <= n * u (u = 2**-24 ~ 6e-8) in any summation order; with n <= 64 squares per
# norm here the norm is within 32 u ~ 1.9e-6, and AGC (n <= 18, two norms, a divide and a
# multiply) within ~25 u. 2e-6 covers both worst cases, yet any wrong axis, wrong eps or result
# rounded to 16 bits (unit roundoff 2**-11 ~ 5e-4 or worse) fails by orders of magnitude.
F32_RTOL = 2e-6
# float64 vs float64: the same formulas in a different summation order, error ~ 1e-16.
F64_RTOL = 1e-12


# ---------------------------------------------------------------------------------------------
# Independent float64 references.
# ---------------------------------------------------------------------------------------------


def ref_unit_norms(x: np.ndarray) -> np.ndarray:
    """Per-unit L2 norms by looping over output units, broadcast to x.shape (float64)."""
    x = np.asarray(x, np.float64)
    if np.count_nonzero(np.array(x.shape) != 1) <= 1:  # Scalar / vector: one unit.
        return np.full(x.shape, np.sqrt(np.sum(x * x)))
    out = np.empty_like(x)
    if x.ndim in (4, 5):  # HWIO / DHWIO: each output channel is the slice x[..., o].
        for o in range(x.shape[-1]):
            out[..., o] = np.sqrt(np.sum(x[..., o] ** 2))
        return out
    for idx in np.ndindex(*x.shape[1:]):  # Ranks 2-3: each unit is the column x[:, *idx].
        out[(slice(None), *idx)] = np.sqrt(np.sum(x[(slice(None), *idx)] ** 2))
    return out


def ref_agc(param, grad, clip_factor: float, eps: float) -> np.ndarray:
    """AGC in float64 numpy, straight from the paper's definition."""
    p_norm, g_norm = ref_unit_norms(param), ref_unit_norms(grad)
    max_norm = clip_factor * np.maximum(p_norm, eps)
    grad = np.asarray(grad, np.float64)
    return np.where(g_norm < max_norm, grad, grad * max_norm / np.maximum(g_norm, 1e-300))


def grads_with_ratios(params: dict, ratios: dict, clip_factor: float, eps: float, seed: int):
    """Random grads whose unit norms are ratios[leaf] (one per unit) times the AGC threshold.

    Ratios well away from 1 make the clip/no-clip decision independent of rounding.
    """
    rng = np.random.default_rng(seed)
    grads = {}
    for name, p in params.items():
        p = np.asarray(p)
        g = rng.normal(size=p.shape)
        threshold = clip_factor * np.maximum(ref_unit_norms(p), eps)
        g = g / ref_unit_norms(g) * threshold * np.asarray(ratios[name])
        grads[name] = jnp.asarray(g, jnp.float32)
    return grads


def make_params(seed: int = 0, only: tuple[str, ...] | None = None) -> dict:
    """A pytree with one leaf of each kind; `only` keeps a subset (fewer compilations)."""
    rng = np.random.default_rng(seed)
    params = {
        "dense": jnp.asarray(rng.normal(size=(5, 4)), jnp.float32),  # Flax Dense (in, out).
        "bias": jnp.asarray(rng.normal(size=(4,)), jnp.float32),
        "zero_bias": jnp.zeros((3,), jnp.float32),  # Norm 0: eps decides the threshold.
        "conv": jnp.asarray(rng.normal(size=(3, 3, 2, 6)), jnp.float32),  # HWIO.
        "scale": jnp.asarray(0.7, jnp.float32),  # Rank 0.
        "row": jnp.asarray(rng.normal(size=(1, 7)), jnp.float32),  # Dense with in=1.
    }
    return {k: v for k, v in params.items() if only is None or k in only}


# Per-unit ratio of grad norm to threshold: > 1 is clipped, < 1 is not.
RATIOS = {
    "dense": [3.0, 0.5, 2.0, 0.25],
    "bias": 4.0,
    "zero_bias": 10.0,
    "conv": [0.5, 3.0, 0.3, 5.0, 0.7, 1.5],
    "scale": 0.5,
    "row": 2.0,
    "conv1d": [3.0, 0.5, 2.0, 0.3],
    "conv3d": [0.4, 2.5, 0.8, 6.0],
}


def max_ulp_diff(a, b) -> int:
    a = np.asarray(a, np.float32).ravel().view(np.int32).astype(np.int64)
    b = np.asarray(b, np.float32).ravel().view(np.int32).astype(np.int64)
    return int(np.max(np.abs(a - b), initial=0))


# Most tests jit one function that computes everything they check: each XLA compilation costs
# far more than the arithmetic, and eager mode compiles every op separately.

# ---------------------------------------------------------------------------------------------
# compute_norm
# ---------------------------------------------------------------------------------------------

AXES = [(None, False), (None, True), (0, False), ((0, 1), True), (-1, True)]


def test_compute_norm_matches_numpy():
    x = np.random.default_rng(1).normal(size=(3, 4, 5)).astype(np.float32)
    norms = jax.jit(lambda x: [compute_norm(x, axis=a, keepdims=k) for a, k in AXES])(x)
    for (axis, keepdims), got in zip(AXES, norms, strict=True):
        want = np.sqrt(np.sum(x.astype(np.float64) ** 2, axis=axis, keepdims=keepdims))
        assert got.dtype == jnp.float32
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=F32_RTOL)


def test_compute_norm_low_precision_returns_float32():
    x = np.random.default_rng(2).normal(size=(64, 3)) * 30.0
    xs = {"bf16": jnp.asarray(x, jnp.bfloat16), "f16": jnp.asarray(x, jnp.float16)}
    big = jnp.full((4,), 300.0, jnp.float16)  # Squares (9e4) overflow float16 (max 65504).
    norms, big_norm = jax.jit(
        lambda xs, b: (jax.tree.map(lambda t: compute_norm(t, 0), xs), compute_norm(b))
    )(xs, big)
    np.testing.assert_allclose(big_norm, 600.0, rtol=F32_RTOL)
    for name, x16 in xs.items():
        want = np.sqrt(np.sum(np.asarray(x16, np.float64) ** 2, axis=0))
        # Guard: the true norms are not representable in 16 bits, so a result rounded to 16
        # bits would miss F32_RTOL by orders of magnitude and this test can fail.
        as_16 = np.asarray(jnp.asarray(want, x16.dtype), np.float64)
        assert np.all(np.abs(as_16 - want) / want > 10 * F32_RTOL)
        assert norms[name].dtype == jnp.float32
        np.testing.assert_allclose(norms[name], want, rtol=F32_RTOL, err_msg=name)


def test_compute_norm_float64_and_complex():
    with jax.enable_x64(True):
        x = np.random.default_rng(3).normal(size=(4, 6))
        got = compute_norm(jnp.asarray(x), axis=1)
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(got, np.linalg.norm(x, axis=1), rtol=F64_RTOL)
    rng = np.random.default_rng(4)
    z = (rng.normal(size=(5, 2)) + 1j * rng.normal(size=(5, 2))).astype(np.complex64)
    got = compute_norm(jnp.asarray(z), axis=0)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, np.linalg.norm(z.astype(np.complex128), axis=0), rtol=F32_RTOL)


def test_compute_norm_rejects_integers():
    with pytest.raises(TypeError, match="floating point"):
        compute_norm(jnp.arange(4))


# ---------------------------------------------------------------------------------------------
# squared_norm: the one sum of squares (compute_norm is its square root)
# ---------------------------------------------------------------------------------------------


def test_squared_norm_matches_numpy_in_float32():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(3, 4, 5)) * 30.0
    z = (rng.normal(size=(3, 4, 5)) + 1j * rng.normal(size=(3, 4, 5))).astype(np.complex64)
    xs = {
        "f32": jnp.asarray(x, jnp.float32),
        "bf16": jnp.asarray(x, jnp.bfloat16),
        "f16": jnp.asarray(x, jnp.float16),
        "c64": jnp.asarray(z),
    }
    got = jax.jit(
        lambda xs: {
            name: [squared_norm(t, axis=a, keepdims=k) for a, k in AXES] for name, t in xs.items()
        }
    )(xs)
    for name, leaf in xs.items():
        exact = np.asarray(leaf).astype(np.complex128 if name == "c64" else np.float64)
        for (axis, keepdims), value in zip(AXES, got[name], strict=True):
            want = np.sum(np.abs(exact) ** 2, axis=axis, keepdims=keepdims)
            assert value.dtype == jnp.float32 and value.shape == want.shape
            # A sum of <= 60 positive terms: within 60 u ~ 3.6e-6 (2 u more for complex).
            np.testing.assert_allclose(value, want, rtol=4e-6, err_msg=name)


def test_squared_norm_does_not_round_to_16_bits():
    # optax.tree.norm squares and returns float16/bfloat16 leaves in their own dtype: inf for
    # the first, 9984 for the second.
    big = jnp.full((1,), 300.0, jnp.float16)
    ones = jnp.ones((10001,), jnp.bfloat16)
    assert float(squared_norm(big)) == 90000.0 and float(squared_norm(ones)) == 10001.0


def test_compute_norm_is_the_square_root_of_squared_norm_bitwise():
    rng = np.random.default_rng(6)
    xs = [jnp.asarray(rng.normal(size=(7, 33)), d) for d in (jnp.float16, jnp.float32)]
    xs.append(jnp.asarray(rng.normal(size=(7, 33)) + 1j * rng.normal(size=(7, 33)), jnp.complex64))
    for x in xs:
        for f in (lambda x: x, jax.jit):
            a = f(lambda x: compute_norm(x, axis=0))(x)
            b = f(lambda x: jnp.sqrt(squared_norm(x, axis=0)))(x)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_global_norm_uses_the_same_sum_of_squares_on_real_leaves():
    # The window's global norm sums each leaf's squared_norm: the same bits as summing them here.
    rng = np.random.default_rng(7)
    tree = {
        d.__name__: jnp.asarray(rng.normal(size=(n,)) * 10.0, d)
        for d, n in ((jnp.float16, 3), (jnp.bfloat16, 1000), (jnp.float32, 4097))
    }
    ours = jax.jit(
        lambda t: jnp.sqrt(sum((squared_norm(x) for x in jax.tree.leaves(t)), jnp.zeros(())))
    )(tree)
    assert np.asarray(jax.jit(global_norm)(tree)).tobytes() == np.asarray(ours).tobytes()


def test_squared_norm_rejects_integers():
    with pytest.raises(TypeError, match="floating point"):
        squared_norm(jnp.arange(4))


# ---------------------------------------------------------------------------------------------
# unitwise_norm
# ---------------------------------------------------------------------------------------------

# name: (shape, shape of the norms).
UNIT_SHAPES = {
    "scalar": ((), ()),
    "vector": ((7,), (1,)),
    "row": ((1, 7), (1, 1)),  # A single unit, as in optax's squeeze rule.
    "dense": ((5, 4), (1, 4)),  # Flax Dense (in, out).
    "conv1d": ((3, 5, 4), (1, 5, 4)),  # Rank 3: per axis 0, as optax and the TF library.
    "conv": ((3, 3, 2, 6), (1, 1, 1, 6)),  # HWIO.
    "conv3d": ((2, 3, 2, 2, 4), (1, 1, 1, 1, 4)),  # DHWIO: per output channel, as optax.
}


def test_unitwise_norm_per_output_unit_and_vs_optax():
    rng = np.random.default_rng(6)
    xs = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, (s, _) in UNIT_SHAPES.items()}
    xs["bf16_dense"] = jnp.asarray(rng.normal(size=(6, 3)), jnp.bfloat16)

    @jax.jit
    def norms(xs):
        ours = jax.tree.map(unitwise_norm, xs)
        optax_default = jax.tree.map(optax.transforms.unitwise_norm, xs)
        return ours, optax_default

    ours, optax_default = norms(xs)
    for k, x in xs.items():
        norm_shape = UNIT_SHAPES.get(k, (None, (1, 3)))[1]
        assert ours[k].shape == norm_shape, k
        assert ours[k].dtype == jnp.float32, k  # bfloat16 too.
        full = np.broadcast_to(ours[k], x.shape)
        np.testing.assert_allclose(full, ref_unit_norms(np.asarray(x)), rtol=F32_RTOL, err_msg=k)
        if k != "bf16_dense":
            # Same reduction over the same float32 values: bit-exact.
            np.testing.assert_array_equal(full, optax_default[k], err_msg=k)


def test_unitwise_norm_rejects_rank_6():
    with pytest.raises(ValueError, match="rank 0 to 5"):
        unitwise_norm(jnp.ones((2, 2, 2, 2, 2, 2)))


def test_agc_rank_6_error_names_the_leaf():
    params = {"ok": jnp.ones((2, 3)), "block": {"kernel6d": jnp.ones((2,) * 6)}}
    with pytest.raises(ValueError, match=r"rank 0 to 5; leaf \['block'\]\['kernel6d'\]"):
        adaptive_clip_grad(params, params)
    # Masked out, the leaf passes through unchanged.
    mask = {"ok": True, "block": {"kernel6d": False}}
    out = adaptive_clip_grad(params, params, mask=mask)
    assert out["block"]["kernel6d"] is params["block"]["kernel6d"]


# ---------------------------------------------------------------------------------------------
# adaptive_clip_grad: agreement with optax and with the float64 reference
# ---------------------------------------------------------------------------------------------


def test_agc_matches_optax_exactly_op_by_op():
    # Eager mode compiles every op separately (slow), so this uses a Dense and a conv kernel;
    # every leaf kind is compared under jit below.
    params = make_params(seed=12, only=("dense", "conv"))
    params["conv3d"] = jnp.asarray(np.random.default_rng(15).normal(size=(2, 3, 2, 2, 4)))
    grads = grads_with_ratios(params, RATIOS, 0.01, 1e-3, seed=13)
    tx = optax.adaptive_grad_clip(clipping=0.01, eps=1e-3)
    # Op by op, both run the same float32 operations on the same values (sum of squares, sqrt,
    # max, multiply, divide, multiply, select), so they must agree bit for bit.
    want, _ = tx.update(grads, tx.init(params), params)
    got = adaptive_clip_grad(params, grads)
    for k in params:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.parametrize(("clip_factor", "eps"), [(0.01, 1e-3), (0.1, 1e-2)])
def test_agc_matches_float64_reference_and_optax(clip_factor, eps):
    params = make_params(seed=12)
    params["conv1d"] = jnp.asarray(np.random.default_rng(14).normal(size=(3, 5, 4)), jnp.float32)
    params["conv3d"] = jnp.asarray(np.random.default_rng(15).normal(size=(2, 3, 2, 2, 4)))
    grads = grads_with_ratios(params, RATIOS, clip_factor, eps, seed=13)
    tx = optax.adaptive_grad_clip(clipping=clip_factor, eps=eps)

    @jax.jit
    def run(p, g):
        return adaptive_clip_grad(p, g, clip_factor, eps), tx.update(g, tx.init(p), p)[0]

    out, by_optax = run(params, grads)
    # The data exercise both branches: dense column 1 kept (ratio 0.5), column 0 clipped (3).
    kept = np.asarray(out["dense"]) == np.asarray(grads["dense"])
    assert kept[:, 1].all() and not kept[:, 0].any()
    np.testing.assert_array_equal(out["scale"], grads["scale"])
    for k in params:
        assert out[k].dtype == jnp.float32
        np.testing.assert_allclose(
            out[k], ref_agc(params[k], grads[k], clip_factor, eps), rtol=F32_RTOL, err_msg=k
        )
        # Clipped units end up exactly at the threshold (up to float32 rounding).
        ratio = np.broadcast_to(np.asarray(RATIOS[k]), np.shape(params[k]))
        threshold = clip_factor * np.maximum(ref_unit_norms(params[k]), eps)
        new_norm = ref_unit_norms(out[k])
        np.testing.assert_allclose(
            new_norm, np.where(ratio > 1, threshold, ratio * threshold), rtol=F32_RTOL, err_msg=k
        )
        # Under jit XLA may rewrite one graph's `x / broadcast(y)` as `x * broadcast(1 / y)`
        # (two roundings instead of one) and fuse the reductions differently, so the scale can
        # differ by 1 ulp and the product by at most 2 ulp. A wrong axis, eps or threshold
        # would change whole units by far more.
        assert max_ulp_diff(out[k], by_optax[k]) <= 2, k


def test_agc_small_eps_and_zero_norms():
    params = {"tiny": jnp.zeros((4,)), "w": jnp.zeros((3, 2))}
    grads = {"tiny": jnp.full((4,), 2.5e-7), "w": jnp.zeros((3, 2))}  # "tiny" has norm 5e-7.

    @jax.jit
    def run(p, g):
        return adaptive_clip_grad(p, g, 0.01, 1e-6), adaptive_clip_grad(p, g, 0.01, 0.0)

    small_eps, zero_eps = run(params, grads)
    # clip_factor * eps = 1e-8 < 1e-6: our tiny division floor never engages, so the clipped
    # norm is the threshold itself (optax's 1e-6 floor would give half of it here).
    norm = np.linalg.norm(np.asarray(small_eps["tiny"], np.float64))
    np.testing.assert_allclose(norm, 1e-8, rtol=F32_RTOL)
    # eps = 0 with zero params and grads: threshold 0, 0 / 0 is guarded, result stays 0.
    np.testing.assert_array_equal(zero_eps["w"], 0.0)
    np.testing.assert_array_equal(zero_eps["tiny"], 0.0)  # Threshold 0 clips everything.


def test_agc_low_precision_grads():
    params = make_params(seed=16, only=("dense", "bias", "conv"))
    grads32 = grads_with_ratios(params, RATIOS, 0.01, 1e-3, seed=17)
    grads16 = jax.tree.map(lambda g: g.astype(jnp.bfloat16), grads32)
    p_f16 = {"w": jnp.ones((4, 2), jnp.float16)}
    g_f16 = {"w": jnp.full((4, 2), 300.0, jnp.float16)}  # Unit norm 600: squares overflow f16.

    @jax.jit
    def run(p, g16, p_f16, g_f16):
        upcast = jax.tree.map(lambda g: g.astype(jnp.float32), g16)
        return (
            adaptive_clip_grad(p, g16),
            jax.tree.map(lambda g: g.astype(jnp.bfloat16), adaptive_clip_grad(p, upcast)),
            adaptive_clip_grad(p_f16, g_f16, clip_factor=0.5),
        )

    out, want, out_f16 = run(params, grads16, p_f16, g_f16)
    for k in params:
        assert out[k].dtype == jnp.bfloat16
        # Norms and scales are computed in float32 from the exactly-upcast bfloat16 values,
        # the product is rounded to float32 and then to bfloat16: the same steps as clipping
        # the upcast gradient and casting the result, hence exact.
        np.testing.assert_array_equal(out[k], want[k], err_msg=k)
    assert not np.array_equal(out["dense"], grads16["dense"])  # Clipping is active.
    assert out_f16["w"].dtype == jnp.float16
    # Threshold 0.5 * 2 = 1, each element 300 / 600 = 0.5, exact in float16.
    np.testing.assert_array_equal(out_f16["w"], 0.5)


# ---------------------------------------------------------------------------------------------
# Mask
# ---------------------------------------------------------------------------------------------


def _nested():
    # Same shapes as the eager test above, so the eager op compilations are reused.
    params = make_params(seed=18, only=("dense",))
    grads = grads_with_ratios(params, RATIOS, 0.01, 1e-3, seed=19)
    head = {"kernel": jnp.asarray(np.random.default_rng(20).normal(size=(5, 4)), jnp.float32)}
    head_g = {"kernel": 5.0 * head["kernel"]}  # Ratio 500 to the threshold: would be clipped.
    return {"body": params, "head": head}, {"body": grads, "head": head_g}


@pytest.mark.parametrize(
    "kind", ["full", "prefix", "callable", "numpy_bool"], ids=lambda kind: kind
)
def test_mask_excludes_leaves_bit_for_bit(kind):
    params, grads = _nested()
    if kind == "full":
        mask = jax.tree.map(lambda _: True, params)
        mask["head"]["kernel"] = False
    elif kind == "prefix":
        mask = {"body": True, "head": False}
    elif kind == "callable":
        mask = lambda p: {"body": jax.tree.map(lambda _: True, p["body"]), "head": False}
    else:
        mask = {"body": np.bool_(True), "head": np.bool_(False)}
    out = adaptive_clip_grad(params, grads, mask=mask)
    assert out["head"]["kernel"] is grads["head"]["kernel"]  # Untouched, same object.
    unmasked = adaptive_clip_grad(params, grads)  # Eager like `out`, so bit-exact below.
    assert not np.array_equal(unmasked["head"]["kernel"], grads["head"]["kernel"])
    for k in params["body"]:
        np.testing.assert_array_equal(out["body"][k], unmasked["body"][k], err_msg=k)


def test_mask_under_jit_and_masked_integer_leaf():
    params = {"w": jnp.ones((3, 2)), "step": jnp.asarray(3)}
    grads = {"w": jnp.full((3, 2), 10.0), "step": jnp.asarray(7)}
    mask_fn = lambda p: jax.tree.map(lambda x: jnp.issubdtype(x.dtype, jnp.floating), p)
    out = jax.jit(lambda p, g: adaptive_clip_grad(p, g, mask=mask_fn))(params, grads)
    assert out["step"].dtype == grads["step"].dtype and int(out["step"]) == 7
    # Unit norm sqrt(300), threshold 0.01 * sqrt(3): every element becomes 0.01 * 1 / 1 = 0.01.
    np.testing.assert_allclose(out["w"], 0.01, rtol=F32_RTOL)


def test_mask_errors():
    params, grads = _nested()
    with pytest.raises(ValueError, match="structure of params"):
        adaptive_clip_grad(params, grads, mask={"body": True, "tail": False})
    with pytest.raises(TypeError, match="Python bools"):
        adaptive_clip_grad(params, grads, mask={"body": True, "head": jnp.asarray(False)})
    with pytest.raises(TypeError, match="Python bools"):
        adaptive_clip(mask={"body": True, "head": jnp.asarray(False)})


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_integer_grads_raise_at_trace_time():
    params = {"w": jnp.ones((3, 2))}
    grads = {"w": jnp.ones((3, 2), jnp.int32)}
    with pytest.raises(TypeError, match=r"\['w'\] has dtype int32"):
        jax.jit(adaptive_clip_grad)(params, grads)


def test_structure_and_shape_mismatch_raise():
    params = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
    with pytest.raises(ValueError, match="pytree structure"):
        jax.jit(adaptive_clip_grad)(params, {"w": jnp.ones((3, 2))})
    with pytest.raises(ValueError, match="pytree structure"):
        adaptive_clip_grad(params, [jnp.ones(2), jnp.ones((3, 2))])
    with pytest.raises(ValueError, match=r"grads shape \(2, 3\) != params shape \(3, 2\)"):
        adaptive_clip_grad(params, {"w": jnp.ones((2, 3)), "b": jnp.ones(2)})


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"clip_factor": 0.0}, ValueError),
        ({"clip_factor": -0.1}, ValueError),
        ({"clip_factor": float("nan")}, ValueError),
        ({"clip_factor": float("inf")}, ValueError),
        ({"eps": -1e-3}, ValueError),
        ({"clip_factor": "0.1"}, TypeError),
        ({"clip_factor": True}, TypeError),
        ({"eps": jnp.asarray(1)}, TypeError),  # Arrays are welcome (traced), integers not.
    ],
)
def test_bad_hyperparameters(kwargs, error):
    with pytest.raises(error):
        adaptive_clip(**kwargs)
    with pytest.raises(error):
        adaptive_clip_grad({"w": jnp.ones(2)}, {"w": jnp.ones(2)}, **kwargs)


def test_transform_requires_params():
    tx = adaptive_clip()
    state = tx.init({"w": jnp.ones(2)})
    with pytest.raises(ValueError, match="needs the current parameters"):
        tx.update({"w": jnp.ones(2)}, state)


# ---------------------------------------------------------------------------------------------
# Transform
# ---------------------------------------------------------------------------------------------


def test_transform_in_chain_under_jit():
    params = make_params(seed=21, only=("dense", "bias", "conv"))
    grads = grads_with_ratios(params, RATIOS, 0.01, 1e-3, seed=22)
    tx = optax.chain(adaptive_clip(0.01), optax.adam(1e-3))
    adam = optax.adam(1e-3)

    @jax.jit
    def run(p, g):
        chained = tx.update(g, tx.init(p), p)
        manual = adam.update(adaptive_clip_grad(p, g, 0.01), adam.init(p), p)
        return chained, manual

    (got, state), (want, want_state) = run(params, grads)
    assert isinstance(state[0], optax.EmptyState)
    # The chain must perform exactly the manual sequence (clip, then Adam): identical results.
    for k in params:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        np.testing.assert_array_equal(state[1][0].nu[k], want_state[0].nu[k], err_msg=k)
    # And Adam's first moment holds the clipped, not the raw, gradient: mu = (1 - b1) * g.
    ref = ref_agc(params["conv"], grads["conv"], 0.01, 1e-3)
    np.testing.assert_allclose(state[1][0].mu["conv"], 0.1 * ref, rtol=F32_RTOL)
    assert not np.allclose(ref, grads["conv"], rtol=0.1)


def test_transform_with_mask_and_extra_args():
    params = make_params(seed=23, only=("dense", "bias", "conv"))
    grads = grads_with_ratios(params, RATIOS, 0.05, 1e-3, seed=24)
    tx = adaptive_clip(0.05, mask={"dense": True, "bias": True, "conv": False})
    got, _ = jax.jit(lambda g, p: tx.update(g, tx.init(p), p, unused=1.0))(grads, params)
    np.testing.assert_array_equal(got["conv"], grads["conv"])  # Excluded: passed through.
    for k in ("dense", "bias"):
        want = ref_agc(params[k], grads[k], 0.05, 1e-3)
        np.testing.assert_allclose(got[k], want, rtol=F32_RTOL, err_msg=k)
        assert not np.allclose(got[k], grads[k], rtol=0.1), k  # Clipping is active.


# ---------------------------------------------------------------------------------------------
# Placement: on the accumulated gradient vs per microbatch
# ---------------------------------------------------------------------------------------------

N, K, D_IN, D_OUT = 8, 4, 3, 2


def _linear_problem():
    rng = np.random.default_rng(25)
    x = rng.normal(size=(N, D_IN))
    y = rng.normal(size=(N, D_OUT)) * 3.0
    params = {"w": rng.normal(size=(D_IN, D_OUT)), "b": rng.normal(size=(D_OUT,))}
    return x, y, params


def _loss(params, x, y):
    """Mean over examples of 0.5 * squared error."""
    r = x @ params["w"] + params["b"] - y
    return 0.5 * jnp.mean(jnp.sum(r * r, axis=-1))


def _np_grad(params, x, y):
    """Analytic float64 gradient of `_loss`."""
    r = x @ params["w"] + params["b"] - y
    return {"w": x.T @ r / len(x), "b": r.sum(0) / len(x)}


def _np_agc(params, grads, clip_factor):
    return {k: ref_agc(params[k], grads[k], clip_factor, 1e-3) for k in params}


def _clip_factor_between_units(params, grads):
    """A clip factor that clips some units of `grads` and leaves others (float64)."""
    ratios = np.concatenate(
        [np.ravel(ref_unit_norms(grads[k]) / ref_unit_norms(params[k])) for k in ("w",)]
    )
    return float(np.sqrt(ratios.min() * ratios.max()))


def test_placement_on_accumulated_gradient_equals_full_batch():
    x, y, params_np = _linear_problem()
    full = _np_grad(params_np, x, y)
    clip_factor = _clip_factor_between_units(params_np, full)
    want = _np_agc(params_np, full, clip_factor)
    # The reference clips some units and not others, so the comparison is meaningful.
    w_kept = np.isclose(want["w"], full["w"], rtol=0, atol=0).all(axis=0)
    assert w_kept.any() and not w_kept.all()
    with jax.enable_x64(True):
        params = jax.tree.map(jnp.asarray, params_np)
        # Microbatch gradients of loss / K sum to the full-batch gradient of the mean loss.
        micro = [
            jax.jit(jax.grad(lambda p, xs, ys: _loss(p, xs, ys) / K))(params, xs, ys)
            for xs, ys in zip(np.split(x, K), np.split(y, K), strict=True)
        ]
        accumulated = jax.tree.map(lambda *g: sum(np.asarray(a) for a in g), *micro)  # numpy
        tx = optax.chain(adaptive_clip(clip_factor))
        got, _ = jax.jit(tx.update)(accumulated, tx.init(params), params)
        for k in params:
            np.testing.assert_allclose(got[k], want[k], rtol=F64_RTOL, err_msg=k)


def test_placement_per_microbatch_differs_from_accumulated():
    x, y, params_np = _linear_problem()
    clip_factor = _clip_factor_between_units(params_np, _np_grad(params_np, x, y))
    micro_np = [
        _np_grad(params_np, xs, ys) for xs, ys in zip(np.split(x, K), np.split(y, K), strict=True)
    ]
    # Reference: clip each microbatch gradient (of its own mean loss) separately, then mean.
    want = {
        k: np.mean([_np_agc(params_np, g, clip_factor)[k] for g in micro_np], axis=0)
        for k in params_np
    }
    on_accumulated = _np_agc(params_np, _np_grad(params_np, x, y), clip_factor)
    with jax.enable_x64(True):
        params = jax.tree.map(jnp.asarray, params_np)
        clip = jax.jit(lambda p, g: adaptive_clip_grad(p, g, clip_factor))
        grad_fn = jax.jit(jax.grad(_loss))
        clipped = [
            clip(params, grad_fn(params, xs, ys))
            for xs, ys in zip(np.split(x, K), np.split(y, K), strict=True)
        ]
        got = jax.tree.map(lambda *g: sum(np.asarray(a) for a in g) / K, *clipped)  # numpy
        for k in params:
            np.testing.assert_allclose(got[k], want[k], rtol=F64_RTOL, err_msg=k)
        # Clipping is nonlinear: the two placements differ by far more than rounding.
        diff = max(np.max(np.abs(got[k] - on_accumulated[k])) for k in params)
        scale = max(np.max(np.abs(on_accumulated[k])) for k in params)
        assert diff > 1e-2 * scale

        # With microbatch gradients of loss / K, clip_factor c acts like K * c: exact, since
        # K = 4 is a power of two, so dividing by it is exact and commutes with every step.
        g = grad_fn(params, x[: N // K], y[: N // K])
        small, loose, tight = jax.jit(
            lambda p, g: (
                adaptive_clip_grad(p, jax.tree.map(lambda t: t / K, g), clip_factor),
                adaptive_clip_grad(p, g, K * clip_factor),
                adaptive_clip_grad(p, g, clip_factor),
            )
        )(params, g)
        for k in params:
            np.testing.assert_array_equal(small[k], np.asarray(loose[k]) / K)
        assert any(not np.allclose(loose[k], tight[k], rtol=1e-3) for k in params)


# ---------------------------------------------------------------------------------------------
# Conv3D (rank-5 kernels) in a real model
# ---------------------------------------------------------------------------------------------


class _Conv3DNet(nn.Module):
    """Conv3D -> relu -> global mean pool -> Dense: kernels of rank 5 and 2, biases."""

    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(4, kernel_size=(2, 2, 2), param_dtype=self.param_dtype)(x)
        x = nn.relu(x).mean(axis=(1, 2, 3))
        return nn.Dense(3, param_dtype=self.param_dtype)(x)


@functools.cache  # one problem per dtype for the module (the float64 one under x64)
def _conv3d_problem(dtype):
    rng = np.random.default_rng(31)
    x = jnp.asarray(rng.normal(size=(8, 4, 5, 3, 2)), dtype)  # (B, D, H, W, C)
    y = jnp.asarray(rng.normal(size=(8, 3)) * 3.0, dtype)
    model = _Conv3DNet(param_dtype=dtype)
    # Parameters like flax's defaults, drawn in numpy: normal kernels of variance 1 / fan_in
    # (lecun_normal, untruncated) and zero biases. model.init compiles each random kernel
    # draw, and XLA:CPU takes about a second for the rank-5 one alone.
    shapes = jax.eval_shape(model.init, jax.random.key(0), x[:1])["params"]
    draw = np.random.default_rng(32)

    def fill(path, leaf):
        if path[-1].key == "bias":
            return jnp.asarray(np.zeros(leaf.shape, leaf.dtype))
        fan_in = np.prod(leaf.shape[:-1])
        return jnp.asarray((draw.normal(size=leaf.shape) / np.sqrt(fan_in)).astype(leaf.dtype))

    params = jax.tree_util.tree_map_with_path(fill, shapes)

    def loss(p, xs, ys):
        return 0.5 * jnp.mean(jnp.sum((model.apply({"params": p}, xs) - ys) ** 2, axis=-1))

    return x, y, params, loss


def test_agc_on_conv3d_model_clips_per_output_channel():
    x, y, params, loss = _conv3d_problem(jnp.float32)
    kernel = params["Conv_0"]["kernel"]
    assert kernel.shape == (2, 2, 2, 2, 4)  # DHWIO
    clip_factor = 1e-3

    @jax.jit
    def run(p):
        g = jax.grad(loss)(p, x, y)
        clipped = adaptive_clip_grad(p, g, clip_factor)
        return g, clipped, unitwise_norm(clipped["Conv_0"]["kernel"])

    grads, clipped, norms = run(params)
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(clipped))
    assert norms.shape == (1, 1, 1, 1, 4)
    g_kernel, p_kernel = np.asarray(grads["Conv_0"]["kernel"]), np.asarray(kernel)
    threshold = clip_factor * np.maximum(ref_unit_norms(p_kernel)[0, 0, 0, 0], 1e-3)
    g_norms = ref_unit_norms(g_kernel)[0, 0, 0, 0]
    assert (g_norms > threshold).any()  # the check below is not vacuous
    np.testing.assert_allclose(
        np.asarray(norms).ravel(), np.minimum(g_norms, threshold), rtol=F32_RTOL
    )
    np.testing.assert_allclose(
        clipped["Conv_0"]["kernel"],
        ref_agc(p_kernel, g_kernel, clip_factor, 1e-3),
        rtol=F32_RTOL,
        atol=1e-12,
    )


def test_agc_on_accumulated_gradient_equals_full_batch_float64():
    with jax.enable_x64(True):
        x, y, params, loss = _conv3d_problem(jnp.float64)
        grad_fn = jax.jit(jax.grad(loss))
        full = grad_fn(params, x, y)
        # Microbatch gradients of the mean loss, summed and divided by K (in numpy: the same
        # float64 operations as jnp's, none of them compiled on its own).
        xs_ys = zip(np.split(np.asarray(x), K), np.split(np.asarray(y), K), strict=True)
        micro = [grad_fn(params, xs, ys) for xs, ys in xs_ys]
        accumulated = jax.tree.map(lambda *g: sum(np.asarray(a) for a in g) / K, *micro)
        assert all(leaf.dtype == jnp.float64 for leaf in jax.tree.leaves(accumulated))
        # float64 sums of the same terms in a different order: ~1e-16 relative.
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=F64_RTOL), accumulated, full
        )

        kernel = params["Conv_0"]["kernel"]
        ratios = ref_unit_norms(full["Conv_0"]["kernel"]) / ref_unit_norms(kernel)
        clip_factor = float(np.sqrt(ratios.min() * ratios.max()))  # clips some units only
        clip = jax.jit(lambda p, g: adaptive_clip_grad(p, g, clip_factor))
        on_accumulated, on_full = clip(params, accumulated), clip(params, full)
        kept = np.asarray(on_full["Conv_0"]["kernel"]) == np.asarray(full["Conv_0"]["kernel"])
        kept = kept.all((0, 1, 2, 3))
        assert kept.any() and not kept.all()
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=F64_RTOL, atol=1e-15),
            on_accumulated,
            on_full,
        )


def test_conv3d_model_trains_with_adaptive_clip_in_both_modes():
    x, y, params, loss = _conv3d_problem(jnp.float32)
    batch_loss = lambda p, b: loss(p, b[0], b[1])
    evaluate = jax.jit(batch_loss)  # one program, not the model's every op compiled eagerly
    before = float(evaluate(params, (x, y)))
    # AGC of the window gradient: adaptive_clip first in the inner chain.
    tx = accumjax.accumulate(optax.chain(adaptive_clip(0.05), optax.sgd(0.5)), 2)
    # The stream mode's two microbatches, sliced in numpy: nothing to compile.
    halves = [tuple(jnp.asarray(np.asarray(a)[i::2]) for a in (x, y)) for i in (0, 1)]
    for mode in ("scan", "stream"):
        step = accumjax.make_train_step(batch_loss, mode=mode, donate=False)
        state = step.init(params, tx)
        for _ in range(10):
            for b in [(x, y)] if mode == "scan" else halves:
                state, _ = step(state, b)
        assert int(state.step) == 10
        assert float(evaluate(state.params, (x, y))) < before  # it trains, clipped


# ---------------------------------------------------------------------------------------------
# optax's interface: axis=, the clip factor as an array (inject_hyperparams), `clipping=`
# ---------------------------------------------------------------------------------------------


def _np_axis(axis):
    return tuple(axis) if isinstance(axis, list) else axis


def ref_axis_norms(x, axis) -> np.ndarray:
    """float64 norms over exactly `axis` (optax's meaning), broadcast to x.shape."""
    x = np.asarray(x, np.float64)
    return np.broadcast_to(np.sqrt(np.sum(x * x, axis=_np_axis(axis), keepdims=True)), x.shape)


def grads_for_axis(params: dict, axis, clip: float, eps: float, seed: int) -> dict:
    """Random grads whose units (for `axis`) alternate between 3 and 0.3 times the threshold."""
    rng = np.random.default_rng(seed)
    grads = {}
    for name, p in params.items():
        g = rng.normal(size=np.shape(p))
        units = np.sum(g * g, axis=_np_axis(axis), keepdims=True)  # one entry per unit
        ratio = np.where(np.arange(units.size) % 2 == 0, 3.0, 0.3).reshape(units.shape)
        threshold = clip * np.maximum(ref_axis_norms(p, axis), eps)
        grads[name] = jnp.asarray(g / ref_axis_norms(g, axis) * threshold * ratio, jnp.float32)
    return grads


def ref_agc_axis(param, grad, clip: float, eps: float, axis) -> np.ndarray:
    """AGC in float64 with units over exactly `axis`."""
    p_norm, g_norm = ref_axis_norms(param, axis), ref_axis_norms(grad, axis)
    max_norm = clip * np.maximum(p_norm, eps)
    grad = np.asarray(grad, np.float64)
    return np.where(g_norm < max_norm, grad, grad * max_norm / np.maximum(g_norm, 1e-300))


# (axis, leaf shapes): Dense, conv and 3-D kernels next to ranks 6 and 7, which only `axis=`
# can clip (the rank-based default stops at 5, as optax's does).
AXIS_CASES = {
    "0": (0, {"dense": (5, 4), "bias": (4,), "k3": (3, 5, 4), "r6": (2, 3, 2, 2, 1, 3)}),
    "-1": (-1, {"dense": (5, 4), "conv": (3, 3, 2, 6), "r7": (2, 1, 2, 3, 1, 2, 3)}),
    "0,1,2": ((0, 1, 2), {"conv": (3, 3, 2, 6), "r6": (2, 3, 2, 2, 2, 3)}),
    "list": ([0, -1], {"k3": (3, 5, 4), "r6": (2, 3, 2, 2, 2, 3)}),
    "none_reduced": ((), {"scale": (), "dense": (5, 4)}),
}


def _axis_problem(case: str, clip: float, eps: float):
    axis, shapes = AXIS_CASES[case]
    rng = np.random.default_rng(50)
    params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
    return axis, params, grads_for_axis(params, axis, clip, eps, seed=51)


def test_unitwise_norm_axis_matches_optax():
    rng = np.random.default_rng(52)
    cases = [
        ((5, 4), 1),
        ((2, 3, 2, 2, 2, 3), (0, 1, 2, 3, 4)),
        ((2,) * 7, -1),
        ((), ()),
        ((3, 5, 4), [0, 2]),
        ((4,), 0),
        ((1, 7), 1),  # The squeeze rule is only the default's: axis=1 is what is reduced.
    ]
    xs = [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape, _ in cases]
    axes = [axis for _, axis in cases]

    @jax.jit
    def norms(xs):
        ours = [unitwise_norm(x, axis=a) for x, a in zip(xs, axes, strict=True)]
        upstream = [
            optax.transforms.unitwise_norm(x, axis=a) for x, a in zip(xs, axes, strict=True)
        ]
        return ours, upstream

    ours, upstream = norms(xs)
    for x, axis, got, want in zip(xs, axes, ours, upstream, strict=True):
        keep = np.sum(np.zeros(x.shape), axis=_np_axis(axis), keepdims=True).shape
        assert got.shape == keep and got.dtype == jnp.float32, axis
        # Same sum of the same float32 squares, then the same sqrt: bit-exact.
        np.testing.assert_array_equal(np.broadcast_to(got, x.shape), want, err_msg=str(axis))
        np.testing.assert_allclose(want, ref_axis_norms(x, axis), rtol=F32_RTOL)
    # bfloat16 is reduced in float32 (optax reduces in bfloat16), to the float64 reference.
    x16 = jnp.asarray(rng.normal(size=(6, 3)), jnp.bfloat16)
    got = unitwise_norm(x16, axis=1)
    assert got.shape == (6, 1) and got.dtype == jnp.float32
    np.testing.assert_allclose(
        np.broadcast_to(got, x16.shape), ref_axis_norms(x16, 1), rtol=F32_RTOL
    )


@pytest.mark.parametrize(
    ("axis", "error", "match"),
    [
        (True, TypeError, "axis must be None, an int or a tuple of ints"),
        (1.0, TypeError, "axis must be None, an int or a tuple of ints"),
        ((0, "1"), TypeError, "axis must be None, an int or a tuple of ints"),
        (jnp.asarray(0), TypeError, "static_args"),
        (2, ValueError, r"axis 2 is out of range for shape \(2, 3\)"),
        ((0, -3), ValueError, r"axis \(0, -3\) is out of range"),
        ((0, -2), ValueError, r"axis \(0, -2\) names an axis twice"),
    ],
)
def test_unitwise_norm_axis_errors(axis, error, match):
    with pytest.raises(error, match=match):
        unitwise_norm(jnp.ones((2, 3)), axis=axis)


@pytest.mark.parametrize("case", list(AXIS_CASES))
def test_adaptive_clip_axis_matches_optax(case):
    clip, eps = 0.05, 1e-3
    axis, params, grads = _axis_problem(case, clip, eps)
    tx = accumjax.adaptive_clip(clipping=clip, eps=eps, axis=axis)
    upstream = optax.adaptive_grad_clip(clip, eps, axis=axis)
    # Op by op both run the same float32 operations on the same values: bit for bit.
    got, _ = tx.update(grads, tx.init(params), params)
    want, _ = upstream.update(grads, upstream.init(params), params)
    by_function = adaptive_clip_grad(params, grads, clip, eps, axis=axis)
    jitted, jitted_upstream = jax.jit(
        lambda g, p: (tx.update(g, None, p)[0], upstream.update(g, None, p)[0])
    )(grads, params)
    for k in params:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        np.testing.assert_array_equal(by_function[k], got[k], err_msg=k)
        ref = ref_agc_axis(params[k], grads[k], clip, eps, axis)
        np.testing.assert_allclose(got[k], ref, rtol=F32_RTOL, err_msg=k)
        # Under jit, as above: XLA may turn a division into a reciprocal and a multiply in
        # one graph and not the other (1 ulp on the scale, at most 2 on the product).
        assert max_ulp_diff(jitted[k], jitted_upstream[k]) <= 2, k
        assert not (np.asarray(got[k]) == np.asarray(grads[k])).all(), k  # 3x: clipped...
    kept_any = any((np.asarray(got[k]) == np.asarray(grads[k])).any() for k in params)
    assert kept_any  # ...and units at 0.3x are not.


def test_adaptive_clip_grad_axis_error_names_the_leaf():
    params = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
    with pytest.raises(ValueError, match=r"leaf \['b'\]: axis \(0, 1\) is out of range"):
        adaptive_clip_grad(params, params, axis=(0, 1))
    # Masked out, the vector passes through; the kernel is clipped as one unit.
    out = adaptive_clip_grad(params, params, 0.5, axis=(0, 1), mask={"w": True, "b": False})
    assert out["b"] is params["b"]
    np.testing.assert_allclose(out["w"], 0.5, rtol=F32_RTOL)  # Whole kernel scaled by 0.5.


def test_clip_factor_and_eps_may_be_arrays_and_traced():
    params = make_params(seed=40, only=("dense", "bias", "conv"))
    grads = grads_with_ratios(params, RATIOS, 0.05, 1e-2, seed=41)
    fixed = jax.jit(lambda p, g: adaptive_clip_grad(p, g, 0.05, 1e-2))(params, grads)
    traced = jax.jit(adaptive_clip_grad)(params, grads, jnp.float32(0.05), jnp.float32(1e-2))
    # float64 numpy scalars are cast to the norms' dtype (float32), as Python floats are.
    tx = adaptive_clip(clipping=np.asarray(0.05), eps=np.asarray(1e-2))
    as_numpy, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    c16 = jnp.asarray(0.05, jnp.bfloat16)  # inject_hyperparams casts to bfloat16 params' dtype
    in_bf16 = jax.jit(lambda p, g: adaptive_clip_grad(p, g, c16, 1e-2))(params, grads)
    fixed_bf16 = jax.jit(lambda p, g: adaptive_clip_grad(p, g, float(c16), 1e-2))(params, grads)
    assert not np.array_equal(fixed["dense"], grads["dense"])  # Clipping is active.
    for k in params:
        # The same float32 operations on the same float32 values, one program with constants
        # and one with arguments.
        np.testing.assert_array_equal(traced[k], fixed[k], err_msg=k)
        np.testing.assert_array_equal(as_numpy[k], fixed[k], err_msg=k)
        np.testing.assert_array_equal(in_bf16[k], fixed_bf16[k], err_msg=k)
        assert in_bf16[k].dtype == jnp.float32


@pytest.mark.parametrize(
    "kwargs",
    [
        {"clip_factor": jnp.asarray(1)},
        {"clip_factor": jnp.asarray(True)},
        {"clip_factor": jnp.ones(2)},
        {"eps": np.asarray([1e-3])},
        {"clipping": jnp.asarray(1j)},
    ],
    ids=["int_array", "bool_array", "vector", "eps_vector", "complex"],
)
def test_array_hyperparameters_must_be_floating_scalars(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(TypeError, match=rf"{name} must be a real number or a floating point"):
        adaptive_clip(**kwargs)
    if name != "clipping":
        with pytest.raises(TypeError, match=rf"{name} must be a real number or a floating point"):
            adaptive_clip_grad({"w": jnp.ones(2)}, {"w": jnp.ones(2)}, **kwargs)


def test_clipping_is_optax_name_for_clip_factor():
    params = make_params(seed=42, only=("dense", "bias"))
    grads = grads_with_ratios(params, RATIOS, 0.05, 1e-3, seed=43)

    def run(tx):
        return tx.update(grads, tx.init(params), params)[0]

    want = run(optax.adaptive_grad_clip(clipping=0.05, eps=1e-3))  # The call site users port.
    for tx in (
        adaptive_clip(clipping=0.05, eps=1e-3),
        adaptive_clip(clip_factor=0.05, eps=1e-3),
        adaptive_clip(0.05, 1e-3),
    ):
        got = run(tx)
        for k in params:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    default, explicit = run(adaptive_clip()), run(adaptive_clip(clipping=0.01))
    for k in params:
        np.testing.assert_array_equal(default[k], explicit[k], err_msg=k)
    with pytest.raises(TypeError, match="either `clip_factor` or `clipping`"):
        adaptive_clip(0.05, clipping=0.05)
    with pytest.raises(ValueError, match="clipping must be finite and > 0"):
        adaptive_clip(clipping=0.0)  # The error names the argument given.
    # optax's third positional argument is axis; ours is mask: the error says so.
    with pytest.raises(TypeError, match=r"pass it by name: axis="):
        adaptive_clip(0.05, 1e-3, (0, 1))


def test_inject_hyperparams_schedule_matches_fixed_values_step_by_step():
    params = make_params(seed=44, only=("dense", "bias", "conv"))
    # Unit ratios to the threshold for 0.02 (RATIOS) put these units' grad / param norms at
    # 0.005 to 0.1: the factor falls from 0.07 (clips 2 units) to 0.004 (clips all of them).
    sched = optax.linear_schedule(0.07, 0.004, transition_steps=4)
    tx = optax.inject_hyperparams(accumjax.adaptive_clip)(clipping=sched, eps=1e-3)
    upstream = optax.inject_hyperparams(optax.adaptive_grad_clip)(clipping=sched, eps=1e-3)
    update, upstream_update, schedule = jax.jit(tx.update), jax.jit(upstream.update), jax.jit(sched)
    state, upstream_state = tx.init(params), upstream.init(params)
    kept_per_step = []
    for t in range(6):
        grads = grads_with_ratios(params, RATIOS, 0.02, 1e-3, seed=46 + t)
        got, state = update(grads, state, params)
        by_upstream, upstream_state = upstream_update(grads, upstream_state, params)
        clip = float(state.hyperparams["clipping"])  # The float32 value this step used.
        np.testing.assert_allclose(clip, float(schedule(t)), rtol=1e-6)
        fixed = adaptive_clip(clipping=clip, eps=1e-3)
        want, _ = jax.jit(fixed.update)(grads, fixed.init(params), params)
        for k in params:
            # The same float32 operations on the same values (an argument against a constant).
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"step {t}: {k}")
            assert max_ulp_diff(got[k], by_upstream[k]) <= 2, (t, k)  # jit: see above.
        kept_per_step.append(sum(int(np.sum(np.equal(got[k], grads[k]))) for k in params))
    # The schedule really drives the clipping: fewer units kept as the factor falls.
    assert kept_per_step[0] > kept_per_step[2] > kept_per_step[4] == kept_per_step[5]


def test_inject_hyperparams_by_either_name_and_a_static_axis():
    axis, params, grads = _axis_problem("0", 0.05, 1e-3)
    fixed = adaptive_clip(clipping=0.05, axis=axis)
    want, _ = jax.jit(fixed.update)(grads, fixed.init(params), params)
    injected = [
        optax.inject_hyperparams(accumjax.adaptive_clip)(clip_factor=0.05, axis=(0,)),
        optax.inject_hyperparams(accumjax.adaptive_clip, static_args="axis")(clipping=0.05, axis=0),
    ]
    for tx in injected:
        got, state = jax.jit(tx.update)(grads, tx.init(params), params)
        assert set(state.hyperparams) == {"eps", "clip_factor" if tx is injected[0] else "clipping"}
        for k in params:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    # An int axis is a number to inject_hyperparams, which would make it an array.
    with pytest.raises(TypeError, match="static_args"):
        optax.inject_hyperparams(accumjax.adaptive_clip)(clipping=0.05, axis=0).init(params)
