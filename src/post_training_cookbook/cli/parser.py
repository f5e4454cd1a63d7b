"""The argument parser of every command, and ``main``: errors become one line and a status."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from post_training_cookbook.cli import commands
from post_training_cookbook.cli.loading import DEFAULT_ENV, DEFAULT_TASKS, CliError, add_set_option
from post_training_cookbook.cli.sft import add_sft
from post_training_cookbook.runs.stopping import TrainingStopped

PROG = commands.PROG


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        commands_named = ", ".join(sorted(_command_names(parser)))
        print(f"{PROG}: error: name a command ({commands_named}); see --help", file=sys.stderr)
        return 2
    try:
        return int(args.run(args))
    except TrainingStopped as stopped:  # a scheduler's SIGTERM, honoured: the status it expects
        print(f"{PROG} {args.command}: {stopped}", file=sys.stderr)
        return 128 + signal.SIGTERM
    except (CliError, ValueError, ImportError) as exc:
        return _fail(args, exc, status=2)
    except (OSError, RuntimeError) as exc:
        return _fail(args, exc, status=1)
    except KeyboardInterrupt:
        return 130


def _fail(args: argparse.Namespace, exc: BaseException, *, status: int) -> int:
    if args.traceback:
        raise exc
    reason = "; ".join(line.strip(" -") for line in str(exc).splitlines() if line.strip())
    print(f"{PROG} {args.command}: error: {reason or type(exc).__name__}", file=sys.stderr)
    return status


# --- Parser -------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Multi-turn GRPO for tool-use agents: train, SFT, evaluate, inspect runs.",
        epilog="Run '%(prog)s COMMAND --help' for a command's options. Docs: docs/cli.md.",
    )
    parser.add_argument(
        "--traceback", action="store_true", help="show the full traceback of an error"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_train(subparsers)
    add_sft(subparsers, _command)
    _add_eval(subparsers)
    _add_serve(subparsers)
    _add_models(subparsers)
    _add_plot(subparsers)
    _add_view(subparsers)
    return parser


def _command(subparsers: Any, name: str, summary: str, epilog: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help=summary,
        description=summary,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--traceback", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    return parser


def _add_train(subparsers: Any) -> None:
    parser = _command(
        subparsers,
        "train",
        "Train with GRPO (train_multi_turn) from a YAML config.",
        "The YAML holds GRPOConfig fields, one mapping per section (docs/grpo_config.md),\n"
        "plus an 'env:' section:\n\n"
        "  base:\n"
        "    model: post-training-cookbook/tool-use-tiny\n"
        "  optimizer:\n"
        "    num_steps: 20\n"
        "  logging:\n"
        "    wandb_project: null\n"
        "  env:\n"
        f"    factory: {DEFAULT_ENV}\n"
        "    tasks: post_training_cookbook.envs.tool_use_game:TOOL_USE_GAME_TRAIN_TASKS\n"
        f"    val_tasks: {DEFAULT_TASKS}\n\n"
        "example: %(prog)s run.yaml --set optimizer.num_steps=2 --set checkpoints.run_name=smoke",
    )
    parser.add_argument("config", type=Path, help="YAML file: GRPOConfig fields + env section")
    add_set_option(parser, "a GRPOConfig field", "batch_size=4")
    parser.set_defaults(run=commands.run_train)


def _add_eval(subparsers: Any) -> None:
    parser = _command(
        subparsers,
        "eval",
        "Score a model on an env: mean reward, pass@k, per level, how episodes end.",
        "MODEL is a catalog id, a local Hugging Face folder, a run directory (its\n"
        "final_model; --step N for a checkpoint), a checkpoint folder, or hosted:NAME,\n"
        "the model NAME on the OpenAI-compatible endpoint at --base-url (API key read\n"
        "from --api-key-env). A hosted model's tokens are its own: token counts do not\n"
        "compare with a local model's (docs/hosted_eval.md).\n"
        "Settings: a flag, else --config's (the run's validation settings), else the\n"
        "GRPOConfig defaults. Compare models only under the same settings.\n\n"
        "examples:\n"
        "  %(prog)s post-training-cookbook/tool-use-tiny --episodes-per-task 4\n"
        "  %(prog)s --config run.yaml --compare post-training-cookbook/tool-use-tiny runs/x\n"
        "  %(prog)s runs/x --step 10 --num-tasks 8\n"
        "  %(prog)s --compare hosted:gpt-4.1-mini post-training-cookbook/tool-use-tiny \\\n"
        "      --base-url https://api.openai.com/v1 --api-key-env OPENAI_API_KEY\n"
        "  %(prog)s runs/x --benchmark bfcl --limit 20\n"
        "  %(prog)s hosted:my-model --base-url http://127.0.0.1:8000/v1 --no-api-key \\\n"
        "      --benchmark bfcl:simple_python,irrelevance\n"
        "  %(prog)s runs/x --benchmark bfcl_multi_turn:base@held_out\n"
        "  %(prog)s runs/x --benchmark tau2:airline@test --episodes-per-task 4 \\\n"
        "      --user-model Qwen/Qwen3-8B --user-base-url http://127.0.0.1:8001/v1 \\\n"
        "      --user-no-api-key\n"
        "  %(prog)s runs/x --benchmark tau2:telecom_solo --limit 20",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="what to evaluate (default: --config's model, else the bundled model)",
    )
    which.add_argument(
        "--compare", nargs=2, metavar=("A", "B"), help="evaluate A and B, print side by side"
    )
    parser.add_argument("--step", type=int, metavar="N", help="a run's checkpoint at step N")
    parser.add_argument(
        "--config", type=Path, metavar="YAML", help="a training config: env, tasks, settings"
    )
    parser.add_argument("--env", metavar="IMPORT", help=f"env factory (default: {DEFAULT_ENV})")
    parser.add_argument("--tasks", metavar="IMPORT|JSONL", help=f"tasks (default: {DEFAULT_TASKS})")
    parser.add_argument("--num-tasks", type=_positive, metavar="N", help="only the first N tasks")
    parser.add_argument(
        "--benchmark",
        metavar="NAME[:CATEGORIES][@SPLIT]",
        help="a published benchmark instead of an env: bfcl (its five single-turn test "
        "categories) or bfcl:simple_python,multiple,... (docs/evaluation.md); "
        "bfcl_multi_turn[:base,miss_func,...][@train|@held_out]: BFCL's multi-turn entries, "
        "entry and per-turn accuracy (docs/bfcl_multi_turn.md); tau2[:airline,retail,telecom,"
        "telecom_solo][@SPLIT]: τ²-bench's pass^k per domain, k up to --episodes-per-task "
        "(docs/tau2.md); greedy unless --temperature",
    )
    parser.add_argument(
        "--limit",
        type=_positive,
        metavar="N",
        help="with --benchmark: first N items per category (tau2: tasks per domain)",
    )
    settings = parser.add_argument_group(
        "settings", "default: --config's validation settings, else GRPOConfig's defaults"
    )
    settings.add_argument(
        "--episodes-per-task", type=_positive, metavar="N", help="episodes per task (default 1)"
    )
    settings.add_argument("--max-turns", type=_positive, metavar="N", help="(default 6)")
    settings.add_argument("--max-model-length", type=_positive, metavar="N", help="(default 2048)")
    settings.add_argument(
        "--max-tokens-per-turn", type=_positive, metavar="N", help="(default 256)"
    )
    settings.add_argument("--temperature", type=float, metavar="T", help="(default 1.0; 0 greedy)")
    settings.add_argument("--top-p", type=float, metavar="P", help="(default 1.0)")
    settings.add_argument(
        "--success-threshold", type=float, metavar="R", help="reward that passes (default 1.0)"
    )
    settings.add_argument(
        "--pass-k", type=_positive, nargs="+", metavar="K", help="k of pass@k (default 1,2,4..N)"
    )
    parser.add_argument("--codec", help="codec name (default: the catalog's or the run's)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="sampling dtype")
    parser.add_argument(
        "--device", default="auto", help="where to sample: auto (CUDA when present), cpu, cuda:N"
    )
    hosted = parser.add_argument_group("hosted models (MODEL = hosted:NAME)")
    hosted.add_argument("--base-url", metavar="URL", help="the endpoint, up to /v1")
    hosted.add_argument(
        "--api-key-env",
        default="OPENAI_API_KEY",
        metavar="VAR",
        help="environment variable holding the API key (default OPENAI_API_KEY)",
    )
    hosted.add_argument("--no-api-key", action="store_true", help="the endpoint takes no API key")
    hosted.add_argument(
        "--max-concurrency", type=_positive, default=8, metavar="N", help="requests in flight (8)"
    )
    hosted.add_argument(
        "--request-timeout", type=float, default=120.0, metavar="S", help="per request (120)"
    )
    hosted.add_argument(
        "--max-retries", type=int, default=4, metavar="N", help="retries with backoff (4)"
    )
    user = parser.add_argument_group(
        "τ²'s user simulator (--benchmark tau2 with airline, retail or telecom)",
        "the simulated user's model at an OpenAI-compatible endpoint (docs/tau2.md)",
    )
    user.add_argument("--user-model", metavar="NAME", help="the model the endpoint serves")
    user.add_argument(
        "--user-base-url", metavar="URL", help="up to /v1 (default $OPENAI_BASE_URL, else OpenAI)"
    )
    user.add_argument(
        "--user-api-key-env", metavar="VAR", help="variable holding its key (OPENAI_API_KEY)"
    )
    user.add_argument("--user-no-api-key", action="store_true", help="it takes no API key")
    parser.add_argument("--label", default="eval", help="output folder: eval_LABEL_MODEL_TIME")
    parser.add_argument("--runs-dir", default="runs", metavar="DIR", help="(default: runs)")
    parser.add_argument("--no-save", action="store_true", help="write no output folder")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(run=commands.run_eval)


def _add_serve(subparsers: Any) -> None:
    parser = _command(
        subparsers,
        "serve",
        "Serve a model as an OpenAI-compatible /v1/chat/completions endpoint.",
        "MODEL is a catalog id, a local folder, a run directory (--step N for a checkpoint)\n"
        "or a checkpoint folder: sampled through the same codec and engine as training,\n"
        "token-in-token-out per conversation. Binds 127.0.0.1 unless --host says otherwise;\n"
        "any other address needs --token-env (clients send Authorization: Bearer TOKEN).\n\n"
        "examples:\n"
        "  %(prog)s post-training-cookbook/tool-use-tiny --port 8000\n"
        "  %(prog)s runs/x --step 10 --host 0.0.0.0 --token-env SERVE_TOKEN",
    )
    parser.add_argument("model", metavar="MODEL", help="what to serve")
    parser.add_argument("--step", type=int, metavar="N", help="a run's checkpoint at step N")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8000, help="port (8000)")
    parser.add_argument(
        "--token-env", metavar="VAR", help="environment variable holding the bearer token"
    )
    parser.add_argument("--name", help="the model name answers carry (default: the model's)")
    parser.add_argument("--codec", help="codec name (default: the catalog's or the run's)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="sampling dtype")
    parser.add_argument(
        "--max-model-length", type=_positive, metavar="N", help="prompt + completion limit"
    )
    parser.add_argument(
        "--max-tokens", type=_positive, default=256, metavar="N",
        help="max_tokens of a request that names none (256)",
    )  # fmt: skip
    parser.add_argument(
        "--max-concurrent-requests", type=_positive, default=64, metavar="N",
        help="requests in flight; more get 429 (64)",
    )  # fmt: skip
    parser.add_argument(
        "--max-request-bytes", type=_positive, default=4 * 2**20, metavar="N",
        help="larger bodies get 413 (4 MiB)",
    )  # fmt: skip
    parser.add_argument(
        "--prefix-cache-bytes", type=_positive, metavar="N",
        help="bytes of KV the engine keeps for prompts that extend earlier ones "
        "(default: 1/10 of a GPU's memory, 1/16 of the machine's up to 2 GiB on CPU)",
    )  # fmt: skip
    parser.set_defaults(run=commands.run_serve)


def _add_models(subparsers: Any) -> None:
    parser = _command(
        subparsers,
        "models",
        "List the model catalog: codec, generator support or trainer-only, context, dtype.",
        "GRPO needs generator support; trainer-only models can still be fine-tuned with SFT.\n"
        "A local Hugging Face folder also works wherever a model id does.",
    )
    parser.add_argument("--json", action="store_true", help="print the catalog as JSON")
    parser.set_defaults(run=commands.run_models)


def _add_plot(subparsers: Any) -> None:
    parser = _command(
        subparsers,
        "plot",
        "Plot a run's metrics.jsonl: reward, validation reward, how episodes end, timings.",
        "example: %(prog)s runs/my-run --out reward.png",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN", help="a run directory")
    parser.add_argument("--out", type=Path, help="PNG path (default: RUN/plots.png)")
    parser.set_defaults(run=commands.run_plot)


def _add_view(subparsers: Any) -> None:
    parser = _command(
        subparsers,
        "view",
        "Show one step's episodes: turns, tool calls, results, reward, trained tokens.",
        "Trained tokens (mask 1, sampled) show green, forced ones (prompt, tool results)\n"
        "dim. RUN is a run directory, an evaluation folder or a rollouts .jsonl file.\n\n"
        "examples:\n"
        "  %(prog)s runs/my-run --step 3 | less -R\n"
        "  %(prog)s runs/my-run --kind val --html val.html",
    )
    parser.add_argument("path", type=Path, metavar="RUN", help="run, eval folder or .jsonl")
    parser.add_argument("--step", type=int, metavar="N", help="step N (default: the last dumped)")
    parser.add_argument("--kind", choices=("train", "val"), default="train", help="which dump")
    parser.add_argument("--html", type=Path, metavar="OUT", help="write a self-contained HTML")
    parser.add_argument("--limit", type=_positive, metavar="N", help="show at most N episodes")
    parser.add_argument("--group", type=int, metavar="G", help="only group G's episodes")
    parser.add_argument("--env", metavar="NAME", help="only env NAME's episodes (a mixture run)")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    parser.add_argument("--full-prompt", action="store_true", help="show the prompt's tokens")
    parser.set_defaults(run=commands.run_view)


def _command_names(parser: argparse.ArgumentParser) -> list[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices)
    return []


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {value}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value
