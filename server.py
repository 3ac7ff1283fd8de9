"""An OpenAI-compatible HTTP server: many users share one GPU through one engine loop.

    python server.py --model Qwen/Qwen3-8B --budget 3200            # http://127.0.0.1:8000/v1
    curl 127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "Qwen/Qwen3-8B", "messages": [{"role": "user", "content": "Hi"}]}'

One thread owns the GPU and runs Engine.serve: while each block of 16 decode steps runs it prefills
waiting requests into free rows of the batch; at the host sync that ends the block it hands each request
its new tokens and frees the rows of requests that ended (EOS, max_tokens, a stop string, a client gone).
The HTTP handlers run on asyncio and never block that thread: each request's tokens wait in its own queue
until its client reads them.

Endpoints: POST /v1/chat/completions, POST /v1/completions (streamed as server-sent events or not),
GET /v1/models, GET /health. Errors are OpenAI's error JSON with a 4xx status; the server keeps serving.
"""
import argparse
import asyncio
import errno
import json
import math
import os
import queue
import random
import secrets
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

if __name__ == "__main__":  # Ctrl-C while torch still imports: one line, no traceback (main() restores Ctrl-C)
    signal.signal(signal.SIGINT, lambda *_: os._exit(print("interrupted", file=sys.stderr) or 130))

from cache import KV_DTYPES
from policies import is_int, resolve_policy
from generate import Engine, pick_device
from memory import pick_batch
from sampling import SAMPLING_RANGES, BadSetting, Sampling
from cli import (Parser, add_cache_options, check_policy_args, ignore_further_interrupts, positive_int,
                 run_as_command, say)
import parallel
from model import load, plural, template_messages

try:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route
except ImportError:  # the `serve` extra; main() says what to install
    Starlette = None

SYNC_TICK = 0.05  # seconds the idle engine thread waits for a request before looking again


class ApiError(Exception):
    """A request the server refuses: its HTTP status and OpenAI's error object."""
    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
             503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": None}}

    def response(self):
        return JSONResponse(self.body(), status_code=self.status)


def shutting_down() -> ApiError:  # a new one each time: a raised exception collects its traceback
    return ApiError(503, "the server is shutting down: this request got no answer or an unfinished one; send it "
                         "again")


# ---- one request, as the engine thread and its HTTP handler share it ------------------------------------
@dataclass
class Job:
    """One generation: what the engine needs to admit it, and the queue its handler reads. The engine
    thread puts (new ids, finished) events into the queue through the handler's event loop."""
    prompt: list[int]
    max_tokens: int
    eos: set
    sampling: Sampling
    seed: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    sent: int = 0  # ids handed to the handler so far (engine thread only)
    stop: bool = False  # set by the handler: the client left, or a stop string ended the text

    def push(self, ids: list[int], finished: bool, failure: "ApiError | None" = None):
        """Hand the ids not yet handed over to the handler; failure: why the answer ends unfinished (the
        server is shutting down, the engine failed), which the handler answers instead of a completion."""
        new = list(ids[self.sent:])
        self.sent = max(self.sent, len(ids))
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (new, finished, failure))
        except RuntimeError:  # the event loop has closed (the server stopped): nobody is listening
            pass


