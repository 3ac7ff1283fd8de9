"""One rank of a tensor-parallel run on CPU processes (gloo), started by tests/test_parallel.py through
torchrun: `python -m torch.distributed.run --nproc-per-node 2 tests/tp_worker.py OUT FOLDER@WEIGHTS...` (every
checkpoint in one run: torchrun, torch and the process group start once). For checkpoint I, each rank writes
what the test compares with one process (OUT.I.RANK, a torch.save file): the bytes it read from the
safetensors files and the bytes of its parameters, the teacher-forced log-probabilities of the full cache,
and for every policy the greedy tokens and the positions its cache holds at the end."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cli  # noqa: E402
import model as model_module  # noqa: E402
import parallel  # noqa: E402
import tinyflow  # noqa: E402

PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 8, "Hello world, hello tinyflow! " * 10]
CONTINUATIONS = ["Please reason step by step.", "What is 2 + 3? The answer is 5."]
# Every policy but knorm: it ranks by key norms, which RoPE leaves equal for a repeated token (greedy decoding
# on these random weights repeats tokens), so its ties fall on the last bit of k, and a rank's smaller q/k/v
# matrix product rounds differently from the whole one's
RUNS = [("longflow", "snapkv"), ("longflow", "decode"), ("longflow-head", "snapkv"), ("tova", "decode"),
        ("h2o", "snapkv"), ("vatp", "decode"), ("streaming", "snapkv"), ("keydiff", "decode"), ("rkv", "decode"),
        ("random", "decode"), ("longflow-ema", "decode"), ("snapkv-decode", "snapkv"), ("lazy", "decode"),
        ("triattention", "decode")]  # its statistics: each rank reads its heads' (the test's cache folder)
# what splitting the heads could change is in the policy, not the architecture: the first checkpoint (Qwen3,
# GQA) runs every policy, the others one of each kind (the kernel's per layer and per head, accumulated, keys)
FEW_RUNS = [("longflow", "snapkv"), ("longflow-head", "snapkv"), ("h2o", "snapkv"), ("keydiff", "decode"),
            ("random", "decode")]  # random: it numbers the KV heads across ranks, which Qwen2's 2 per rank can show
BUDGET, NEW_TOKENS = 64, 24  # prompts of 90-100 tokens: compressed, then evicting at every step


def runs(llm, every_policy: bool) -> dict:
    """For each (policy, prompt compression) of RUNS (or FEW_RUNS): the greedy tokens and each layer's final
    slot positions."""
    done = {}
    for policy, rule in RUNS if every_policy else FEW_RUNS:
        llm.set_policy(BUDGET, policy, prompt_compression=rule)
        outs = llm.generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        done[policy, rule] = dict(tokens=[o.token_ids for o in outs],
                                  pos=[layer.pos.clone() for layer in llm.engine.cache.layers])
    return done


def full_cache(llm) -> dict:
    llm.set_policy(None)
    scores = llm.score(PROMPTS, CONTINUATIONS)
    outs = llm.generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return dict(logprobs=[s.logprobs for s in scores], tokens=[o.token_ids for o in outs])


class Counted:
    """A safetensors file whose reads are counted (get_tensor, and the slices of get_slice)."""

    def __init__(self, f, read: list):
        self.f, self.read = f, read

    def __enter__(self):
        self.f = self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_tensor(self, name):
        t = self.f.get_tensor(name)
        self.read.append(t.nbytes)
        return t

    def get_slice(self, name):
        return CountedSlice(self.f.get_slice(name), self.read)


class CountedSlice:
    def __init__(self, s, read: list):
        self.s, self.read = s, read

    def get_shape(self):
        return self.s.get_shape()

    def __getitem__(self, at):
        t = self.s[at]
        self.read.append(t.nbytes)
        return t


def main(out: str, *checkpoints: str):
    """checkpoints: each FOLDER@WEIGHTS (LLM's weights: auto, or fp8 to quantize them at load)."""
    for i, checkpoint in enumerate(checkpoints):
        folder, _, weights = checkpoint.rpartition("@")
        read = []
        opener = model_module.safe_open
        model_module.safe_open = lambda *a, **k: Counted(opener(*a, **k), read)
        llm = tinyflow.LLM(folder, device="cpu", compile=False, weights=weights)
        model_module.safe_open = opener
        result = dict(read=sum(read), params=sum(p.nbytes for p in llm.model.parameters()),
                      kv_heads=llm.model.cfg.n_kv_heads, **full_cache(llm),
                      runs=runs(llm, every_policy=i == 0))
        torch.save(result, f"{out}.{i}.{parallel.rank()}")
    parallel.stop()


if __name__ == "__main__":  # ended as the commands end under torchrun (cli.run_as_command: gloo's shutdown abort)
    cli.run_as_command(lambda: main(*sys.argv[1:]))
