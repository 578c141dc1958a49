"""Draft-length policy: choose `k` each round to maximise expected goodput `E(k) / T(k)`. Pure.

`k` is the draft length; a round yields between 1 and `k + 1` tokens, and `k = 0` is plain
target decoding. The orchestrator calls `step(state, obs, config) -> (k, k_ahead, state)` once a
round; the state is JSON (`PolicyState.to_dict`) and lives in Redis with the session. No I/O,
clocks or global state. The model and the decision rule are explained in docs/policy.md.

Modules: `state` (config, observation, state), `estimators` (learning), `cost` (the model),
`decision` (choosing `k`, `step`), `prior` (new sessions and the global prior).
"""

from specdec.core.policy.cost import expected_tokens, goodput_curve, guess_ahead_pays, pass_line
from specdec.core.policy.decision import best_k, choose_k, is_exploration_round, passes_before_exploration, step
from specdec.core.policy.estimators import ALPHA_MAX, alpha_upper, update
from specdec.core.policy.prior import initial_state, merge_prior
from specdec.core.policy.state import Observation, PolicyConfig, PolicyState

__all__ = [
    "ALPHA_MAX",
    "Observation",
    "PolicyConfig",
    "PolicyState",
    "alpha_upper",
    "best_k",
    "choose_k",
    "expected_tokens",
    "goodput_curve",
    "guess_ahead_pays",
    "initial_state",
    "is_exploration_round",
    "merge_prior",
    "pass_line",
    "passes_before_exploration",
    "step",
    "update",
]
