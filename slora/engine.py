"""The engine: the public API over one step loop.

    Engine.generate / stream / add_request
      -> Scheduler.schedule(now)            who runs, which pages, which adapter loads/evictions
      -> ModelRunner.execute(plan)          adapter copies, batch metadata, model, sampling
      -> Scheduler.update(plan, tokens)     append tokens, free pages of finished requests
      -> Engine._resolve_texts              detokenise; a stop string finishes its request
      -> RequestOutput per request          built from the request's state, nothing changed
      -> Engine._release                    drop finished requests' per-request state

With `EngineConfig.async_scheduling` a step is launched (`ModelRunner.launch`) and the scheduler
advanced (`Scheduler.advance`: the new tokens PENDING) before the step before it is collected
(`ModelRunner.collect`, `Scheduler.resolve`): see `Engine._step_async`.
"""

from __future__ import annotations

import functools
import gc
import itertools
import time
import weakref
from pathlib import Path
from typing import Iterator, Sequence

import torch

from slora.config import (LORA_MODULES, VOCAB_MODULES, EngineConfig, ModelConfig, cdiv, is_int,
                          is_seed)
from slora.core.adapters import AdapterInfo, AdapterLayout, AdapterManager, synthetic_identity
from slora.core.pages import PageAllocator
from slora.core.scheduler import Scheduler
from slora.distributed.group import torchrun_rank
from slora.graphs import warmup_adapters, warmup_steps
from slora.guided import Grammar, Guide, TokenPieces, choice_pattern
from slora.json_regex import schema_regex
from slora.kernels.segments import PATHS
from slora.model.llama import modules_of
from slora.model.loader import (AdapterError, PeftAdapter, pack_adapter, synthetic_pack,
                                unpack_adapter)
from slora.model.merge import MergeSpec, merge_weights
from slora.request import Request, RequestOutput, RequestStatus, SamplingParams
from slora.runner import ModelRunner, resolve_device
from slora.tokenizer import IncrementalDecoder, Tokenizer

