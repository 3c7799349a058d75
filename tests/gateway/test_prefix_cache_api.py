"""Prefix caching as an OpenAI client sees it: a repeated prompt reports cached prompt tokens in
usage.prompt_tokens_details, per adapter, and /metrics counts the hits."""

from __future__ import annotations

import re

BASE = "demo-base"  # conftest's served model name
# Long enough for several 16-token KV blocks; a first sentence no other test sends.
PROMPT = ("Prefix caching check: a lighthouse keeper counts the ships that pass the cape. "
          * 8).strip()
GREEDY = dict(temperature=0.0, max_tokens=4, extra_body={"ignore_eos": True})


def metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.MULTILINE).group(1))


def test_a_repeated_prompt_reports_cached_tokens(client, http, server, wait_idle):
    block_size = server.services.info.block_size
    first = client.completions.create(model=BASE, prompt=PROMPT, **GREEDY)
    second = client.completions.create(model=BASE, prompt=PROMPT, **GREEDY)
    prompt_tokens = second.usage.prompt_tokens
    assert prompt_tokens > 4 * block_size
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < prompt_tokens and cached % block_size == 0
    assert second.choices[0].text == first.choices[0].text
    # An adapter's K/V differ from the base model's: nothing is shared across them.
    other = client.completions.create(model="lora-0", prompt=PROMPT, **GREEDY)
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    wait_idle(server.services)  # cached blocks nobody references count as free
    text = http.get("/metrics").text
    assert metric(text, "loragw_prefix_cache_hits_total") >= cached
    assert metric(text, "loragw_prefix_cache_queries_total") >= 3 * prompt_tokens
