"""Moved to ``post_training_cookbook.envs.tool_use_game.scripted_player``, with
``TeacherErrors`` now ``PlayerMistakes`` and ``BUNDLED_MODEL_TEACHER`` now
``BUNDLED_MODEL_PLAYER`` (this path and these names warn, for one release)."""

from post_training_cookbook.deprecation import moved_name
from post_training_cookbook.envs.tool_use_game import scripted_player

_RENAMED = {"TeacherErrors": "PlayerMistakes", "BUNDLED_MODEL_TEACHER": "BUNDLED_MODEL_PLAYER"}


def __getattr__(name: str) -> object:
    new_name = _RENAMED.get(name, name)
    if name.startswith("__") or not hasattr(scripted_player, new_name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return moved_name(__name__, name, scripted_player.__name__, new_name=new_name)
