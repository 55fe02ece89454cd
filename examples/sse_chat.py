"""A minimal streaming chat client that reads flotilla's SSE by hand (no openai package needed).

    flotilla serve &            # in another terminal
    python examples/sse_chat.py "What is the capital of France?"
"""

from __future__ import annotations

import json
import sys

import httpx


def chat(question: str, url: str = "http://127.0.0.1:8000/v1/chat/completions") -> None:
    body = {"messages": [{"role": "user", "content": question}], "stream": True, "max_tokens": 128,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        if response.status_code != 200:
            error = json.loads(response.read())["error"]
            sys.exit(f"error {response.status_code}: {error['message']}")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue  # SSE events are separated by blank lines
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                sys.exit(f"\nerror: {chunk['error']['message']}")
            for choice in chunk["choices"]:
                print(choice["delta"].get("content") or "", end="", flush=True)
            if chunk.get("usage"):
                u = chunk["usage"]
                print(f"\n[{u['prompt_tokens']} prompt + {u['completion_tokens']} completion tokens]")


if __name__ == "__main__":
    chat(" ".join(sys.argv[1:]) or "Tell me a joke.")
