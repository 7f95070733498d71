"""The tracker estimators `spo` and `spo++`, registered with trl_aspo.algorithms.advantage_estimators by the layer
that owns their trackers (imported by trl_aspo.values, so any use of the values layer, and both configs, see them).

Both baselines are a per-prompt Beta value ``A_i = R_i - v_x`` (docs/design.md section 3):

- `spo` (SPO, Xu & Ding 2025, arXiv 2509.13232): `VisitValueTracker`, evidence aged per visit; batch normalization.
- `spo++` (SPO++, arXiv 2608.24870, building on SPO): evidence aged by policy events, the generation round
  synchronously (`EventValueTracker`) and the sample's model version asynchronously (`AsyncEventValues`,
  order-invariant); normalization under the action-token measure.
"""

from __future__ import annotations

from trl_aspo.algorithms.advantage_estimators import register_tracker_estimator
from trl_aspo.algorithms.papers import SPO_PAPER, SPO_PLUS_PLUS_PAPER
from trl_aspo.values.event_tracker import EventValueTracker
from trl_aspo.values.event_values import AsyncEventValues
from trl_aspo.values.visit_tracker import VisitValueTracker


def visit_tracker(args, asynchronous: bool) -> VisitValueTracker:
    """SPO's tracker; it has no policy event, so it is the same in both trainers."""
    return VisitValueTracker()


def event_tracker(args, asynchronous: bool) -> EventValueTracker | AsyncEventValues:
    """SPO++'s tracker at forgetting `value_rho`: per generation round, or per model version asynchronously."""
    return AsyncEventValues(rho=args.value_rho) if asynchronous else EventValueTracker(rho=args.value_rho)


SPO_ESTIMATOR = register_tracker_estimator(
    "spo", visit_tracker, default_normalization="batch", per_visit_forgetting=True, papers=(SPO_PAPER,)
)
SPO_PLUS_PLUS_ESTIMATOR = register_tracker_estimator(
    "spo++", event_tracker, default_normalization="token", papers=(SPO_PLUS_PLUS_PAPER, SPO_PAPER)
)
