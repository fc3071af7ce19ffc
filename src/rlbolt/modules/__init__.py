"""Ready RLModules for language models: GRPO, DAPO, Dr.GRPO, RLOO, REINFORCE++, GSPO and PPO. The base
class `RLModule` (defined in `rlbolt.module`) is importable from here too."""

from rlbolt.module import RLModule

from rlbolt.modules.dapo import DAPO
from rlbolt.modules.grpo import GRPO, GSPO, RLOO, DrGRPO
from rlbolt.modules.policy import LMPolicyModule
from rlbolt.modules.ppo import PPO
from rlbolt.modules.reinforcepp import ReinforcePP

MODULES = {"grpo": GRPO, "dapo": DAPO, "drgrpo": DrGRPO, "rloo": RLOO, "reinforcepp": ReinforcePP, "gspo": GSPO, "ppo": PPO}

__all__ = ["DAPO", "RLModule", "GRPO", "GSPO", "MODULES", "PPO", "RLOO", "DrGRPO", "LMPolicyModule", "ReinforcePP"]
