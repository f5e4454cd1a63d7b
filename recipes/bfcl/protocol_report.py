"""The report of BFCL run 2 (``protocol_run.py``'s ``report`` stage): per model scored so far,
per category and pooled, entry accuracy and prefix turn accuracy with their SEs (ours beside
them), both on held-out turns of seen and of unseen call patterns, and each GRPO seed's paired
gains over every baseline scored on all four categories, a scenario's entries one cluster.
"""

from __future__ import annotations

from pathlib import Path

from post_training_cookbook.bundled_envs.bfcl.multi_turn_data import (
    MULTI_TURN_CATEGORIES,
    load_multi_turn_entries,
)

CATEGORIES = MULTI_TURN_CATEGORIES
BASELINES = ("never_call", "sft", "zero_shot", "rft")
"""(b), (c), (a), (d): the stages ``eval_<name>_<category or part>``."""
SEEDS = (0, 1, 2)


def seen_call_lists() -> set[tuple[str, ...]]:
    """Every ground-truth call list of a user turn in the train split (all categories, all
    prompt lengths; the empty list of a turn that needs no call among them): a held-out turn
    with one of these is of a seen pattern."""
    return {
        tuple(calls)
        for entry in load_multi_turn_entries(CATEGORIES, "train")  # type: ignore[arg-type]
        for calls in entry.ground_truth
    }


def report(out: Path) -> dict:
    """Per model scored so far: per category and pooled, entry accuracy (binomial SE; pooled:
    a scenario's entries as one cluster) and prefix turn accuracy (clustered SE), ours beside
    them; the prefix turn accuracy of held-out turns of seen and of unseen call patterns."""
    import json

    seen = seen_call_lists()
    truths = {e.id: e for e in load_multi_turn_entries(CATEGORIES, "held_out")}
    stages = {f"eval_{name}": name for name in BASELINES}
    stages |= {"best_of_n": "best_of_n"} | {f"eval_grpo_seed{s}": f"grpo_seed{s}" for s in SEEDS}
    rows: dict[str, dict[str, dict]] = {}
    for stage, name in stages.items():
        # a stage a category (never-call) or a part of whole backend groups (the models)
        for found in sorted(out.glob(f"{stage}_*.json")):
            for entry_id, row in json.loads(found.read_text())["per_entry"].items():
                category = truths[entry_id].category
                rows.setdefault(name, {}).setdefault(category, {})[entry_id] = row
    models = {name: model_report(scored, truths, seen) for name, scored in rows.items()}
    complete = {n: pooled(r) for n, r in rows.items() if len(pooled(r)) == len(truths)}
    baselines = [n for n in complete if n in BASELINES]
    gains = {
        f"{grpo}_over_{baseline}": {
            metric: paired_gain(complete[baseline], complete[grpo], metric)
            for metric in ("valid", "prefix_turns")
        }
        for grpo in complete
        if grpo.startswith("grpo_")
        for baseline in baselines
    }
    return {"models": models, "paired_gains": gains}


def pooled(scored: dict[str, dict]) -> dict[str, dict]:
    return {entry_id: row for rows in scored.values() for entry_id, row in rows.items()}


def paired_gain(before: dict[str, dict], after: dict[str, dict], metric: str) -> dict:
    """``metric`` after minus before on the same entries, a scenario's entries (its four
    categories) one cluster: entry accuracy (``valid``, per entry) or prefix turn accuracy
    (``prefix_turns``, per turn); the SE of the paired difference and the gain in SEs."""
    from post_training_cookbook.evaluation.benchmarks import clustered_se

    clusters: dict[str, tuple[int, int]] = {}
    for entry_id in sorted(set(before) & set(after)):
        scale = 1 if metric == "valid" else before[entry_id]["turns"]
        change = int(after[entry_id][metric]) - int(before[entry_id][metric])
        key = entry_id.rsplit("_", 1)[1]
        old = clusters.get(key, (0, 0))
        clusters[key] = (old[0] + change, old[1] + scale)
    gain = sum(d for d, _ in clusters.values()) / sum(t for _, t in clusters.values())
    se = clustered_se(list(clusters.values()))
    return {"gain": gain, "se": se, "gain_in_se": gain / se if se else None}


def model_report(scored: dict[str, dict], truths: dict, seen: set) -> dict:
    from post_training_cookbook.evaluation.benchmarks import clustered_se

    def rates(per_entry: dict, by_scenario: bool) -> dict:
        entries: dict[str, tuple[int, int]] = {}
        prefix: dict[str, tuple[int, int]] = {}
        ours: dict[str, tuple[int, int]] = {}
        split: dict[str, dict[str, tuple[int, int]]] = {"seen": {}, "unseen": {}}
        for entry_id, row in per_entry.items():
            key = entry_id.rsplit("_", 1)[1] if by_scenario else entry_id
            add(entries, key, int(row["valid"]), 1)
            add(prefix, key, row["prefix_turns"], row["turns"])
            add(ours, key, row["turns_valid_ours"], row["turns"])
            for turn, calls in enumerate(truths[entry_id].ground_truth):
                kind = "seen" if tuple(calls) in seen else "unseen"
                add(split[kind], key, int(turn < row["prefix_turns"]), 1)
        result = {"entries": len(per_entry)}
        for label, clusters in (("entry", entries), ("prefix_turn", prefix), ("turn_ours", ours)):
            result |= ratio(label, clusters)
        for kind, clusters in split.items():
            result |= ratio(f"prefix_turn_{kind}", clusters)
        return result

    def add(clusters: dict, key: str, passed: int, total: int) -> None:
        old = clusters.get(key, (0, 0))
        clusters[key] = (old[0] + passed, old[1] + total)

    def ratio(label: str, clusters: dict) -> dict:
        values = list(clusters.values())
        total = sum(t for _, t in values)
        accuracy = sum(v for v, _ in values) / total if total else None
        return {
            f"{label}_accuracy": accuracy,
            f"{label}_se": clustered_se(values),
            f"{label}_count": total,
        }

    report = {category: rates(rows, by_scenario=False) for category, rows in scored.items()}
    if len(scored) > 1:
        pooled = {k: v for rows in scored.values() for k, v in rows.items()}
        report["pooled"] = rates(pooled, by_scenario=True) | {"categories": sorted(scored)}
    return report
