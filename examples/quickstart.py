"""slora's Python API in one batch: the embedded SmolLM2-135M-Instruct on CPU, the shipped
pirate adapter, and one prompt asked twice in the same batch, once through the adapter and
once of the base model.

    .venv/bin/python examples/quickstart.py        (after ./run made the venv)

The first run converts the embedded model into ~/.cache/slora (a few seconds); the answers are
greedy, so every run prints the same text.
"""

import os
from pathlib import Path

# On CPU slora's tensors are small: one torch thread computes them fastest, and more threads
# only wait on each other, far longer when other processes share the cores. (Set before torch
# is imported, as ./run does; a value you set yourself wins.)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from slora import Engine, EngineConfig, SamplingParams  # noqa: E402

# The adapters shipped in the repository, found from this file: the script runs from any directory.
ADAPTERS = Path(__file__).resolve().parents[1] / "slora" / "assets" / "adapters"

engine = Engine(EngineConfig(device="cpu"))  # model=None: the embedded SmolLM2-135M-Instruct
engine.add_adapter("pirate", ADAPTERS / "pirate")  # validated now, loaded lazily
chat = [{"role": "user", "content": "What is the capital of France?"}]
prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(chat),
                                 add_special_tokens=False)
outs = engine.generate([prompt, prompt],
                       SamplingParams(max_tokens=32, temperature=0.0, logprobs=1),
                       adapters=["pirate", None])  # None = base model, same batch
for o in outs:
    ttft = o.metrics.first_token_time - o.metrics.arrival_time
    print(f"{o.adapter or 'base'}: {o.text!r} ({o.finish_reason}, first token {ttft:.3f} s)")
print(engine.stats())  # pages_total, pages_free, pages_kv, pages_adapter, adapter_loads, ...
