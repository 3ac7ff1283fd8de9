"""The public Python API: load a model once, generate many times.

    import tinyflow
    llm = tinyflow.LLM("Qwen/Qwen3-8B", budget=3200)            # LongFlow, 3,200 KV slots per sequence
    outs = llm.generate(["What is 17 * 23?"], max_new_tokens=256)
    print(outs[0].text, llm.stats.line())
"""
import importlib.util
import operator
import os
import shlex
from dataclasses import dataclass


def check_own_modules():
    """tinyflow's files are top-level modules (model, cache, policies, kernel, generate, ...): a file
    of the same name earlier on sys.path (a model.py in the current folder, say) would be imported in their place,
    and an install older than one of them does not find it at all."""
    here = os.path.dirname(os.path.abspath(__file__))
    for name in ("cache", "policies", "kernel", "fp8", "model", "sampling", "step", "memory", "generate", "cli",
                 "parallel", "calibration", "default_model"):
        spec = importlib.util.find_spec(name)
        if spec is None:  # an editable install made before this module existed does not map it
            clone = os.path.dirname(os.path.realpath(__file__))  # a strict editable install links the clone's files
            raise ImportError(f"tinyflow's install is out of date: `import {name}` finds no {name}.py; reinstall it: "
                              f"pip install -e {shlex.quote(clone)} --config-settings editable_mode=strict")
        origin = spec.origin
        if origin is None or os.path.dirname(os.path.abspath(origin)) != here:
            raise ImportError(f"tinyflow needs its own {name}.py (in {here}) but `import {name}` finds {origin}; "
                              f"rename that file or run from another folder")


check_own_modules()
from cache import KV_DTYPES
from policies import resolve_policy  # noqa: E402 (after the check, which says why an import would go wrong)
from generate import Engine, Interrupted, Stats  # noqa: E402
from sampling import Sampling  # noqa: E402
from cli import refuse_thinking, refuse_when_greedy  # noqa: E402
from model import DTYPES, WEIGHTS, load, pick_device  # noqa: E402
from parallel import join, launched  # noqa: E402


@dataclass
class Output:
    token_ids: list[int]  # the generated ids only, EOS included if it was produced
    text: str  # the decoded generated text


@dataclass
class Score:
    token_ids: list[int]  # the continuation's ids
    logprobs: list[float]  # log p of each of them given everything before it (the first: given the prompt)
    argmax: list[int]  # the most likely token at each of those positions


