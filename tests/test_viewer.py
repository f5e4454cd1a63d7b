"""The rollout viewer: one step's episodes in a terminal (ANSI colours by mask) and as HTML,
rendered by headless Chromium for the screenshot test."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
from test_codecs_common import make_tokenizer
from test_eval_common import tool_use_records, trained_run, write_rollouts

from post_training_cookbook.codecs import HERMES_CHAT_TEMPLATE
from post_training_cookbook.viewer import (
    FORCED,
    RESET,
    TRAINED,
    format_step,
    load_decoder,
    load_step,
    render_html,
    token_spans,
    write_html,
)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium is not on PATH (Debian: apt-get install -y chromium)",
)


def decode(token_ids):
    return make_tokenizer(HERMES_CHAT_TEMPLATE).decode(token_ids, skip_special_tokens=False)


@pytest.fixture
def tool_use_run(tmp_path):
    """A run directory whose step 0 holds three oracle episodes of the tool-use game."""
    run = tmp_path / "tool-use"
    write_rollouts(run, tool_use_records(3))
    return run


def test_token_spans_cut_exactly_where_the_mask_changes():
    spans = token_spans([5, 6, 7, 8, 9, 10], [0, 0, 1, 1, 0, 1])
    assert [(s.start, s.token_ids, s.trained) for s in spans] == [
        (0, [5, 6], False), (2, [7, 8], True), (4, [9], False), (5, [10], True),
    ]  # fmt: skip


def test_terminal_view_colours_exactly_the_sampled_tokens_green(tool_use_run):
    view = load_step(tool_use_run, 0)
    text = format_step(view, decode, color=True, limit=1)
    record = tool_use_records(1)[0]
    trained = [t for t, bit in zip(record["token_ids"], record["mask"], strict=True) if bit]
    painted = "".join(re.findall(re.escape(TRAINED) + r"(.*?)" + re.escape(RESET), text, re.S))
    legend = "trained (mask 1)"
    assert painted.replace(legend, "", 1).replace("\n", "") == decode(trained).replace("\n", "")
    assert FORCED in text and "<tool_response>" in text


def test_terminal_view_shows_turns_tool_calls_results_reward_and_cause(tool_use_run):
    text = format_step(load_step(tool_use_run, 0), decode, color=False)
    record = tool_use_records(1)[0]
    call = record["messages"][2]["tool_calls"][0]["function"]
    assert f"{call['name']}({call['arguments']})" in text
    assert f"assistant (turn 1) → {call['name']}({call['arguments']})" in text
    assert f"tool {call['name']} ← {record['messages'][3]['content']}" in text
    assert "reward 1.000 · terminated" in text and "3 episode(s) · mean reward 1.000" in text
    assert "\x1b[" not in text


def test_terminal_view_filters_by_group_and_limits_the_episodes(tool_use_run):
    view = load_step(tool_use_run, 0)
    assert format_step(view, decode, color=False, group=1).count("── episode") == 1
    limited = format_step(view, decode, color=False, limit=2)
    assert limited.count("── episode") == 2 and "1 more episode(s)" in limited


def test_html_escapes_what_the_model_and_the_tools_wrote(tool_use_run):
    view = load_step(tool_use_run, 0)
    view.episodes[0].messages.append({"role": "tool", "content": "<script>alert(1)</script>"})
    page = render_html(view, decode)
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_a_step_that_was_not_dumped_lists_the_steps_there_are():
    with pytest.raises(ValueError, match="no train rollouts for step 9; steps: 0, 1"):
        load_step(trained_run(), 9)


def test_the_default_step_is_the_last_one_and_val_dumps_load_too():
    assert load_step(trained_run()).title == "variety · train step 1"
    assert len(load_step(trained_run(), 2, kind="val").episodes) == 2


def test_a_run_decodes_with_its_final_models_tokenizer():
    decoder = load_decoder(trained_run())
    assert decoder is not None and decoder([0]) == "<|endoftext|>"


@needs_chromium
def test_html_view_renders_every_episode_in_headless_chromium(tool_use_run, tmp_path):
    page = write_html(load_step(tool_use_run, 0), decode, tmp_path / "step.html")
    dom = _chromium(["--dump-dom", page.as_uri()], tmp_path)
    assert dom.count('class="episode ') == 3
    for record in tool_use_records(3):
        assert record["task"]["prompt"] in dom
    assert dom.count('<span class="s"') >= 3 * 2  # each episode: several trained spans


@needs_chromium
def test_html_view_of_a_real_runs_step_renders_all_its_episodes(tmp_path):
    view = load_step(trained_run(), 1)
    page = write_html(view, load_decoder(trained_run()), tmp_path / "step1.html")
    dom = _chromium(["--dump-dom", page.as_uri()], tmp_path)
    assert dom.count('class="episode ') == len(view.episodes) >= 8
    assert all(f'id="episode-{e.index}"' in dom for e in view.episodes)


@needs_chromium
def test_html_view_screenshot_shows_the_steps_episodes(tool_use_run, tmp_path):
    from PIL import Image

    page = write_html(load_step(tool_use_run, 0), decode, tmp_path / "step.html")
    shot = tmp_path / "step.png"
    _chromium([f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri()], tmp_path)
    pixels = np.asarray(Image.open(shot).convert("RGB"), dtype=np.int32)
    assert pixels.shape == (1600, 1200, 3)
    assert pixels.mean(axis=2).var() > 100, "the screenshot is blank"
    trained_green = (0xC8, 0xF0, 0xC0)  # .s background: trained tokens
    assert (pixels == trained_green).all(axis=2).sum() > 500, "no trained tokens on screen"


def _chromium(arguments: list[str], tmp_path) -> str:
    assert CHROMIUM is not None
    command = [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}", *arguments]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout
