"""Self-hosted post-training cookbook: multi-turn GRPO for tool-use agents.

Where to start: ``grpo.train.train_multi_turn(config, tasks, env_factory)`` trains a model on
an env under a ``grpo.config.GRPOConfig`` (README's first example; docs/tutorial.md walks
through a run). An env is written with ``envs`` (the contract ``Env``, ``Task``, ``Tool``;
``function_tool``, ``ToolEnv``, rewards, ``check_env``); ``envs.tool_use_game`` is the
reference env to copy. ``evaluation.evaluate`` scores a model, a run or a hosted endpoint;
``sft.train_sft`` fine-tunes on demonstrations; ``post-training-cookbook`` (``cli``, also
``python -m post_training_cookbook``) runs them from the command line.

The layers, bottom up; a module imports only from its own layer and those below, and no
circle of imports runs through two folders or inside one (docs/architecture.md has the table
``tests/test_layers.py`` checks):
- the foundation: ``types`` (chat records), ``files``, ``sync``, ``openai_api`` and the other
  top-level modules;
- ``envs`` (tasks, tools, episodes), ``tool_backends`` (MCP servers, the code sandbox),
  ``bundled_envs`` (the calculator, BFCL, τ²-bench);
- ``codecs`` (messages and tool specs ↔ token ids), ``models`` (the catalog, loading);
- ``engine`` (sampling), ``rollout`` (episodes and groups), ``trainer`` (log-probabilities,
  losses, the optimizer step), ``service`` (trainer and generators behind one interface);
- ``runs`` (a run's folder, checkpoints, resume, config rules), ``distill`` (on-policy
  distillation's teachers), ``evaluation``;
- ``grpo`` (the training loop), ``serve`` (the policy server), ``agents`` (external agents
  trained through it), ``sft``; the plots and viewer, ``cli``.
"""

__version__ = "0.1.0"

from post_training_cookbook import deprecation as _deprecation
from post_training_cookbook import runs as _runs
from post_training_cookbook.moved_paths import MOVED_MODULES as _MOVED_MODULES
from post_training_cookbook.moved_paths import MOVED_NAMES as _MOVED_NAMES

# Old paths of modules and names that moved up the layers, served until the removal release:
# from here, the top, where naming the new homes points down.
_deprecation.redirect(_MOVED_MODULES, _MOVED_NAMES)

# A run folder that no caller names a config class for (``evaluate("runs/x")``) is GRPO's:
# the entry wires it in by name, so ``runs/`` and ``evaluation/`` import nothing of ``grpo/``.
_runs.set_default_config_type("post_training_cookbook.grpo.config", "GRPOConfig")
