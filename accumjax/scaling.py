"""How an accumulated gradient is normalised: the scaling strategies of `accumulate`.

Every strategy accumulates ``sum_i w_i * g_i`` over the microbatches a window used (``w_i = 1``
unless ``scaling="weighted"``; a skipped microbatch adds nothing) and divides once, at the end
of the window, by a denominator:

================  ============================================  ===============================
strategy          denominator                                   use it when
================  ============================================  ===============================
``"mean"``        the microbatches used (times the data axis)   losses are means (the default)
``"sum"``         ``1``                                         losses are sums over examples
``"weighted"``    ``sum_i w_i`` of the microbatches used        per-token losses, ragged batches
``"sum_over_k"``  ``K`` (times the data axis), skips or not     a skipped microbatch counts
                                                                as a zero gradient (a
                                                                smaller step)
================  ============================================  ===============================

``"mean"`` without skips is ``optax.MultiSteps``' mean; a window that skips one microbatch of
4 applies the mean of the other 3. ``"count"`` is a deprecated name for it. A state records
its strategy as an index into `SCALINGS` (``scaling_code``, append only). The token-weighting
guide (``docs/guides/token_weighting.md``) shows ``"weighted"`` with token counts.
"""

from __future__ import annotations

from accumjax._moved import forward_moved
from accumjax._scaling import SCALINGS, Scaling

__all__ = ["SCALINGS", "Scaling"]


# Exported by 0.4, internal now: resolved with a DeprecationWarning until 0.6.
__getattr__ = forward_moved(__name__)
