"""Sampling: one token per sequence from its logits, and vLLM-shaped logprobs."""

from __future__ import annotations

import torch

from slora.request import Request, SamplingParams


class Sampler:
    """Greedy rows take the argmax the runner computed at launch, unless their sampling
    changes the logits first (`SamplingParams.changes_logits`: `process_logits`); sampled
    rows draw from their own generator, seeded by the request's seed or, without one, from
    `seed`'s stream in the order requests first sample. A request's generator (and its
    prompt's token ids, for a repetition penalty) lives until `release`.
    `vocab`: the base vocabulary, whose logits must be finite (the columns past it, adapters'
    added tokens, are -inf where a row's adapter has none)."""

    def __init__(self, seed: int, vocab: int | None = None) -> None:
        self.vocab = vocab
        self.generators: dict[str, torch.Generator] = {}  # request id -> its generator
        self.prompts: dict[str, torch.Tensor] = {}  # request id -> its prompt's distinct ids
        self.rng = torch.Generator().manual_seed(seed)  # seeds requests without a seed

    def sample(self, logits: torch.Tensor, seqs: list[Request], greedy: torch.Tensor,
               samples: list[bool] | None = None):
        """(tokens, logprobs, errors), one token and logprob entry per sequence. `greedy`:
        the logits' argmax, for the greedy rows. Logprobs are those of the raw distribution,
        for the rows that ask for them: {token id: log-prob} holding the chosen token and the
        top N. `errors`: {row: message} for the rows that failed alone (logits not finite,
        or a sampling error), whose token is meaningless. `samples` (default: all): the rows
        that sample; the others (chunks short of their prompt's end) are left as they are,
        their generators untouched, so chunking does not change a seeded request's draws."""
        tokens = greedy.tolist()
        finite = finite_rows(logits, self.vocab).tolist()
        want_lp = any(r.sampling.logprobs is not None for r in seqs)
        logp = torch.log_softmax(logits, dim=-1) if want_lp else None
        out_lp, errors = [], {}
        for i, r in enumerate(seqs):
            entry = None
            if samples is not None and not samples[i]:
                out_lp.append(entry)
                continue
            try:
                if not finite[i]:
                    raise FloatingPointError(nonfinite_error(r))
                sp = r.sampling
                x = self.process_logits(logits[i], r) if sp.changes_logits else logits[i]
                if not sp.greedy:
                    tokens[i] = self._sample_row(x, sp, r.request_id)
                elif sp.changes_logits:
                    tokens[i] = int(x.argmax())
                if sp.logprobs is not None:
                    row = logp[i]
                    entry = {}
                    if sp.logprobs:
                        top = torch.topk(row, min(sp.logprobs, row.shape[-1]))
                        entry = dict(zip(top.indices.tolist(), top.values.tolist()))
                    entry[tokens[i]] = float(row[tokens[i]])
            except FloatingPointError as e:
                errors[i] = str(e)
            except Exception as e:  # noqa: BLE001 - this row fails alone
                errors[i] = f"request {r.request_id}: sampling failed: {type(e).__name__}: {e}"
            out_lp.append(entry)
        return tokens, out_lp, errors

    @staticmethod
    def prompt_logprobs(logits: torch.Tensor, seqs: list[Request], rows) -> None:
        """Append prompt log-probs to the requests they belong to: `rows` ((sequence, first
        position, count), `Batch.prompt_rows`) name the rows of `logits` in order; position
        q's row gives prompt token q + 1's entry, {token id: log-prob} of the raw distribution
        holding that token and the top `prompt_logprobs`."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        nxt = [t for i, q, n in rows for t in seqs[i].prompt_token_ids[q + 1:q + 1 + n]]
        nxt_t = torch.tensor(nxt, device=logp.device)
        chosen = logp.gather(1, nxt_t[:, None])[:, 0].tolist()
        k = min(max(seqs[i].sampling.prompt_logprobs for i, _, _ in rows), logp.shape[-1])
        top_v, top_i = torch.topk(logp, k) if k else (logp[:, :0], nxt_t[:, None][:, :0])
        top_v, top_i = top_v.tolist(), top_i.tolist()
        at = 0
        for i, q, n in rows:
            req, want = seqs[i], seqs[i].sampling.prompt_logprobs
            assert len(req.prompt_logprobs) == q + 1, (req, q)  # (no gap, no repeat)
            for j in range(at, at + n):
                entry = dict(zip(top_i[j][:want], top_v[j][:want]))
                entry[nxt[j]] = chosen[j]
                req.prompt_logprobs.append(entry)
            at += n

    def process_logits(self, logits: torch.Tensor, req: Request) -> torch.Tensor:
        """A copy of one row's logits (fp32) changed as `req.sampling` says, in vLLM's order:
        the tokens outside allowed_token_ids and those the guide rules out masked, the last token of each bad word whose
        other tokens end the output masked, the stop ids masked while fewer than min_tokens
        tokens are known, logit_bias added, the repetition penalty on the prompt's and the
        output's tokens, the frequency and presence penalties on the output's. The output so
        far is its known tokens (a step still running holds a PENDING place for the token
        sampled here)."""
        sp, x = req.sampling, logits.float().clone()
        known = req.output_token_ids[:len(req.output_token_ids) - req.num_pending]
        width = x.shape[-1]
        for allowed in (sp.allowed_token_ids, req.guide and req.guide.allowed(known)):
            if allowed is not None:
                allowed = [t for t in allowed if t < width]
                kept = x[allowed]
                x.fill_(float("-inf"))
                x[allowed] = kept
        for word in req.bad_words_ids:
            head = len(word) - 1
            if head <= len(known) and (not head or known[-head:] == list(word[:-1])):
                x[word[-1]] = float("-inf")
        if len(known) < sp.min_tokens:
            stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(req.eos_token_ids))
            x[[t for t in stops if t < width]] = float("-inf")
        if not bool(torch.isfinite(x).any()):  # (a bias would not bring one back)
            why = (f"guided decoding's pattern {req.guide.pattern!r}" if req.guide is not None
                   else "allowed_token_ids, bad_words")
            raise ValueError(f"no token is left to pick after {len(known)} tokens: {why} and "
                             f"min_tokens={sp.min_tokens} rule out every one")
        if sp.logit_bias:
            ids, bias = zip(*sp.logit_bias)
            x[list(ids)] += torch.tensor(bias, dtype=x.dtype, device=x.device)
        if not (sp.repetition_penalty != 1.0 or sp.frequency_penalty or sp.presence_penalty):
            return x
        out = torch.tensor(known, dtype=torch.long, device=x.device)
        if sp.repetition_penalty != 1.0:
            prompt = self.prompts.get(req.request_id)
            if prompt is None:
                prompt = self.prompts[req.request_id] = torch.tensor(
                    req.prompt_token_ids, device=x.device).unique()
            seen = torch.cat([prompt, out]).unique()
            v = x[seen]
            x[seen] = torch.where(v > 0, v / sp.repetition_penalty, v * sp.repetition_penalty)
        if (sp.frequency_penalty or sp.presence_penalty) and len(known):
            ids, counts = out.unique(return_counts=True)
            x[ids] -= sp.frequency_penalty * counts.to(x.dtype) + sp.presence_penalty
        return x

    def _sample_row(self, logits: torch.Tensor, sp: SamplingParams, request_id: str) -> int:
        """One token from `logits` with temperature, then min-p, top-k and top-p applied."""
        gen = self.generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=logits.device)
            seed = sp.seed if sp.seed is not None else int(torch.randint(1 << 62, (), generator=self.rng))
            gen.manual_seed(seed)
            self.generators[request_id] = gen
        x = logits / sp.temperature
        if sp.min_p > 0:
            probs = torch.softmax(x, dim=-1)
            x = x.masked_fill(probs < sp.min_p * probs.max(), float("-inf"))
        if sp.top_k and sp.top_k < x.shape[-1]:
            kth = torch.topk(x, sp.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if sp.top_p < 1.0:
            sorted_x, order = torch.sort(x, descending=True)
            probs = torch.softmax(sorted_x, dim=-1)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = probs.cumsum(-1) - probs >= sp.top_p
            x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
        return int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=gen))

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator and prompt ids."""
        self.generators.pop(request_id, None)
        self.prompts.pop(request_id, None)


def finite_rows(logits: torch.Tensor, vocab: int | None) -> torch.Tensor:
    """bool [S]: the rows whose logits over the base vocabulary (its first `vocab` columns;
    None: all) are finite and whose added-token columns hold no NaN or +inf (-inf marks an
    added token that is not the row's adapter's)."""
    vocab = logits.shape[1] if vocab is None else vocab
    base, added = logits[:, :vocab], logits[:, vocab:]
    return torch.isfinite(base).all(dim=-1) & ~(added.isnan() | (added == float("inf"))).any(-1)


def nonfinite_error(req: Request) -> str:
    """The error of a row whose logits hold NaN or inf: it names the adapter, whose weights
    are the likely cause (a base model that overflows would fail every row)."""
    by = f"adapter {req.adapter!r}" if req.adapter else "the base model"
    return (f"request {req.request_id}: the logits are not finite (NaN or inf) under {by}; "
            "its weights may hold NaN or overflow the model's dtype")
