"""Talk to k3serve's Anthropic-compatible /v1/messages with the official `anthropic` package:
thinking blocks, streaming, and tool use.

    pip install anthropic
    python3 examples/clients/anthropic_messages.py [--base-url http://127.0.0.1:8000]
"""

import argparse
import json
import os

import anthropic

STOCK = {
    "name": "get_stock_price",
    "description": "Latest price of a stock.",
    "input_schema": {
        "type": "object",
        "properties": {"symbol": {"type": "string", "description": "Ticker symbol."}},
        "required": ["symbol"],
    },
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="k3-mini")
    args = ap.parse_args()
    client = anthropic.Anthropic(base_url=args.base_url, api_key=os.environ.get("K3SERVE_API_KEY", "none"))

    # Recent `anthropic` releases dropped the `temperature` argument; the server still reads it.
    m = client.messages.create(
        model=args.model, max_tokens=500, extra_body={"temperature": 0},
        thinking={"type": "enabled", "budget_tokens": 400},
        messages=[{"role": "user", "content": "What is 250 - 75?"}],
    )
    for block in m.content:
        print(f"[{block.type}]", getattr(block, "thinking", None) or getattr(block, "text", ""))

    print("\nstreaming: ", end="", flush=True)
    with client.messages.stream(
        model=args.model, max_tokens=200, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Say hello to Maya."}],
    ) as stream:
        for text in stream.text_stream:
            print(text, end="", flush=True)
    print()

    messages = [{"role": "user", "content": "What is the price of ACME?"}]
    m = client.messages.create(model=args.model, max_tokens=500, extra_body={"temperature": 0}, tools=[STOCK], messages=messages)
    print("\nstop_reason:", m.stop_reason)
    uses = [b for b in m.content if b.type == "tool_use"]
    if uses:
        print("tool_use:", uses[0].name, uses[0].input)
        messages += [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                          "content": json.dumps({"price": 42.5, "symbol": "ACME"})}]},
        ]
        final = client.messages.create(model=args.model, max_tokens=500, extra_body={"temperature": 0}, tools=[STOCK],
                                       messages=messages)
        print("answer:", "".join(b.text for b in final.content if b.type == "text"))


if __name__ == "__main__":
    main()
