"""What the benchmarks that put ours beside TRL share: each side in a fresh subprocess, its
memory read from ``/proc``, a check on other processes' CPU use, and SmolLM2-135M's shape.

- ``run_side``: runs ``python script --child ...`` (TRL's sides with TRL's venv), returns the
  JSON its child printed on a ``RESULT`` line; ``print_result`` is the child's half.
- ``proc_status``: ``VmHWM`` / ``VmRSS`` of this process.
- ``CpuSample`` / ``others_share``: how much of the machine other processes used between two
  samples (``/proc/stat``'s busy jiffies less this process tree's own), so that a timed step
  that shared the CPU says so.
- ``smollm2_shape_folder``: a random-initialised model of SmolLM2-135M's shape and a
  byte-level BPE tokenizer of its 49,152 ids with the Hermes chat template, saved to a
  folder; nothing downloaded.

Only the standard library at import: the helpers import torch and transformers when called,
so this module loads in either venv and in the unit tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULT = "RESULT "
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>"]  # fmt: skip
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
"""``/proc/stat``'s user, nice, system, irq, softirq, steal (idle and iowait are not busy;
guest time is already in user)."""


def proc_status(key: str) -> int:
    """``VmHWM`` / ``VmRSS`` of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


# ---------------------------------------------------------------- CPU used by others


def busy_jiffies(proc_stat: str) -> int:
    """The machine's busy jiffies, all CPUs, from the text of ``/proc/stat``."""
    fields = proc_stat.splitlines()[0].split()
    if fields[0] != "cpu":
        raise ValueError(f"/proc/stat starts with {fields[0]!r}, not the 'cpu' total")
    values = [int(v) for v in fields[1:]]
    return sum(values[i] for i in BUSY_FIELDS if i < len(values))


def process_jiffies(stat: str, *, with_children: bool) -> tuple[int, int]:
    """(parent pid, user + system jiffies) from the text of ``/proc/<pid>/stat``; with
    ``with_children`` the waited-for children's too. The command name may hold spaces and
    parentheses, so the fields are counted from its last ``)``."""
    fields = stat[stat.rindex(")") + 2 :].split()
    # after the name: state ppid ... utime(14th field) stime cutime cstime, 1-based from pid
    ppid, utime, stime, cutime, cstime = (int(fields[i]) for i in (1, 11, 12, 13, 14))
    return ppid, utime + stime + (cutime + cstime if with_children else 0)


def tree_jiffies(root: int | None = None) -> int:
    """CPU jiffies of process ``root`` (default: this one) and its live descendants, plus
    what its exited children had used."""
    root = os.getpid() if root is None else root
    processes: dict[int, tuple[int, int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            pid = int(entry.name)
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # it exited meanwhile
                continue
            processes[pid] = process_jiffies(stat, with_children=pid == root)
    return tree_total(processes, root)


def tree_total(processes: dict[int, tuple[int, int]], root: int) -> int:
    """The jiffies of ``root`` and its descendants in ``{pid: (parent pid, jiffies)}``."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in processes.items():
        children.setdefault(ppid, []).append(pid)
    total, frontier = 0, [root] if root in processes else []
    while frontier:
        pid = frontier.pop()
        total += processes[pid][1]
        frontier += [child for child in children.get(pid, []) if child != root]
    return total


@dataclass(frozen=True)
class CpuSample:
    """The machine's busy jiffies, this process tree's, and the monotonic time, at once."""

    machine: int
    own: int
    seconds: float

    @classmethod
    def now(cls) -> CpuSample:
        return cls(busy_jiffies(Path("/proc/stat").read_text()), tree_jiffies(), time.monotonic())


def others_share(
    before: CpuSample, after: CpuSample, cpus: int, ticks_per_s: float = 100.0
) -> float:
    """The share of the machine (``cpus`` cores over the interval) that processes outside
    this tree kept busy between the samples, in [0, 1]."""
    capacity = (after.seconds - before.seconds) * cpus * ticks_per_s
    others = (after.machine - before.machine) - (after.own - before.own)
    return min(1.0, max(0.0, others / capacity)) if capacity > 0 else 0.0


def machine_cpus() -> tuple[int, float]:
    """(CPUs, jiffies a second) to pass to ``others_share``."""
    return os.cpu_count() or 1, float(os.sysconf("SC_CLK_TCK"))


# ---------------------------------------------------------------- the sides' processes


def print_result(row: dict[str, Any]) -> None:
    """The child's last word: its measurements as one JSON line."""
    print(RESULT + json.dumps(row), flush=True)


def run_side(
    side: str, python: str, script: str, arguments: list[str], *, with_src: bool
) -> dict[str, Any]:
    """Run ``python script --child side arguments...`` in a fresh process (offline, W&B
    off; ``with_src``: this checkout's ``src`` first on its path), and return the JSON of
    its ``RESULT`` line with ``side`` and its wall time; exit with its output on failure."""
    env = os.environ | {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    if with_src:
        paths = [str(ROOT / "src"), env.get("PYTHONPATH")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    started = time.monotonic()
    command = [python, script, "--child", side, *arguments]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    output = done.stdout + done.stderr
    results = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode or not results:
        sys.exit(f"{side} failed (exit {done.returncode}):\n{output[-6000:]}")
    row: dict[str, Any] = json.loads(results[-1][len(RESULT) :])
    return row | {"side": side, "wall_s": time.monotonic() - started, "output": output}


# ---------------------------------------------------------------- SmolLM2-135M's shape


def smollm2_shape_folder(folder: Path, seed: int = 0) -> Any:
    """Save a random-initialised model of SmolLM2-135M's shape (``SMOLLM2_135M`` of
    ``benchmarks/packing.py``) and its tokenizer to ``folder``; returns the tokenizer."""
    import torch
    from packing import SMOLLM2_135M
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from post_training_cookbook.codecs import HERMES_CHAT_TEMPLATE

    shape: dict[str, Any] = dict(SMOLLM2_135M)
    vocab_size = shape["vocab_size"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: (not c.isalpha(), c))
    vocab = {token: i for i, token in enumerate(SPECIALS + alphabet)}
    merges = []  # byte pairs, letters first, until the vocabulary is SmolLM2's
    for a in alphabet:
        for b in alphabet:
            if len(vocab) < vocab_size:
                merges.append((a, b))
                vocab[a + b] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIALS)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=HERMES_CHAT_TEMPLATE,
    )  # fmt: skip
    assert len(wrapped) == vocab_size, len(wrapped)
    torch.manual_seed(seed)
    ids = {"bos_token_id": wrapped.pad_token_id, "pad_token_id": wrapped.pad_token_id}
    config = LlamaConfig(**shape, **ids, eos_token_id=wrapped.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    wrapped.save_pretrained(folder)
    return wrapped
