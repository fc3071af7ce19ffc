"""Multi-turn rollouts: environments, tools and token-in/token-out episodes (docs/howto/agents.md).

The entry point is `run_episodes(engine, envs, rng_keys, tokenizer=..., max_turns=...,
max_total_tokens=..., max_turn_tokens=...) -> EpisodeBatch`: N episodes, one batched generate call
per turn, the training sequence exactly the sampled ids plus the environment's ids, with a loss
mask (`completion_mask`) that is 1 only on sampled ids.
"""

from rlbolt.agents.environment import (EnvFactory, Environment, Message, StepResult, ToolEnvironment,
                                       load_env_factory)
from rlbolt.agents.failures import EnvErrorMonitor, EnvFailureError
from rlbolt.agents.episode import EpisodeState, TurnRenderer
from rlbolt.agents.openenv_adapter import OpenEnvEnvironment
from rlbolt.agents.parsers import (THINK_TAGS, CompactToolParser, HermesToolParser, Llama3JsonToolParser, ParsedTurn,
                                   ToolCall, ToolCallParser, split_reasoning)
from rlbolt.agents.rollout import END_REASONS, EpisodeBatch, run_episodes
from rlbolt.agents.tools import Tool, ToolOutcome, ToolRunner, as_tool, python_tool, tool_schema

__all__ = ["END_REASONS", "THINK_TAGS", "CompactToolParser", "EnvErrorMonitor", "EnvFactory", "EnvFailureError",
           "Environment", "EpisodeBatch", "EpisodeState",
           "HermesToolParser", "Llama3JsonToolParser", "Message", "OpenEnvEnvironment", "ParsedTurn", "StepResult", "Tool", "ToolCall",
           "ToolCallParser", "ToolEnvironment", "ToolOutcome", "ToolRunner", "TurnRenderer", "as_tool",
           "load_env_factory", "python_tool", "run_episodes", "split_reasoning", "tool_schema"]
