"""Self-hosted post-training cookbook: multi-turn GRPO for tool-use agents.

The path of an episode, one layer a subpackage: ``envs`` (tasks, tools, episodes) →
``codecs`` (messages ↔ tokens) → ``engine`` (sampling) → ``rollout`` (episodes and groups)
→ ``trainer`` (losses and the optimizer step) → ``service`` (trainer and generators behind
one interface) → ``grpo`` (the training loop). ``docs/architecture.md`` has every layer in
its order; no module imports from a layer above its own.
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
