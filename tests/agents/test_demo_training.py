"""EpisodeGRPO end to end: a real Trainer.fit on episodes; the training forward reproduces the
sampler's logps (ratio 1 on the first update), so environment ids are read as context."""

import numpy as np
from flax import nnx

from rlbolt import BatchPlan, Callback, Trainer
from rlbolt.demo.episodes import EpisodeGRPO, _demo_config
from rlbolt.demo.agent_tasks import demo_tokenizer
from rlbolt.demo.tasks import DEMO_TASKS
from rlbolt.models import Decoder, tiny_config
from rlbolt.rollout.native_session import NativeSession


class Record(Callback):
    def __init__(self):
        self.infos = []

    def on_step_end(self, trainer, info):
        self.infos.append(info)


def test_episode_grpo_trains_on_multi_turn_batches(tmp_path, monkeypatch):
    turns = []
    real_turn = NativeSession.turn
    monkeypatch.setattr(NativeSession, "turn", lambda self, *args: turns.append(args[0]) or real_turn(self, *args))
    task = DEMO_TASKS["guess"]
    rows, factory, limits = task.load("rows"), task.load("env"), task.limits
    tok = demo_tokenizer()
    config = tiny_config(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=16, max_position_embeddings=32)
    module = EpisodeGRPO(_demo_config(1e-3, 0.0, limits["max_turn_tokens"]), env_factory=factory, prompt_width=4,
                         model=Decoder(config, rngs=nnx.Rngs(0)), tokenizer=tok, **limits)
    record = Record()
    Trainer(BatchPlan(prompts_per_step=4, num_generations=4), max_steps=2, seed=0, callbacks=[record],
            run_dir=tmp_path).fit(module, rows(32, 0))
    assert len(record.infos) == 2
    assert len(turns) >= 2 and len(turns[0]) == 16  # the module's episodes kept their KV caches across turns
    for info in record.infos:
        m, batch = info.metrics, info.batch
        mask, seq = np.asarray(batch["completion_mask"]), np.asarray(batch["sequence_mask"])
        assert mask.shape == (16, limits["max_total_tokens"]) and (mask <= seq).all()
        assert (seq & ~mask).any()  # environment ids: holes in the loss mask
        np.testing.assert_allclose(np.asarray(batch["rewards"]), np.asarray(batch["env_reward"]))
        assert m["agents/turns"] >= 1.0 and "agents/end/done" in m and np.isfinite(m["loss/policy"])
        # First update of a step: the policy is the sampler's, so every ratio is 1 (float32 rounding)
        # only if the forward read the environment's ids as the sampler did.
        assert abs(m["ratio/mean"] - 1.0) < 1e-4 and m["clip_frac"] == 0.0
