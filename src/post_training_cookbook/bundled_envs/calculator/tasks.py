"""The calculator environment's bundled tasks: seeded arithmetic with integer answers.

``calculator_tasks()`` draws expressions from a few shapes (two to four numbers, mixed
operators, parentheses, squares and exact divisions) with a fixed seed, so every process
gets the same list. The split is by position: the first ``NUM_TRAIN_TASKS`` tasks are
``train``, the rest ``val``; expressions are unique across the whole list, so the splits
share no question.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from post_training_cookbook.envs.arithmetic import format_number, safe_eval
from post_training_cookbook.envs.base import Task

NUM_TRAIN_TASKS = 250
NUM_VAL_TASKS = 50
TASK_SEED = 20250101

_Shape = Callable[[random.Random], str]


def _two_numbers(rng: random.Random) -> str:
    return f"{rng.randint(12, 999)} {rng.choice('+-*')} {rng.randint(12, 99)}"


def _product_of_sum(rng: random.Random) -> str:
    return f"{rng.randint(3, 49)} * ({rng.randint(2, 99)} + {rng.randint(2, 99)})"


def _difference_of_products(rng: random.Random) -> str:
    a, b, c, d = (rng.randint(3, 99) for _ in range(4))
    return f"{a} * {b} - {c} * {d}"


def _sum_times_difference(rng: random.Random) -> str:
    a, b, c = (rng.randint(10, 99) for _ in range(3))
    return f"({a} + {b}) * ({c} - {rng.randint(1, c - 1)})"


def _square_plus(rng: random.Random) -> str:
    return f"{rng.randint(11, 99)} ** 2 {rng.choice('+-')} {rng.randint(2, 999)}"


def _exact_division(rng: random.Random) -> str:
    divisor, quotient = rng.randint(3, 29), rng.randint(11, 199)
    return f"{divisor * quotient} / {divisor} + {rng.randint(2, 99)}"


def _three_terms(rng: random.Random) -> str:
    a, b, c = (rng.randint(100, 9999) for _ in range(3))
    return f"{a} {rng.choice('+-')} {b} {rng.choice('+-')} {c}"


_SHAPES: tuple[_Shape, ...] = (
    _two_numbers,
    _product_of_sum,
    _difference_of_products,
    _sum_times_difference,
    _square_plus,
    _exact_division,
    _three_terms,
)


def calculator_tasks(
    num_train: int = NUM_TRAIN_TASKS, num_val: int = NUM_VAL_TASKS, seed: int = TASK_SEED
) -> list[Task]:
    """``num_train`` train tasks then ``num_val`` val tasks, unique expressions, same per seed."""
    if num_train < 0 or num_val < 0:
        raise ValueError(f"task counts must be >= 0, got num_train={num_train}, num_val={num_val}")
    rng = random.Random(seed)
    expressions: dict[str, None] = {}  # insertion-ordered set
    while len(expressions) < num_train + num_val:
        expressions[rng.choice(_SHAPES)(rng)] = None
    return [
        _task(expression, "train" if index < num_train else "val")
        for index, expression in enumerate(expressions)
    ]


def _task(expression: str, split: str) -> Task:
    return Task(
        prompt=f"What is {expression}?",
        target=format_number(safe_eval(expression)),
        metadata={"expression": expression, "split": split},
    )


CALCULATOR_TASKS: tuple[Task, ...] = tuple(calculator_tasks())
"""The bundled tasks: 250 ``train`` then 50 ``val`` (see ``metadata["split"]``)."""

CALCULATOR_TRAIN_TASKS: tuple[Task, ...] = CALCULATOR_TASKS[:NUM_TRAIN_TASKS]
CALCULATOR_VAL_TASKS: tuple[Task, ...] = CALCULATOR_TASKS[NUM_TRAIN_TASKS:]
