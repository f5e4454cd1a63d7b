"""Moved to ``post_training_cookbook.envs.tool_use_game.scripted_player``, with
``TeacherErrors`` now ``PlayerMistakes`` and ``BUNDLED_MODEL_TEACHER`` now
``BUNDLED_MODEL_PLAYER`` (this path and these names warn, for one release)."""

from post_training_cookbook.deprecation import moved_name

_NEW = "post_training_cookbook.envs.tool_use_game.scripted_player"
_RENAMED = {"TeacherErrors": "PlayerMistakes", "BUNDLED_MODEL_TEACHER": "BUNDLED_MODEL_PLAYER"}


def __getattr__(name: str) -> object:
    return moved_name(__name__, name, _NEW, new_name=_RENAMED.get(name, name))
