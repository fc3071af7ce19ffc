"""DAPO dynamic sampling through a real Trainer.fit: no zero-spread group is trained, the batch
is always full, and the dropped count equals what on_advantage saw."""

import numpy as np
from module_helpers import G, TINY, module_config

from rlbolt.callback import Callback
from rlbolt.data import gsm8k_style_rows
from rlbolt.modules import DAPO
from rlbolt.plan import BatchPlan
from rlbolt.trainer import Trainer


def parity_reward(completion, sample):
    """Prompts with an even prompt_index always score 1 (a zero-spread group); odd ones score
    by completion, so their groups (almost surely) differ."""
    if sample["prompt_index"] % 2 == 0:
        return 1.0
    return float(sum(map(ord, completion)) % 7)


class SpyDAPO(DAPO):
    """Records what every on_advantage call received and kept (overrides one hook, calls super)."""

    seen: list

    def on_advantage(self, batch):
        out = super().on_advantage(batch)
        self.seen.append((batch.num_samples, out.num_samples, len(set(batch["group_ids"]) - set(out["group_ids"]))))
        return out


class Record(Callback):
    def __init__(self):
        self.infos = []

    def on_rollout_end(self, trainer, produced):
        self.seen_before = list(trainer.module.seen)

    def on_step_end(self, trainer, info):
        self.infos.append((info, list(trainer.module.seen)))


def test_dynamic_sampling_refills_and_counts_drops(tmp_path, tokenizer, model):
    cfg = module_config("dapo", lr=1e-3, overlong_cache_length=0)  # shaping would add spread of its own
    cfg["model"] = {"tiny": TINY}
    module = SpyDAPO(cfg, model=model, tokenizer=tokenizer, reward=parity_reward)
    module.seen = []
    record = Record()
    plan = BatchPlan(prompts_per_step=2, num_generations=G, max_refill_rounds=4)
    trainer = Trainer(plan, max_steps=3, shuffle=False, callbacks=[record], run_dir=tmp_path)
    trainer.fit(module, gsm8k_style_rows(40))

    assert len(record.infos) == 3
    calls_before = 0
    for info, seen in record.infos:
        batch = info.batch
        assert batch.num_samples == plan.global_batch_size  # always full
        rewards, groups = np.asarray(batch["rewards"]), np.asarray(batch["group_ids"])
        for g in np.unique(groups):
            assert np.ptp(rewards[groups == g]) > 0  # never a zero-spread group
            assert (groups == g).sum() == G  # whole groups
        assert all(g % 2 == 1 for g in np.unique(groups))  # the constant (even) prompts were all dropped
        step_calls = seen[calls_before:]
        calls_before = len(seen)
        dropped = sum(n_in - n_out for n_in, n_out, _ in step_calls)
        assert dropped > 0 and len(step_calls) >= 2  # at least one refill round happened
        assert info.metrics["refill/dropped_samples"] == dropped
        # The module's own metric: dropped groups, averaged over the step's on_advantage calls (a mean
        # of a few small integers: float32 holds it to ~1e-7 relative, allclose's default rtol 1e-7).
        np.testing.assert_allclose(info.metrics["dynamic_sampling/dropped_groups"],
                                   np.mean([d for _, _, d in step_calls]))
        assert dropped == G * sum(d for _, _, d in step_calls)
