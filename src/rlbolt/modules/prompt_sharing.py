"""Where the LM modules run each group's prompt once (`model.share_prompt`), and the check that
makes it safe.

The producer lays a global batch out as `a a b b`: the G = num_generations samples of a prompt
are consecutive, and every stage's micro batch is a consecutive slice. A stage whose micro
batches hold whole groups (its size a multiple of G) runs each group's prompt once
(`rlbolt.models.shared_prefix`); a stage whose micro batches would split a group falls back to
the unshared forward (the plan is left as the user wrote it). On a mesh with more than one
batch shard (data x fsdp > 1) every stage runs unshared: the shared forward packs a micro
batch's prompt and completion tokens into one row, which does not split over batch shards. The layout is checked on the host
before it is trusted: a hook that reorders or drops single samples is refused with one line
instead of training on another sample's prompt.
"""

from __future__ import annotations

import numpy as np

from rlbolt.models.shared_prefix import shared_rows_mismatch


def stage_group_size(share: bool, micro_batch_size: int, num_generations: int, batch_shards: int = 1) -> int:
    """The static group size a stage's forward shares its prompts over: G, or 1 (unshared).

    Args:
      share: `model.share_prompt`.
      micro_batch_size: the stage's samples per device call.
      num_generations: G.
      batch_shards: pieces a mesh cuts the sample axis into (data x fsdp); the shared forward
        packs a micro batch's tokens into one row, so a mesh with more than one batch shard
        runs unshared.

    Returns:
      G when sharing is on, G > 1, one batch shard and every micro batch holds whole groups; else 1.
    """
    if not share or num_generations < 2 or batch_shards > 1 or micro_batch_size % num_generations:
        return 1
    return num_generations


def require_shared_layout(prompt_ids: np.ndarray, prompt_mask: np.ndarray, group_size: int, where: str) -> None:
    """Raises ValueError unless every block of `group_size` consecutive rows has one prompt.

    Args:
      prompt_ids: [N, P] left-padded prompt tokens (host).
      prompt_mask: [N, P] bool.
      group_size: the G the stage shares over (1: nothing to check).
      where: the hook that produced the batch, for the message.
    """
    row = shared_rows_mismatch(prompt_ids, prompt_mask, group_size)
    if row is None:
        return
    n = np.shape(prompt_ids)[0]
    what = (f"{n} samples do not split into groups of {group_size}" if row == n else
            f"sample {row} has a different prompt from sample {row - row % group_size}, the first of its group")
    raise ValueError(
        f"model.share_prompt: {where} gave a batch whose {what}; the shared-prompt forward needs each "
        f"prompt's num_generations={group_size} samples consecutive (drop or reorder whole groups only), "
        "or set model.share_prompt=false")
