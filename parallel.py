"""Several processes of one host through torch.distributed (NCCL between GPUs, gloo between CPU processes):
tensor parallel (TP), one model split over the processes, and data parallel (DP), one whole model per
process, each with its share of the prompts. Started by torchrun, which sets RANK, WORLD_SIZE and
LOCAL_RANK:

    torchrun --nproc-per-node 2 generate.py --model Qwen/Qwen3-8B --budget 3200

Tensor parallel, as Megatron-LM splits a transformer: each rank holds H_kv / N of the KV heads with their
query heads (the rows of q/k/v_proj, the columns of o_proj) and 1 / N of the MLP (the rows of gate/up_proj,
the columns of down_proj), so a layer needs one all-reduce (sum) after o_proj and one after down_proj. A
rank keeps the cache slots of its own KV heads. The lm_head is split by vocabulary rows, each rank's starting at a
multiple of 128 (VOCAB_ROWS), and its logits gathered (concatenated: exact); the input embedding is replicated (a step reads only B of its rows, and
splitting it would cost an all-reduce). Rules that decide per layer on the mean over every head (longflow,
tova) average the ranks' per-slot partial scores with one more all-reduce, so that every rank evicts the
same slot; per-KV-head rules need nothing from the other ranks, nor does streaming (the oldest position is
the same in every head).
"""
import datetime
import os
import signal
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

# torch >= 2.12 names it all_gather_single (all_gather_tensor, the same function, is deprecated there)
all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


# each rank's share of the vocabulary starts at a multiple of this: an FP8 LM head's blocks of 128 rows (fp8.py) are
# then each within one rank, quantized as one process quantizes them
VOCAB_ROWS = 128


