"""A microbatch's decision (accumjax._decision): the callers' readings of it, one device's
values, no mesh (the devices' agreement is checked end to end in tests/test_sharded.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from accumjax._config import Config
from accumjax._decision import (
    Microbatch,
    MicrobatchDecision,
    add_condition,
    decide_microbatch,
    device_decision,
    gated_decision,
    pooled_decision,
    rows_decision,
    sum_decision,
    window_decisions,
)


def _config(**policy):
    return Config(inner=optax.with_extra_args_support(optax.sgd(0.1)), every_k=4, **policy)


def _microbatch(added, nonfinite, weight=1.0):
    return Microbatch(jnp.bool_(added), jnp.bool_(nonfinite), jnp.float32(weight))


def _summed(*decisions):
    return jax.tree.map(lambda *x: sum(x), *decisions)


def test_a_pooled_decision_adds_what_the_devices_accept_with_their_weight_sum():
    ok = device_decision("mean", jnp.bool_(False), jnp.float32(1.0))
    nan = device_decision("mean", jnp.bool_(True), jnp.float32(1.0))
    mine = _microbatch(True, False, 0.5)
    kept = pooled_decision(_config(), mine, jnp.float32(2.0), _summed(ok, ok))
    assert (bool(kept.added), bool(kept.nonfinite), float(kept.weight)) == (True, False, 2.0)
    # Another device's rows were non-finite: the whole microbatch is, on this device too.
    left = pooled_decision(_config(), mine, jnp.float32(2.0), _summed(ok, nan))
    assert (bool(left.added), bool(left.nonfinite), float(left.weight)) == (False, True, 0.0)
    # A policy that reads the gradient found it finite; another device refused it (skip_fn).
    reads = pooled_decision(_config(max_norm=1.0), mine, jnp.float32(2.0), _summed(ok, nan))
    assert (bool(reads.added), bool(reads.nonfinite)) == (False, False)


def test_a_gated_decision_adds_only_where_the_gate_and_keeps_this_devices_decision():
    config = _config(scaling="weighted")
    m = _microbatch(True, False, 3.0)
    closed, mine = gated_decision(config, m, jnp.float32(3.0), jnp.bool_(False))
    assert (bool(closed.added), float(closed.weight)) == (False, 0.0)
    assert mine == device_decision("weighted", jnp.bool_(False), jnp.float32(3.0))
    opened, _ = gated_decision(config, m, jnp.float32(3.0), jnp.bool_(True))
    assert (bool(opened.added), float(opened.weight)) == (True, 3.0)
    _, unweighted = gated_decision(_config(), _microbatch(False, True), None, jnp.bool_(True))
    assert (float(unweighted.rejected), float(unweighted.weight)) == (1.0, 1.0)


def test_rows_decision_rejects_the_rows_a_microbatch_left_out_skips_included():
    # A skip_fn skip (not non-finite) is this device's rejection in a stream call's pool.
    skipped = rows_decision("mean", _microbatch(False, False, 0.0), None)
    assert (float(skipped.rejected), float(skipped.weight)) == (1.0, 1.0)
    kept = rows_decision("weighted", _microbatch(True, False, 3.0), jnp.float32(3.0))
    assert kept == device_decision("weighted", jnp.bool_(False), jnp.float32(3.0))
    weightless = rows_decision("weighted", _microbatch(False, True, 0.0), jnp.float32(0.0))
    assert (float(weightless.rejected), float(weightless.rejected_weightless)) == (0.0, 1.0)


def test_decide_microbatch_takes_the_decision_as_the_devices_agree_about_it():
    grads = {"w": jnp.array([1.0, jnp.nan])}
    now, none = decide_microbatch(_config(), grads, None, None)
    assert (bool(now.added), bool(now.nonfinite), none) == (False, True, None)
    pooled, none = decide_microbatch(_config(), grads, None, None, agree="pool")
    assert (bool(pooled.added), none) == (False, None)
    finite = {"w": jnp.array([1.0, 2.0])}
    gated, mine = decide_microbatch(
        _config(), finite, None, None, agree="window_end", gate=jnp.bool_(False)
    )
    assert (bool(gated.added), float(gated.weight)) == (False, 0.0)
    assert mine == device_decision("mean", jnp.bool_(False), jnp.float32(1.0))


def test_a_sum_decides_a_microbatch_non_finite_only_past_2_to_the_62():
    config, added, reading = _config(), jnp.bool_(True), jnp.bool_(False)
    bound = jnp.float32(2.0**62)
    counted, kept, mine = sum_decision(config, bound, added, reading)
    assert (bool(counted.nonfinite), bool(kept), float(counted.weight)) == (False, True, 1.0)
    assert float(mine.rejected) == 0.0
    past = jnp.nextafter(bound, jnp.float32(np.inf))
    counted, kept, mine = sum_decision(config, past, added, reading)
    assert (bool(counted.nonfinite), bool(kept), float(mine.rejected)) == (True, True, 1.0)
    # A reading pass adds nothing: a finite gradient keeps its model state and loss.
    off, on = jnp.bool_(False), jnp.bool_(True)
    counted, kept, _ = sum_decision(config, jnp.float32(2.0**100), off, on)
    assert (bool(counted.added), bool(counted.nonfinite), bool(kept)) == (False, False, True)
    counted, kept, _ = sum_decision(config, jnp.float32(np.inf), off, on)
    assert (bool(counted.nonfinite), bool(kept), float(counted.weight)) == (True, False, 0.0)


def test_the_add_condition_is_the_gate_the_decision_or_none():
    m, gate = _microbatch(False, True), jnp.bool_(True)
    assert add_condition(_config(), m, gate) is gate
    assert add_condition(_config(), m, None) is m.added  # a policy that detects waits
    assert add_condition(_config(on_nonfinite="propagate"), m, None) is None


def test_a_windows_stacked_decisions_say_which_microbatches_are_accepted():
    # Three microbatches on two devices: accepted; one device's rows non-finite; weightless
    # rows with a NaN beside rows that weigh something (accepted, as on one device).
    rejected = jnp.array([0.0, 1.0, 0.0])
    weightless = jnp.array([0.0, 0.0, 1.0])
    weight = jnp.array([4.0, 4.0, 2.0])
    summed = MicrobatchDecision(rejected, weightless, weight)
    ok, refused = window_decisions("weighted", summed)
    assert ok.tolist() == [True, False, True] and refused.dtype == jnp.int32
    assert int(refused) == 1
    _, refused = window_decisions("weighted", summed._replace(weight=jnp.zeros(3)))
    assert int(refused) == 2
