"""The command line that generate.py, server.py, bench.py and eval.py share: argparse with one-line errors
and the defaults in --help, the model and cache options, the refusal of options that would be ignored,
reading a prompt, the sampling flags, what generate.py prints, and how a command ends (bad input: one line and
exit status 2, as argparse's own errors; Ctrl-C: 130; a reader gone: 1)."""
import argparse
import os
import signal
import sys

import parallel
from cache import KV_DTYPES
from policies import POLICIES, PROMPT_RULES
from model import DTYPES, WEIGHTS
from sampling import BadSetting, Sampling


# ---- parsing -------------------------------------------------------------------------------------------
class ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """--help appends each option's default, unless its help already says it or there is none to show (None,
    or the off state of a flag)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors and the defaults shown in --help."""

    def __init__(self, **kwargs):
        super().__init__(formatter_class=ShowDefaults, **kwargs)

    def add_argument(self, *args, **kwargs):  # an option without a help text still shows its default
        if kwargs.get("help") is None and kwargs.get("default") is not None and kwargs.get("default") is not False:
            kwargs["help"] = "default: %(default)s"
        return super().add_argument(*args, **kwargs)

    def error(self, message):  # one line instead of argparse's usage block; under torchrun, rank 0's alone
        self.exit(2, f"error: {message} (see --help)\n" if parallel.rank() == 0 else None)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:  # argparse would name this function in its message
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def batch_size(text: str):
    return text if text == "max" else positive_int(text)