@dataclass(frozen=True)
class Group:
    """The processes one model is split over (tensor parallel): rank in 0 .. size-1. With size 1 every
    method is the identity, and the model runs as it does without torch.distributed."""
    rank: int = 0
    size: int = 1

    def sum(self, x):
        """x summed over the ranks: a functional all-reduce, which torch.compile traces into the step (and
        NCCL supports inside a CUDA graph's capture)."""
        return x if self.size == 1 else funcol.all_reduce(x, "sum", dist.group.WORLD)

    def mean(self, x):
        """The mean over the ranks of each rank's mean over its own heads: the mean over every head, since
        each rank holds as many."""
        return x if self.size == 1 else self.sum(x) / self.size

    def gather_vocab(self, logits, vocab: int):
        """Each rank's logits [..., part] of its vocabulary rows -> every rank's [..., vocab] (parts padded to
        one length for the all-gather, then cut back)."""
        if self.size == 1:
            return logits
        padded = torch.nn.functional.pad(logits, (0, self.share(vocab, VOCAB_ROWS) - logits.shape[-1]))
        return all_gather(padded.contiguous(), logits.dim() - 1, dist.group.WORLD)[..., :vocab]

    def part(self, n: int, multiple: int = 1) -> slice:
        """This rank's share of n things in a row (the last shares may be shorter or empty; n >= size)."""
        step = self.share(n, multiple)
        return slice(min(n, self.rank * step), min(n, (self.rank + 1) * step))

    def vocab_part(self, vocab: int) -> slice:
        """This rank's rows of the LM head."""
        return self.part(vocab, VOCAB_ROWS)

    def share(self, n: int, multiple: int = 1) -> int:
        """The most of n things a rank holds: n / size rounded up to a multiple of `multiple`."""
        return -(-(-(-n // self.size)) // multiple) * multiple

    def smallest(self, n: int) -> int:
        """The least of every rank's n (host side: batch sizes every rank can hold)."""
        if self.size == 1:
            return n
        t = torch.tensor([n], device=device_of_group())
        dist.all_reduce(t, dist.ReduceOp.MIN)
        return int(t.item())

    def same(self, obj):
        """Rank 0's obj on every rank (a random seed)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def shard(self, cfg):
        """The config of this rank's part of the model: its heads and its share of the MLP (the hidden size
        and the vocabulary stay whole). Refuses sizes that do not split evenly."""
        if self.size == 1:
            return cfg
        for what, n in (("KV heads", cfg.n_kv_heads), ("MLP intermediate size", cfg.intermediate_size)):
            if n % self.size:
                raise ValueError(f"the model's {n} {what} do not split over {self.size} ranks; run with a "
                                 f"tensor-parallel size that divides {n}")
        return replace(cfg, n_heads=cfg.n_heads // self.size, n_kv_heads=cfg.n_kv_heads // self.size,
                       intermediate_size=cfg.intermediate_size // self.size)


SINGLE = Group()


def device_of_group():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def launched() -> bool:
    """Started by torchrun (or anything that sets its variables) with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def start(device: torch.device | None, data_parallel: bool = False) -> torch.device:
    """Join the processes torchrun started (once per process) and return this rank's device: GPU LOCAL_RANK
    or, with device cpu, the CPU. Tensor parallel talks through NCCL between GPUs (gloo between CPU
    processes: for tests and for trying the code path, not for speed), within 30 minutes a collective. Data
    parallel ranks only meet at the end of their work, which may be hours apart: through gloo, without a
    practical time limit. Refuses a GPU index (each rank takes its own) and more ranks than GPUs."""
    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        if device.index is not None:
            raise ValueError(f"under torchrun each rank takes the GPU of its LOCAL_RANK; give --device cuda, not "
                             f"{device}")
        if torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", world)):
            raise ValueError(f"{os.environ.get('LOCAL_WORLD_SIZE', world)} processes on this host but "
                             f"{torch.cuda.device_count()} GPU(s); start at most one process per GPU "
                             f"(torchrun --nproc-per-node {torch.cuda.device_count()})")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        nccl = device.type == "cuda" and not data_parallel
        dist.init_process_group("nccl" if nccl else "gloo", device_id=device if nccl else None,
                                timeout=datetime.timedelta(days=7 if data_parallel else 0, minutes=30))
        if dist.get_rank() > 0:  # Ctrl-C reaches every rank: rank 0 stops and says so, the others stop when
            #                      their next collective finds it gone (see peer_gone)
            signal.signal(signal.SIGINT, lambda *_: INTERRUPTED.append(True))
    return device


INTERRUPTED = []  # on a rank after the first: Ctrl-C has reached it


def peer_gone(e: BaseException) -> bool:
    """A collective failed because rank 0 stopped at Ctrl-C: this rank ends quietly too (exit status 130)."""
    return isinstance(e, RuntimeError) and bool(INTERRUPTED)


def join(device: torch.device | None, data_parallel: bool = False) -> tuple[Group, torch.device | None]:
    """Under torchrun: this rank's device and the group its model is split over, every process (tensor
    parallel) or none (data parallel: a whole model per process, the caller shares out the work); without
    torchrun, SINGLE and the device as given."""
    if not launched():
        return SINGLE, device
    device = start(device, data_parallel)
    return (SINGLE if data_parallel else Group(dist.get_rank(), dist.get_world_size())), device


def rank() -> int:
    """This process's rank (torchrun's RANK until the group is joined); 0 without torchrun."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0")) if launched() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def on_rank0(fn):
    """fn() run by rank 0 alone (reading a file, checking and writing one), its result handed to every rank;
    its ValueError or OSError is raised on every rank (as a ValueError), so that none is left waiting for
    the others."""
    if not dist.is_initialized():
        return fn()
    result = error = None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except (ValueError, OSError) as e:
            error = str(e)
    box = [(result, error)]
    dist.broadcast_object_list(box, src=0)
    result, error = box[0]
    if error is not None:
        raise ValueError(error)
    return result


def report(e: Exception) -> str | None:
    """The line a rank prints for an error that ends it: rank 0 every error; the others none for bad input
    (ValueError, FileNotFoundError: every rank checks the same input, and rank 0 says what is wrong), and
    their own failures (out of memory, say) marked with their rank."""
    if rank() == 0:
        return f"error: {e}"
    if isinstance(e, (ValueError, FileNotFoundError)):
        return None
    return f"error (rank {rank()}): {e}"


def gather(obj) -> list:
    """Every rank's obj, in rank order, on every rank (host side: small results)."""
    if not dist.is_initialized():
        return [obj]
    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, obj)
    return objs


def barrier():
    """Every rank here before any goes on: at the end of a run, before the group is left (a rank that left while
    another still finished its part was seen to abort at exit: "terminate called without an active exception")."""
    if dist.is_initialized():
        dist.barrier()


def stop():
    """Leave the process group at the end of a run (torch warns about a group never destroyed)."""
    if dist.is_initialized():
        dist.destroy_process_group()
