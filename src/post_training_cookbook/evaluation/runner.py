"""``evaluate``: score a model on any environment, before or after training.

The episodes are played exactly as training validation plays them: the model's codec
renders the prompt with the env's tools, the ``LocalEngine`` samples each turn within the
token budget (``max_model_length``, ``max_tokens_per_turn``), and ``rollout.play_group``
runs one group of ``episodes_per_task`` episodes per task. So with the same settings,
``eval/reward_mean`` of a baseline, of a trained model and ``val/reward_mean`` of the run
compare. (The hosted cookbook's baseline scripts skip the codec and the token budget, and
say their numbers do not compare; these do.)

A ``HostedModel`` (any OpenAI-compatible endpoint, ``hosted.py``) is scored on the same env,
tasks and settings through the rollout layer's chat driver; its token counts are its own and
are reported as such (docs/hosted_eval.md).

Output, unless ``runs_dir=None``::

    runs/eval_<label>_<model>_<UTC time>/
        episodes.jsonl   one line per episode, the fields of a run's rollout dumps
        summary.json     EvalResult.to_dict(): settings, metrics, per level, per task
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from post_training_cookbook.envs.base import EnvFactory, Task
from post_training_cookbook.evaluation.benchmarks import (
    BenchmarkSpec,
    benchmark_inputs,
    benchmark_limits,
    score_benchmark,
    write_benchmark_files,
)
from post_training_cookbook.evaluation.hosted import HostedModel, play_chat_tasks, play_hosted
from post_training_cookbook.evaluation.models import (
    EvalModel,
    load_eval_weights,
    resolve_eval_model,
)
from post_training_cookbook.evaluation.results import (
    EvalResult,
    EvalSettings,
    default_ks,
    summarize,
    termination_shares,
)
from post_training_cookbook.models.catalog import check_model_can_sample
from post_training_cookbook.rollout import (
    ChatSampler,
    EnvErrorPolicy,
    EpisodeLimits,
    EpisodeRunner,
    Group,
    check_episode_inputs,
    episode_record,
    play_group,
)
from post_training_cookbook.sync import run_sync

if TYPE_CHECKING:
    from post_training_cookbook.bundled_envs.tau2.user import Tau2User
    from post_training_cookbook.engine.rows import EngineStats  # imports torch

ModelToScore = str | os.PathLike[str] | HostedModel | ChatSampler


def evaluate(
    model_or_checkpoint: ModelToScore,
    tasks: Sequence[Task] | None = None,
    env_factory: EnvFactory | None = None,
    episodes_per_task: int = 1,
    *,
    benchmark: str | None = None,
    limit: int | None = None,
    user_simulator: Tau2User | None = None,
    max_turns: int | None = None,
    max_model_length: int | None = None,
    max_tokens_per_turn: int | None = None,
    temperature: float | None = None,
    top_p: float = 1.0,
    success_threshold: float = 1.0,
    failed_parse_reward: float = 0.0,
    env_errors: EnvErrorPolicy = "raise",
    codec: str | None = None,
    step: int | None = None,
    dtype: str | None = None,
    pass_k: Sequence[int] | None = None,
    label: str = "eval",
    runs_dir: str | os.PathLike[str] | None = "runs",
    max_batch_size: int = 64,
    progress: bool = False,
    device: str = "auto",
    prefix_cache_bytes: int | None = None,
) -> EvalResult:
    """Play ``episodes_per_task`` episodes of every task with ``model_or_checkpoint``.

    ``model_or_checkpoint``: a catalog id, a local Hugging Face folder, a run directory (its
    ``final_model``, or its checkpoint ``step``), a checkpoint folder, or a ``HostedModel``
    (an OpenAI-compatible endpoint; ``codec``, ``step``, ``dtype`` and ``device`` do not apply),
    or any ``ChatSampler`` (a scripted policy as a baseline: ``ScriptedChat(policy)``).
    ``benchmark``: a published benchmark in place of ``tasks`` and ``env_factory``:
    ``"bfcl"`` (BFCL's five single-turn test categories) or ``"bfcl:simple_python,multiple"``;
    ``"bfcl_multi_turn:base@held_out"``; ``"tau2:airline@test"`` (τ²-bench: its pass^k per
    domain, k up to ``episodes_per_task``; docs/tau2.md); the result's ``benchmark`` holds its
    report; ``limit``: only the first N items of each category (τ²: tasks of each domain).
    ``user_simulator``: τ²'s simulated user, for a ``tau2`` benchmark's domains with a user
    (``UserSimulatorSettings(model=..., base_url=...)``, or any ``UserFactory``).
    ``temperature`` defaults to 1.0, and to 0 (greedy) for a benchmark.
    The limits default to the benchmark's own (``bfcl_multi_turn``: BFCL bounds a user turn,
    not an episode, and its prompts run to 8k tokens: 200 replies, 16,384 tokens, 256 a
    reply; ``tau2``: 200, 32,768, 1,024), else to ``GRPOConfig``'s (6, 2,048, 256).
    ``pass_k`` defaults to 1, 2, 4, ... up to ``episodes_per_task``. ``dtype`` defaults to the
    run's, else the model's. ``device``: where the engine samples, as ``GRPOConfig.device``
    (``"auto"``: CUDA when present).
    ``prefix_cache_bytes``: the engine's prefix cache bound, as ``GRPOConfig``'s (None: a share
    of the device's memory). A multi-turn episode reuses its previous turn's KV from that
    cache; when ``max_batch_size`` long conversations are in flight and their KV does not fit,
    turns compute their whole conversation again (``result.engine`` counts reused tokens).
    ``runs_dir=None`` writes nothing.
    Bad input raises ``ValueError`` before any weights load. Callable from sync code, also
    inside a running event loop; ``aevaluate`` is the async form.
    """
    sizes = benchmark_limits(BenchmarkSpec.parse(benchmark)) if benchmark else {}
    usual = EpisodeLimits()

    def size(name: str, given: int | None) -> int:
        return given if given is not None else sizes.get(name, getattr(usual, name))

    limits = EpisodeLimits(
        max_turns=size("max_turns", max_turns),
        max_model_length=size("max_model_length", max_model_length),
        max_tokens_per_turn=size("max_tokens_per_turn", max_tokens_per_turn),
        failed_parse_reward=failed_parse_reward,
        env_errors=env_errors,
    )
    settings = EvalSettings(
        episodes_per_task=episodes_per_task,
        limits=limits,
        temperature=(0.0 if benchmark else 1.0) if temperature is None else temperature,
        top_p=top_p,
        success_threshold=success_threshold,
    )
    coroutine = aevaluate(
        model_or_checkpoint, tasks, env_factory, settings,
        benchmark=benchmark, limit=limit, user_simulator=user_simulator,
        codec=codec, step=step, dtype=dtype, pass_k=pass_k, label=label, runs_dir=runs_dir,
        max_batch_size=max_batch_size, progress=progress, device=device,
        prefix_cache_bytes=prefix_cache_bytes,
    )  # fmt: skip
    return run_sync(coroutine)


async def aevaluate(
    model_or_checkpoint: ModelToScore,
    tasks: Sequence[Task] | None = None,
    env_factory: EnvFactory | None = None,
    settings: EvalSettings | None = None,
    *,
    benchmark: str | None = None,
    limit: int | None = None,
    user_simulator: Tau2User | None = None,
    codec: str | None = None,
    step: int | None = None,
    dtype: str | None = None,
    pass_k: Sequence[int] | None = None,
    label: str = "eval",
    runs_dir: str | os.PathLike[str] | None = "runs",
    max_batch_size: int = 64,
    progress: bool = False,
    device: str = "auto",
    prefix_cache_bytes: int | None = None,
) -> EvalResult:
    """``evaluate`` for async callers, with the settings as one ``EvalSettings``."""
    started = time.perf_counter()
    engine_stats = None
    settings = settings or EvalSettings(temperature=0.0 if benchmark else 1.0)
    spec = BenchmarkSpec.parse(benchmark) if benchmark is not None else None
    tasks, env_factory = _inputs(tasks, env_factory, spec, limit, user_simulator)
    if prefix_cache_bytes is not None and prefix_cache_bytes < 0:
        raise ValueError(f"prefix_cache_bytes must be >= 0 or None, got {prefix_cache_bytes}")
    local_only = {
        "codec": codec,
        "step": step,
        "dtype": dtype,
        "prefix_cache_bytes": prefix_cache_bytes,
    }
    given = [name for name, value in local_only.items() if value is not None]
    if isinstance(model_or_checkpoint, HostedModel):
        hosted = model_or_checkpoint
        if given:
            raise ValueError(f"{', '.join(given)}: for a local model, not a HostedModel")
        ks = _checked(tasks, env_factory, settings, pass_k, label)
        hosted.api_key()  # an unset key fails before any episode starts
        name, source, tokenizer = hosted.name, hosted.base_url, "(the endpoint's own)"
        with _Bar(len(tasks), f"eval {name}", progress) as bar:
            groups = await play_hosted(hosted, tasks, env_factory, settings, bar.tick)
    elif isinstance(model_or_checkpoint, ChatSampler):  # a scripted policy, a baseline
        if given:
            raise ValueError(f"{', '.join(given)}: for a local model, not a ChatSampler")
        sampler = model_or_checkpoint
        ks = _checked(tasks, env_factory, settings, pass_k, label)
        name = getattr(sampler, "name", type(sampler).__name__)
        source, tokenizer = name, "(none: the sampler's own messages)"
        with _Bar(len(tasks), f"eval {name}", progress) as bar:
            groups = await play_chat_tasks(sampler, tasks, env_factory, settings, bar.tick)
    else:
        from post_training_cookbook.service.factory import resolve_device

        model = resolve_eval_model(model_or_checkpoint, step=step, codec=codec)
        ks = _checked(tasks, env_factory, settings, pass_k, label)
        check_model_can_sample(model.info, settings.limits.max_model_length)
        engine_device = resolve_device(device)
        name, source, tokenizer = model.name, model.source, model.tokenizer_info.source
        groups, engine_stats = await _play(
            model, list(tasks), env_factory, settings, dtype, max_batch_size, progress,
            engine_device, prefix_cache_bytes,
        )  # fmt: skip
    metrics, per_level, per_task = summarize(groups, settings, ks)
    result = EvalResult(
        label=label,
        model=_described(model_or_checkpoint),
        model_name=name,
        model_source=source,
        tokenizer_source=tokenizer,
        settings=settings,
        num_tasks=len(groups),
        num_episodes=sum(len(group.episodes) for group in groups),
        reward_mean=metrics["eval/reward_mean"],
        pass_at_k={k: metrics[f"eval/pass@{k}"] for k in ks},
        termination=termination_shares(metrics),
        length_capped=metrics["eval/length_capped"],
        metrics=metrics,
        per_level=per_level,
        per_task=per_task,
        elapsed_s=time.perf_counter() - started,
        groups=groups,
        hosted=isinstance(model_or_checkpoint, HostedModel),
        benchmark=None if spec is None else score_benchmark(spec, groups, limit),
        engine=engine_stats,
    )
    if runs_dir is not None:
        result.output_dir = write_eval(result, Path(runs_dir))
    return result


def write_eval(result: EvalResult, runs_dir: Path) -> Path:
    """``runs_dir/eval_<label>_<model>_<time>/`` with episodes.jsonl and summary.json."""
    folder = _new_folder(runs_dir, f"eval_{result.label}_{result.model_name}")
    with (folder / "episodes.jsonl").open("w") as file:
        for record in _episode_records(result.groups):
            file.write(json.dumps(record, default=str) + "\n")
    write_benchmark_files(result.groups, folder)
    result.output_dir = folder
    (folder / "summary.json").write_text(json.dumps(result.to_dict(), indent=1, default=str))
    return folder


def _inputs(
    tasks: Sequence[Task] | None,
    env_factory: EnvFactory | None,
    spec: BenchmarkSpec | None,
    limit: int | None,
    user_simulator: Tau2User | None,
) -> tuple[Sequence[Task], EnvFactory]:
    """The tasks and env to play: the caller's, or the benchmark's."""
    if spec is None:
        if limit is not None:
            raise ValueError("limit applies to a benchmark (items per category); slice tasks")
        if user_simulator is not None:
            raise ValueError(
                "user_simulator is for benchmark='tau2:...'; your env_factory builds its own users"
            )
        if tasks is None or env_factory is None:
            raise ValueError("pass tasks and env_factory, or benchmark= (e.g. 'bfcl')")
        return tasks, env_factory
    if tasks is not None or env_factory is not None:
        raise ValueError(f"benchmark={str(spec)!r} brings its tasks and env: pass neither")
    return benchmark_inputs(spec, limit, user_simulator)


def _checked(
    tasks: Sequence[Task],
    env_factory: EnvFactory,
    settings: EvalSettings,
    pass_k: Sequence[int] | None,
    label: str,
) -> list[int]:
    """Every check that needs no weights; returns the k of pass@k."""
    check_episode_inputs(tasks, env_factory, purpose="evaluate")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", label):
        raise ValueError(f"label must be a folder name (letters, digits, . _ -), got {label!r}")
    ks = sorted(set(pass_k)) if pass_k else default_ks(settings.episodes_per_task)
    if not all(1 <= k <= settings.episodes_per_task for k in ks):
        raise ValueError(
            f"pass@k needs 1 <= k <= episodes_per_task ({settings.episodes_per_task}), got {ks}"
        )
    return ks


async def _play(
    model: EvalModel,
    tasks: list[Task],
    env_factory: EnvFactory,
    settings: EvalSettings,
    dtype: str | None,
    max_batch_size: int,
    progress: bool,
    device: str,
    prefix_cache_bytes: int | None,
) -> tuple[list[Group], EngineStats]:
    import torch

    from post_training_cookbook.engine.local import LocalEngine
    from post_training_cookbook.engine.types import SamplingParams
    from post_training_cookbook.models.loading import load_codec

    options = model.run_config.codec_options() if model.run_config is not None else None
    codec = load_codec(model.tokenizer_info, options=options)
    engine_dtype = getattr(torch, dtype or model.dtype)
    engine = LocalEngine(
        load_eval_weights(model, engine_dtype),
        dtype=engine_dtype,
        device=device,
        max_batch_size=max_batch_size,
        copy_model=False,
        prefix_cache_bytes=prefix_cache_bytes,
    )
    limits = settings.limits
    runner = EpisodeRunner(env_factory, engine, codec, limits)
    params = SamplingParams(
        max_tokens=settings.limits.max_tokens_per_turn,
        temperature=settings.temperature,
        top_p=settings.top_p,
        stop_token_ids=codec.stop_token_ids,
    )

    async def play_task(task: Task, bar: _Bar) -> Group:
        group = await play_group(runner, task, settings.episodes_per_task, params)
        bar.tick()
        return group

    try:
        with _Bar(len(tasks), f"eval {model.name}", progress) as bar:
            # long multi-turn tasks finish late: the engine's counters show the work meanwhile
            counters = asyncio.create_task(_show_counters(engine, bar)) if progress else None
            try:
                groups = list(await asyncio.gather(*(play_task(task, bar) for task in tasks)))
            finally:
                if counters is not None:
                    counters.cancel()
        return groups, engine.stats()
    finally:
        await engine.close()


COUNTERS_EVERY_S = 30.0


async def _show_counters(engine: Any, bar: _Bar) -> None:
    """Every ``COUNTERS_EVERY_S``, the engine's work so far beside the progress bar."""
    while True:
        await asyncio.sleep(COUNTERS_EVERY_S)
        bar.show(engine_summary(engine.stats()))


def engine_summary(stats: EngineStats) -> str:
    """One line of an engine's counters: prompt tokens computed and reused, decode tokens."""
    prompt = stats.prefill_tokens_computed + stats.prefill_tokens_reused
    reused = stats.prefill_tokens_reused / prompt if prompt else 0.0
    return (
        f"prefill {stats.prefill_tokens_computed:,} tok ({stats.prefill_tokens_per_s:.0f}/s, "
        f"{reused:.0%} of prompts reused), decode {stats.decode_tokens:,} tok "
        f"({stats.decode_tokens_per_s:.1f}/s)"
    )


class _Bar:
    def __init__(self, total: int, description: str, shown: bool) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=description, unit="task", disable=not shown)

    def tick(self) -> None:
        self._bar.update(1)

    def show(self, text: str) -> None:
        self._bar.set_postfix_str(text)

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._bar.close()


def _described(model: ModelToScore) -> str:
    if isinstance(model, HostedModel):
        return f"{model.model} at {model.base_url}"
    return str(model)


def _episode_records(groups: Sequence[Group]) -> Iterator[dict[str, Any]]:
    """The lines of a run's rollout dumps, so one viewer reads both."""
    for index, group in enumerate(groups):
        for number, episode in enumerate(group.episodes):
            yield {"step": None, "group": index, "episode": number, **episode_record(episode)}


def _new_folder(runs_dir: Path, prefix: str) -> Path:
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    base = runs_dir / f"{prefix}_{stamp}"
    for attempt in range(1, 1000):
        folder = base if attempt == 1 else base.with_name(f"{base.name}-{attempt}")
        try:
            folder.mkdir(parents=True)
            return folder
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a new folder next to {base}")