Prompt = str | list[int]
GRAMMARS = 64  # guided decoding's compiled patterns kept (their states' token masks with them)


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        config = (config or EngineConfig()).replace(**overrides)
        if config.model is None:
            from slora.model.smollm import default_model_dir

            config = config.replace(model=str(default_model_dir()))
        if config.async_scheduling is None:  # auto: where launches are asynchronous
            config = config.replace(async_scheduling=resolve_device(config.device).type == "cuda")
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        has_tok = (Path(config.model) / "tokenizer.json").is_file()
        self.tokenizer = (Tokenizer(config.model, self.model_config.eos_token_ids)
                          if has_tok or config.load_format != "dummy" else None)
        if config.tensor_parallel_size > 1 and (torchrun_rank() or 0) > 0:
            # under torchrun, ranks above 0 are tensor-parallel workers: they serve rank 0's
            # steps and end the process when rank 0 closes the group
            from slora.distributed.worker import serve_torchrun

            serve_torchrun(config)
            raise SystemExit(0)
        tp = None
        if config.tensor_parallel_size > 1:  # rank 0 starts the group: workers run the rest
            from slora.distributed.worker import launch

            tp = launch(config, self.model_config)
        self.runner = ModelRunner(config, self.model_config, config.model, tp=tp)
        self.allocator = PageAllocator(self.runner.num_pages)
        self.adapters = AdapterManager(self.allocator, config.host_cache_bytes)
        # the scheduler fits chunks to the mixed-step graphs in effect (none on CPU)
        self.scheduler = Scheduler(config.replace(mixed_graph_tokens=self.runner.mixed_graph_tokens),
                                   self.allocator, self.adapters)
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = (self.tokenizer.eos_token_ids if self.tokenizer
                              else self.model_config.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._ended: list[Request] = []  # ended outside a step (failed, aborted): reported next step
        self._decoders: dict[str, IncrementalDecoder] = {}  # per running request
        self._stop_from: dict[str, int] = {}  # request id -> where stop strings may begin
        self._synthetic: dict[tuple, object] = {}  # (rank, targets, seed) -> shared host buffer
        # guided decoding: each tokenizer's token pieces (while the tokenizer lives), and the
        # last GRAMMARS patterns compiled, by (tokenizer, pattern)
        self._pieces: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._grammars: dict[tuple[Tokenizer, str], Grammar] = {}
        self._tokenizers: dict[str, Tokenizer] = {}  # adapter -> its own (it adds tokens)
        self._flight = None  # async scheduling: the launched step not yet collected
        # the step being scheduled and run, and the launched steps being collected: the
        # requests a step failure fails (`_fail_step`)
        self._plan = None
        self._open: list = []

    # -- adapters
    def add_adapter(self, name: str, path: str | Path) -> None:
        """Register a PEFT LoRA directory under `name` (a non-empty str not registered yet):
        validated now (AdapterError naming the adapter, the file and the reason), its weights
        read when it is first loaded into the host tier and checked then (`PeftAdapter.pack`)."""
        self.adapters.check_name(name)  # before any file is read
        w = self.runner.model.w
        peft = PeftAdapter(name, path, self.model_config,
                           base_vocab={"embed_tokens": w.embed, "lm_head": w.lm_head},
                           max_added=self.config.max_added_tokens)
        pack = peft.pack  # DoRA: its norms computed where the base weights are
        if peft.dora:
            pack = functools.partial(peft.pack, weight_norms=self.runner.weight_norms)
        tokenizer = None
        if peft.added_tokens and (Path(path) / "tokenizer.json").is_file():
            tokenizer = Tokenizer(path, self.model_config.eos_token_ids)
        self._register(name, peft.layout, str(path), pack, identity=peft.digest)
        if tokenizer is not None:  # its requests are encoded and decoded with it
            self._tokenizers[name] = tokenizer

    def add_synthetic_adapter(self, name: str, rank: int,
                              target_modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
                              seed: int = 0, dora: bool = False) -> None:
        """An adapter of random weights (benchmarks, S-LoRA's dummy mode), with random DoRA
        rows on its targets if `dora`. Adapters of one (rank, targets, seed, dora) share one
        host buffer, made (and pinned) here at registration, so
        thousands of adapters cost the host one buffer per shape and the serving loop never
        waits to make one, while every load still copies the full adapter size to the device.
        Give adapters distinct seeds only when their outputs must differ: each seed is
        another buffer (a rank-64 q/k/v/o adapter of a 7B is 134 MB, ~1 s to draw on a CPU).
        A buffer lives while an adapter of its key is registered: `remove_adapter` of the last
        one frees it."""
        if isinstance(target_modules, str):
            target_modules = (target_modules,)
        layout = AdapterLayout.uniform(self.model_config, rank, tuple(target_modules),
                                       bool(dora))
        if not is_int(seed):
            raise TypeError(f"adapter {name!r}: seed must be an int, not {type(seed).__name__}")
        if not is_seed(seed):
            raise ValueError(f"adapter {name!r}: seed {seed} does not fit 64 bits")
        key = (rank, tuple(target_modules), seed) + (("dora",) if dora else ())
        # registered first (its name and size checked), so a refused adapter makes no buffer
        self._register(name, layout, "synthetic", lambda page_size, dtype: self._synthetic[key],
                       shared=key, identity=synthetic_identity(*key))
        if key not in self._synthetic:
            try:
                buf = synthetic_pack(self.model_config, layout, self.runner.page_size,
                                     self.runner.dtype, seed)
                # pinned once here, so host-tier misses cost no re-pinning copy
                self._synthetic[key] = (buf.pin_memory() if self.runner.device.type == "cuda"
                                        else buf)
            except BaseException:
                self.adapters.unregister(name)
                raise

    def add_merged_adapter(self, name: str, spec: MergeSpec) -> None:
        """Register adapter `name` as a merge of registered adapters (`slora.model.merge`:
        LoRAX's merged_adapters), its weights computed here once and kept on the host.
        KeyError for an unknown constituent; AdapterError for one that is DoRA or adds
        tokens, for ranks that disagree, and under tensor parallelism."""
        infos = [self.adapters.get(a) for a in spec.adapters]  # KeyError names an unknown one
        if self.config.tensor_parallel_size > 1:
            raise AdapterError(f"adapter {name!r}: merged adapters are not served with "
                               f"tensor_parallel_size={self.config.tensor_parallel_size}",
                               adapter=name)
        for a, info in zip(spec.adapters, infos):
            if info.layout.dora_modules or info.layout.added_tokens:
                raise AdapterError(f"adapter {name!r}: {a!r} cannot be merged: DoRA adapters "
                                   "and adapters that add tokens do not merge (LoRA only)",
                                   adapter=name)
        cfg, page_size, dtype = self.model_config, self.runner.page_size, self.runner.dtype
        parts = [unpack_adapter(cfg, info.layout, info.pack(page_size, torch.float32))
                 for info in infos]
        try:
            merged = merge_weights(parts, spec)
        except ValueError as e:
            raise AdapterError(f"adapter {name!r}: {e}", adapter=name) from None
        ranks = [[0] * len(LORA_MODULES) for _ in range(cfg.num_layers)]
        vocab = [0, 0]
        for (layer, module), (A, _) in merged.items():
            if module in VOCAB_MODULES:
                vocab[VOCAB_MODULES.index(module)] = A.shape[0]
            else:
                ranks[layer][LORA_MODULES.index(module)] = A.shape[0]
        layout = AdapterLayout.build(cfg, ranks, vocab_ranks=tuple(vocab))
        flat = pack_adapter(cfg, layout, page_size, dtype, lambda layer, m: merged[(layer, m)])
        if self.runner.device.type == "cuda":
            flat = flat.pin_memory()  # (once: host-tier misses then copy it as it is)
        self._register(name, layout, "merged: " + ", ".join(spec.adapters),
                       lambda page_size, dtype: flat,
                       identity=spec.identity([info.identity for info in infos]))

    def _register(self, name, layout, source, pack, shared=None, identity=None) -> None:
        limit = self.config.max_lora_rank
        if limit is not None and layout.max_rank > limit:
            raise AdapterError(f"adapter {name!r}: its rank {layout.max_rank} is past "
                               f"EngineConfig.max_lora_rank={limit}; raise max_lora_rank "
                               "(--max-lora-rank) or leave it unset for any rank", adapter=name)
        layout, pack = self.runner.adapter_view(name, layout, pack)  # (a rank's, under TP)
        pages = layout.num_pages(self.runner.page_size)
        self.adapters.register(AdapterInfo(
            name=name, num_pages=pages, nbytes=pages * self.runner.host_page_bytes, source=source,
            layout=layout, pack=pack, shared=shared, identity=identity))

    def remove_adapter(self, name: str) -> None:
        """Unregister an adapter at once. Its queued and running requests end with
        finish_reason "error" (their outputs come with the next step); every other request
        goes on. Its pages are free for the next step."""
        info = self.adapters.get(name)  # a clear KeyError for unknown names
        self._ended += self.scheduler.fail(
            self.scheduler.requests_of(name),
            f"adapter {name!r} was removed while the request was queued or running",
            time.monotonic())
        self.allocator.free(self.adapters.unregister(name))
        self.runner.host_tier.drop(name)
        self._tokenizers.pop(name, None)
        if info.shared is not None and not self.adapters.sharing(info.shared):
            self._synthetic.pop(info.shared, None)  # its last adapter is gone

    def list_adapters(self) -> list[str]:
        return sorted(self.adapters.adapters)

    # -- requests
    def add_request(self, prompt: Prompt, sampling: SamplingParams | None = None,
                    adapter: str | None = None, request_id: str | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    cache_prefix: bool = True, priority: int = 0) -> str:
        """Queue one request; returns its id. Bad input raises here and queues nothing:
        KeyError for an unknown adapter, ValueError for an empty prompt, token ids that are
        not ints of the vocabulary, sampling the engine cannot serve, a request id in use, or
        a cache_salt that is not a non-empty str.
        A prompt too long for the model or the pool is returned as a failed output.
        `cache_salt` (vLLM's): requests with different salts never share prefix-cache pages.
        `cache_prefix=False`: the request skips the prefix cache (no lookup, its pages are
        not offered), for a prompt known to share nothing, such as a replay's random ids.
        `priority` (vLLM's; with EngineConfig.policy="priority"): lower goes first."""
        return self._queue(self._request(prompt, sampling, adapter, request_id, arrival_time,
                                         cache_salt, cache_prefix, priority))

    def _request(self, prompt: Prompt, sampling: SamplingParams | None, adapter: str | None,
                 request_id: str | None, arrival_time: float | None,
                 cache_salt: str | None = None, cache_prefix: bool = True,
                 priority: int = 0) -> Request:
        """A validated request, not queued yet."""
        if self.runner.dead:
            raise RuntimeError(self.runner.dead)
        if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):
            raise ValueError(f"cache_salt={cache_salt!r}: expected None or a non-empty str")
        if not isinstance(cache_prefix, bool):
            raise ValueError(f"cache_prefix={cache_prefix!r}: expected True or False")
        if not is_int(priority):
            raise ValueError(f"priority={priority!r}: expected an integer")
        if priority and self.config.policy != "priority":
            raise ValueError(f"priority={priority}: requests take priorities under "
                             "EngineConfig.policy='priority' (this engine's is "
                             f"{self.config.policy!r})")
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling: expected SamplingParams, got {type(sampling).__name__}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(sampling, name)
            if n is not None and n > self.config.max_logprobs:
                raise ValueError(f"SamplingParams.{name}={n}: at most "
                                 f"EngineConfig.max_logprobs={self.config.max_logprobs}")
        if adapter is not None:
            self.adapters.get(adapter)  # raises a clear KeyError for unknown names
        ids = self._encode(prompt, adapter)
        if sampling.logit_bias:
            self._check_ids([t for t, _ in sampling.logit_bias], adapter,
                            "SamplingParams.logit_bias token ids")
        if sampling.allowed_token_ids is not None:
            self._check_ids(list(sampling.allowed_token_ids), adapter,
                            "SamplingParams.allowed_token_ids")
        rid = request_id if request_id is not None else str(next(self._ids))
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id={rid!r}: expected a non-empty string")
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        return Request(rid, ids, sampling, adapter,
                       arrival_time if arrival_time is not None else time.monotonic(),
                       eos_token_ids=self.eos_token_ids, max_len=self.max_model_len,
                       cache_salt=cache_salt, cache_prefix=cache_prefix,
                       bad_words_ids=self._bad_words_ids(sampling.bad_words, adapter),
                       guide=self._guide(sampling, adapter), priority=int(priority))

    def _queue(self, req: Request) -> str:
        rid, ids = req.request_id, req.prompt_token_ids
        self.requests[rid] = req
        if len(ids) >= self.max_model_len:
            req.status = RequestStatus.FINISHED
            req.finish_reason = "error"
            req.metrics.finish_time = req.arrival_time
            req.error = (f"request {rid}: prompt of {len(ids)} tokens does not fit "
                         f"max_model_len={self.max_model_len} (the model's limit or the pool's "
                         "size); shorten the prompt or raise num_pages / max_model_len")
            self._ended.append(req)
        else:
            self.scheduler.add(req)
        return rid

    def tokenizer_of(self, adapter: str | None) -> Tokenizer | None:
        """The tokenizer of `adapter`'s requests: its own where it adds tokens and has one,
        else the base model's."""
        return self._tokenizers.get(adapter, self.tokenizer)

    def _encode(self, prompt: Prompt, adapter: str | None = None) -> list[int]:
        """The prompt's token ids, with `adapter`'s tokenizer; ids past the base vocabulary
        only where they are ones `adapter` adds (ValueError otherwise)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt: a request needs a non-empty string or token ids")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer (load_format='dummy' without "
                                 "tokenizer.json): pass token-id lists")
            ids = self.tokenizer_of(adapter).encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            # (plain ints pass at a type check; the slower ABC check and the copy through int()
            # are for other integral types, numpy's say, and for the refusals)
            if any(type(t) is not int for t in ids):
                bad = [t for t in ids if not is_int(t)]
                if bad:
                    raise ValueError(f"prompt token ids must be ints; got {bad[:5]!r}")
                ids = [int(t) for t in ids]
        else:
            raise ValueError(f"prompt: expected a string or a list of token ids, got "
                             f"{type(prompt).__name__}")
        if not ids:
            raise ValueError("empty prompt: a request needs at least one token")
        self._check_ids(ids, adapter, "prompt token ids")
        return ids

    def _guide(self, sampling: SamplingParams, adapter: str | None) -> Guide | None:
        """Guided decoding's Guide for a request (None unless asked for): its pattern
        compiled once per tokenizer (the last GRAMMARS kept), with the tokenizer's pieces."""
        if not sampling.guided:
            return None
        tokenizer = self.tokenizer_of(adapter)
        if tokenizer is None:
            raise ValueError("guided decoding (SamplingParams.guided_*) needs a tokenizer; "
                             "this engine has none (load_format='dummy' without tokenizer.json)")
        if sampling.guided_json is not None:
            try:
                pattern = schema_regex(sampling.guided_json)
            except ValueError as e:
                raise ValueError(f"SamplingParams.guided_json: {e}") from None
        elif sampling.guided_choice is not None:
            pattern = choice_pattern(sampling.guided_choice)
        else:
            pattern = sampling.guided_regex
        key = (tokenizer, pattern)
        grammar = self._grammars.pop(key, None)
        if grammar is None:
            pieces = self._pieces.get(tokenizer)
            if pieces is None:
                pieces = self._pieces[tokenizer] = TokenPieces(tokenizer, tokenizer.vocab_size)
            grammar = Grammar(pattern, pieces, self.eos_token_ids)  # ValueError names it
        self._grammars[key] = grammar  # (the most recent last)
        while len(self._grammars) > GRAMMARS:
            self._grammars.pop(next(iter(self._grammars)))
        return Guide(grammar)

    def _bad_words_ids(self, words: tuple[str, ...], adapter: str | None):
        """Each bad word's token ids by `adapter`'s tokenizer (vLLM's rule): the word as it
        stands (leading spaces dropped), and after a space where that gives as many tokens
        but another first one (the word in mid-text)."""
        if not words:
            return ()
        tokenizer = self.tokenizer_of(adapter)
        if tokenizer is None:
            raise ValueError("SamplingParams.bad_words needs a tokenizer; this engine has none "
                             "(load_format='dummy' without tokenizer.json)")
        out = []
        for word in words:
            alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            out.append(tuple(alone))
            if len(spaced) == len(alone) and spaced[0] != alone[0]:
                out.append(tuple(spaced))
        return tuple(w for w in out if w)

    def _check_ids(self, ids: list[int], adapter: str | None, what: str) -> None:
        """ValueError naming `what` unless every id is in the base vocabulary or one of the
        tokens `adapter` adds."""
        vocab = self.model_config.vocab_size
        added = self.adapters.get(adapter).layout.added_tokens if adapter is not None else 0
        bad = [t for t in ids if not 0 <= t < vocab + added]
        if bad:
            where = (f"the vocabulary [0, {vocab + added}) of the base model and adapter "
                     f"{adapter!r}'s {added} added tokens" if added else
                     f"the vocabulary [0, {vocab}) of the base model"
                     + (f" (adapter {adapter!r} adds no tokens)" if adapter else ""))
            raise ValueError(f"{what} {bad[:5]} are outside {where}; ids past the base "
                             "vocabulary are an adapter's added tokens, served only with that "
                             "adapter")

    def abort(self, request_id: str) -> None:
        """Stop a request; its final output (finish_reason "abort") comes from the next step."""
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"abort: unknown request id {request_id!r} (a finished request is "
                           "forgotten once its final output was returned)")
        if not req.finished:
            self.scheduler.abort(req, "abort", time.monotonic())
            self._ended.append(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._ended) or self._flight is not None

    # -- the loop
    def step(self) -> list[RequestOutput]:
        """One scheduling + forward step; outputs of the requests that progressed or ended.
        With `async_scheduling` the step is launched and the one before it collected: its
        outputs are that step's.

        Faults stay with the requests they belong to: an adapter whose read fails fails its
        own requests (`_stage`); a row whose logits are not finite, or whose sampling or
        detokenising fails, fails alone; any other error while running a step fails that
        step's requests (and those of the step still in flight). Each failed request ends
        with finish_reason "error" and the reason in `error`, its pages freed; the next step
        runs on consistent state."""
        try:
            touched = self._step_async() if self.config.async_scheduling else self._step_sync()
        except Exception as e:  # noqa: BLE001 - the step's requests fail, the engine serves on
            touched = self._fail_step(e)
        touched += self._ended
        self._ended = []
        texts = self._resolve_texts(touched)
        outputs = [self._output(r, text) for r, text in zip(touched, texts)]
        self._release(touched)
        return outputs

    def _step_sync(self) -> list[Request]:
        plan = self._plan = self.scheduler.schedule(time.monotonic())
        self._stage(plan)
        tokens, logprobs, errors = self.runner.execute(plan, self.adapters)
        self._plan = None
        return self.scheduler.update(plan, tokens, logprobs, time.monotonic(), errors)

    def _stage(self, plan) -> None:
        """Read the adapters the plan copies into the pool from disk into the host tier. An
        adapter whose read fails (its file gone, changed, or holding NaN) fails its own
        requests, waiting and in the plan, with the reason; it leaves the plan and the pool
        (not resident: the next use reads again). No other row is touched."""
        moves = plan.adapter_loads + plan.prefetch
        if not moves:
            return
        failed = self.runner.host_tier.stage([name for name, _ in moves], self.adapters)
        if not failed:
            return
        now = time.monotonic()
        for name, err in failed.items():
            why = str(err) if isinstance(err, AdapterError) else f"{type(err).__name__}: {err}"
            plan.finished += self.scheduler.fail(
                self.scheduler.requests_of(name),
                f"adapter {name!r} could not be loaded: {why}", now)
            self.allocator.free(self.adapters.unload(name))
        plan.decode = [r for r in plan.decode if not r.finished]
        plan.prefill = [r for r in plan.prefill if not r.finished]
        plan.adapter_loads = [m for m in plan.adapter_loads if m[0] not in failed]
        plan.prefetch = [m for m in plan.prefetch if m[0] not in failed]

    def _fail_step(self, error: Exception) -> list[Request]:
        """A step failed where no single request is to blame: its requests, and those of
        the step still in flight, end with the error; the scheduler frees their pages."""
        plans = [p for p in (self._plan, *self._open, self._flight and self._flight.plan) if p]
        self._plan, self._open, self._flight = None, [], None
        self.runner.host_tier.staged = {}
        failed = self.scheduler.fail([r for plan in plans for r in plan.seqs],
                                     f"the step failed: {type(error).__name__}: {error}",
                                     time.monotonic())
        if self.runner.dead:  # a tensor-parallel worker died: nothing can run any more
            failed += self.scheduler.fail([*self.scheduler.waiting, *self.scheduler.running],
                                          self.runner.dead, time.monotonic())
        # The adapters these steps were copying into the pool may hold pages never written:
        # they leave the pool, so the next use reads and copies them again.
        for plan in plans:
            for name, _ in plan.adapter_loads + plan.prefetch:
                info = self.adapters.adapters.get(name)
                if info is not None and info.resident and not info.refcount:
                    self.allocator.free(self.adapters.unload(name))
        return failed

    def _step_async(self) -> list[Request]:
        """Schedule and launch this step while the last one still runs on the device, then
        collect the last one: the host's work for a step overlaps the device's for the one
        before. The scheduler sees this step's tokens as PENDING until they are collected; a
        request found stopped meanwhile drops the token it got in the step that was already
        running. A step with a sampled (not greedy) row, logprobs or logits to change
        (`SamplingParams.changes_logits`) is collected at once."""
        plan = self._plan = self.scheduler.schedule(time.monotonic())
        self._stage(plan)
        flight = self.runner.launch(plan, self.adapters, prev=self._flight)
        touched = []
        if flight is None:
            touched += plan.finished
        else:
            self.scheduler.advance(plan)
        keep = flight is not None and flight.tokens_only  # left running until the next call
        prev, self._flight = self._flight, None
        self._open = [f.plan for f in (prev, flight) if f is not None]  # launched, uncollected
        for done in (prev, None if keep else flight):  # in launch order
            if done is not None:
                tokens, logprobs, errors = self.runner.collect(done)
                touched += self.scheduler.resolve(done.plan, tokens, logprobs,
                                                  time.monotonic(), errors)
        self._flight = flight if keep else None
        self._plan, self._open = None, []
        return touched

    def _resolve_texts(self, reqs: list[Request]) -> list[str]:
        """The output text of each request so far, decoded incrementally from its known
        tokens (the full decode once finished). The earliest stop string in a text finishes
        its request (finish_reason "stop", over a length limit hit in the same step) and is
        cut off with what follows (what follows alone with `include_stop_str_in_output`). A
        request listed twice gets the same text twice."""
        if self.tokenizer is None:
            return [""] * len(reqs)
        texts: dict[str, str] = {}  # request id -> its text: decoded once per call
        for req in reqs:
            if req.request_id in texts:
                continue
            try:
                texts[req.request_id] = self._text(req)
            except Exception as e:  # noqa: BLE001 - this request fails alone
                why = f"request {req.request_id}: detokenising failed: {type(e).__name__}: {e}"
                if req.finished:  # (its last step: only its outcome changes)
                    req.finish_reason, req.error = "error", why
                    self.scheduler.failed += 1
                else:
                    self.scheduler.fail([req], why, time.monotonic())
                texts[req.request_id] = ""
        return [texts[req.request_id] for req in reqs]

    def _text(self, req: Request) -> str:
        ids = req.output_token_ids[:len(req.output_token_ids) - req.num_pending]
        dec = self._decoders.get(req.request_id)
        if dec is None:
            dec = self._decoders[req.request_id] = IncrementalDecoder(
                self.tokenizer_of(req.adapter), req.sampling.skip_special_tokens)
        text = dec.update(ids)
        # Stop strings count once more than min_tokens tokens are out, and only where they
        # end in the text past the first min_tokens tokens' (as vLLM checks them).
        sp, rid = req.sampling, req.request_id
        cuts = []  # (where a stop string begins, where it ends)
        if len(ids) <= sp.min_tokens:
            self._stop_from[rid] = len(text)
        elif sp.stop:
            start = self._stop_from.get(rid, 0)
            cuts = [(at, at + len(s)) for s in sp.stop
                    if (at := text.find(s, max(0, start - len(s) + 1))) >= 0]
        if cuts:
            at, end = min(cuts, key=lambda c: (c[0], -c[1]))  # the first; the longest there
            text = text[:end if sp.include_stop_str_in_output else at]
            self.scheduler.abort(req, "stop", time.monotonic())
            req.finish_reason = "stop"
        elif req.finished:
            text = self.tokenizer_of(req.adapter).decode(ids, sp.skip_special_tokens)
        return text

    @staticmethod
    def _output(req: Request, text: str) -> RequestOutput:
        """The request's output as it stands: its known tokens (not those still pending)."""
        ids = req.output_token_ids[:len(req.output_token_ids) - req.num_pending]
        return RequestOutput(
            request_id=req.request_id, adapter=req.adapter,
            prompt_token_ids=req.prompt_token_ids, text=text,
            token_ids=ids,
            logprobs=list(req.logprobs) if req.sampling.logprobs is not None else None,
            finish_reason=req.finish_reason, finished=req.finished, metrics=req.metrics,
            error=req.error, num_cached_tokens=req.num_cached_tokens,
            prompt_logprobs=(list(req.prompt_logprobs)
                             if req.sampling.prompt_logprobs is not None else None))

    def _release(self, reqs: list[Request]) -> None:
        """Forget the finished requests' per-request state: sampler, decoder, id."""
        for req in reqs:
            if req.finished:
                self.runner.sampler.release(req.request_id)
                self._decoders.pop(req.request_id, None)
                self._stop_from.pop(req.request_id, None)
                self.requests.pop(req.request_id, None)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 adapters: str | None | Sequence[str | None] = None,
                 use_tqdm: bool = False,
                 cache_salt: str | None | Sequence[str | None] = None,
                 priority: int | Sequence[int] = 0) -> list[RequestOutput]:
        """Run prompts to completion in one continuous batch; outputs in prompt order.

        `prompts`: a string, a token-id list, or a list of either. `sampling`: one for all or
        one per prompt. `adapters`: one name (or None = base model) for all, or one per prompt.
        `cache_salt`, `priority`: one for all or one per prompt (see `add_request`).
        """
        if isinstance(prompts, str) or (prompts and is_int(prompts[0])):
            prompts = [prompts]
        n = len(prompts)
        sampling = sampling or SamplingParams()
        sps = [sampling] * n if isinstance(sampling, SamplingParams) else list(sampling)
        names = [adapters] * n if adapters is None or isinstance(adapters, str) else list(adapters)
        salts = ([cache_salt] * n if cache_salt is None or isinstance(cache_salt, str)
                 else list(cache_salt))
        ranks = [priority] * n if is_int(priority) else list(priority)
        if len(sps) != n or len(names) != n or len(salts) != n or len(ranks) != n:
            raise ValueError(f"generate: {n} prompts but {len(sps)} sampling params, "
                             f"{len(names)} adapters, {len(salts)} cache salts and "
                             f"{len(ranks)} priorities")
        reqs = []  # every item is validated before any is queued
        for i, (p, sp, a, salt, rank) in enumerate(zip(prompts, sps, names, salts, ranks)):
            try:
                reqs.append(self._request(p, sp, a, None, None, salt, priority=rank))
            except (KeyError, ValueError) as e:
                raise type(e)(f"generate: prompt {i}: {e.args[0] if e.args else e}") from None
        ids = [self._queue(r) for r in reqs]
        mine = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = _progress(n) if use_tqdm else None
        while len(done) < n:
            for out in self.step():
                if out.finished and out.request_id in mine and out.request_id not in done:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]

    def stream(self, prompt: Prompt, sampling: SamplingParams | None = None,
               adapter: str | None = None, cache_salt: str | None = None
               ) -> Iterator[RequestOutput]:
        """Yield the request's output after every step in which it progressed."""
        rid = self.add_request(prompt, sampling, adapter, cache_salt=cache_salt)
        finished = False
        try:
            while not finished:
                for out in self.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
                        if finished:
                            return
        finally:  # the consumer stopped early: the request ends, its pages are freed
            if not finished and rid in self.requests:
                self.abort(rid)

    def warmup(self, ranks: Sequence[int] = (), progress: bool = False,
               modules: Sequence[Sequence[str]] = ()) -> float:
        """Compile the kernels and capture the graphs before serving; returns seconds.

        Each Triton kernel variant compiles on first use and each graph is captured on first
        use: stalls that would otherwise land on the first requests (vLLM captures its graphs
        at start for the same reason). This runs the steps `slora.graphs.warmup_steps` names,
        without LoRA and with one temporary adapter per (rank bucket, module groups) that
        `slora.graphs.warmup_adapters` names for the registered adapters, `ranks` and
        `modules` (adapters to come). The graphs' page-table width is set first, to the
        widest of these adapters. Last, one full prefill step (`max_batch_tokens`: the
        allocator grows to its largest activations). Only idle engines warm up; the copies
        show in `stats()`; `progress` shows a bar. Last, the objects that exist are frozen out
        of the garbage collector's view (`gc.freeze`; `close` unfreezes them)."""
        if self.has_unfinished():
            raise RuntimeError("warmup: the engine is serving requests; warm up before adding any")
        t0 = time.perf_counter()
        graphs = self.runner.graphs
        names = []
        for r, groups, dora in warmup_adapters(
                [i.layout for i in self.adapters.adapters.values()], ranks, modules):
            names.append(f"__warmup_r{r}_{'_'.join(groups)}{'_dora' * dora}")
            self.add_synthetic_adapter(names[-1], r, modules_of(groups), dora=dora)
        if graphs is not None and names:  # the widest page table, set once
            graphs.reserve_pages(max(self.adapters.get(n).num_pages for n in names))
        # A warm-up prompt runs in one step: the steps run with prompts whole (chunking off),
        # so one step's prompts reach every mixed graph bucket, those that serving reaches
        # only with a chunk beside decode rows included.
        cfg = self.config
        limit = min(cfg.max_batch_tokens, self.max_model_len - 4)
        graphed, eager = warmup_steps(graphs, limit)
        # A graph's key holds its decode rows' LoRA path: with decode_lora "auto" the adapters'
        # graphed steps, decode and mixed, run under each path (MBGMV, by adapter, both: their
        # rows share one adapter, so the table alone would pick one), each step's decode rows
        # forced onto it (`BatchBuilder.decode_lora`).
        builder = self.runner.batches
        mode = builder.decode_lora
        paths = list(PATHS) if mode == "auto" and graphs is not None else [mode]
        batches = [(name, prompts, late, paths[0]) for steps in (graphed, eager)
                   for name in names + [None] for prompts, late in steps]
        batches += [(name, prompts, late, path) for path in paths[1:] for name in names
                    for prompts, late in graphed]
        largest = []  # the largest activations, after the captures: prompts as serving cuts them
        if self.runner.device.type == "cuda":
            chunk = min(limit, cfg.max_prefill_chunk or limit)
            largest = [(None, [[1] * chunk] * min(cfg.max_num_seqs, cdiv(cfg.max_batch_tokens,
                                                                          chunk)), [], paths[0])]
        sp = SamplingParams(max_tokens=3, ignore_eos=True)
        bar = _progress(len(batches) + len(largest), unit="step", desc="warm-up") if progress else None

        def run(name, prompts, late, path):
            builder.decode_lora = path
            need = (sum(cdiv(len(p) + 3, self.config.block_size) for p in prompts + late)
                    + self.adapters.pages_needed(name))
            if need <= self.allocator.num_free:  # (a pool too small skips the largest)
                for p in prompts:
                    self.add_request(p, sp, name)
                if late:
                    self.step()
                    for p in late:
                        self.add_request(p, sp, name)
                while self.has_unfinished():
                    self.step()
            if bar is not None:
                bar.update()

        sched = self.scheduler
        try:
            # no prefix caching while warming up: every step runs the shape it is made for
            with sched.prefix_cache_off():
                with sched.prompts_whole():
                    for batch in batches:
                        run(*batch)
                for batch in largest:
                    run(*batch)
        finally:
            builder.decode_lora = mode
            if bar is not None:
                bar.close()
            for name in names:
                self.remove_adapter(name)
        # What exists now lives as long as the engine: move it out of the garbage collector's
        # view (as vLLM does after start-up), so a full collection while serving walks only
        # the objects made since, not thousands of registered adapters.
        gc.collect()
        gc.freeze()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Give the engine's device memory (pool, weights, graphs, host copies) back now rather
        than whenever the garbage collector breaks the runner's reference cycles. A new engine
        sizes its pool from free memory, so one built while an old one lingers gets a sliver
        of it. The engine cannot serve afterwards."""
        import torch

        cuda = self.runner.device.type == "cuda"
        self.runner.close()
        self.runner = self._flight = None
        self._synthetic.clear()
        gc.unfreeze()  # what `warmup` froze is collectable again
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    def reset_prefix_cache(self) -> int:
        """Forget every prefix-cache page: no later request finds KV computed before. Pages
        no request holds are freed now (their count is returned), held ones when released."""
        return self.scheduler.reset_prefix_cache()

    def stats(self) -> dict:
        s = self.scheduler.stats()
        s["page_bytes"] = self.runner.page_bytes
        s["block_size"] = self.config.block_size
        return s


def _progress(total: int, unit: str = "req", desc: str | None = None):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit=unit, desc=desc)
