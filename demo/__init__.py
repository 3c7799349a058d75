"""The demo: a small Llama-architecture base model with its own tokenizer (demo.model), four
PEFT-trained adapters that each answer with a catch-phrase (demo.adapters), and the requests
`loragw serve --demo` prints (demo.examples). Built by `loragw demo`, served by `make demo`."""

import os

# Where `loragw demo` builds the demo (its --out default) and `loragw serve --demo` serves it from.
DEMO_DIR = os.path.join("~", ".cache", "lora-gateway", "demo")
