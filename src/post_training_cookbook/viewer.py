"""Look at one step's episodes: turns, tool calls and results, reward, how each ended, and which
tokens were trained (mask 1: sampled by the policy) and which were forced (mask 0: prompt,
tool results, template glue).

    post-training-cookbook view runs/my-run --step 3              # terminal, ANSI colours
    post-training-cookbook view runs/my-run --html step3.html     # one self-contained file

Reads a run's rollout dumps (``rollouts/train_step_NNNNNN.jsonl``, ``val_step_...``), an
evaluation's ``episodes.jsonl``, or such a file named directly. Tokens are decoded with the
run's tokenizer (its ``final_model``'s, else its base model's); without one, token ids show.

A mixture run's episodes show their env, and the summary each env's mean reward. One module,
a little over 400 lines: loading, the terminal view and the HTML view share the episode
model (``EpisodeView``) and its turn splitting, and read best side by side.
"""

from __future__ import annotations

import html
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from post_training_cookbook.types import Message

Decode = Callable[[list[int]], str]
TRAINED = "\x1b[1;32m"
FORCED = "\x1b[2m"
BOLD = "\x1b[1m"
RESET = "\x1b[0m"
_STEP_FILE = re.compile(r"(train|val)_step_(\d+)\.jsonl")


@dataclass(frozen=True)
class EpisodeView:
    """One episode of a rollout dump."""

    index: int
    group: int
    prompt: str
    target: str
    reward: float
    cause: str
    """``terminated`` or the truncation cause (``max_turns``, ``parse_failure``, ...)."""
    num_turns: int
    messages: list[Message] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    env_error: str | None = None
    env: str | None = None
    """A mixture run's: its task's ``metadata["env"]``."""
    retried: list[str] = field(default_factory=list)
    """The errors of the attempts played again (``env_errors="retry"``)."""

    @classmethod
    def from_record(cls, index: int, record: dict[str, Any]) -> EpisodeView:
        task = record.get("task") or {}
        return cls(
            index=index,
            group=int(record.get("group") or 0),
            prompt=str(task.get("prompt", "")),
            target=str(task.get("target", "")),
            reward=float(record.get("reward") or 0.0),
            cause=record.get("truncation") or "terminated",
            num_turns=int(record.get("num_turns") or 0),
            messages=list(record.get("messages") or []),
            token_ids=[int(t) for t in record.get("token_ids") or []],
            mask=[int(m) for m in record.get("mask") or []],
            metrics=dict(record.get("metrics") or {}),
            env_error=record.get("env_error"),
            env=(task.get("metadata") or {}).get("env"),
            retried=list(record.get("retried_env_errors") or []),
        )

    @property
    def num_trained(self) -> int:
        return sum(1 for bit in self.mask if bit)


@dataclass(frozen=True)
class StepView:
    """The episodes of one file, and where they came from."""

    title: str
    source: Path
    episodes: list[EpisodeView]


@dataclass(frozen=True)
class Span:
    """Consecutive tokens with the same mask bit."""

    start: int
    token_ids: list[int]
    trained: bool


# --- Loading ------------------------------------------------------------------------------------


def load_step(
    path: str | os.PathLike[str], step: int | None = None, kind: str = "train"
) -> StepView:
    """The episodes of a run's step (default: its last ``kind`` step), of an evaluation
    folder, or of a ``.jsonl`` file. ``ValueError`` lists what there is instead."""
    source = _episodes_file(Path(path), step, kind)
    lines = [line for line in source.read_text().splitlines() if line.strip()]
    episodes = [EpisodeView.from_record(i, json.loads(line)) for i, line in enumerate(lines)]
    return StepView(_title(source), source, episodes)


def steps_in(run_dir: Path, kind: str) -> list[int]:
    """The steps with a ``kind`` rollout dump, ascending."""
    folder = run_dir / "rollouts"
    found = (_STEP_FILE.fullmatch(p.name) for p in folder.glob("*.jsonl"))
    return sorted(int(m.group(2)) for m in found if m and m.group(1) == kind)


