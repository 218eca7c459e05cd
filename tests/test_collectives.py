"""Tests for accumjax.collectives: counting collectives in optimized HLO."""

import jax
import jax.numpy as jnp
import pytest
from _assertions import collective_counts

import accumjax
from accumjax import collectives, distributed
from accumjax.collectives import COLLECTIVE_OPS, count_collectives

# Hand-written optimized HLO: names and metadata that mention collectives must not count,
# an async start/done pair counts once, a loop body runs 5 times, one branch runs.
HLO = """HloModule jit_f, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %all-reduce.9 = f32[] add(%a, %b), metadata={op_name="jit(f)/all-reduce"}
}

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%p), index=1
  %psum.3 = f32[4]{0} all-reduce(%x), to_apply=%add, metadata={op_name="all-gather"}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %psum.3)
}

%cond (q: (s32[], f32[4])) -> pred[] {
  %q = (s32[], f32[4]{0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %five = s32[] constant(5)
  ROOT %lt = pred[] compare(%j, %five), direction=LT
}

%branch0 (r: f32[4]) -> f32[4] {
  ROOT %r = f32[4]{0} parameter(0)
}

%branch1 (s: f32[4]) -> f32[4] {
  %s = f32[4]{0} parameter(0)
  %ag = f32[8]{0} all-gather(%s), dimensions={0}, replica_groups={{0,1}}
  %cp-start = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(%s)
  %cp-done = f32[4]{0} collective-permute-done(%cp-start)
  ROOT %sl = f32[4]{0} slice(%ag), slice={[0:4]}
}

ENTRY %main (x.1: f32[4]) -> f32[4] {
  %x.1 = f32[4]{0} parameter(0)
  %one = f32[] constant(1)
  %ars = (f32[4]{0}, f32[]) all-reduce-start(%x.1, %one), replica_groups={{0,1}}, to_apply=%add
  %ard = (f32[4]{0}, f32[]) all-reduce-done(%ars)
  %y = f32[4]{0} get-tuple-element(%ard), index=0
  %zero = s32[] constant(0)
  %init = (s32[], f32[4]{0}) tuple(%zero, %y)
  %w = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body, TRIP_COUNT
  %z = f32[4]{0} get-tuple-element(%w), index=1
  %pred = pred[] constant(true)
  ROOT %c = f32[4]{0} conditional(%pred, %z, %z), branch_computations={%branch0, %branch1}
}
""".replace("TRIP_COUNT", 'backend_config={"known_trip_count":{"n":"5"}}')


def test_count_collectives_static_hlo_text():
    assert count_collectives(HLO) == collective_counts(all_reduce=2, all_gather=1, permute=1)


def test_count_collectives_per_execution_hlo_text():
    # entry all-reduce 1 + loop body 1 x 5 trips; the all-gather branch counts once.
    assert count_collectives(HLO, per_execution=True) == collective_counts(
        all_reduce=6, all_gather=1, permute=1
    )


def test_count_collectives_unknown_trip_count_raises():
    text = HLO.replace(', backend_config={"known_trip_count":{"n":"5"}}', "")
    assert count_collectives(text)["all-reduce"] == 2
    with pytest.raises(ValueError, match="trip count"):
        count_collectives(text, per_execution=True)
    counts = count_collectives(text, per_execution=True, default_trip_count=1)
    assert counts == collective_counts(all_reduce=2, all_gather=1, permute=1)


def test_count_collectives_rejects_bad_input():
    with pytest.raises(TypeError, match="HLO text"):
        count_collectives(42)
    lowered = jax.jit(lambda x: x + 1).lower(jnp.ones(2))
    with pytest.raises(ValueError, match="HloModule"):
        count_collectives(lowered.as_text())  # StableHLO, not optimized HLO


def test_count_collectives_real_pmap_program():
    n = jax.device_count()
    assert n >= 8

    def f(x):
        gathered = jax.lax.all_gather(x, "i")
        scattered = jax.lax.psum_scatter(x, "i", tiled=True)
        permuted = jax.lax.ppermute(x, "i", [(j, (j + 1) % n) for j in range(n)])
        swapped = jax.lax.all_to_all(x.reshape(n, -1), "i", 0, 0)
        summed = jax.lax.psum(x, "i")
        return gathered.sum() + scattered.sum() + permuted.sum() + swapped.sum() + summed.sum()

    lowered = jax.pmap(f, axis_name="i").lower(jnp.ones((n, 2 * n)))
    compiled = lowered.compile()
    expected = collective_counts(1, 1, 1, 1, 1)
    assert count_collectives(lowered) == expected
    assert count_collectives(compiled) == expected
    assert count_collectives(compiled.as_text(), per_execution=True) == expected


def test_count_collectives_no_collectives():
    compiled = jax.jit(lambda x: jnp.sin(x) * 2).lower(jnp.ones(3)).compile()
    assert count_collectives(compiled) == collective_counts()


def test_count_collectives_is_exported_by_accumjax_collectives_only():
    # accumjax.collectives keeps it; the top-level name and accumjax.distributed's are
    # deprecated, and each warns naming accumjax.collectives.count_collectives.
    with pytest.warns(DeprecationWarning, match=r"accumjax\.collectives\.count_collectives"):
        assert accumjax.count_collectives is count_collectives
    with pytest.warns(DeprecationWarning, match=r"import it from accumjax\.collectives"):
        assert distributed.count_collectives is count_collectives
    assert count_collectives.__module__ == "accumjax.collectives"
    assert "count_collectives" not in distributed.__all__
    assert collectives.__all__ == ["COLLECTIVE_OPS", "count_collectives"]
    assert list(count_collectives("HloModule m\n")) == list(COLLECTIVE_OPS[:5])
