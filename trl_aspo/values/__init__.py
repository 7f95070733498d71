"""Per-prompt value tracking (SPO, arXiv 2509.13232; SPO++, arXiv 2608.24870): the trackers, their estimators'
registrations (`spo`, `spo++`), prompt identity, the prioritized sampler and value initialization. Imports
`algorithms` only; public path: `from trl_aspo.values import EventValueTracker`.
"""

from trl_aspo.values.beta_counts import default_prior_strength
from trl_aspo.values.event_tracker import EventValueTracker
from trl_aspo.values.event_values import AsyncEventValues
from trl_aspo.values.kl_rho import kl_adaptive_rho, logprob_drift
from trl_aspo.values.prompt_ids import prompt_id_key, prompt_key, prompt_keys
from trl_aspo.values.sampler import PrioritizedRepeatSampler, effective_num_prompts, priority_weights
from trl_aspo.values.tracker_estimators import SPO_ESTIMATOR, SPO_PLUS_PLUS_ESTIMATOR
from trl_aspo.values.value_init import InitRecords, prepass_plan, read_init_records
from trl_aspo.values.visit_tracker import VisitValueTracker

__all__ = [
    "AsyncEventValues",
    "EventValueTracker",
    "InitRecords",
    "PrioritizedRepeatSampler",
    "SPO_ESTIMATOR",
    "SPO_PLUS_PLUS_ESTIMATOR",
    "VisitValueTracker",
    "default_prior_strength",
    "effective_num_prompts",
    "kl_adaptive_rho",
    "logprob_drift",
    "prepass_plan",
    "priority_weights",
    "prompt_id_key",
    "prompt_key",
    "prompt_keys",
    "read_init_records",
]
