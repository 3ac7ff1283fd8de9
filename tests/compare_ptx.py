"""Whether a change to kernel.py changed the code the GPU runs, checked on a machine without a GPU: the decode
kernel (_attend_kernel) of a revision and of this tree compiled by Triton for Hopper (sm_90), in the
configurations tinyflow launches, their PTX instructions compared (debug line records and labels aside).

    python tests/compare_ptx.py REV        # e.g. HEAD~1; needs triton with its CUDA backend (the pip wheel)

Identical instructions mean identical speed; different ones need the GPU (tests/gpu_compare.sh).
"""
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ("SPLIT", "SELECT", "VALUE_NORM", "HAS_LIMIT", "FP8_KV", "FP16_PRODUCTS")
CONFIGS = {  # Qwen3-8B's shapes (8 KV heads of 4 query heads, head_dim 128), as kernel.py launches them
    "bf16, longflow (select, ||v||_1)": (False, True, True, False, False, False),
    "bf16, longflow, split": (True, True, True, False, False, False),
    "bf16, full cache (limit, split)": (True, False, False, True, False, False),
    "fp8, longflow": (False, True, True, False, True, True),
}
POINTER_TYPES = {"pos_ptr": "i64", "newest_ptr": "i32", "key_ptr": "i64", "limit_ptr": "i64"}


def kernel_module(source: str, name: str):
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def signature(fn, fp8: bool) -> dict:
    types = {}
    for i, name in enumerate(fn.arg_names):
        if i in fn.constexprs:
            types[name] = "constexpr"
        elif name.endswith("_ptr"):
            stored = "u8" if fp8 else "bf16"
            types[name] = "*" + {"q_ptr": "bf16", "out_ptr": "bf16", "k_ptr": stored, "v_ptr": stored,
                                 **POINTER_TYPES}.get(name, "fp32")
        else:
            types[name] = "i32"
    return types


def instructions(module, flags) -> list[str]:
    """The PTX of one configuration, without the debug sections, line records, comments and labels."""
    fn, kernel = module._attend_kernel, dict(zip(FLAGS, flags))
    launch = module.FP8_ATTEND_LAUNCH if kernel["FP8_KV"] else module.ATTEND_LAUNCH[kernel["SELECT"]]
    constants = dict(H_KV=8, G=4, G_PAD=16, D=128, BLOCK_S=64, SCALE=1 / 128 ** 0.5, **kernel)
    compiled = triton.compile(ASTSource(fn, signature(fn, kernel["FP8_KV"]), constexprs=constants),
                              target=GPUTarget("cuda", 90, 32), options=launch)
    ptx = compiled.asm["ptx"].split(".section\t.debug")[0]
    return [line for line in ptx.splitlines() if not re.match(r"\s*(\.loc|\.file|//|\$L__tmp)", line)]


def main(rev: str):
    before = subprocess.run(["git", "show", f"{rev}:kernel.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    old, new = kernel_module(before.stdout, "kernel_before"), kernel_module((ROOT / "kernel.py").read_text(), "kernel_now")
    same = True
    for name, flags in CONFIGS.items():
        a, b = instructions(old, flags), instructions(new, flags)
        differing = sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
        same &= differing == 0
        print(f"{name}: {len(a)} -> {len(b)} PTX lines, {'identical' if differing == 0 else f'{differing} differ'}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/compare_ptx.py REV")
    main(sys.argv[1])
