"""bench.py --contend N: the same runs with N busy-looping processes beside them, as on a machine
shared with other work. Each busy process is a Python loop that never sleeps, in a process group of
its own, killed afterwards."""

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from benchmarks.compare import kill_group


@contextmanager
def busy_processes(n: int) -> Iterator[None]:
    """`n` processes that each keep one CPU busy while the block runs."""
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(n)
    ]
    try:
        yield
    finally:
        for proc in procs:
            kill_group(proc.pid)
            proc.wait()


def print_table(quiet: list[dict], busy: list[dict], n: int) -> None:
    """Each engine's output tok/s quiet and beside n busy processes, the share it kept, and
    nanovllm's ratio to each engine under contention."""
    ours = busy[0]
    print(f"\nbeside {n} busy process(es):")
    rows = [["engine", "quiet tok/s", "busy tok/s", "kept", "nanovllm / engine (busy)"]]
    for q, b in zip(quiet, busy):
        if "ok" not in (q["status"], b["status"]) or q["status"] != b["status"]:
            rows.append([q["engine"], q["status"], b["status"], "", ""])
            continue
        ratio = ours["output_tok_s"] / b["output_tok_s"] if ours["status"] == "ok" else None
        rows.append(
            [
                q["engine"],
                f"{q['output_tok_s']:.1f}",
                f"{b['output_tok_s']:.1f}",
                f"{b['output_tok_s'] / q['output_tok_s']:.0%}",
                f"{ratio:.2f}x" if ratio else "",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