class Feed:
    """The engine loop's side of the server (Engine.serve's feed): requests in, tokens out."""

    def __init__(self, max_waiting: int):
        self.inbox, self.max_waiting = queue.Queue(), max_waiting
        self.jobs: dict[int, Job] = {}  # by the engine's request index, until it ends
        self.count = 0  # requests handed to the engine so far
        self.lock = threading.Lock()  # for the two counts below, which both threads change
        self.waiting = 0  # submitted, no row yet (in the inbox, or in the engine's own queue)
        self.active = 0  # decoding in a row
        self.closing = False
        self.ready = threading.Event()  # set once the decode step is compiled and the loop runs

    def submit(self, job: Job):
        with self.lock:  # with the check that closes: no request slips in after the last look at the inbox
            if self.closing:
                raise ApiError(503, "the server is shutting down")
            if self.waiting >= self.max_waiting:
                raise ApiError(429, f"{self.max_waiting} requests are already waiting for a free row; retry later")
            self.waiting += 1
            self.inbox.put(job)

    def close(self) -> list[Job]:
        """No more requests; returns those still in the inbox."""
        with self.lock:
            self.closing = True
            jobs = []
            while not self.inbox.empty():
                jobs.append(self.inbox.get_nowait())
            return jobs

    def _moved(self, waiting: int, active: int):
        with self.lock:
            self.waiting += waiting
            self.active += active

    def arrivals(self, idle: bool):
        """New requests, as Engine.serve reads them while each block runs: waits while idle; None (only when idle)
        ends the loop."""
        self.ready.set()
        jobs = []
        while not jobs:
            try:
                jobs.append(self.inbox.get(timeout=SYNC_TICK) if idle else self.inbox.get_nowait())
            except queue.Empty:
                with self.lock:
                    if self.closing and idle and self.inbox.empty():
                        return None
                if not idle:
                    break
        while True:
            try:
                jobs.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        left = [job for job in jobs if job.stop or self.closing]  # clients gone while waiting, or shutting down
        self._moved(-len(left), 0)
        for job in left:  # the ones still there are told the server is going
            job.push([], finished=True, failure=None if job.stop else shutting_down())
        jobs = [job for job in jobs if job not in left]
        for job in jobs:
            self.jobs[self.count] = job
            self.count += 1
        return [(j.prompt, j.max_tokens, j.eos, j.sampling, j.seed) for j in jobs]

    def stopped(self, i: int) -> bool:
        return self.closing or self.jobs[i].stop

    def progress(self, i: int, ids: list[int]):
        job = self.jobs[i]
        if job.sent == 0:  # its first token: it has a row
            self._moved(-1, 1)
        job.push(ids, finished=False)

    def finished(self, i: int, ids: list[int]):
        job = self.jobs.pop(i)
        self._moved(-1, 0) if job.sent == 0 else self._moved(0, -1)
        ended = job.stop or len(ids) >= job.max_tokens or (ids and ids[-1] in job.eos)
        job.push(ids, finished=True, failure=None if ended else shutting_down())  # else the shutdown cut it


# ---- text out: incremental decoding, reasoning, stop strings ---------------------------------------------
class TextStream:
    """The text of a growing list of ids, a piece at a time. Each piece decodes from a few ids back, so that
    tokenizers which drop a leading space at the start of a decode, and characters split across ids, come
    out as decoding the whole list would; a piece ending in half a character waits for the rest."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.start, self.read = tokenizer, [], 0, 0

    def add(self, ids: list[int], last: bool = False) -> str:
        self.ids += ids
        before = self.tok.decode(self.ids[self.start:self.read])
        now = self.tok.decode(self.ids[self.start:])
        if (now.endswith("\ufffd") and not last) or len(now) <= len(before):
            return ""
        self.start, self.read = self.read, len(self.ids)
        return now[len(before):]


class Output:
    """One request's output as its handler sees it: the ids split into reasoning (inside <think> ...
    </think>, for models that think) and content, each decoded as it streams, stop strings applied.
    A piece of text is held back while it could be the start of a stop string."""

    def __init__(self, tok, eos: set, stop: list[str], thinking: tuple[int, int] | None, reasoning: bool):
        self.eos, self.stop, self.thinking = eos, stop, thinking
        self.streams = {"reasoning_content": TextStream(tok), "content": TextStream(tok)}
        self.part = "reasoning_content" if reasoning else "content"  # where the next text goes
        self.text = {"reasoning_content": "", "content": ""}  # all of it (stop strings cut), held back included
        self.shown = {"reasoning_content": 0, "content": 0}  # characters of it already given out
        self.tokens, self.finish = 0, None  # ids counted as generated; "stop" / "length" once ended

    def add(self, ids: list[int], finished: bool, max_tokens: int) -> dict:
        """Take the new ids; returns the new text of each part that grew: {"content": "..."}."""
        for t in ids:
            if self.finish:
                break
            self.tokens += 1
            if t in self.eos:
                self.finish = "stop"
            elif self.thinking and t == self.thinking[0] and self.tokens == 1:
                self.part = "reasoning_content"  # the model opens its thinking itself (Qwen3)
            elif self.thinking and t == self.thinking[1] and self.part == "reasoning_content":
                self._flush()
                self.part = "content"
            else:
                self.text[self.part] += self.streams[self.part].add([t])
                self._cut_at_stop()
        if not self.finish and finished:
            self.finish = "length" if self.tokens >= max_tokens else "stop"
        if self.finish:
            self._flush()
        return self._new_text()

    def _flush(self):  # the part's last, possibly incomplete, character
        self.text[self.part] += self.streams[self.part].add([], last=True)
        self._cut_at_stop()

    def _cut_at_stop(self):
        text = self.text[self.part]
        at = min((i for i in (text.find(s, max(0, self.shown[self.part] - len(s))) for s in self.stop) if i >= 0),
                 default=-1)
        if at >= 0:
            self.text[self.part], self.finish = text[:at], "stop"

    def _new_text(self) -> dict:
        new = {}
        for part, text in self.text.items():
            # only the part being written can still grow into a stop string
            hold = 0 if self.finish or part != self.part else max((len(s) - 1 for s in self.stop), default=0)
            end = max(self.shown[part], len(text) - hold)
            if end > self.shown[part]:
                new[part], self.shown[part] = text[self.shown[part]:end], end
        return new


# ---- reading requests ------------------------------------------------------------------------------------
def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_text(text: str, name: str) -> str:
    """JSON can carry lone UTF-16 surrogates ("\\ud800"), which are no text a tokenizer can read."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"'{name}' holds {text[e.start:e.end]!a}, a lone UTF-16 surrogate, which is not text",
                       name) from None
    return text


