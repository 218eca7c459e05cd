"""Comparisons the tests share: what "equal up to rounding" means for two programs, and the
collective counts a compiled program is compared with."""

import numpy as np


def assert_within_ulps(actual, expected, ulps: int = 2, err_msg: str = "") -> None:
    """``actual`` equals ``expected`` within ``ulps`` rounding steps of ``expected``'s dtype,
    measured on the array's scale (``ulps * eps * max|expected|`` absolute, and as much
    relative).

    For two different programs (ours and flax's, each compiled by XLA) that do the same
    arithmetic: XLA may fuse or reorder them differently on another machine (FMA, vector
    width), one rounding step at a time; eagerly (one op at a time) they agree bit for bit.
    """
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype, err_msg
    wide = np.complex128 if np.iscomplexobj(expected) else np.float64
    eps = float(np.finfo(np.real(expected).dtype).eps) if expected.dtype.kind in "fc" else 0.0
    if expected.dtype.name == "bfloat16":
        eps = 2.0**-7
    reference = expected.astype(wide)
    scale = float(np.max(np.abs(reference))) if reference.size else 0.0
    np.testing.assert_allclose(
        actual.astype(wide), reference, rtol=ulps * eps, atol=ulps * eps * scale, err_msg=err_msg
    )


def collective_counts(
    all_reduce: int = 0,
    all_gather: int = 0,
    reduce_scatter: int = 0,
    permute: int = 0,
    all_to_all: int = 0,
) -> dict[str, int]:
    """What `accumjax.collectives.count_collectives` must return: every collective it counts,
    by its HLO name, with the number given (0 for those not named)."""
    return {
        "all-reduce": all_reduce,
        "all-gather": all_gather,
        "reduce-scatter": reduce_scatter,
        "collective-permute": permute,
        "all-to-all": all_to_all,
    }