def add_cache_options(p: Parser):
    """The model, cache and device options that generate.py and server.py share."""
    p.add_argument("--budget", type=positive_int, default=None,
                   help="KV slots per sequence and layer (default: keep every token); at least 33 slots (53 for "
                        "vatp, 37 for streaming, more with a larger --sinks or --window): the sinks, the last 32 "
                        "prompt tokens or the recent window, and the new token")
    p.add_argument("--policy", default=None, choices=list(POLICIES), metavar="POLICY",
                   help=f"the eviction rule, one of {', '.join(POLICIES)} (default: longflow with --budget, "
                        f"full without)")
    p.add_argument("--sinks", type=non_negative_int, default=None,
                   help="first tokens never evicted (default: the policy's)")
    p.add_argument("--window", type=non_negative_int, default=None,
                   help="recent tokens never evicted (default: the policy's)")
    p.add_argument("--prompt-compression", default=None, choices=PROMPT_RULES,
                   help="how a prompt longer than --budget is cut: snapkv, streaming, or decode (the policy's "
                        "rule); default: snapkv")
    p.add_argument("--kv-dtype", default="auto", choices=list(KV_DTYPES),
                   help="what the KV cache stores: auto (the model's dtype) or fp8 (e4m3 and a scale per token "
                        "and KV head: half the bytes of bf16)")
    add_weights_option(p)
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--no-compile", action="store_true", help="run the decode step (and the server's prefill) eagerly")


def add_weights_option(p: Parser):
    p.add_argument("--weights", default="auto", choices=WEIGHTS,
                   help="the linear weights: auto (as the checkpoint stores them: 16-bit, or FP8 blocks for an "
                        "FP8 checkpoint's layers), fp8 (the layers' quantized at load into e4m3 with a factor per "
                        "128 x 128 block: half the bytes of bf16) or fp8-all (the LM head's too)")


# ---- refusals: options that would be ignored --------------------------------------------------------------
def ignored(options: list[str], when: str, fix: str) -> ValueError:
    """The refusal of options that would be ignored: "--a and --b only apply WHEN: FIX or drop them"."""
    many = len(options) > 1
    return ValueError(f"{' and '.join(options)} only {'apply' if many else 'applies'} {when}: {fix} or drop "
                      f"{'them' if many else 'it'}")


def check_policy_args(args):
    """Settings that would be ignored are refused, each with what to add or drop."""
    evicting = [f"--{name}" for name, value in (("sinks", args.sinks), ("window", args.window),
                                                ("prompt-compression", args.prompt_compression)) if value is not None]
    if args.policy == "full" and (args.budget is not None or evicting):
        dropped = ["--budget"] * (args.budget is not None) + evicting
        raise ValueError(f"--policy full keeps every token: drop {' and '.join(dropped)}, or pick a policy that evicts")
    given = ["--policy"] * (args.policy is not None and args.policy != "full") + evicting
    if args.budget is None and given:
        raise ignored(given, "to a cache with a budget", "add --budget N (KV slots per sequence)")


def check_sampling_args(args, sampling):
    """--top-k, --top-p and --seed are refused when decoding is greedy (given or the model's default).
    sampling: the sampling.Sampling the run decodes with."""
    given = {f"--{name.replace('_', '-')}": getattr(args, name) for name in ("top_k", "top_p", "seed")}
    refuse_when_greedy(given, sampling, args.temperature is not None, "add --temperature T (> 0)")


def refuse_when_greedy(given: dict, sampling, temperature_given: bool, fix: str):
    """Settings only sampling reads (top-k, top-p, the seed) refused when decoding is greedy, as the command line
    and the API (tinyflow.LLM.generate) name them. given: name -> value (None: not given); sampling: the
    sampling.Sampling the run decodes with; temperature_given: False when its 0 is the model's default."""
    named = [name for name, value in given.items() if value is not None]
    if named and sampling.temperature == 0:
        default = "" if temperature_given else ", the model default"
        raise ignored(named, f"when sampling, and this decodes greedily (temperature 0{default})", fix)


def refuse_thinking(tok, name: str, chat: bool = True):
    """A thinking switch (--thinking, --no-thinking, LLM.chat's enable_thinking) that the prompt would never
    reach is refused: a plain-text prompt, or a chat template that does not read enable_thinking. name: the
    switch as the caller gave it."""
    if tok.template is None:
        raise ValueError(f"{name} would be ignored: this model has no chat template to switch thinking in; drop it")
    if not chat:
        raise ignored([name], "to a prompt in the model's chat template", "drop --no-chat")
    if not tok.has_thinking_switch:
        raise ValueError(f"{name} would be ignored: this model's chat template has no thinking switch (it never "
                         f"reads enable_thinking); drop it")


# ---- input and output ----------------------------------------------------------------------------------
DEFAULT_PROMPT = "Briefly, why is the sky blue?"  # what `generate.py --model M --budget B` asks


def read_prompt(args) -> str:
    """--prompt, or the whole content of --prompt-file ('-': standard input), which must be UTF-8 text; neither
    given, DEFAULT_PROMPT, said on stderr (an answer to a question not asked would otherwise puzzle)."""
    if args.prompt_file is None and args.prompt is None:
        say(f"no --prompt given, so asking {DEFAULT_PROMPT!r} (give --prompt TEXT or --prompt-file FILE)")
        return DEFAULT_PROMPT
    if args.prompt_file is None:
        return args.prompt
    name = "standard input" if args.prompt_file == "-" else f"prompt file {args.prompt_file}"
    try:
        if args.prompt_file == "-":
            return sys.stdin.buffer.read().decode("utf-8")
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise FileNotFoundError(f"cannot read {name}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{name} is not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x}); convert it to "
                         f"UTF-8") from None


def say(line: str | None):
    """One line on stderr (None: nothing, as for another rank's copy of rank 0's error)."""
    if line:
        print(line, file=sys.stderr)


def reader_gone():
    """`generate.py ... | head -1`: the reader has gone, so has the output; end quietly (exit status 1)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's own flush at exit would fail
    sys.exit(1)


def sampling_from_flags(given: dict, defaults: dict) -> Sampling:
    """--temperature, --top-k, --top-p, --repetition-penalty as given (a setting absent or None: not given), and
    the model's defaults for those not given; a refusal names the flag (eval.py's too)."""
    given = {name: given.get(name) for name in ("temperature", "top_k", "top_p", "repetition_penalty")}
    try:
        return Sampling.with_defaults(defaults, **given)
    except BadSetting as e:
        flag = "--" + e.setting.replace("_", "-")
        if given[e.setting] is None:
            raise ValueError(e.as_default(f"give {flag} to override it")) from None
        raise ValueError(f"{flag} must be {e.allowed}, got {e.value!r}") from None


def prompt_ids(tok, text: str, args) -> list[int]:
    """The prompt through the model's chat template (--chat; by default when it has one), or as plain text."""
    if args.chat and tok.template is None:
        raise ValueError("--chat: this model has no chat template; drop --chat to give the prompt as plain text")
    chat = tok.template is not None if args.chat is None else args.chat
    if args.thinking is not None:
        refuse_thinking(tok, "--thinking" if args.thinking else "--no-thinking", chat)
    return tok.chat([{"role": "user", "content": text}], args.thinking is not False) if chat else tok.encode(text)


