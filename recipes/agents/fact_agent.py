"""An agent written against the OpenAI API alone: it answers questions about a fictional world
with three tools of its own (list_fact_keys, lookup, calculator) and grades its final answer.

Nothing here imports the cookbook: the agent gets a base URL, an API key and the task (an
object with ``prompt``, ``target`` and ``metadata``; the facts it may look up are in
``metadata["facts"]``), talks to the endpoint with the ``openai`` client as it would to any
OpenAI-compatible API, keeps its own history, and returns its reward. Train it with
``recipes/agents/train_fact_agent.py``; docs/agents.md walks through both.
"""

import json

import openai

SYSTEM_PROMPT = (
    "Answer questions about a fictional world. Look facts up with the tools and use the "
    "calculator for arithmetic. Then reply with only the final number, rounded to two "
    "decimals if it is not whole."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "list_fact_keys",
            "description": "List the fact keys that start with a prefix, such as an entity's name.",
            "parameters": {
                "type": "object",
                "properties": {"prefix": {"type": "string"}},
                "required": ["prefix"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up the value of a fact by its key, such as 'kalo.weight'.",
            "parameters": {
                "type": "object",
                "properties": {"key": {"type": "string"}},
                "required": ["key"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": (
                "Evaluate an arithmetic expression with numbers, + - * / and parentheses, such "
                "as 'a * (b + c)' with numbers in place of the letters."
            ),
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    },
]
MAX_TURNS = 6
# One HTTP client for every episode: building one costs ~0.1 s of CPU (it loads the TLS
# certificates), more than an episode's sampling on the bundled model. with_options below
# points a copy of it at each episode's base URL and key, sharing its connections.
CLIENT = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="set per episode", max_retries=2)


def fact_agent(base_url, api_key, task):
    """Play one task; return 1.0 for a correct final answer, else 0.0."""
    client = CLIENT.with_options(base_url=base_url, api_key=api_key)
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task.prompt},
    ]
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=64
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # the reply, as it came
        if not message.tool_calls:
            return 1.0 if same_number(message.content or "", task.target) else 0.0
        for call in message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments, task.metadata["facts"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0


def run_tool(name, arguments, facts):
    """A tool's result as text; a bad call gets an error the model can read."""
    try:
        values = json.loads(arguments)
        if name == "list_fact_keys":
            keys = sorted(key for key in facts if key.startswith(values["prefix"].strip()))
            return ", ".join(keys) if keys else f"no keys start with '{values['prefix']}'"
        if name == "lookup":
            return str(facts[values["key"].strip()])
        if name == "calculator":
            return format_number(Arithmetic(values["expression"]).value())
        return f"tool_error: unknown tool '{name}'"
    except (ValueError, KeyError, TypeError, ZeroDivisionError, RecursionError) as error:
        return f"tool_error: {error!r}"


def same_number(reply, target):
    try:
        return round(float(reply.strip()), 2) == round(float(target), 2)
    except ValueError:
        return False


def format_number(value):
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.6f}".rstrip("0").rstrip(".")


class Arithmetic:
    """+ - * / and parentheses over decimal numbers, parsed by hand (never eval model text)."""

    def __init__(self, text):
        self.text, self.at = text.replace(" ", ""), 0

    def value(self):
        result = self.sum()
        if self.at != len(self.text):
            raise ValueError(f"unexpected {self.text[self.at :]!r}")
        return result

    def sum(self):
        result = self.product()
        while self.peek() in ("+", "-"):
            sign = self.take()
            result = result + self.product() if sign == "+" else result - self.product()
        return result

    def product(self):
        result = self.factor()
        while self.peek() in ("*", "/"):
            operator = self.take()
            result = result * self.factor() if operator == "*" else result / self.factor()
        return result

    def factor(self):
        if self.peek() == "-":
            self.take()
            return -self.factor()
        if self.peek() == "(":
            self.take()
            result = self.sum()
            if self.take() != ")":
                raise ValueError("missing ')'")
            return result
        start = self.at
        while self.peek() is not None and (self.peek().isdigit() or self.peek() == "."):
            self.at += 1
        if start == self.at:
            raise ValueError(f"expected a number at {self.text[start:]!r}")
        return float(self.text[start : self.at])

    def peek(self):
        return self.text[self.at] if self.at < len(self.text) else None

    def take(self):
        char = self.peek()
        self.at += 1
        return char
