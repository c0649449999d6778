"""Request bodies (pydantic v2): OpenAI's completions and chat completions with vLLM's
extensions, vLLM's adapter load/unload, and LoRAX/TGI's generate.

Fields the server does not implement are refused with 400 by the handlers (not silently
ignored) when they would change the output; unknown fields are ignored, as OpenAI-compatible
servers do.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries its choice's usage


class _Sampling(_Body):
    """Sampling fields shared by completions and chat (OpenAI names, vLLM extensions)."""

    model: str | None = None  # the base model's name or an adapter's; None: the base model
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = None  # None: 1.0, as OpenAI
    top_p: float | None = None
    top_k: int | None = None  # vLLM: 0 or -1 disables
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None  # None: 0, as OpenAI
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as a string) -> bias
    # vLLM's extensions
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = Field(None, ge=0)
    # the prompt's last N tokens alone (vLLM's)
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    # lower goes first, when the server runs --policy priority
    priority: int = 0
    # guided decoding: the output one of the strings, or a full match of the regex
    guided_choice: list[str] | None = None
    guided_regex: str | None = None
    guided_json: str | dict | None = None  # a JSON Schema
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM: logprobs' tokens as "token_id:<id>" (token strings may not be unique)
    return_tokens_as_token_ids: bool = False
    user: str | None = None
    # vLLM: enters the prefix cache's keys; requests of different salts share no cached KV
    cache_salt: str | None = Field(None, min_length=1)
    # OpenAI's and vLLM's fields that slora does not implement, read only to be refused
    # (400) when set to anything but their neutral value: `openai_api.UNSUPPORTED`
    response_format: dict | None = None  # (text, json_object and json_schema are served)
    best_of: int | None = None
    use_beam_search: bool = False
    guided_grammar: str | None = None
    structured_outputs: dict | None = None  # (choice, regex, json, json_object are served)
    logits_processors: list | None = None
    length_penalty: float = 1.0
    spaces_between_special_tokens: bool = True


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True  # (vLLM's: the tokenizer's BOS before a string prompt)
    prompt_embeds: str | list | None = None  # refused


class ChatMessage(_Body):
    role: str
    content: str | list[dict] | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls, as answers give them
    tool_call_id: str | None = None  # a tool message's: the call it answers
    name: str | None = None
    # an assistant's reasoning, as answers give it (vLLM's field)
    reasoning_content: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the model's length
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    add_generation_prompt: bool = True
    # OpenAI's function tools (slora.server.tools)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    # vLLM's: the text ends in the last message, for the model to go on with it
    continue_final_message: bool = False
    # OpenAI's: how hard a reasoning model thinks, the chat template's `reasoning_effort`
    # variable (gpt-oss's template reads it)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    add_special_tokens: bool = False  # (the template writes them)
    chat_template_kwargs: dict | None = None  # more variables for the template
    chat_template: str | None = None  # refused: templates come from the model or adapter
    documents: list | None = None  # refused
    echo: bool = False  # refused


class ResponsesRequest(_Body):
    """OpenAI's Responses API request (slora.server.responses_api)."""

    model: str | None = None
    input: str | list = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict | None = None  # {"format": {"type": text | json_object | json_schema, ...}}
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    store: bool | None = None  # (nothing is stored either way)
    metadata: dict | None = None
    user: str | None = None
    # refused when set (responses_api.REFUSED)
    previous_response_id: str | None = None
    reasoning: dict | None = None
    include: list | None = None
    background: bool = False
    conversation: str | dict | None = None
    prompt: dict | None = None
    truncation: str | None = None


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class LoadAdapterRequest(_Body):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: a loaded name's weights replaced


class UnloadAdapterRequest(_Body):
    lora_name: str


class MergedAdapters(_Body):
    """LoRAX's `merged_adapters`: adapters merged into one for the request
    (`slora.model.merge`)."""

    ids: list[str] = Field(min_length=1)
    weights: list[float] | None = None
    merge_strategy: str | None = None  # None: linear
    density: float = 1.0
    majority_sign_method: str | None = None  # None: total


class GenerateParameters(_Body):
    """LoRAX's `parameters` (lorax-client's `Parameters`)."""

    adapter_id: str | None = None
    adapter_source: Literal["hub", "local", "s3", "pbase"] | None = None
    merged_adapters: MergedAdapters | None = None
    api_token: str | None = None
    do_sample: bool = False
    max_new_tokens: int | None = None  # None: up to the model's length
    ignore_eos_token: bool = False
    repetition_penalty: float | None = None
    return_full_text: bool = False
    stop: list[str] = []
    seed: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    truncate: int | None = Field(None, ge=1)
    typical_p: float | None = None
    best_of: int | None = None
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    return_k_alternatives: int | None = Field(None, ge=1)
    response_format: dict | None = None
    cache_salt: str | None = Field(None, min_length=1)  # as in the OpenAI routes


class GenerateRequest(_Body):
    inputs: str = Field(min_length=1)
    parameters: GenerateParameters | None = None
    stream: bool = False
