"""Self-hosted post-training cookbook: multi-turn GRPO for tool-use agents.

The path of an episode, one layer a subpackage: ``envs`` (tasks, tools, episodes) →
``codecs`` (messages ↔ tokens) → ``engine`` (sampling) → ``rollout`` (episodes and groups)
→ ``trainer`` (losses and the optimizer step) → ``service`` (trainer and generators behind
one interface) → ``grpo`` (the training loop). ``docs/architecture.md`` has every layer in
its order; no module imports from a layer above its own.
"""

__version__ = "0.1.0"

from post_training_cookbook import runs as _runs

# A run folder that no caller names a config class for (``evaluate("runs/x")``) is GRPO's:
# the entry wires it in by name, so ``runs/`` and ``evaluation/`` import nothing of ``grpo/``.
_runs.set_default_config_type("post_training_cookbook.grpo.config", "GRPOConfig")
