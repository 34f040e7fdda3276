"""Chat with k3serve through the official `openai` package: a plain answer, a streamed answer with
reasoning, and a full tool-use round trip.

    pip install openai
    python3 examples/clients/openai_chat.py [--base-url http://127.0.0.1:8000/v1]
"""

import argparse
import json
import os

import openai

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=os.environ.get("K3SERVE_API_KEY", "none"))
    model = client.models.list().data[0].id

    r = client.chat.completions.create(
        model=model, temperature=0, max_tokens=400,
        messages=[{"role": "user", "content": "What is 345 + 678?"}],
    )
    msg = r.choices[0].message
    print("reasoning:", (msg.model_extra or {}).get("reasoning_content"))
    print("answer:   ", msg.content)
    print("usage:    ", r.usage)

    print("\nstreaming (thinking off): ", end="", flush=True)
    for chunk in client.chat.completions.create(
        model=model, temperature=0, max_tokens=100, reasoning_effort="none", stream=True,
        messages=[{"role": "user", "content": "What is 12 × 11?"}],
    ):
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
    print()

    messages = [{"role": "user", "content": "What is the weather in Lima in fahrenheit?"}]
    r = client.chat.completions.create(
        model=model, temperature=0, max_tokens=400, messages=messages, tools=[WEATHER]
    )
    choice = r.choices[0]
    print("\nfinish_reason:", choice.finish_reason)
    for call in choice.message.tool_calls or []:
        print("tool call:", call.function.name, json.loads(call.function.arguments))
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": json.dumps({"city": "Lima", "condition": "foggy", "temperature": 64})})
        final = client.chat.completions.create(
            model=model, temperature=0, max_tokens=400, messages=messages, tools=[WEATHER]
        )
        print("answer:", final.choices[0].message.content)


if __name__ == "__main__":
    main()
