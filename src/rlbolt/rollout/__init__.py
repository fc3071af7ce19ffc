"""Rollout: the RolloutEngine protocol, the native JAX sampler, and chunked token log-probabilities."""

from rlbolt.rollout.engine import RolloutEngine, RolloutOutput
from rlbolt.rollout.logps import left_pad_positions, token_logps, token_logps_and_entropy
from rlbolt.rollout.sampler import NativeSampler
from rlbolt.rollout.sampling import SamplingParams
