"""Envs that come with the package, each built on the env contract (``envs/``): the
calculator (``calculator``: the docs' ``MathEnv`` with seeded arithmetic tasks) and the
Berkeley Function Calling Leaderboard (``bfcl``: single- and multi-turn). The reference env,
``tool_use_game``, stays beside the contract (``post_training_cookbook.envs.tool_use_game``),
the path the guide gives for copying it. Importing this package imports no env."""