class LLM:
    def __init__(self, model: str | None = None, budget: int | None = None, policy: str | None = None,
                 device=None, dtype=None, compile: bool = True, sinks: int | None = None,
                 window: int | None = None, prompt_compression: str = "snapkv", allow_long_context: bool = False,
                 kv_dtype: str = "auto", weights: str = "auto", data_parallel: bool = False):
        """model: a Hugging Face id or a local folder (None: SmolLM2-135M-Instruct, converted once into tinyflow's
        cache folder, as generate.py without --model: default_model.py). budget: KV slots per sequence and layer,
        or None to keep every token. policy: "longflow" (one decision per layer, as in the paper; the default with
        a budget), "longflow-head" (per KV head), "full" (the default without), or another rule of
        policies.POLICIES (tova, h2o, vatp, streaming, keydiff, rkv, random, knorm, triattention: it reads
        statistics of the model that `python eval.py calibrate --model DIR` measures). sinks / window: first /
        most recent tokens never evicted (default: the policy's own). prompt_compression: for prompts
        longer than the budget, "snapkv", "streaming", or "decode" (the policy's own rule).
        allow_long_context: let sequences run past the model's max_position_embeddings (refused otherwise).
        kv_dtype: "auto" (K and V in the model's dtype) or "fp8" (float8 e4m3 and a scale per token and KV
        head: about half the bytes of bf16, so about twice the sequences fit). weights: "auto" (as the checkpoint
        stores them: 16-bit, or FP8 blocks for an FP8 checkpoint such as Qwen/Qwen3-8B-FP8), "fp8" (each layer's
        linear weights quantized at load into e4m3 with a factor per 128 x 128 block: half their bytes; fp8.py)
        or "fp8-all" (the LM head too; a head tied to the embedding becomes a quantized copy beside it).

        Under torchrun (several processes) the model is split over them (tensor parallel, parallel.py): every
        process makes the same calls and gets the same outputs. data_parallel: under torchrun, a whole model
        in each process instead, on its own GPU; each process then generates for its own prompts."""
        check_llm_args(model, dtype, kv_dtype, weights, compile=compile, allow_long_context=allow_long_context,
                       data_parallel=data_parallel)
        self.set_policy(budget, policy, sinks, window, prompt_compression)
        self.device, self.dtype = pick_device(device, dtype)
        tp, self.device = join(self.device, data_parallel)
        self.model, self.tokenizer = load(model, self.device, self.dtype, tp, weights)
        self.engine = Engine(self.model, compile=compile, allow_long_context=allow_long_context,
                             kv_dtype=KV_DTYPES[kv_dtype])
        self.engine.check_budget(budget)  # (set_policy's later budgets: when generate or score runs)
        self.engine.for_model(self.policy)  # a policy that needs data of this model (its statistics) is refused now
        self.stats: Stats | None = None  # the last call's statistics (after Ctrl-C: of what was generated)

    def set_policy(self, budget: int | None, policy: str | None = None, sinks: int | None = None,
                   window: int | None = None, prompt_compression: str = "snapkv"):
        """Switch budget and policy for later calls, keeping the loaded model (arguments as in __init__)."""
        if budget is None and prompt_compression != "snapkv":
            raise ValueError(f"prompt_compression={prompt_compression!r} applies to a cache with a budget: give "
                             f"budget= or leave it out")
        self.policy = resolve_policy(policy, budget, sinks, window, prompt_compression)
        self.budget, self.prompt_rule = budget, prompt_compression

    def generate(self, prompts, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | list[int] | None = None, batch_size: int | None = None,
                 ignore_eos: bool = False, on_output=None, repetition_penalty: float = 1.0, n: int = 1) -> list[Output]:
        """prompts: a list of strings (tokenized as they are) or of token-id lists. Greedy unless
        temperature > 0; top_p, top_k and seed only apply when sampling (refused when greedy, but for top_p 1 and
        top_k 0, which ask for nothing); repetition_penalty as transformers defines it (1: none). n: one output
        per prompt (several samples of a prompt: repeat it in prompts). batch_size: how many
        sequences decode together (default: all, or as many as fit in GPU memory); the rest wait and
        take the rows that free up. seed: one int (prompt i gets seed + i) or one seed per prompt.
        ignore_eos: generate max_new_tokens tokens whatever they are. on_output(i, Output) is called as
        soon as prompt i is finished (outputs come back in prompt order at the end too). Ctrl-C raises
        generate.Interrupted, a KeyboardInterrupt holding the ids generated so far; self.stats counts them."""
        check_flags(ignore_eos=ignore_eos)
        if n != 1:
            raise ValueError(f"n={n!r}: generate returns one output per prompt; for {n} samples of a prompt, give it "
                             f"{n} times in prompts with a temperature above 0 (prompt i samples with seed + i)")
        sampling = Sampling(temperature, top_k, top_p, repetition_penalty)
        # top_p 1 and top_k 0 ask for nothing, so a greedy run ignores nothing (eval.py passes them to every run)
        given = {"top_p": top_p if top_p != 1 else None, "top_k": top_k if top_k != 0 else None, "seed": seed}
        refuse_when_greedy(given, sampling, True, "give temperature= above 0")
        if on_output is not None and not callable(on_output):  # it would fail only once the first prompt is done
            raise TypeError(f"on_output must be a function of (i, Output), got {type(on_output).__name__}")
        ids = self._ids(prompts, "prompts")
        eos = [] if ignore_eos else self.tokenizer.eos_ids
        on_done = (lambda i, o: on_output(i, Output(list(o), self.tokenizer.decode(o)))) if on_output else None
        try:
            outs, self.stats = self.engine.generate(ids, max_new_tokens, eos, self.budget, self.policy, sampling, seed,
                                                    batch_size, prompt_rule=self.prompt_rule, on_done=on_done)
        except Interrupted as stop:
            self.stats = stop.stats
            raise
        return [Output(o, self.tokenizer.decode(o)) for o in outs]

    def score(self, prompts, continuations, batch_size: int | None = None) -> list[Score]:
        """Teacher-forced log-probabilities: each prompt is prefilled (compressed if it does not fit, as in
        generate), then its continuation is fed one token at a time through the decode step, evicting with
        this LLM's budget and policy exactly as generation would. prompts, continuations: lists of the
        same length, of strings (tokenized separately; a continuation gets no BOS) or token-id lists."""
        prompt_ids = self._ids(prompts, "prompts")
        cont_ids = self._ids(continuations, "continuations", special=False)
        outs, self.stats = self.engine.score(prompt_ids, cont_ids, self.budget, self.policy, batch_size,
                                             self.prompt_rule)
        return [Score(*map(list, zip(*records))) for records in outs]

    def _ids(self, texts, what: str, special: bool = True) -> list[list[int]]:
        """Token ids of each text: a string is tokenized; any sequence of integers (a list, a numpy array, a
        tensor) is taken as ids."""
        if isinstance(texts, (str, bytes, dict)) or not hasattr(texts, "__len__"):
            raise TypeError(f"{what} must be a list of strings or of token-id lists, not {type(texts).__name__}")
        return [self.tokenizer.encode(t, special) if isinstance(t, str) else token_ids(t, what) for t in texts]

    def chat(self, conversations, enable_thinking: bool | None = None, **kwargs) -> list[Output]:
        """conversations: a list of conversations, each a list of {"role", "content"} messages (one
        conversation alone is accepted too); a content may be OpenAI's text parts ([{"type": "text", "text":
        ...}], joined), an assistant's null. Rendered with the model's own chat template. enable_thinking: the
        template's thinking switch (None: the template's default, thinking for Qwen3); refused for a template
        that has none."""
        if isinstance(conversations, (list, tuple)) and conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        if not isinstance(conversations, (list, tuple)) or not all(map(is_conversation, conversations)):
            raise TypeError("chat takes a list of messages ({'role': ..., 'content': ...}), or a list of such "
                            "lists; for plain text use generate")
        if enable_thinking is not None:
            check_flags(enable_thinking=enable_thinking)
            refuse_thinking(self.tokenizer, f"enable_thinking={enable_thinking!r}")
        ids = [self.tokenizer.chat(c, enable_thinking is not False) for c in conversations]
        return self.generate(ids, **kwargs)