class Screen:
    """What generate.py prints: on standard output the answer alone (a single sequence streamed as it is
    generated, several each whole at the end), so that `generate.py ... > answer.txt` holds it; the run's
    statistics on standard error."""

    def __init__(self, tok, batch: int):
        self.tok, self.batch, self.printed = tok, batch, ""

    def stream(self, new_ids, last=False):  # print the text decoded so far, past what is already on screen
        out = self.tok.decode(new_ids)
        if out.endswith("\ufffd") and not last:  # half of a multi-byte character: wait for the rest
            return
        print(out[len(self.printed):], end="", flush=True)
        self.printed = out

    def show(self, outs, stats):  # the text (a single sequence has streamed already), then the statistics
        if self.batch == 1:
            self.stream(outs[0], last=True)  # whatever a cut-off character held back
            print(flush=True)  # the answer's last line ends
        else:
            for i, o in enumerate(outs):
                print(f"--- sequence {i} ---\n{self.tok.decode(o)}", flush=True)
        say(stats.line() if parallel.rank() == 0 else None)  # (the other ranks' standard output is closed)


# ---- how a command ends ----------------------------------------------------------------------------------
def run_command(body, memory_error: type[BaseException], memory_advice, interrupted=None):
    """body() as generate.py and bench.py run it, under torchrun on every rank (rank 0 alone prints). Bad input
    (ValueError, FileNotFoundError) is one line and exit status 2, and so is a memory_error (the line
    memory_advice() says); Ctrl-C is interrupted() (default: the line "interrupted") and exit status 130, as on
    a rank whose collective found rank 0 gone at Ctrl-C (quietly); a reader gone ends quietly."""
    if parallel.rank() > 0:  # the other ranks compute the same tokens, or their share of the rows
        sys.stdout = open(os.devnull, "w")
    try:
        body()
        parallel.barrier()
    except (ValueError, FileNotFoundError) as e:
        say(parallel.report(e))
        sys.exit(2)
    except memory_error:
        say(parallel.report(RuntimeError(memory_advice())))
        sys.exit(2)
    except KeyboardInterrupt:
        ignore_further_interrupts()
        (interrupted or say_interrupted)()
        sys.exit(130)
    except RuntimeError as e:
        if not parallel.peer_gone(e):
            raise
        sys.exit(130)
    except BrokenPipeError:
        reader_gone()
    finally:
        parallel.stop()


AS_COMMAND = False  # in a command's own process (run_as_command), not in a Python session that calls its main()


def run_as_command(main):
    """Each command's `if __name__ == "__main__":`: main() in a process of its own. Under torchrun the process
    then ends at once, its output flushed (os._exit): ranks that had finished and left the process group can
    abort in the interpreter's own shutdown ("terminate called without an active exception", SIGABRT; docs/
    performance.md, "Measurements that code comments used to hold"), as PyTorch's gloo threads are known to
    when their last objects go during finalization (pytorch/pytorch#179291)."""
    global AS_COMMAND
    AS_COMMAND = True
    if not parallel.launched():
        return main()
    try:
        main()
        code = 0
    except SystemExit as e:  # the commands exit with a status (an int) or none
        code = e.code or 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def ignore_further_interrupts():
    """Once a Ctrl-C is handled, more while the finished part is written and the process ends are ignored: one
    arriving there (a second key press, or a wrapper signalling the process group too) would be a traceback.
    Only in a command's own process: a notebook that called main() must still be able to interrupt."""
    if AS_COMMAND:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def say_interrupted():
    say("interrupted" if parallel.rank() == 0 else None)
