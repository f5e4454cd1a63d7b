"""Self-hosted post-training cookbook: multi-turn GRPO for tool-use agents.

Layers, each a subpackage: ``envs`` (tasks, tools, episodes) → ``codecs`` (messages ↔ tokens)
→ ``engine`` (sampling) → ``service`` (trainer and generators behind one interface)
→ ``grpo`` (the training loop).
"""

__version__ = "0.1.0"
