"""Rollout engines for tests: a recording wrapper around the native sampler (what the module
asked of its engine), and one that lies about the weights it used. Importable by reference
('engine_fakes:recording_engine'), as a config names a factory."""

from __future__ import annotations

from rlbolt.rollout.engines import native_engine

CALLS: list[tuple[str, int]] = []  # ("update_weights", version) / ("generate", rows), in order


class Recording:
    """Forwards the protocol's two calls to the native sampler and records them."""

    def __init__(self, inner):
        self.inner = inner

    def generate(self, prompt_ids, rng_keys, **opts):
        CALLS.append(("generate", len(prompt_ids)))
        return self.inner.generate(prompt_ids, rng_keys, **opts)

    def update_weights(self, params, policy_version):
        CALLS.append(("update_weights", int(policy_version)))
        self.inner.update_weights(params, policy_version)


def recording_engine(model, spec):
    return Recording(native_engine(model, spec))


class Stale(Recording):
    """Claims the weights it was first given forever: as an engine that dropped a weight push."""

    def update_weights(self, params, policy_version):
        if self.inner.policy_version == 0 and not CALLS:
            CALLS.append(("update_weights", int(policy_version)))
            self.inner.update_weights(params, policy_version)
        else:
            self.inner.update_weights(params, 0)


def stale_engine(model, spec):
    return Stale(native_engine(model, spec))