def check_llm_args(model, dtype, kv_dtype, weights, **flags):
    """LLM()'s arguments that would otherwise fail deep inside loading, or be taken for what they are not
    (compile="no" is true), before anything loads; the policy's are resolve_policy's, the device's
    pick_device's."""
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a Hugging Face id or a folder path, not {type(model).__name__}")
    if not (isinstance(kv_dtype, str) and kv_dtype in KV_DTYPES):
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if not (isinstance(weights, str) and weights in WEIGHTS):
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if dtype is not None and not (isinstance(dtype, str) and dtype in DTYPES or dtype in DTYPES.values()):
        *others, last = DTYPES
        raise ValueError(f"dtype must be {', '.join(others)} or {last} (a name or a torch.dtype), got {dtype!r}")
    check_flags(**flags)
    if flags["data_parallel"] and not launched():  # as the command lines' --dp
        raise ValueError("data_parallel=True shares the prompts out among torchrun's processes: start under "
                         "torchrun --nproc-per-node N, or drop it")


def check_flags(**flags):
    """Flags are bools: a string or a number would count as true or false unseen."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")


def token_ids(ids, what: str) -> list[int]:
    """A sequence of integers (list, tuple, numpy array, tensor) as a list of Python ints."""
    if isinstance(ids, (bytes, dict)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"each of the {what} must be a string or a sequence of token ids, not {type(ids).__name__}")
    try:
        return [operator.index(t) for t in (ids.tolist() if hasattr(ids, "tolist") else ids)]
    except TypeError:
        raise ValueError(f"token ids must be integers; {what} hold {ids!r}"[:200]) from None


def is_conversation(messages) -> bool:
    """A list of messages (dicts); their fields are checked as the chat template gets them
    (model.template_messages, which names a bad one)."""
    return isinstance(messages, (list, tuple)) and all(isinstance(m, dict) for m in messages)
