"""GRPO for tool-use agents: ``config`` holds ``GRPOConfig``, the one typed config of the
entry points; ``train`` holds ``train_multi_turn`` and ``train_single_turn``.

``post_training_cookbook.grpo.config`` itself imports neither torch nor wandb, so that a
recipe can build, validate and save a config before anything heavy is needed.
"""
