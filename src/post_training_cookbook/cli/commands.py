"""What each command does, once its arguments are parsed (heavy imports happen here)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from post_training_cookbook.cli.loading import (
    CliError,
    eval_env,
    load_env_factory,
    load_mixture,
    load_tasks,
    load_train_config,
)

if TYPE_CHECKING:
    from post_training_cookbook.bundled_envs.tau2 import UserSimulatorSettings
    from post_training_cookbook.cli.loading import EnvFactory
    from post_training_cookbook.envs.base import Task
    from post_training_cookbook.evaluation import EvalResult, EvalSettings, HostedModel
    from post_training_cookbook.grpo.config import GRPOConfig
    from post_training_cookbook.models.catalog import ModelInfo

PROG = "post-training-cookbook"
HOSTED_PREFIX = "hosted:"


def run_train(args: argparse.Namespace) -> int:
    from post_training_cookbook.grpo.train import train_multi_turn

    config, env = load_train_config(args.config, args.overrides)
    if "mixture" in env:
        run = train_multi_turn(config, load_mixture(env["mixture"]))
    else:
        if "tasks" not in env:
            raise CliError(f"{args.config}: env.tasks is missing (the tasks to train on)")
        factory = load_env_factory(env["factory"])
        tasks = load_tasks(env["tasks"])
        val_tasks = load_tasks(env["val_tasks"]) if "val_tasks" in env else None
        run = train_multi_turn(config, tasks, factory, val_tasks)
    print(f"run: {run.path}")
    print(f"final model: {run.final_model_dir}")
    print(f"next: {PROG} plot {run.path}  |  {PROG} view {run.path}")
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from transformers.utils import logging as transformers_logging

    from post_training_cookbook.evaluation import aevaluate, format_comparison

    transformers_logging.disable_progress_bar()  # weight loading bars, one per model

    config, env = load_train_config(args.config, []) if args.config else (None, {})
    named = list(args.compare) if args.compare else [args.model or _config_model(config)]
    models = [_hosted_or_local(model, args) for model in named]
    if args.step is not None and args.compare:
        raise CliError("--step applies to one MODEL; with --compare, name checkpoint folders")
    settings = _eval_settings(args, config)
    factory, tasks = _eval_inputs(args, env)
    user = _user_simulator(args)
    codec = args.codec or (config.codec if config else None)
    results: list[EvalResult] = []
    for model in models:
        local = isinstance(model, str)
        coroutine = aevaluate(
            model, tasks, factory, settings, benchmark=args.benchmark, limit=args.limit,
            user_simulator=user, codec=codec if local else None, step=args.step if local else None,
            dtype=args.dtype if local else None, pass_k=args.pass_k, label=args.label,
            runs_dir=None if args.no_save else args.runs_dir, progress=sys.stderr.isatty(),
            device=args.device,
        )  # fmt: skip
        results.append(asyncio.run(coroutine))
    if args.json:
        summaries = [result.to_dict() for result in results]
        print(json.dumps(summaries if args.compare else summaries[0], indent=1, default=str))
    else:
        print(format_comparison(results))
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from transformers.utils import logging as transformers_logging

    from post_training_cookbook.serve import ServerLimits, load_served_model, serve_forever
    from post_training_cookbook.serve.server import check_bind

    transformers_logging.disable_progress_bar()
    token = _env_value(args.token_env, "--token-env") if args.token_env else None
    check_bind(args.host, token)  # before the weights load
    listening = _listen(args.host, args.port)  # a port in use fails before the weights load
    limits = ServerLimits(
        max_request_bytes=args.max_request_bytes,
        max_concurrent_requests=args.max_concurrent_requests,
    )
    served, engine = load_served_model(
        args.model, step=args.step, codec=args.codec, dtype=args.dtype,
        max_model_length=args.max_model_length, default_max_tokens=args.max_tokens,
        name=args.name, prefix_cache_bytes=args.prefix_cache_bytes,
    )  # fmt: skip
    shown = args.host if ":" not in args.host else f"[{args.host}]"
    print(f"serving {served.name} at http://{shown}:{args.port}/v1 (Ctrl-C stops)", flush=True)
    try:
        serving = serve_forever(
            served, host=args.host, port=args.port, token=token, limits=limits, sock=listening
        )
        asyncio.run(serving)
    except KeyboardInterrupt:  # Ctrl-C is how a server stops: uvicorn re-raises it once done
        print("stopped", flush=True)
    finally:
        engine.shutdown()
    return 0


def _listen(host: str, port: int) -> Any:
    from post_training_cookbook.serve.server import bound_socket

    try:
        return bound_socket(host, port)
    except OSError as exc:
        raise CliError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another --port "
            "(or stop what uses it)"
        ) from None


def run_models(args: argparse.Namespace) -> int:
    from post_training_cookbook.models.catalog import list_models

    models = list_models()
    if args.json:
        print(json.dumps([_model_json(info) for info in models], indent=1))
        return 0
    header = ("id", "codec", "sampling", "context", "dtype", "training", "description")
    rows = [header] + [_model_row(info) for info in models]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        print("  ".join([*cells, row[-1]]).rstrip())
    return 0


def run_plot(args: argparse.Namespace) -> int:
    from post_training_cookbook.plots import save_run_plot

    print(save_run_plot(args.run_dir, args.out))
    return 0


def run_view(args: argparse.Namespace) -> int:
    from post_training_cookbook.viewer import format_step, load_decoder, load_step, write_html

    view = load_step(args.path, args.step, args.kind)
    decode = load_decoder(view.source)
    if decode is None:
        print("note: no tokenizer found for this run: showing token ids", file=sys.stderr)
    if args.html:
        path = write_html(view, decode, args.html)
        print(f"{path} ({len(view.episodes)} episodes of {view.title})")
        return 0
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    options = {"limit": args.limit, "group": args.group, "full_prompt": args.full_prompt}
    options["env"] = args.env
    print(format_step(view, decode, color=color, **options))
    return 0


def _eval_inputs(
    args: argparse.Namespace, env: dict[str, Any]
) -> tuple[EnvFactory | None, list[Task] | None]:
    """The env and tasks ``eval`` plays; ``None`` for both when a benchmark brings its own."""
    if args.benchmark is None:
        if args.limit is not None:
            raise CliError("--limit applies to --benchmark (items per category); see --num-tasks")
        factory, tasks = eval_env(args.env, args.tasks, env)
        return factory, tasks[: args.num_tasks] if args.num_tasks else tasks
    clashing = [flag for flag, value in _ENV_FLAGS.items() if getattr(args, value) is not None]
    if clashing:
        raise CliError(f"--benchmark brings its own tasks and env: drop {', '.join(clashing)}")
    return None, None


_ENV_FLAGS = {"--env": "env", "--tasks": "tasks", "--num-tasks": "num_tasks"}


def _eval_settings(args: argparse.Namespace, config: GRPOConfig | None) -> EvalSettings:
    from post_training_cookbook.evaluation import EvalSettings
    from post_training_cookbook.evaluation.benchmarks import BenchmarkSpec, benchmark_limits
    from post_training_cookbook.grpo.settings import eval_settings

    base = eval_settings(config) if config else EvalSettings()
    if args.benchmark is not None:
        base = replace(base, temperature=0.0)  # benchmarks are scored greedy by default
        # ... and under their own bounds (bfcl_multi_turn's), unless the flags say otherwise
        base = base.with_limits(**benchmark_limits(BenchmarkSpec.parse(args.benchmark)))
    flags = {
        "episodes_per_task": args.episodes_per_task,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "success_threshold": args.success_threshold,
    }
    limits = {
        "max_turns": args.max_turns,
        "max_model_length": args.max_model_length,
        "max_tokens_per_turn": args.max_tokens_per_turn,
    }
    base = base.with_limits(**{key: value for key, value in limits.items() if value is not None})
    return replace(base, **{key: value for key, value in flags.items() if value is not None})


def _user_simulator(args: argparse.Namespace) -> UserSimulatorSettings | None:
    """τ²'s simulated user from the ``--user-*`` flags (None without ``--user-model``)."""
    if args.user_model is None:
        given = [flag for flag, value in _USER_FLAGS.items() if getattr(args, value)]
        if given:
            raise CliError(f"the user simulator's {', '.join(given)}: name its --user-model")
        return None
    if args.user_no_api_key and args.user_api_key_env:
        raise CliError("the user simulator's key: --user-no-api-key or --user-api-key-env")
    from post_training_cookbook.bundled_envs.tau2 import UserSimulatorSettings

    key = None if args.user_no_api_key else args.user_api_key_env or "OPENAI_API_KEY"
    return UserSimulatorSettings(args.user_model, base_url=args.user_base_url, api_key_env=key)


