"""Evaluation: score a catalog model, a local folder or a run's checkpoint on any env.

    from post_training_cookbook.evaluation import evaluate, format_comparison

    before = evaluate("post-training-cookbook/tool-use-tiny", tasks, env_factory, 4)
    after = evaluate("runs/my-run", tasks, env_factory, 4)
    print(format_comparison([before, after]))

``runner`` plays the episodes (as training validation does), ``results`` holds what comes
back (``EvalResult``, pass@k, tables), ``models`` decides what to load, ``hosted`` scores an
OpenAI-compatible endpoint (``evaluate(HostedModel(name, base_url), ...)``), ``benchmarks``
plays a published benchmark instead of your env (``evaluate(model, benchmark="bfcl")``,
its report in ``result.benchmark``, a ``scores.BenchmarkScore``; docs/evaluation.md;
τ²-bench's pass^k: ``benchmark="tau2:retail@test", user_simulator=...``, ``tau2_benchmark``,
docs/tau2.md),
``local_judge`` runs a judge model for judge rewards (``LocalJudge``, imported on first use).
"""

from post_training_cookbook.evaluation.benchmarks import BenchmarkSpec
from post_training_cookbook.evaluation.hosted import HostedEndpointError, HostedModel
from post_training_cookbook.evaluation.models import EvalModel, resolve_eval_model
from post_training_cookbook.evaluation.results import (
    EvalResult,
    EvalSettings,
    LevelResult,
    TaskResult,
    format_comparison,
    format_result,
    pass_at_k,
)
from post_training_cookbook.evaluation.runner import aevaluate, evaluate
from post_training_cookbook.evaluation.scores import BenchmarkScore, CategoryScore
from post_training_cookbook.lazy import module_getattr

__all__ = [
    "BenchmarkScore",
    "BenchmarkSpec",
    "CategoryScore",
    "EvalModel",
    "EvalResult",
    "EvalSettings",
    "HostedEndpointError",
    "HostedModel",
    "LevelResult",
    "LocalJudge",
    "TaskResult",
    "aevaluate",
    "evaluate",
    "format_comparison",
    "format_result",
    "pass_at_k",
    "resolve_eval_model",
]

__getattr__ = module_getattr(
    __name__, lazy={"LocalJudge": "post_training_cookbook.evaluation.local_judge"}
)
