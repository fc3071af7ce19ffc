"""Rollout: the RolloutEngine protocol and the native JAX sampler; the token log-probabilities live in
`rlbolt.models.logps` (re-exported here)."""

from rlbolt.rollout.engine import RolloutEngine, RolloutOutput
from rlbolt.models.logps import left_pad_positions, token_logps, token_logps_and_entropy
from rlbolt.rollout.sampler import NativeSampler
from rlbolt.rollout.sampling import SamplingParams
