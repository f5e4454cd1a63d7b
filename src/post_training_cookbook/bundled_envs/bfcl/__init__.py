"""The Berkeley Function Calling Leaderboard (BFCL v4) on ``bfcl-eval``'s data and checker.

    from post_training_cookbook.bundled_envs.bfcl import BFCLEnv, bfcl_tasks, bfcl_train_tasks

    test = bfcl_tasks()          # simple_python, multiple, parallel, parallel_multiple, irrelevance
    train = bfcl_train_tasks()   # the live_* categories, less any question the test set has

    from post_training_cookbook.bundled_envs.bfcl import BFCLMultiTurnEnv, bfcl_multi_turn_tasks

    train = bfcl_multi_turn_tasks(["multi_turn_base"], split="train")     # 148 entries
    held_out = bfcl_multi_turn_tasks(["multi_turn_base"], split="held_out")  # 52 entries

``evaluate(model, benchmark="bfcl")`` scores the test categories as BFCL reports them
(per-category accuracy; docs/evaluation.md); ``benchmark="bfcl_multi_turn"`` the multi-turn
categories, played by ``BFCLMultiTurnEnv`` on ``bfcl-eval``'s backends
(docs/bfcl_multi_turn.md). Needs the ``bfcl`` extra and ``bfcl-eval``
installed without its dependencies (``requirements/bfcl.txt``); importing this package
does not import ``bfcl-eval``, the first item loaded or checked does.
"""

from post_training_cookbook.bundled_envs.bfcl.checker import BFCLVerdict, check_reply, reply_calls
from post_training_cookbook.bundled_envs.bfcl.data import (
    CATEGORIES,
    NO_ANSWER_CATEGORIES,
    TEST_CATEGORIES,
    TRAIN_CATEGORIES,
    BFCLItem,
    bfcl_tasks,
    bfcl_train_tasks,
    load_items,
    question_texts,
)
from post_training_cookbook.bundled_envs.bfcl.env import BFCLEnv
from post_training_cookbook.bundled_envs.bfcl.ground_truth import GroundTruthPlayer, NeverCallPlayer
from post_training_cookbook.bundled_envs.bfcl.multi_turn_data import (
    MULTI_TURN_CATEGORIES,
    MultiTurnEntry,
    bfcl_multi_turn_tasks,
    load_multi_turn_entries,
    scenario_split,
)
from post_training_cookbook.bundled_envs.bfcl.multi_turn_env import BFCLMultiTurnEnv
from post_training_cookbook.bundled_envs.bfcl.package import (
    BFCL_EVAL_VERSION,
    CHECKER_MODEL_NAME,
    BFCLNotInstalledError,
)

__all__ = [
    "BFCL_EVAL_VERSION",
    "CATEGORIES",
    "CHECKER_MODEL_NAME",
    "MULTI_TURN_CATEGORIES",
    "NO_ANSWER_CATEGORIES",
    "TEST_CATEGORIES",
    "TRAIN_CATEGORIES",
    "BFCLEnv",
    "BFCLItem",
    "BFCLMultiTurnEnv",
    "BFCLNotInstalledError",
    "BFCLVerdict",
    "GroundTruthPlayer",
    "MultiTurnEntry",
    "NeverCallPlayer",
    "bfcl_multi_turn_tasks",
    "bfcl_tasks",
    "bfcl_train_tasks",
    "check_reply",
    "load_items",
    "load_multi_turn_entries",
    "question_texts",
    "reply_calls",
    "scenario_split",
]
