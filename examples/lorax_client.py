"""LoRAX's multi-adapter batch, served by `slora serve` and sent by the unchanged
`lorax-client`: one question asked of the base model and of every shipped adapter at once.
The server runs them as one continuous batch, each row through its own adapter; adapters are
found by name under --adapter-dir and loaded on first use. Then one answer streamed token by
token, as LoRAX's README does it.

    ./run slora serve --adapter-dir slora/assets/adapters      # one terminal: the server
    .venv/bin/python examples/lorax_client.py                  # another: this client

`/generate` takes the prompt as given (no chat template), so the question is written in
SmolLM2's chat format here.
"""

import argparse
import asyncio

from lorax import AsyncClient, Client

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the slora serve address")
    p.add_argument("--adapters", default="pirate,json,french", help="adapter ids, comma-separated")
    p.add_argument("--question", default="What is the capital of France?")
    p.add_argument("--template", default=CHAT, help="the prompt, {} standing for the question")
    p.add_argument("--max-new-tokens", type=int, default=32)
    args = p.parse_args(argv)
    prompt = args.template.format(args.question)
    adapters = [None] + args.adapters.split(",")  # None: the base model

    async def batch():
        client = AsyncClient(args.url)
        return await asyncio.gather(*(
            client.generate(prompt, adapter_id=adapter, max_new_tokens=args.max_new_tokens)
            for adapter in adapters))

    for adapter, res in zip(adapters, asyncio.run(batch())):
        d = res.details
        print(f"{adapter or 'base'}: {res.generated_text!r} "
              f"({d.finish_reason.value}, {d.generated_tokens} tokens)")

    text = ""
    for event in Client(args.url).generate_stream(prompt, adapter_id=adapters[1],
                                                  max_new_tokens=args.max_new_tokens):
        if not event.token.special:
            text += event.token.text
    print(f"{adapters[1]}, streamed: {text!r}")


if __name__ == "__main__":
    main()
