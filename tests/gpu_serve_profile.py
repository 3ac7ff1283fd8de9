"""On a GPU (issue 27): where the server's engine thread spends each host sync under load. server.py runs in this
process with timers put around the engine loop's parts from here (server.py and generate.py are not changed).
Once the server stops (SIGINT), it writes every sync's times to OUT.json and prints, for each window of time in
the marks file (lines `label start end`, seconds since the epoch; `bash tests/gpu_ladder.sh serve-profile`
writes it), the mean per sync:

  rows      the step's size (the ladder's, holding the busy rows)
  cycle     wall time from one block's launch to the next, per step (16 steps a block), less `idle` and the
            start-up
  gpu       the GPU's time from the block's first step's start to its last one's end, per step (CUDA events)
  enqueue   the host's time launching the 16 steps (graph replays), in all
  idle      waiting for a request while no row is busy
  arrive    taking new requests, emptying the free rows' caches (while the block before runs)
  prefill   the host queuing the prefill of new requests into free rows (its GPU time is in `wait`)
  prefilled the requests prefilled (in all, not per sync)
  prefill_gpu  the GPU's time from the prefill's start (after the block) to its end (CUDA events), in `wait`
  wait      the host sync: until the block before and the prefill are done and its tokens on the host
  keep      handing each busy row's tokens to its request (and to its client's queue)
  start     the new requests' first tokens, handed over; their rows made busy
  compact   moving busy rows down into free rows
  rest      the cycle's time not in the parts above
A record's `wait` and `keep` are the block before's; its `rows`, `gpu` and `enqueue` the block it launches.

    python tests/gpu_serve_profile.py OUT.json MARKS -- SERVER_OPTIONS...
"""
import json
import os
import statistics
import sys
import threading
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import generate  # noqa: E402
import server  # noqa: E402
import step  # noqa: E402

CUDA = torch.cuda.is_available()
SYNCS = []  # one dict per host sync of the engine thread
current = defaultdict(float)  # the sync being timed


def timed(part: str, fn):
    """fn, its time added to the current sync's `part` (the engine thread's calls only)."""
    def wrapper(*args, **kwargs):
        if threading.current_thread().name != "engine":
            return fn(*args, **kwargs)
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            current[part] += time.perf_counter() - t
            current[part + "_end"] = time.perf_counter()
    return wrapper


def stepper_call(original):
    """The graph replays: their launch time, and CUDA events around the sync's first and last step."""
    def call(self):
        if not current["steps"]:
            current["events"] = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if CUDA else None
            current["rows"] = self.size
            if CUDA:
                current["events"][0].record()
        timed("enqueue", original)(self)
        current["steps"] += 1
        if CUDA:
            current["events"][1].record()
    return call


def arrivals(original):
    """Feed.arrivals, its time while no row is busy (it waits for a request) counted as `idle`."""
    def arrive(self, idle: bool):
        return timed("idle", original)(self, idle) if idle else original(self, idle)
    return arrive


def starting(original):
    """Engine._start_rows, after the sync: the requests it starts, and their prefill's GPU time (DeviceTimer)."""
    def start(self, requests, serving, admitted, run):
        current["prefilled"] += len(admitted.rows)
        current["prefill_gpu"] += admitted.timer.seconds() if admitted.timer else 0.0
        return original(self, requests, serving, admitted, run)
    return start


def serve(original):
    """Engine.serve, each sync from its yield to the next one a record (the first from the end of _prepare)."""
    def run(self, *args, **kwargs):
        start = None
        for _ in original(self, *args, **kwargs):
            now = time.perf_counter()
            if current["steps"]:
                record = {k: v for k, v in current.items() if not k.endswith("_end") and k != "events"}
                record.update(at=time.time(), events=current["events"],
                              cycle=now - (start if start is not None else current.get("prepare_end", now))
                              - current["idle"],
                              arrive=current["arrive"] - current["idle"])
                SYNCS.append(record)
            current.clear()
            start = now
            yield
    return run


def summary(syncs: list, label: str) -> str:
    if not syncs:
        return f"{label}: no host sync"
    mean = lambda key: statistics.fmean(s.get(key, 0.0) for s in syncs)
    parts = ["enqueue", "arrive", "prefill", "wait", "keep", "start", "compact"]  # the cycle's, idle left out
    rest = mean("cycle") - sum(mean(p) for p in parts)
    per_step = lambda key: mean(key) / mean("steps") * 1e3
    prefilled = sum(s.get("prefilled", 0) for s in syncs)
    per_request = sum(s.get("prefill_gpu", 0.0) for s in syncs) / max(1, prefilled) * 1e3
    return (f"{label}: {len(syncs)} syncs, rows {mean('rows'):.1f}, cycle {per_step('cycle'):.2f} ms/step, "
            f"gpu {per_step('gpu'):.2f} ms/step; per sync (ms): idle {mean('idle') * 1e3:.2f}, "
            + ", ".join(f"{p} {mean(p) * 1e3:.2f}" for p in parts) + f", rest {rest * 1e3:.2f}; "
            f"{prefilled:.0f} prefilled, their prefill's GPU time {per_request:.2f} ms a request")


def main():
    out, marks = sys.argv[1], sys.argv[2]
    generate.Engine.serve = serve(generate.Engine.serve)
    generate.Engine._read_block = timed("wait", generate.Engine._read_block)
    generate.Engine._keep_block = timed("keep", generate.Engine._keep_block)
    generate.Engine._start_rows = timed("start", starting(generate.Engine._start_rows))
    generate.Engine._take_arrivals = timed("arrive", generate.Engine._take_arrivals)
    generate.Engine._fill_free_rows = timed("prefill", generate.Engine._fill_free_rows)
    generate.Engine._compact = timed("compact", generate.Engine._compact)
    generate.Engine._prepare = timed("prepare", generate.Engine._prepare)
    generate.Engine._compile_prefill = timed("prepare", generate.Engine._compile_prefill)  # start-up, not a cycle
    server.Feed.arrivals = arrivals(server.Feed.arrivals)
    step.Stepper.__call__ = stepper_call(step.Stepper.__call__)
    try:
        server.main(sys.argv[sys.argv.index("--") + 1:])
    except SystemExit:
        pass
    if CUDA:
        torch.cuda.synchronize()
    for s in SYNCS:  # on the CPU (a dry run of this script) the steps ran as they were launched
        events = s.pop("events")
        s["gpu"] = events[0].elapsed_time(events[1]) / 1e3 if events else 0.0
    with open(out, "w") as f:
        json.dump(SYNCS, f)
    windows = [line.split() for line in open(marks)] if os.path.exists(marks) else [["all", "0", "inf"]]
    for label, start, end in windows:
        print(summary([s for s in SYNCS if float(start) <= s["at"] <= float(end)], label), flush=True)


if __name__ == "__main__":
    main()