def load_decoder(path: str | os.PathLike[str]) -> Decode | None:
    """Token ids → text with the tokenizer that made them, or None when it cannot load."""
    source = _tokenizer_source(Path(path))
    if source is None:
        return None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):
        return None

    def decode(token_ids: list[int]) -> str:
        return str(
            tokenizer.decode(
                token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        )

    return decode


def _episodes_file(path: Path, step: int | None, kind: str) -> Path:
    if kind not in ("train", "val"):
        raise ValueError(f"kind must be 'train' or 'val', got {kind!r}")
    if path.is_file():
        return path
    if (path / "episodes.jsonl").is_file():
        if step is not None:
            raise ValueError(f"{path} is an evaluation (one set of episodes): drop the step")
        return path / "episodes.jsonl"
    if not (path / "rollouts").is_dir():
        raise ValueError(f"{path} is neither a run directory (rollouts/) nor an evaluation folder")
    steps = steps_in(path, kind)
    if not steps:
        raise ValueError(f"{path} has no {kind} rollouts yet")
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        listed = ", ".join(map(str, steps))
        raise ValueError(f"{path} has no {kind} rollouts for step {step}; steps: {listed}")
    return path / "rollouts" / f"{kind}_step_{chosen:06d}.jsonl"


def _title(source: Path) -> str:
    match = _STEP_FILE.fullmatch(source.name)
    if match and source.parent.name == "rollouts":
        run = source.parent.parent.name
        return f"{run} · {match.group(1)} step {int(match.group(2))}"
    return source.parent.name if source.name == "episodes.jsonl" else source.name


def _tokenizer_source(path: Path) -> str | None:
    folder = path.parent if path.is_file() else path
    if folder.name == "rollouts":
        folder = folder.parent
    summary = folder / "summary.json"
    if summary.is_file():
        return str(json.loads(summary.read_text()).get("tokenizer_source") or "") or None
    if (folder / "final_model" / "tokenizer_config.json").is_file():
        return str(folder / "final_model")
    if (folder / "config.yaml").is_file():
        from post_training_cookbook.grpo.config import GRPOConfig
        from post_training_cookbook.models.catalog import resolve_model

        try:
            config = GRPOConfig.from_yaml(folder / "config.yaml")
            return resolve_model(config.model, codec=config.codec).source
        except ValueError:
            return None
    return None


# --- Tokens -------------------------------------------------------------------------------------


def token_spans(token_ids: Sequence[int], mask: Sequence[int]) -> list[Span]:
    """The episode's tokens cut where the mask changes."""
    spans: list[Span] = []
    for index, (token, bit) in enumerate(zip(token_ids, mask, strict=False)):
        if spans and spans[-1].trained == bool(bit):
            spans[-1].token_ids.append(token)
        else:
            spans.append(Span(index, [token], bool(bit)))
    return spans


def _text(span: Span, decode: Decode | None) -> str:
    if decode is None:
        return " ".join(f"⟨{token}⟩" for token in span.token_ids)
    return decode(span.token_ids)


# --- Terminal -----------------------------------------------------------------------------------


def format_step(
    view: StepView,
    decode: Decode | None,
    *,
    color: bool = True,
    limit: int | None = None,
    group: int | None = None,
    env: str | None = None,
    full_prompt: bool = False,
) -> str:
    """The step as terminal text: a summary, then each episode (turns and coloured tokens);
    ``group`` and ``env`` keep only that group's or that env's episodes."""
    episodes = [e for e in view.episodes if group in (None, e.group) and env in (None, e.env)]
    shown = episodes[:limit] if limit is not None else episodes
    paint = _painter(color)
    lines = [paint(BOLD, view.title), _summary(episodes)]
    lines.append(
        f"tokens: {paint(TRAINED, 'trained (mask 1)')}  {paint(FORCED, 'forced (mask 0)')}"
    )
    for episode in shown:
        lines += ["", *_episode_lines(episode, decode, paint, full_prompt)]
    if len(shown) < len(episodes):
        lines.append(f"\n… {len(episodes) - len(shown)} more episode(s): raise --limit")
    return "\n".join(lines)


def _painter(color: bool) -> Callable[[str, str], str]:
    def paint(code: str, text: str) -> str:
        if not color or not text:
            return text
        # per line, so that pagers (less -R) keep the colour across line breaks
        return "\n".join(f"{code}{line}{RESET}" if line else line for line in text.split("\n"))

    return paint


def _summary(episodes: Sequence[EpisodeView]) -> str:
    if not episodes:
        return "no episodes"
    mean = sum(e.reward for e in episodes) / len(episodes)
    causes: dict[str, int] = {}
    for episode in episodes:
        causes[episode.cause] = causes.get(episode.cause, 0) + 1
    ended = ", ".join(f"{cause} {count}" for cause, count in sorted(causes.items()))
    by_env = ", ".join(
        f"{name} {len(mine)} (mean {sum(e.reward for e in mine) / len(mine):.3f})"
        for name in sorted({e.env for e in episodes if e.env is not None})
        if (mine := [e for e in episodes if e.env == name])
    )
    by_env = f" · envs: {by_env}" if by_env else ""
    return f"{len(episodes)} episode(s) · mean reward {mean:.3f} · {ended}{by_env}"


def _episode_lines(
    episode: EpisodeView, decode: Decode | None, paint: Callable[[str, str], str], full: bool
) -> list[str]:
    env = f" · env {episode.env}" if episode.env else ""
    head = (
        f"── episode {episode.index} · group {episode.group}{env} · reward {episode.reward:.3f} · "
        f"{episode.cause} · {episode.num_turns} turn(s) · {len(episode.token_ids)} tokens "
        f"({episode.num_trained} trained)"
    )
    lines = [paint(BOLD, head), f"task: {episode.prompt}", f"target: {episode.target}"]
    if episode.env_error:
        lines.append(f"env error: {episode.env_error}")
    lines += [f"played again after: {error}" for error in episode.retried]
    lines += [f"  {label} {text}" for label, text in _turns(episode)]
    lines.append("tokens:")
    lines.append(_token_text(episode, decode, paint, full))
    return lines


def _token_text(
    episode: EpisodeView, decode: Decode | None, paint: Callable[[str, str], str], full: bool
) -> str:
    spans = token_spans(episode.token_ids, episode.mask)
    parts = []
    for number, span in enumerate(spans):
        if number == 0 and not span.trained and not full:
            parts.append(paint(FORCED, f"[prompt: {len(span.token_ids)} tokens; --full-prompt]\n"))
            continue
        parts.append(paint(TRAINED if span.trained else FORCED, _text(span, decode)))
    return "".join(parts)


def _turns(episode: EpisodeView) -> Iterator[tuple[str, str]]:
    """(label, text) per message after the opening prompt; tool calls one per line."""
    started = False
    turn = 0
    for message in episode.messages:
        role = message.get("role", "?")
        started |= role == "assistant"
        if not started:
            continue
        if role == "assistant":
            turn += 1
            content = (message.get("content") or "").strip()
            if content:
                yield f"assistant (turn {turn}):", _short(content)
            for call in message.get("tool_calls") or []:
                function = call["function"]
                yield f"assistant (turn {turn}) →", f"{function['name']}({function['arguments']})"
        else:
            name = f" {message.get('name')}" if message.get("name") else ""
            yield f"{role}{name} ←", _short(message.get("content") or "")
    if episode.cause == "parse_failure":
        yield f"assistant (turn {turn + 1}):", "[could not be parsed: see its tokens]"


def _short(text: str, limit: int = 400) -> str:
    flat = text.replace("\n", " ⏎ ")
    return flat if len(flat) <= limit else flat[:limit] + f"… (+{len(flat) - limit} chars)"


# --- HTML ---------------------------------------------------------------------------------------


def render_html(view: StepView, decode: Decode | None) -> str:
    """The step as one self-contained HTML page (inline CSS, no scripts, no requests)."""
    esc = html.escape
    index_rows = "".join(
        f'<tr><td><a href="#episode-{e.index}">{e.index}</a></td><td>{e.group}</td>'
        f"<td>{esc(e.env or '')}</td><td>{e.reward:.3f}</td><td>{esc(e.cause)}</td>"
        f"<td>{e.num_turns}</td>"
        f"<td>{esc(_short(e.prompt, 120))}</td></tr>"
        for e in view.episodes
    )
    episodes = "\n".join(_episode_html(e, decode) for e in view.episodes)
    return _PAGE.format(
        title=esc(view.title),
        summary=esc(_summary(view.episodes)),
        source=esc(str(view.source)),
        index_rows=index_rows,
        episodes=episodes,
        style=_STYLE,
    )


def write_html(view: StepView, decode: Decode | None, out: str | os.PathLike[str]) -> Path:
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(render_html(view, decode), encoding="utf-8")
    return target


def _episode_html(episode: EpisodeView, decode: Decode | None) -> str:
    esc = html.escape
    turns = "".join(
        f'<li class="{esc(role.split()[0])}"><b>{esc(role)}</b> {esc(text)}</li>'
        for role, text in _turns(episode)
    )
    spans = token_spans(episode.token_ids, episode.mask)
    prompt, rest = (spans[0], spans[1:]) if spans and not spans[0].trained else (None, spans)
    prompt_html = (
        f"<details><summary>prompt: {len(prompt.token_ids)} forced tokens</summary>"
        f'<pre class="tokens"><span class="f">{esc(_text(prompt, decode))}</span></pre></details>'
        if prompt
        else ""
    )
    tokens = "".join(
        f'<span class="{"s" if s.trained else "f"}" title="tokens {s.start}–'
        f'{s.start + len(s.token_ids) - 1}">{esc(_text(s, decode))}</span>'
        for s in rest
    )
    error = f'<p class="error">env error: {esc(episode.env_error)}</p>' if episode.env_error else ""
    error += "".join(f'<p class="error">played again after: {esc(e)}</p>' for e in episode.retried)
    env = f" · env {esc(episode.env)}" if episode.env else ""
    return (
        f'<section class="episode {esc(episode.cause)}" id="episode-{episode.index}">'
        f"<h2>Episode {episode.index} · group {episode.group}{env} · reward {episode.reward:.3f} · "
        f"{esc(episode.cause)} · {episode.num_turns} turn(s)</h2>"
        f'<p class="task"><b>Task</b> {esc(episode.prompt)} <b>Target</b> '
        f"{esc(episode.target)}</p>{error}"
        f'<ol class="turns">{turns}</ol>'
        f"<h3>Tokens: {len(episode.token_ids)}, {episode.num_trained} trained</h3>"
        f'{prompt_html}<pre class="tokens">{tokens}</pre></section>'
    )


_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em auto; max-width: 70em;
       color: #1d2330; background: #fff; padding: 0 1em; }
h1 { font-size: 1.4em; margin-bottom: .2em; } h2 { font-size: 1.1em; margin: 0 0 .4em; }
h3 { font-size: .95em; margin: .6em 0 .3em; color: #555; }
table { border-collapse: collapse; margin: .8em 0 1.5em; } td, th { padding: .15em .6em;
        border-bottom: 1px solid #e3e6ea; text-align: left; }
.episode { border: 1px solid #d5d9df; border-left: 6px solid #2e7d32; border-radius: 6px;
           padding: .8em 1em; margin: 1em 0; }
.episode:not(.terminated) { border-left-color: #c62828; }
.turns { padding-left: 1.4em; } .turns li { margin: .15em 0; word-break: break-word; }
.turns li.assistant b { color: #1b5e20; } .turns li.tool b { color: #0d47a1; }
pre.tokens { white-space: pre-wrap; word-break: break-all; background: #f6f7f9;
             padding: .6em; border-radius: 4px; font-size: 12.5px; margin: .3em 0; }
.s { background: #c8f0c0; color: #0b3d0b; } .f { color: #707784; }
.legend span { padding: 0 .4em; border-radius: 3px; } .error { color: #c62828; }
"""

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>{style}</style></head>
<body>
<h1>{title}</h1>
<p>{summary}</p>
<p class="legend">tokens: <span class="s">trained (mask 1, sampled)</span>
<span class="f">forced (mask 0: prompt, tool results, template)</span></p>
<p><small>{source}</small></p>
<table><tr><th>#</th><th>group</th><th>env</th><th>reward</th><th>ended</th><th>turns</th><th>task</th></tr>
{index_rows}</table>
{episodes}
</body></html>
"""