def take(body: dict, name: str, check, what: str, default=None):
    """body[name] if present and not null, else default; checked with `check`, refused as `what` otherwise."""
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise ApiError(400, f"'{name}' must be {what}, got {json.dumps(value)[:100]}", name)
    return value


def is_top_k(x) -> bool:
    return (is_int(x) and x == -1) or SAMPLING_RANGES["top_k"][0](x)


# Each sampling setting's check and how a refusal says it: the engine's own range (sampling.py), so that every
# value taken here runs and a value out of it is refused in the words of the other fields; narrowed to
# OpenAI's range of temperature, and widened by vLLM's -1 for top_k (no limit, as 0 is).
SAMPLING = {"temperature": (lambda x: SAMPLING_RANGES["temperature"][0](x) and x <= 2,
                            "0 (greedy) or a number from 1e-6 to 2"),
            "top_p": SAMPLING_RANGES["top_p"],
            "top_k": (is_top_k, "an integer from -1 to 2^63 - 1 (0 or -1: no limit)"),
            "repetition_penalty": SAMPLING_RANGES["repetition_penalty"]}

COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "repetition_penalty", "n",
          "stream", "stream_options", "ignore_eos", "user", "presence_penalty", "frequency_penalty", "logprobs",
          "logit_bias"}
CHAT = COMMON | {"messages", "max_completion_tokens", "chat_template_kwargs", "top_logprobs", "tools", "tool_choice",
                 "response_format", "parallel_tool_calls"}
COMPLETION = COMMON | {"prompt", "echo", "suffix", "best_of"}


def check_unsupported(body: dict, known: set):
    """Fields this server does not know, or knows but cannot honour, are refused rather than ignored."""
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(400, f"unsupported field '{unknown[0]}'", unknown[0])
    for name, neutral in (("n", 1), ("best_of", 1), ("presence_penalty", 0), ("frequency_penalty", 0),
                          ("logprobs", False), ("echo", False), ("top_logprobs", 0), ("logit_bias", {}),
                          ("tools", []), ("suffix", "")):
        value = body.get(name)  # the neutral value only, and of its kind: true is no n of 1, 0 no logprobs of false
        if value is not None and not (isinstance(value, bool) == isinstance(neutral, bool) and value == neutral):
            hint = "; for several samples send that many requests, each with its own seed" if name in ("n", "best_of") \
                else ""
            raise ApiError(400, f"'{name}' other than {json.dumps(neutral)} is not supported by this server{hint}",
                           name)
    for name in ("tool_choice", "response_format", "parallel_tool_calls"):
        if body.get(name) is not None:
            raise ApiError(400, f"'{name}' is not supported by this server (no tools or structured output)", name)


