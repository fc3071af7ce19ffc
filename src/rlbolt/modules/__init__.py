"""Ready RLModules for language models: GRPO, DAPO, Dr.GRPO, RLOO, REINFORCE++, GSPO and PPO. The base
class `RLModule` (defined in `rlbolt.module`) is importable from here too. Each class registers its
`algorithm_name` when defined (`rlbolt.config.algorithms`: name -> class, for configs and the CLI)."""

from rlbolt.module import RLModule

from rlbolt.modules.dapo import DAPO
from rlbolt.modules.grpo import GRPO, GSPO, RLOO, DrGRPO
from rlbolt.modules.policy import LMPolicyModule
from rlbolt.modules.ppo import PPO
from rlbolt.modules.reinforcepp import ReinforcePP

__all__ = ["DAPO", "RLModule", "GRPO", "GSPO", "PPO", "RLOO", "DrGRPO", "LMPolicyModule", "ReinforcePP"]
