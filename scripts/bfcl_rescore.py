"""Score a ``bfcl_results.jsonl`` with ``bfcl-eval`` alone: no code of this project runs.

    python scripts/bfcl_rescore.py EVAL_DIR/bfcl_results.jsonl [--json]

Each line holds an entry's ``id``, ``result`` (per user turn played, per reply with calls, the
calls as BFCL writes them) and ``inference_error`` (why the episode ended before the entry
did, or null): what an evaluation of this project writes (the format:
``src/post_training_cookbook/bundled_envs/bfcl/results_file.py``). Each entry is judged as
``bfcl-eval``'s eval runner judges a multi-turn entry once its handler has decoded the replies
(``_evaluate_single_multi_turn_entry``): an inference error fails it, a turn count other than
the entry's is ``force_terminated``, else ``multi_turn_checker`` decides. The prefix turn
count is the number of finished turns before the first failing one, by ``multi_turn_checker``
on each prefix (the last turn of a failed or force-terminated run is unfinished). Prints, per
category and pooled, entry accuracy and prefix turn accuracy, and how many lines carry a
verdict (``valid``, ``prefix_turns``) other than the one found here (exit code 1 if any).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
from pathlib import Path

# bfcl-eval writes its folders under BFCL_PROJECT_ROOT, next to the package by default
os.environ.setdefault("BFCL_PROJECT_ROOT", str(Path(tempfile.gettempdir()) / "bfcl-rescore"))

from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import (
    multi_turn_checker,
)
from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry

MODEL_NAME = "bfcl_rescore"


def judge(line: dict, ground_truth: list[list[str]], entry: dict) -> tuple[bool, int]:
    """The entry's verdict and its prefix turn count."""
    result = line["result"]
    complete = not line.get("inference_error") and len(result) == len(ground_truth)
    finished = len(result) if complete else len(result) - 1
    prefix = 0
    for turns in range(1, finished + 1):
        if not _check(result[:turns], ground_truth[:turns], entry)["valid"]:
            break
        prefix = turns
    return complete and prefix == len(ground_truth), prefix


def _check(result: list, ground_truth: list[list[str]], entry: dict) -> dict:
    prompt = {
        "id": entry["id"],
        "initial_config": copy.deepcopy(entry["initial_config"]),
        "involved_classes": list(entry["involved_classes"]),
    }
    category = entry["id"].rsplit("_", 1)[0]
    try:
        return multi_turn_checker(result, ground_truth, prompt, category, MODEL_NAME)
    finally:  # bfcl-eval keeps backend instances in its module globals, by model and entry
        names = vars(multi_turn_utils)
        for key in [k for k in names if k.startswith(MODEL_NAME)]:
            del names[key]


def rescore(path: Path) -> dict:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    categories = sorted({line["id"].rsplit("_", 1)[0] for line in lines})
    entries, truths = {}, {}
    for category in categories:
        entries |= {e["id"]: e for e in load_dataset_entry(category)}
        truths |= {a["id"]: a["ground_truth"] for a in load_ground_truth_entry(category)}
    rows: dict[str, list[tuple[bool, int, int]]] = {c: [] for c in categories}
    disagreements = []
    for line in lines:
        truth = truths[line["id"]]
        valid, prefix = judge(line, truth, entries[line["id"]])
        rows[line["id"].rsplit("_", 1)[0]].append((valid, prefix, len(truth)))
        if "valid" in line and (line["valid"], line.get("prefix_turns")) != (valid, prefix):
            ours = [line["valid"], line.get("prefix_turns")]
            disagreements.append({"id": line["id"], "ours": ours, "bfcl_eval": [valid, prefix]})
    rows["pooled"] = [row for category in categories for row in rows[category]]
    report = {
        name: {
            "entries": len(found),
            "entry_accuracy": sum(v for v, _, _ in found) / len(found),
            "prefix_turn_accuracy": sum(p for _, p, _ in found) / sum(t for _, _, t in found),
        }
        for name, found in rows.items()
        if found
    }
    return {"per_category": report, "disagreements": disagreements}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a bfcl_results.jsonl")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args()
    report = rescore(args.results)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for name, row in report["per_category"].items():
        accuracy, prefix = row["entry_accuracy"], row["prefix_turn_accuracy"]
        print(f"{name:28s} {row['entries']:4d} entries  entry accuracy {accuracy:.3f}  "
              f"prefix turn accuracy {prefix:.3f}")  # fmt: skip
    print(f"lines whose recorded verdict differs from bfcl-eval's: {len(report['disagreements'])}")
    sys.exit(1 if report["disagreements"] else 0)


if __name__ == "__main__":
    main()
