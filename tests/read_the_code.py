"""The sizes README.md's "Read the code" gives, measured: the lines of one decode step end to end, and of
each engine file.

    python tests/read_the_code.py        # prints the README's two tables
    python tests/read_the_code.py --write   # puts them into README.md

One decode step with the default policy (LongFlow), in reading order: the batch loop, the step, the model,
the cache, the policy, the kernel's PyTorch reference (the Triton kernel computes the same), sampling.
A function's lines are all of them, its docstring and comments included: what a reader reads.
"""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ["generate.py", "step.py", "sampling.py", "memory.py", "model.py", "cache.py", "policies.py", "kernel.py",
          "tinyflow.py"]
DECODE_STEP = [  # (file, the functions and classes read, in order)
    ("generate.py", ["Engine._run", "Engine._read_block", "Engine._keep_block"]),
    ("step.py", ["Stepper.__call__", "Stepper.step", "run_block", "advance", "push"]),
    ("model.py", ["Transformer.forward", "Transformer.run", "Block.forward", "RMSNorm.forward", "Attention.forward", "rotate",
                  "MLP.forward"]),
    ("cache.py", ["KVCache.decode", "KVCache.as_stored", "KVCache.stored_tensors", "KVCache.attention"]),
    ("policies.py", ["LongFlow", "KernelPolicy.attend", "PerSlot.write", "value_l1"]),
    ("kernel.py", ["decode_attention_ref", "choose_slot", "protected_mask", "l1_norm"]),
    ("sampling.py", ["Sampler.pick", "apply_penalty", "sample", "uniform_noise"]),
]


def definitions(path: Path) -> dict[str, ast.AST]:
    """Every function and class of a file by its qualified name (Class.method)."""
    found = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found[prefix + child.name] = child
                visit(child, prefix + child.name + ".")
    visit(ast.parse(path.read_text()), "")
    return found


def lines(node, source: list[str], own_only=False) -> int:
    """Non-blank lines of a definition (decorators included); own_only: a class without its methods."""
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    taken = set(range(start, node.end_lineno + 1))
    if own_only:
        for child in node.body:
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                taken -= set(range(min([child.lineno] + [d.lineno for d in child.decorator_list]),
                                   child.end_lineno + 1))
    return sum(1 for i in taken if source[i - 1].strip())


def decode_step_table() -> tuple[str, int, tuple[int, str]]:
    rows, total, longest = [], 0, (0, "")
    for file, names in DECODE_STEP:
        path = ROOT / file
        defs, source = definitions(path), path.read_text().splitlines()
        missing = [n for n in names if n not in defs]
        if missing:
            sys.exit(f"{file} has no {', '.join(missing)}: update DECODE_STEP in {Path(__file__).name}")
        counts = [lines(defs[n], source, own_only=isinstance(defs[n], ast.ClassDef)) for n in names]
        longest = max(longest, *zip(counts, [f"{file} {n}" for n in names]))
        rows.append(f"| `{file}` | {', '.join(f'`{n}`' for n in names)} | {sum(counts)} |")
        total += sum(counts)
    table = "\n".join(["| file | read, in order | lines |", "|---|---|---|", *rows, f"| | total | {total} |"])
    return table, total, longest


def file_table() -> str:
    rows = []
    for file in ENGINE:
        path = ROOT / file
        source = path.read_text().splitlines()
        functions = [(lines(n, source), name) for name, n in definitions(path).items()
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        n, name = max(functions)
        rows.append(f"| `{file}` | {len(source)} | {len(functions)} | {n} (`{name}`) |")
    return "\n".join(["| file | lines | functions | the longest |", "|---|---|---|---|", *rows])


def tables() -> str:
    step, total, (n, name) = decode_step_table()
    return f"{step}\n\nThe longest function on that path: {n} lines ({name}).\n\n{file_table()}"


def write_readme():
    """Put the tables into README.md between its sizes markers."""
    readme = ROOT / "README.md"
    text, opening, closing = readme.read_text(), "<!-- sizes: python tests/read_the_code.py -->\n", "<!-- /sizes -->"
    start, end = text.index(opening) + len(opening), text.index(closing)
    readme.write_text(text[:start] + tables() + "\n" + text[end:])


if __name__ == "__main__":
    write_readme() if sys.argv[1:] == ["--write"] else print(tables())
