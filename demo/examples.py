"""Ready-to-paste requests printed by `loragw serve --demo` (and so by `make demo`)."""

from __future__ import annotations

import json


def demo_examples(host: str, port: int, base: str, adapters: list[str]) -> str:
    url = f"http://{host}:{port}"
    first, second = (adapters + [base, base])[:2]
    chat = lambda model: json.dumps({"model": model, "max_tokens": 24, "temperature": 0,
                                     "messages": [{"role": "user", "content": "Tell me a story"}]})
    return f"""
Once the log says "ready", try (two adapters answer the same prompt in one batch):

  curl -s {url}/v1/models | python3 -m json.tool

  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{chat(first)}' &
  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{chat(second)}' &
  wait

  curl -sN {url}/v1/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{second}", "prompt": "Hello there", "max_tokens": 24, "stream": true}}'

  python3 - <<'PY'
from concurrent.futures import ThreadPoolExecutor
from openai import OpenAI
client = OpenAI(base_url="{url}/v1", api_key="none")
def ask(model):
    r = client.chat.completions.create(model=model, temperature=0, max_tokens=24,
        messages=[{{"role": "user", "content": "What is the weather like?"}}])
    return model, r.choices[0].message.content
with ThreadPoolExecutor(8) as pool:
    for model, text in pool.map(ask, {[base] + adapters!r}):
        print(f"{{model:>10}}: {{text}}")
PY
"""
