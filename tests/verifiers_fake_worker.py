"""A stand-in for agents/verifiers_worker.py that runs in the cookbook's venv (no verifiers):
it speaks the worker's JSON-lines protocol, and its "rollout" is one streamed call to the
episode's route with the ``openai`` client. For tests/test_verifiers_units.py.

Tasks: 0 and 1 answer with reward 0.75 (rubric parts ``exact`` 0.5 and ``format`` 0.25);
task 2's rollout reports a tool error before any call (an env error); "score" gives 0.75 to
a transcript whose last message is the assistant's. Config ``{"fatal": true}`` fails at start-up.
"""

import json
import sys
import threading

import openai

REWARDS = {"exact": {"score": 0.5, "weight": 1.0}, "format": {"score": 0.25, "weight": 1.0}}
OUT = sys.stdout
LOCK = threading.Lock()


def write(answer):
    with LOCK:
        OUT.write(json.dumps(answer) + "\n")
        OUT.flush()


def run(request):
    if request["task"] == 2:  # its tool server died before the first call
        errors = [{"type": "ToolError", "message": "the tool server died"}]
        return {"reward": 0.0, "rewards": {}, "ok": False, "errors": errors,
                "stop_condition": "error", "num_turns": 0, "messages": []}  # fmt: skip
    client = openai.OpenAI(base_url=request["base_url"], api_key=request["api_key"], max_retries=0)
    messages = [{"role": "user", "content": f"task {request['task']}"}]
    chunks = client.chat.completions.create(
        model=request["model"], messages=messages, stream=True,
        stream_options={"include_usage": True}, **request["sampling"],
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    messages.append({"role": "assistant", "content": text})
    return {"reward": 0.75, "rewards": REWARDS, "ok": True, "errors": [],
            "stop_condition": "agent_completed", "num_turns": 1, "messages": messages}  # fmt: skip


def answer(line):
    request = json.loads(line)
    try:
        if request["op"] == "tasks":
            result = [{"index": i, "key": f"k{i}", "prompt": f"task {i}", "system_prompt": None,
                       "answer": str(i), "data": {"idx": i}} for i in range(3)]  # fmt: skip
        elif request["op"] == "run":
            result = run(request)
        elif request["op"] == "score":
            last = request["messages"][-1]["role"]
            result = {"reward": 0.75 if last == "assistant" else 0.0, "rewards": REWARDS}
        else:
            raise ValueError(f"unknown op {request['op']!r}")
        write({"id": request["id"], "result": result})
    except Exception as exc:
        write({"id": request["id"], "error": repr(exc)})


def main():
    config = json.loads(sys.argv[1])
    if config["taskset"].get("fatal"):
        print("about to fail", file=sys.stderr, flush=True)
        write({"fatal": "ModuleNotFoundError: taskset 'nowhere' not found"})
        return 1
    write({"ready": {"tasks": 3, "verifiers": "fake"}})
    threads = []
    for line in sys.stdin:
        thread = threading.Thread(target=answer, args=(line,))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
