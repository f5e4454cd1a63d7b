"""The ``post-training-cookbook`` command (also ``python -m post_training_cookbook``).

    post-training-cookbook train run.yaml              GRPO from a YAML config
    post-training-cookbook eval MODEL                  score a model on an env
    post-training-cookbook eval --compare A B          two models, side by side
    post-training-cookbook eval hosted:NAME --base-url URL   a hosted model, same env
    post-training-cookbook eval MODEL --benchmark bfcl   BFCL's per-category accuracy
    post-training-cookbook serve MODEL                 an OpenAI-compatible endpoint
    post-training-cookbook models                      the model catalog
    post-training-cookbook plot runs/NAME              PNG of a run's metrics
    post-training-cookbook view runs/NAME --step N     one step's episodes

Each command has ``--help``. Bad arguments exit with status 2 and a one-line reason; a
failure while running exits with 1. Reference: docs/cli.md.

Envs and tasks are named by import path, ``package.module:name`` (the working directory is
importable, so ``my_env:MathEnv`` finds ``./my_env.py``). A class is called with no
arguments when it needs none, any other factory with the task; tasks are a sequence of
``Task``, a function returning one, or a ``.jsonl`` file of ``{"prompt", "target",
"metadata"}`` lines.
"""

from post_training_cookbook.cli.parser import CliError, build_parser, main

__all__ = ["CliError", "build_parser", "main"]
