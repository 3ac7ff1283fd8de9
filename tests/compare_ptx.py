"""Whether a change to kernel.py changed the code the GPU runs, checked on a machine without a GPU: the decode
kernel (_attend_kernel) of a revision and of this tree compiled by Triton for Hopper (sm_90), their PTX
instructions compared (debug line records and labels aside).

    python tests/compare_ptx.py REV        # e.g. HEAD~1; needs triton with its CUDA backend (the pip wheel)

It also counts the instructions of the loop over slots in each (loop_length), and gives each kernel's shared
memory and registers a thread (ptxas from Triton's wheel): what decides how many programs an SM holds.

What it compiles: each configuration of CONFIGS with kernel.py's launch options, at Qwen3-8B's shapes (8 KV
heads of 4 query heads, head_dim 128) and SLOTS slots a row, from the arguments _decode_attention_op passes:
their dtypes (its fp32 stand-in for a buffer a configuration does not use), and the launch-time specialisation
Triton gives them (its JIT, and inductor for the compiled step, alike): every pointer 16-byte aligned (as torch
allocates), each integer argument equal to 1 (the innermost strides) a constant, the others marked divisible
by 16 where they are (every one, at SLOTS = 3200).
What it does not: other shapes (rows of slots not a multiple of 16 give pos's and the scales' strides
that are not, so other code), views with unaligned offsets, _finish_kernel, other GPUs, and what ptxas makes
of the PTX. Identical instructions mean identical speed in these launches; different ones need the GPU
(tests/gpu_compare.sh).
"""
import difflib
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
FLAGS = ("SPLIT", "SELECT", "VALUE_NORM", "HAS_LIMIT", "FP8_KV", "FP16_PRODUCTS", "GIVEN")
H_KV, G, D, SLOTS = 8, 4, 128, 3200  # Qwen3-8B's KV heads, query heads per KV head and head_dim; longflow:3200
CONSTANTS = dict(H_KV=H_KV, G=G, G_PAD=16, D=D, BLOCK_S=64, SCALE=1 / D ** 0.5, HALF_PAD=D // 2)  # as kernel.py launches them
CONFIGS = {
    "bf16, longflow (select, ||v||_1)": (False, True, True, False, False, False, False),
    "bf16, longflow, split": (True, True, True, False, False, False, False),
    "bf16, full cache (limit, split)": (True, False, False, True, False, False, False),
    "fp8, longflow": (False, True, True, False, True, True, False),
    "bf16, triattention (select, a given query)": (False, True, False, False, False, False, True),
}


def kernel_module(source: str, name: str):
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pointer_type(name: str, kernel: dict) -> str:
    """The dtype of what _decode_attention_op passes as pointer `name`, or of its fp32 stand-in `unused`
    where the configuration leaves that buffer alone."""
    stored = "u8" if kernel["FP8_KV"] else "bf16"
    types = {"q_ptr": "bf16", "out_ptr": "bf16", "k_ptr": stored, "v_ptr": stored, "pos_ptr": "i32",
             "newest_ptr": "i32", "key_ptr": "i64", "limit_ptr": "i64"}
    used = {"newest_ptr": kernel["SELECT"], "limit_ptr": kernel["HAS_LIMIT"]}.get(name, True)
    return "*" + (types.get(name, "fp32") if used else "fp32")


def int_values(kernel: dict) -> dict:
    """The integer arguments of one launch, from contiguous q [B, H_q, D], k and v [B, H_kv, S, D], and pos,
    ||v||_1 and the scales [B, H_kv, S]; 0 for the strides of a buffer the configuration leaves alone."""
    row = {"b": H_KV * SLOTS, "h": SLOTS, "s": 1}
    cache = {"b": H_KV * SLOTS * D, "h": SLOTS * D, "s": D, "d": 1}
    none = dict.fromkeys("bhs", 0)
    strides = {"q": {"b": H_KV * G * D, "h": D, "d": 1}, "k": cache, "v": cache, "p": row,
               "n": row if kernel["VALUE_NORM"] else none, "s": row if kernel["FP8_KV"] else none}
    # chunk: whole blocks of 64 slots per split, a multiple of 16 whatever the split (only that is compiled in)
    return {"S": SLOTS, "chunk": 64 * triton.cdiv(SLOTS, 64),
            **{f"s{t}_{axis}": x for t, axes in strides.items() for axis, x in axes.items()}}


def specialised(fn, kernel: dict) -> tuple[dict, dict, dict]:
    """Signature, constants and attributes as Triton specialises the launch (runtime/jit.py, and inductor's
    config_of): an integer 1 becomes a constant, pointers and multiples of 16 get tt.divisibility 16."""
    ints = int_values(kernel)
    signature, attrs = {}, {}
    constants = {name: x for name, x in dict(CONSTANTS, **kernel).items() if name in fn.arg_names}  # (a flag
    # a revision's kernel does not take, such as VALUE_NORM since ||v||_1 moved to the finish kernel, is left out)
    for i, name in enumerate(fn.arg_names):
        if i in fn.constexprs:
            signature[name] = "constexpr"
        elif ints.get(name) == 1:
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = pointer_type(name, kernel) if name.endswith("_ptr") else "i32"
            if name.endswith("_ptr") or ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constants, attrs


def compiled(module, flags):
    """One configuration compiled for sm_90 with its launch options (Triton's CompiledKernel)."""
    fn, kernel = module._attend_kernel, dict(zip(FLAGS, flags))
    launch = module.FP8_ATTEND_LAUNCH if kernel["FP8_KV"] else getattr(module, "GIVEN_ATTEND_LAUNCH", None) \
        if kernel["GIVEN"] else module.ATTEND_LAUNCH[kernel["SELECT"]]
    signature, constants, attrs = specialised(fn, kernel)
    return triton.compile(ASTSource(fn, signature, constexprs=constants, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=launch)


def instructions(kernel) -> list[str]:
    """A compiled kernel's PTX, without the debug sections, line records, comments and labels."""
    ptx = kernel.asm["ptx"].split(".section\t.debug")[0]
    return [line for line in ptx.splitlines() if not re.match(r"\s*(\.loc|\.file|//|\$L__tmp)", line)]


def resources(kernel) -> str:
    """Shared memory and registers a thread, from ptxas -v (the first of Triton's that reads this PTX's version)."""
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(kernel.asm["ptx"])
        for ptxas in (bin_dir / "ptxas", bin_dir / "ptxas-blackwell"):
            run = subprocess.run([ptxas, "-arch=sm_90a", "-v", "k.ptx", "-o", "k.cubin"], cwd=tmp,
                                 capture_output=True, text=True) if ptxas.exists() else None
            if run and (registers := re.search(r"Used (\d+) registers", run.stderr)):
                return f"{kernel.metadata.shared} B shared, {registers.group(1)} registers"
    return f"{kernel.metadata.shared} B shared"


def loop_length(lines: list[str]) -> int:
    """Instructions in the kernel's longest loop (the one over the slots: per thread, a block of slots), from its
    label to the last branch back to it: a hint of a change's speed before the GPU, not a measure of it
    (docs/performance.md, "Then, fewer instructions a logit")."""
    labels = {line.split(":")[0]: i for i, line in enumerate(lines) if re.match(r"\$L__BB\w+:", line)}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\w+);", line)) and labels.get(m.group(1), i) < i]
    if not loops:
        return 0
    first, last = max(loops, key=lambda span: span[1] - span[0])
    return sum(1 for line in lines[first + 1:last + 1] if re.match(r"\s*[@a-z]", line))  # no label, brace, .directive


def main(rev: str):
    before = subprocess.run(["git", "show", f"{rev}:kernel.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    old, new = kernel_module(before.stdout, "kernel_before"), kernel_module((ROOT / "kernel.py").read_text(), "kernel_now")
    same = True
    for name, flags in CONFIGS.items():
        ka, kb = compiled(old, flags), compiled(new, flags)
        a, b = instructions(ka), instructions(kb)
        # lines added or removed count once, and shift nothing after them (a new argument's .param line)
        differing = sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(
            None, a, b, autojunk=False).get_opcodes() if tag != "equal")
        same &= differing == 0
        print(f"{name}: {len(a)} -> {len(b)} PTX lines, {'identical' if differing == 0 else f'{differing} differ'}; "
              f"the loop over slots {loop_length(a)} -> {loop_length(b)} instructions; {resources(ka)} -> {resources(kb)}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/compare_ptx.py REV")
    main(sys.argv[1])
