"""How often a served model's tool calls come back as tool calls, against any OpenAI-compatible endpoint
(pdserve, vLLM with `--enable-auto-tool-choice --tool-call-parser hermes`, ...), side by side when run
against each in turn.

    .venv/bin/python benchmarks/tool_calls.py --base-url http://127.0.0.1:8000/v1 [--model NAME]

Greedy chat requests with two tools (weather, time): questions that call for one (each city asked about
the weather and about the time) and questions that call for none. `tool_choice: "auto"`: how many of the
first kind come back with a call of the right tool (and a `city` argument naming the city), how many of
the second kind come back with a call at all (a false call); `"required"`: how many answers are calls of
a given tool with arguments that parse. Prints one table row per setting.
"""

from __future__ import annotations

import argparse
import json
import time

CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Sydney", "Toronto", "Nairobi", "Berlin"]
PLAIN = ["Write a haiku about the sea.", "What is 17 times 23?", "Name three sorting algorithms.",
         "Translate 'good morning' into Spanish.", "Write a Python function that reverses a string.",
         "What does HTTP stand for?", "Give me a synonym for 'quick'.", "Explain recursion in one sentence.",
         "List the first five prime numbers.", "What is the boiling point of water in Celsius?"]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Get the current local time in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
]
SYSTEM = {"role": "system", "content": "You help travellers. Use the tools when they help."}


def main() -> None:
    from openai import OpenAI

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", default=None, help="default: the endpoint's first model")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=300)
    model = args.model or client.models.list().data[0].id
    asks = [(f"What is the weather in {c} right now?", "get_weather", c) for c in CITIES]
    asks += [(f"What time is it in {c} now?", "get_time", c) for c in CITIES]

    def chat(question: str, choice: str):  # type: ignore[no-untyped-def]
        return client.chat.completions.create(
            model=model, messages=[SYSTEM, {"role": "user", "content": question}], tools=TOOLS, tool_choice=choice,
            temperature=0, max_tokens=args.max_tokens).choices[0]

    t0 = time.perf_counter()
    right = false_calls = required_ok = 0
    for question, tool, city in asks:
        calls = chat(question, "auto").message.tool_calls or []
        right += any(c.function.name == tool and city.lower() in c.function.arguments.lower() for c in calls)
    for question in PLAIN:
        false_calls += bool(chat(question, "auto").message.tool_calls)
    for question, _, _ in asks:
        ch = chat(question, "required")
        try:
            required_ok += bool(ch.message.tool_calls) and all(
                c.function.name in ("get_weather", "get_time") and isinstance(json.loads(c.function.arguments), dict)
                for c in ch.message.tool_calls)
        except ValueError:
            pass
    print(f"{args.base_url} ({model}), {time.perf_counter() - t0:.0f} s")
    print(f"  auto: right tool and city {right}/{len(asks)}; calls on plain questions {false_calls}/{len(PLAIN)}")
    print(f"  required: answers that are calls of a given tool with parsable arguments {required_ok}/{len(asks)}")


if __name__ == "__main__":
    main()
