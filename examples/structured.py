"""Structured answers from adapters through the unchanged `openai` client, served by
`slora serve`: JSON that a schema accepts, one of a set of labels, a forced tool call, and the
log-likelihood of candidate answers (what lm-evaluation-harness asks a server for).

    ./run slora serve --adapter-dir slora/assets/adapters      # one terminal: the server
    .venv/bin/python examples/structured.py                    # another: this client

Each request names its adapter in `model`; the server holds the output to the schema, the
labels or the tool's parameters while it decodes, so what comes back always parses.
"""

import argparse
import json

from openai import OpenAI

SCHEMA = {"type": "object", "properties": {"topic": {"type": "string", "maxLength": 24},
                                           "answer": {"type": "string", "maxLength": 80}},
          "required": ["topic", "answer"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the slora serve address")
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="the base model's name")
    p.add_argument("--adapter", default="json", help="the adapter asked for JSON")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    client = OpenAI(base_url=f"{args.url}/v1", api_key="unused")

    def chat(model, question, **kw):
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], temperature=0,
            max_tokens=args.max_tokens, **kw).choices[0]

    # 1. JSON that the schema accepts, from the adapter trained to answer in JSON
    answer = chat(args.adapter, "What is the capital of France?", response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
    print(f"{args.adapter}, JSON: {json.loads(answer.message.content)}")

    # 2. one label of a set (vLLM's guided_choice)
    label = chat(args.model, "Classify the sentiment of this review as positive or negative: "
                 "'This movie was wonderful, I loved it.'",
                 extra_body={"guided_choice": ["positive", "negative"]})
    print(f"label: {label.message.content}")

    # 3. a forced tool call: the arguments follow the tool's parameters schema
    call = chat(args.model, "What is the weather in Paris?", tools=[WEATHER],
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    fn = call.message.tool_calls[0].function
    print(f"tool call: {fn.name}({json.loads(fn.arguments)})")

    # 4. log-likelihoods of candidate answers: echo the prompt with logprobs, generate nothing
    def scored(prompt):
        return client.completions.create(model=args.model, prompt=prompt, max_tokens=0,
                                         echo=True, logprobs=0).choices[0].logprobs

    question = "The capital of France is"
    asked = len(scored(question).tokens)  # the candidate's tokens follow the question's
    scores = {c.strip(): sum(scored(question + c).token_logprobs[asked:])
              for c in (" Paris", " Berlin")}
    print("log-likelihoods: " + ", ".join(f"{c} {s:.2f}" for c, s in scores.items()))


if __name__ == "__main__":
    main()