# A decode step reads every slot of every row, busy or not, and a CPU reads some GB/s: its default rows hold
# this many slots in all (measured: docs/usage.md, "The server in detail")
CPU_SLOTS = 16384


def cpu_rows(slots: int) -> int:
    """The CPU's default rows: as many as hold CPU_SLOTS slots in all (a budget of 512: 8), at least one."""
    return max(1, min(8, CPU_SLOTS // slots))


class Server:
    """The model, its engine thread, and the HTTP handlers."""

    def __init__(self, llm_model, tokenizer, engine: Engine, args):
        self.model, self.tok, self.engine, self.args = llm_model, tokenizer, engine, args
        self.name = args.served_model_name or args.model
        self.policy = engine.for_model(resolve_policy(args.policy, args.budget, args.sinks, args.window,
                                                      args.prompt_compression or "snapkv"))
        cfg = llm_model.cfg
        self.context = args.max_model_len or cfg.max_position_embeddings or 32768
        self.slots = args.budget or self.context  # the full policy: room for the longest request
        asked = args.max_batch or (None if engine.device.type == "cuda" else cpu_rows(self.slots))
        self.rows = pick_batch(engine, asked, args.max_batch or 2**20, self.slots, self.context)
        self.feed = Feed(args.max_waiting)
        vocab = tokenizer.tok.get_vocab()
        ends = vocab.get("<think>"), vocab.get("</think>")
        self.thinking = ends if None not in ends else None
        self.failed = None  # the engine loop's exception, if it died
        self.uvicorn = None  # the HTTP server, which a failed engine loop stops
        self.thread = threading.Thread(target=self._engine_loop, name="engine", daemon=True)

    def _engine_loop(self):
        try:
            for _ in self.engine.serve(self.feed, self.rows, self.slots, self.policy,
                                       self.args.prompt_compression or "snapkv"):
                pass
        except BaseException as e:  # every handler is told, and the server stops (exit status 1)
            self.failed = e
            # decoding, or waiting in the engine's own queue, and waiting to be handed over
            jobs = list(self.feed.jobs.values()) + self.feed.close()
            for job in jobs:
                job.push([], finished=True, failure=ApiError(500, "the engine loop failed; the server is stopping"))
            print(f"error: the engine loop failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            if self.uvicorn:
                self.uvicorn.should_exit = True

    def authorized(self, request) -> bool:
        given = request.headers.get("authorization", "")
        return not self.args.api_key or secrets.compare_digest(given.encode(), f"Bearer {self.args.api_key}".encode())

    # ---- the parts of a request --------------------------------------------------------------------------
    async def read_body(self, request) -> dict:
        if not self.authorized(request):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'")
        size = request.headers.get("content-length")
        if size and size.isdigit() and int(size) > self.args.max_body_bytes:
            raise ApiError(413, f"the request body is over {self.args.max_body_bytes} bytes")
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.args.max_body_bytes:
                raise ApiError(413, f"the request body is over {self.args.max_body_bytes} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise ApiError(400, "the request body is JSON nested too deeply to read") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = take(body, "model", lambda m: isinstance(m, str), "a string")
        if model is None:
            raise ApiError(400, "'model' is required", "model")
        if model != self.name:
            raise ApiError(404, f"the model '{model}' does not exist here; this server serves '{self.name}'", "model")
        return body

    def job(self, body: dict, prompt: list[int], loop) -> Job:
        """The generation a checked body asks for: its limits and sampling settings."""
        if not prompt:
            raise ApiError(400, "the prompt is empty", "prompt")
        room = self.context - len(prompt)
        if room < 1:
            raise ApiError(400, f"the prompt is {plural(len(prompt), 'token')}, and this server's context is "
                                f"{self.context}: no room for an answer",
                           "messages" if "messages" in body else "prompt")
        at_least_1 = lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 1
        max_tokens = take(body, "max_completion_tokens", at_least_1, "an integer >= 1")
        if max_tokens is not None and body.get("max_tokens") not in (None, max_tokens):
            raise ApiError(400, "'max_tokens' and 'max_completion_tokens' disagree: give one of them", "max_tokens")
        max_tokens = take(body, "max_tokens", at_least_1, "an integer >= 1", max_tokens)
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise ApiError(400, f"max_tokens {max_tokens} + the prompt's {plural(len(prompt), 'token')} is past this "
                                f"server's context of {len(prompt) + room} tokens; ask for at most {room}", "max_tokens")
        given = {name: take(body, name, *check) for name, check in SAMPLING.items()}
        if given["top_k"] == -1:
            given["top_k"] = 0  # no limit
        try:  # the fields were checked above and the model's defaults at startup: a last guard
            sampling = Sampling.with_defaults(self.tok.defaults, **given)
        except BadSetting as e:
            raise ApiError(400, str(e), e.setting) from None
        seed = take(body, "seed", lambda x: isinstance(x, int) and not isinstance(x, bool) and -2**63 <= x < 2**63,
                    "an integer of 64 bits", random.randrange(2**31))
        ignore_eos = take(body, "ignore_eos", lambda x: isinstance(x, bool), "true or false", False)
        return Job(prompt, max_tokens, set() if ignore_eos else set(self.tok.eos_ids), sampling, seed, loop)

    def stop_strings(self, body) -> list[str]:
        stop = take(body, "stop", lambda s: isinstance(s, str) or (isinstance(s, list) and len(s) <= 4 and all(
            isinstance(x, str) for x in s)), "a string or a list of at most 4 strings", [])
        stop = [stop] if isinstance(stop, str) else stop
        if any(s == "" for s in stop):
            raise ApiError(400, "'stop' strings must not be empty", "stop")
        return stop

    def stream_options(self, body) -> tuple[bool, bool]:
        """Whether to stream, and whether the stream ends with a usage chunk."""
        stream = take(body, "stream", lambda x: isinstance(x, bool), "true or false", False)
        options = take(body, "stream_options", lambda x: isinstance(x, dict) and set(x) <= {"include_usage"}
                       and isinstance(x.get("include_usage", False), bool), 'an object {"include_usage": bool}')
        if options is not None and not stream:
            raise ApiError(400, "'stream_options' only goes with 'stream': true", "stream_options")
        return stream, bool(options and options.get("include_usage"))

    def chat_prompt(self, body) -> tuple[list[int], bool]:
        """The rendered conversation's ids, and whether the model starts its answer inside <think>."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list of {\"role\", \"content\"} objects", "messages")
        try:  # each message checked field by field, content parts joined: as LLM.chat does
            messages = template_messages(messages)
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        kwargs = take(body, "chat_template_kwargs", lambda x: isinstance(x, dict) and set(x) <= {"enable_thinking"}
                      and isinstance(x.get("enable_thinking", True), bool),
                      'an object {"enable_thinking": bool} (the only template option this server passes)', {})
        if self.tok.template is None:
            raise ApiError(400, "this model has no chat template: use /v1/completions with a plain prompt", "messages")
        for m in messages:  # every text the template may write (role, content, reasoning_content, ...)
            for value in m.values():
                if isinstance(value, str):
                    check_text(value, "messages")
        enable = kwargs.get("enable_thinking", True)
        try:
            text = self.tok.render(messages, enable)
            # what the template adds to open the assistant's turn: DeepSeek-R1's leaves <think> open there, so
            # the answer starts inside the reasoning (a <think> the user wrote in a message does not count)
            before = self.tok.render(messages, enable, add_generation_prompt=False) if self.thinking else ""
        except ValueError as e:  # the template itself refused the conversation, or has an error
            raise ApiError(400, str(e), "messages") from None
        opening = text[len(before):] if text.startswith(before) else text
        thinking = bool(self.thinking) and opening.rfind("<think>") > opening.rfind("</think>")
        return self.tok.encode(text, special=False), thinking

    def completion_prompt(self, body) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.tok.encode(check_text(prompt, "prompt"))
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not all(0 <= t < self.model.cfg.vocab_size for t in prompt):
                raise ApiError(400, f"token ids must be in [0, {self.model.cfg.vocab_size})", "prompt")
            return prompt
        raise ApiError(400, "'prompt' must be a string or a list of token ids (one prompt per request: send several "
                            "requests for several)", "prompt")

    # ---- the handlers --------------------------------------------------------------------------------------
    async def chat_completions(self, request):
        return await self.handle(request, chat=True)

    async def completions(self, request):
        return await self.handle(request, chat=False)

    async def handle(self, request, chat: bool):
        try:
            if self.failed or not self.feed.ready.is_set():
                raise ApiError(503, "the engine is not running" if self.failed else "the model is still loading")
            body = await self.read_body(request)
            check_unsupported(body, CHAT if chat else COMPLETION)
            stream, usage = self.stream_options(body)
            stop = self.stop_strings(body)
            # off the event loop: tokenizing a long prompt takes seconds, while other streams go on
            prompt, thinking = await asyncio.to_thread(
                self.chat_prompt if chat else lambda b: (self.completion_prompt(b), False), body)
            job = self.job(body, prompt, asyncio.get_running_loop())
            out = Output(self.tok, job.eos, stop, self.thinking if chat else None, thinking)
            self.feed.submit(job)
        except ApiError as e:
            return e.response()
        except ClientDisconnect:
            return JSONResponse({}, status_code=499)
        reply = Reply(self.name, chat, job, out)
        if stream:
            return StreamingResponse(reply.stream(usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await reply.whole(request)

    async def models(self, request):
        if not self.authorized(request):
            return ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'").response()
        return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model", "created": STARTED,
                                                          "owned_by": "tinyflow", "max_model_len": self.context}]})

    async def health(self, request):
        if self.failed:
            return JSONResponse({"status": "failed", "error": repr(self.failed)}, status_code=503)
        if not self.feed.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok", "rows": self.rows, "slots": self.slots, "policy": self.policy.name,
                             "active": self.feed.active, "waiting": self.feed.waiting})


STARTED = int(time.time())


class Reply:
    """The response to one request: OpenAI's objects, whole or as server-sent-event chunks."""

    def __init__(self, model: str, chat: bool, job: Job, out: Output):
        self.model, self.chat, self.job, self.out = model, chat, job, out
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    async def events(self):
        """(new text by part, finished) as the engine produces ids; the job stops once the output is done."""
        while True:
            ids, finished, failure = await self.job.events.get()
            new = self.out.add(ids, finished and not failure, self.job.max_tokens)
            if failure:  # the text so far, then the error: the client must not take this for a whole answer
                if new:
                    yield new, False
                raise failure
            if self.out.finish and not finished:
                self.job.stop = True  # a stop string: the engine frees the row at its next sync
            yield new, self.out.finish is not None
            if self.out.finish:
                return

    def usage(self) -> dict:
        n = self.out.tokens
        return {"prompt_tokens": len(self.job.prompt), "completion_tokens": n, "total_tokens": len(self.job.prompt) + n}

    async def whole(self, request):
        watch = asyncio.create_task(self._watch_disconnect(request))
        try:
            async for _ in self.events():
                pass
        except ApiError as e:  # shutting down (503) or the engine failed (500)
            return e.response()
        finally:
            watch.cancel()
            self.job.stop = True
        text = self.out.text
        if self.chat:
            message = {"role": "assistant", "content": text["content"]}
            if self.out.thinking:
                message["reasoning_content"] = text["reasoning_content"] or None
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": self.out.finish}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text["content"], "logprobs": None, "finish_reason": self.out.finish}
            kind = "text_completion"
        return JSONResponse({"id": self.id, "object": kind, "created": self.created, "model": self.model,
                             "choices": [choice], "usage": self.usage()})

    async def _watch_disconnect(self, request):
        while not await request.is_disconnected():
            await asyncio.sleep(0.2)
        self.job.stop = True  # the client left: its row frees at the next sync

    async def stream(self, include_usage: bool):
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = lambda choices, **extra: "data: " + json.dumps(
            {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
             **extra}) + "\n\n"
        try:
            if self.chat:
                yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            async for new, finished in self.events():
                pieces = [{part: text} for part, text in new.items()] if self.chat else \
                    [{"text": new["content"]}] if "content" in new else []
                for piece in pieces:
                    key = "delta" if self.chat else None
                    yield chunk([{"index": 0, **({key: piece} if key else piece), "logprobs": None,
                                  "finish_reason": None}])
                if finished:
                    end = {"delta": {}} if self.chat else {"text": ""}
                    yield chunk([{"index": 0, **end, "logprobs": None, "finish_reason": self.out.finish}])
            if include_usage:
                yield chunk([], usage=self.usage())
        except ApiError as e:  # the headers are gone: the error travels as an event, as OpenAI's do
            yield "data: " + json.dumps(e.body()) + "\n\n"
        finally:  # also when the client disconnects mid-stream (Starlette cancels this generator)
            self.job.stop = True
        yield "data: [DONE]\n\n"


def app(server: Server):
    routes = [Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
              Route("/v1/completions", server.completions, methods=["POST"]),
              Route("/v1/models", server.models, methods=["GET"]),
              Route("/health", server.health, methods=["GET"])]
    there = ", ".join(f"{'POST' if 'POST' in r.methods else 'GET'} {r.path}" for r in routes)

    async def no_route(request, exc):  # Starlette's own 404 and 405 are plain text: OpenAI's error JSON instead
        asked = f"{request.method} {request.url.path}"
        if exc.status_code == 405:
            allowed = "POST" if "POST" in exc.headers["Allow"] else "GET"
            message = f"{request.url.path} takes {allowed}, not {request.method}; this server has {there}"
        else:
            message = f"no route {asked}; this server has {there}"
        return JSONResponse(ApiError(exc.status_code, message).body(), status_code=exc.status_code,
                            headers=exc.headers)

    async def failure(request, exc):  # a bug in one request's handling fails that request only
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}").response()
    return Starlette(routes=routes, exception_handlers={HTTPException: no_route, Exception: failure})


# ---- the command line -------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = Parser(prog="server.py", description="An OpenAI-compatible server with LongFlow KV-cache compression.")
    p.add_argument("--model", required=True, help="Hugging Face id or local folder")
    p.add_argument("--served-model-name", default=None, help="the name clients ask for (default: --model)")
    add_cache_options(p)
    p.add_argument("--max-batch", type=positive_int, default=None,
                   help="rows decoded together (default: as many as fit in GPU memory; on the CPU as many "
                        f"(1 to 8) as hold {CPU_SLOTS:,} KV slots in all)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="prompt + output tokens per request at most (default: the model's "
                        "max_position_embeddings); with the full policy, also each row's KV slots")
    p.add_argument("--max-waiting", type=positive_int, default=256,
                   help="requests waiting for a row before new ones get 429")
    p.add_argument("--max-body-bytes", type=positive_int, default=4 * 2**20, help="larger request bodies get 413")
    p.add_argument("--api-key", default=None, help="if set, every request must send 'Authorization: Bearer KEY'")
    p.add_argument("--host", default="127.0.0.1", help="127.0.0.1: this machine only; 0.0.0.0: every interface")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument("--allow-long-context", action="store_true",
                   help="let requests run past the model's max_position_embeddings")
    return p.parse_args(argv)


def port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"expected a port number from 1 to 65535, got {text!r}")
    return int(text)


def bind(host: str, port: int) -> socket.socket:
    """The socket the server will listen on, bound before the model loads: a port in use or a host that is not
    this machine's fails at once, not after a minute of compiling (uvicorn binds only when it starts)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a restart need not wait
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(bind_failure(host, port, e)) from None
    return sock


def bind_failure(host: str, port: int, e: OSError) -> str:
    """What a failed bind means, and what to do."""
    if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
        return (f"--host {host} is not an address of this machine ({e.strerror}); give 127.0.0.1 (this machine "
                f"only), 0.0.0.0 (every interface) or one of its own addresses")
    if e.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is in use ({e.strerror}); stop what listens there or give another --port"
    if e.errno == errno.EACCES:
        return f"port {port} on {host} is not allowed to this user ({e.strerror}); give a --port from 1024 up"
    return f"cannot listen on {host}:{port} ({e.strerror or e}); give another --host or --port"


def check_args(args):
    check_policy_args(args)
    if parallel.launched():  # one engine loop owns one GPU: nothing splits a model yet
        raise ValueError("server.py serves from one process on one GPU; start it without torchrun")


def build(args) -> Server:
    check_args(args)
    device, dtype = pick_device(args.device, args.dtype)
    model, tok = load(args.model, device, dtype, weights=args.weights)
    check_default_sampling(tok.defaults)
    limit = model.cfg.max_position_embeddings
    if args.max_model_len and limit and args.max_model_len > limit and not args.allow_long_context:
        raise ValueError(f"--max-model-len {args.max_model_len} is past the model's max_position_embeddings "
                         f"{limit}; lower it, or add --allow-long-context")
    engine = Engine(model, compile=not args.no_compile, allow_long_context=args.allow_long_context,
                    kv_dtype=KV_DTYPES[args.kv_dtype])
    return Server(model, tok, engine, args)


def check_default_sampling(defaults: dict):
    """The model's sampling defaults, checked once at startup: one out of range would refuse every request that
    leaves that setting out."""
    try:
        Sampling.with_defaults(defaults)
    except BadSetting as e:  # generate.py's words, but the server has no flag to override it with
        raise ValueError(e.as_default("correct it in that file")) from None


def main(argv=None):
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C is KeyboardInterrupt again
    args = parse_args(argv)
    if Starlette is None:
        say("error: the server needs starlette and uvicorn (the serve extra): pip install starlette uvicorn")
        sys.exit(2)
    try:
        check_args(args)  # under torchrun every process would try the address: the options are refused first
        listening = bind(args.host, args.port)
        server = build(args)
        server.thread.start()
        started = time.perf_counter()
        print(f"compiling the decode step for {server.rows} rows of {server.slots} KV slots, and the prefill...",
              file=sys.stderr, flush=True)
        while not server.feed.ready.wait(0.5):
            if not server.thread.is_alive():
                say(f"error: the engine failed to start: {server.failed}")
                sys.exit(1)
    except (ValueError, FileNotFoundError) as e:
        say(parallel.report(e))  # under torchrun (refused) every rank meets the same input: rank 0 says it
        # and the other ranks end quietly with status 0: torchrun stops every rank (SIGTERM) once one fails,
        # which would cut off a rank 0 still importing before it says why
        sys.exit(2 if parallel.rank() == 0 else 0)
    except KeyboardInterrupt:  # while loading or compiling (the engine thread is a daemon: it goes too)
        ignore_further_interrupts()
        say("interrupted")
        sys.exit(130)
    sizes = len(server.engine.stepper.sizes)  # the step for a ladder of batch sizes: the busy rows' runs
    graphs = server.engine.prefill_graphs
    replays = f" ({len(graphs.graphs)} graphs, {graphs.bytes / 2**30:.2f} GiB)" if graphs else ""
    print(f"serving {server.name} on http://{args.host}:{args.port}/v1 ({server.rows} rows, {server.policy.name}, "
          f"{server.slots} slots; the step made for {sizes} batch sizes, and the prefill{replays}, in "
          f"{time.perf_counter() - started:.1f} s)",
          file=sys.stderr, flush=True)
    server.uvicorn = Uvicorn(uvicorn.Config(app(server), host=args.host, port=args.port, log_level="warning",
                                            timeout_graceful_shutdown=5), server.feed)
    try:
        server.uvicorn.run(sockets=[listening])
    except KeyboardInterrupt:  # uvicorn raises the Ctrl-C it handled again once it has shut down
        ignore_further_interrupts()
    finally:
        server.feed.closing = True
        server.thread.join(timeout=10)
    if server.failed:
        sys.exit(1)


class Uvicorn(uvicorn.Server if Starlette else object):
    """uvicorn's server, telling the engine at the start of a shutdown (Ctrl-C): it ends every request at its
    next sync, so that open streams finish with their last chunk inside the grace period."""

    def __init__(self, config, feed: Feed):
        super().__init__(config)
        self.feed = feed

    def handle_exit(self, sig, frame):
        """The first Ctrl-C (or SIGTERM) starts the graceful shutdown; more during it are ignored: uvicorn would
        force the exit, cancelling open streams mid-answer, and raise each signal again at the end (a traceback
        from its tasks). The shutdown is bounded anyway: rows end at the next sync, streams within 5 s."""
        self.feed.closing = True
        if not self.should_exit:
            super().handle_exit(sig, frame)


if __name__ == "__main__":
    run_as_command(main)
