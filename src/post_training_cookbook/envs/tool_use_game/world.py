"""The tool-use game's fact world and tasks: fictional entities with numeric attributes.

Everything is generated from a fixed seed, so no model can answer from memory and every
machine builds the same world. Names are two syllables from a small set, which keeps a
tokenizer from memorising whole names (a name is always two syllable tokens).

Levels:
    1: one lookup, answer the value            "What is the weight of kalo?"
    2: one lookup plus arithmetic              "What is the weight of kalo plus 7?"
    3: two lookups plus arithmetic             "What is the weight of kalo minus the age of zuren?"

Split: entities are split 80/20 into train and validation entities. A task belongs to the
validation split when all its entities are validation entities and to the train split when
all are train entities; level-3 tasks that mix the two are not generated. So the two splits
share no task and no entity: validation measures whether a model learned to use the tools,
not whether it memorised facts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cached_property

from post_training_cookbook.envs.base import Task

SYLLABLES = (
    "ka", "lo", "mi", "zu", "ren", "tob", "vis", "gar",
    "pel", "dun", "fim", "sor", "nak", "bel", "tri", "vo",
)  # fmt: skip
ATTRIBUTES = ("weight", "height", "age", "speed", "price")
OPERATIONS = {"plus": "+", "minus": "-", "times": "*"}

WORLD_SEED = 20261129
NUM_ENTITIES = 120
VAL_ENTITY_FRACTION = 0.2
VALUE_RANGE = (2, 99)
CONSTANT_RANGE = (2, 20)
TASKS_PER_LEVEL = {1: 300, 2: 500, 3: 500}


@dataclass(frozen=True)
class FactWorld:
    """Entities, their attribute values, and which entities are held out for validation."""

    facts: dict[str, int]
    """``"<entity>.<attribute>"`` → value."""
    train_entities: tuple[str, ...]
    val_entities: tuple[str, ...]

    @cached_property
    def entities(self) -> tuple[str, ...]:
        return self.train_entities + self.val_entities

    def keys_with_prefix(self, prefix: str) -> list[str]:
        return sorted(key for key in self.facts if key.startswith(prefix))

    def revalued(self, rng: random.Random) -> FactWorld:
        """The same entities and keys with freshly drawn values. Teacher episodes for
        fine-tuning are played in such worlds, so a model cannot memorise facts and has to
        read them from the tools' results."""
        facts = {key: rng.randint(*VALUE_RANGE) for key in self.facts}
        return FactWorld(facts, self.train_entities, self.val_entities)


def build_world(seed: int = WORLD_SEED, num_entities: int = NUM_ENTITIES) -> FactWorld:
    """The deterministic fact world for ``seed``."""
    rng = random.Random(seed)
    names = [a + b for a in SYLLABLES for b in SYLLABLES if a != b]
    entities = rng.sample(names, num_entities)
    facts = {
        f"{entity}.{attribute}": rng.randint(*VALUE_RANGE)
        for entity in entities
        for attribute in ATTRIBUTES
    }
    num_val = round(num_entities * VAL_ENTITY_FRACTION)
    return FactWorld(
        facts=facts,
        train_entities=tuple(entities[num_val:]),
        val_entities=tuple(entities[:num_val]),
    )


def _apply(op: str, left: int, right: int) -> int:
    return {"+": left + right, "-": left - right, "*": left * right}[op]


def _make_task(
    world: FactWorld, rng: random.Random, level: int, entities: tuple[str, ...], split: str
) -> Task:
    opword = rng.choice(list(OPERATIONS))
    op = OPERATIONS[opword]
    entity, attribute = rng.choice(entities), rng.choice(ATTRIBUTES)
    key = f"{entity}.{attribute}"
    value = world.facts[key]
    if level == 1:
        prompt, keys, target = f"What is the {attribute} of {entity}?", [key], value
    elif level == 2:
        constant = rng.randint(*CONSTANT_RANGE)
        prompt = f"What is the {attribute} of {entity} {opword} {constant}?"
        keys, target = [key], _apply(op, value, constant)
    else:
        other_entity = rng.choice([e for e in entities if e != entity])
        other_key = f"{other_entity}.{rng.choice(ATTRIBUTES)}"
        other_attribute = other_key.split(".")[1]
        prompt = (
            f"What is the {attribute} of {entity} {opword} the {other_attribute} of {other_entity}?"
        )
        keys, target = [key, other_key], _apply(op, value, world.facts[other_key])
    metadata = {"level": level, "keys": keys, "split": split}
    if level > 1:
        metadata["operation"] = op
    return Task(prompt=prompt, target=str(target), metadata=metadata)


def build_tasks(world: FactWorld, seed: int = WORLD_SEED) -> tuple[list[Task], list[Task]]:
    """(train tasks, validation tasks), unique prompts, in a fixed shuffled order."""
    rng = random.Random(seed + 1)
    splits: dict[str, list[Task]] = {"train": [], "val": []}
    for split, entities in (("train", world.train_entities), ("val", world.val_entities)):
        share = 1 - VAL_ENTITY_FRACTION if split == "train" else VAL_ENTITY_FRACTION
        seen: set[str] = set()
        for level, count in TASKS_PER_LEVEL.items():
            wanted, attempts = round(count * share), 0
            while wanted > 0 and attempts < 100 * count:
                attempts += 1
                task = _make_task(world, rng, level, entities, split)
                if task.prompt not in seen:
                    seen.add(task.prompt)
                    splits[split].append(task)
                    wanted -= 1
        rng.shuffle(splits[split])
    return splits["train"], splits["val"]
