"""The ``bfcl-eval`` package, imported once, with an error that says how to install it.

Everything BFCL-specific that is not plumbing comes from ``bfcl-eval`` as published: the
questions and possible answers (``bfcl_eval/data``), the function-doc preprocessing (the
language hint, ``convert_to_tool`` with ``GORILLA_TO_OPENAPI``), the output-format checks
(``is_function_calling_format_output``, ``is_empty_output``) and the AST checker
(``ast_checker``). What this module adds is one entry in BFCL's own model registry
(``MODEL_CONFIG_MAPPING``), the way BFCL asks a new model to be added: a function-calling
model whose tool names have their dots replaced by underscores, as ``convert_to_tool`` does
for every OpenAI-style model.
"""

from __future__ import annotations

import functools
import os
import tempfile
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

BFCL_EVAL_VERSION = "2026.3.23"
"""The version the docs' numbers and the tests were made with (requirements/bfcl.txt)."""

CHECKER_MODEL_NAME = "post-training-cookbook-FC"
"""Our entry in BFCL's model registry; the AST checker reads its ``underscore_to_dot``.
No underscores: the checker maps ``_`` to ``/`` before it looks a name up."""

INSTALL_HINT = (
    "BFCL scoring needs the bfcl-eval package and the modules its checker imports: "
    "pip install 'post-training-cookbook[bfcl]' && pip install --no-deps --require-hashes "
    "-r requirements/bfcl.txt (docs/evaluation.md, BFCL)"
)


class BFCLNotInstalledError(ImportError):
    """``bfcl-eval`` (or a module its checker imports) is missing."""


class BFCLModules(NamedTuple):
    """The parts of ``bfcl-eval`` the benchmark uses, imported together."""

    utils: ModuleType  # bfcl_eval.utils: load_file, the language hint, the format checks
    model_utils: ModuleType  # bfcl_eval.model_handler.utils: convert_to_tool
    ast_checker: ModuleType  # bfcl_eval.eval_checker.ast_eval.ast_checker
    enums: ModuleType  # bfcl_eval.constants.enums: Language, ModelStyle
    type_mappings: ModuleType  # bfcl_eval.constants.type_mappings: GORILLA_TO_OPENAPI
    data_dir: Path  # bfcl_eval/data: BFCL_v4_<category>.json and possible_answer/
    version_prefix: str  # "BFCL_v4"
    version: str  # bfcl-eval's installed version


@functools.cache
def bfcl() -> BFCLModules:
    """``bfcl-eval``'s modules, our model registered; ``BFCLNotInstalledError`` if absent."""
    # bfcl-eval writes its result, score and lock folders under BFCL_PROJECT_ROOT, by
    # default next to the installed package (site-packages); keep them out of there.
    os.environ.setdefault(
        "BFCL_PROJECT_ROOT", str(Path(tempfile.gettempdir()) / "post-training-cookbook-bfcl")
    )
    try:
        import bfcl_eval.constants.enums as enums
        import bfcl_eval.constants.type_mappings as type_mappings
        import bfcl_eval.eval_checker.ast_eval.ast_checker as ast_checker
        import bfcl_eval.model_handler.utils as model_utils
        import bfcl_eval.utils as utils
        from bfcl_eval.constants.category_mapping import VERSION_PREFIX
        from bfcl_eval.constants.eval_config import PROMPT_PATH
        from bfcl_eval.constants.model_config import MODEL_CONFIG_MAPPING, ModelConfig
        from bfcl_eval.model_handler.api_inference.openai_completion import (
            OpenAICompletionsHandler,
        )
    except ImportError as exc:
        raise BFCLNotInstalledError(f"{INSTALL_HINT}; importing it failed: {exc}") from exc
    MODEL_CONFIG_MAPPING.setdefault(
        CHECKER_MODEL_NAME,
        ModelConfig(
            model_name=CHECKER_MODEL_NAME,
            display_name="post-training-cookbook (FC)",
            url="docs/evaluation.md",  # no leaderboard page: a local model
            org="post-training-cookbook",
            license="Apache-2.0",
            model_handler=OpenAICompletionsHandler,
            is_fc_model=True,
            underscore_to_dot=True,
        ),
    )
    return BFCLModules(
        utils=utils,
        model_utils=model_utils,
        ast_checker=ast_checker,
        enums=enums,
        type_mappings=type_mappings,
        data_dir=Path(PROMPT_PATH),
        version_prefix=VERSION_PREFIX,
        version=metadata.version("bfcl-eval"),
    )


class BFCLMultiTurnModules(NamedTuple):
    """The parts of ``bfcl-eval`` the multi-turn categories use."""

    load_dataset_entry: Any  # bfcl_eval.utils: an entry with its docs, as BFCL's runner reads it
    load_ground_truth_entry: Any
    utils: ModuleType  # ...multi_turn_eval.multi_turn_utils: executes calls on the backends
    checker: ModuleType  # ...multi_turn_eval.multi_turn_checker: entry, state, response checks
    backend_modules: dict[str, str]  # class name → module (CLASS_FILE_PATH_MAPPING)
    added_functions_prompt: str  # DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC


@functools.cache
def bfcl_multi_turn() -> BFCLMultiTurnModules:
    """``bfcl-eval``'s multi-turn checker, backends and data readers."""
    bfcl()  # the project root, and BFCLNotInstalledError when it is missing
    try:
        import bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker as checker
        import bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils as utils
        from bfcl_eval.constants.default_prompts import (
            DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC,
        )
        from bfcl_eval.constants.executable_backend_config import (
            CLASS_FILE_PATH_MAPPING,
        )
        from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry
    except ImportError as exc:
        raise BFCLNotInstalledError(f"{INSTALL_HINT}; importing it failed: {exc}") from exc
    return BFCLMultiTurnModules(
        load_dataset_entry=load_dataset_entry,
        load_ground_truth_entry=load_ground_truth_entry,
        utils=utils,
        checker=checker,
        backend_modules=dict(CLASS_FILE_PATH_MAPPING),
        added_functions_prompt=DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC,
    )