_USER_FLAGS = {
    "--user-base-url": "user_base_url",
    "--user-api-key-env": "user_api_key_env",
    "--user-no-api-key": "user_no_api_key",
}


def _hosted_or_local(model: str, args: argparse.Namespace) -> str | HostedModel:
    """``hosted:NAME`` as a ``HostedModel`` on ``--base-url``; anything else as it is."""
    from post_training_cookbook.evaluation import HostedModel

    if not model.startswith(HOSTED_PREFIX):
        return model
    if not args.base_url:
        raise CliError(f"{model} needs --base-url (the endpoint, up to /v1)")
    return HostedModel(
        model[len(HOSTED_PREFIX) :],
        args.base_url,
        api_key_env=None if args.no_api_key else args.api_key_env,
        max_concurrency=args.max_concurrency,
        timeout_s=args.request_timeout,
        max_retries=args.max_retries,
    )


def _env_value(name: str, flag: str) -> str:
    value = os.environ.get(name, "")
    if not value:
        raise CliError(f"{flag} {name}: the environment variable is unset or empty")
    return value


def _config_model(config: GRPOConfig | None) -> str:
    """The config's model, else GRPOConfig's default: the bundled model."""
    from post_training_cookbook.models import BUNDLED_MODEL_ID

    return config.model if config is not None else BUNDLED_MODEL_ID


def _model_row(info: ModelInfo) -> tuple[str, ...]:
    sampling = "generator" if info.generator_support else "trainer-only"
    return (
        info.model_id,
        info.codec or "-",
        sampling,
        str(info.max_context),
        info.default_dtype,
        "/".join(info.training_modes),
        info.description + (f" ({info.trainer_only_reason})" if info.trainer_only else ""),
    )


def _model_json(info: ModelInfo) -> dict[str, Any]:
    return {
        "id": info.model_id,
        "codec": info.codec,
        "generator_support": info.generator_support,
        "trainer_only": info.trainer_only,
        "max_context": info.max_context,
        "default_dtype": info.default_dtype,
        "training_modes": list(info.training_modes),
        "source": info.source,
        "description": info.description,
        "trainer_only_reason": info.trainer_only_reason,
    }
