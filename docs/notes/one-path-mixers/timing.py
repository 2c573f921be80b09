"""Eager CPU training-step time (forward, backward, AdamW step) of two source trees, interleaved in one run.

Usage: python docs/notes/one-path-mixers/timing.py BEFORE_ROOT AFTER_ROOT [repeats] [steps] [variants] [vocab]
``variants`` is a comma-separated list (default: the six below), ``vocab`` the vocabulary size (default: the preset's).
Each tree is imported in its own subprocess (PYTHONPATH=root); the parent alternates between them step group by step
group, so load on the shared machine hits both sides alike. Shape: preset small, batch 8, seq 256, float32 (the
defaults of harness/benchmarks/benchmark.py's ``bench``).
"""

import json
import os
import statistics
import subprocess
import sys
import time

ARGS = [a for a in sys.argv[1:] if a != "--child"]  # the child is started with the parent's arguments
VARIANTS = ARGS[4].split(",") if len(ARGS) > 4 else ["preln", "hc", "mhc", "attnres", "attnres-block", "denseformer"]
BATCH, SEQ = 8, 256


def child():
    import torch
    import torch.nn.functional as F

    from harness import build_model, model_preset

    cfg = model_preset("small", **({"vocab_size": int(ARGS[5])} if len(ARGS) > 5 else {}))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(cfg.vocab_size, (BATCH, SEQ + 1), generator=gen)
    idx, targets = tokens[:, :-1], tokens[:, 1:]
    steps = {}
    for name in VARIANTS:
        torch.manual_seed(0)
        model = build_model(cfg, name).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, opt=opt):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
            loss.backward()
            opt.step()

        step()  # warm-up: allocator, optimizer state
        steps[name] = step
    print(json.dumps({"ready": torch.__version__, "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        name, n = line.split()
        start = time.perf_counter()
        for _ in range(int(n)):
            steps[name]()
        print(json.dumps({"s": (time.perf_counter() - start) / int(n)}), flush=True)


def main():
    before, after = ARGS[0], ARGS[1]
    repeats = int(ARGS[2]) if len(ARGS) > 2 else 5
    n = ARGS[3] if len(ARGS) > 3 else "2"
    procs = {}
    for side, root in (("before", before), ("after", after)):
        env = {**os.environ, "PYTHONPATH": root}
        procs[side] = subprocess.Popen(
            [sys.executable, __file__, "--child", *sys.argv[1:]],
            cwd=root,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        print(side, procs[side].stdout.readline().strip(), flush=True)
    times = {(s, v): [] for s in procs for v in VARIANTS}
    for r in range(repeats):
        sides = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for v in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            for s in sides:
                procs[s].stdin.write(f"{v} {n}\n")
                procs[s].stdin.flush()
                times[(s, v)].append(json.loads(procs[s].stdout.readline())["s"])
                print(json.dumps({"repeat": r, "side": s, "variant": v, "s": times[(s, v)][-1]}), flush=True)
        print(f"repeat {r + 1}/{repeats}", flush=True)
    for p in procs.values():
        p.stdin.close()
        p.wait()
    print("| variant | before (s/step) | after (s/step) | after / before | median of paired ratios |")
    print("|---|---|---|---|---|")
    for v in VARIANTS:
        b, a = statistics.median(times[("before", v)]), statistics.median(times[("after", v)])
        paired = statistics.median(x / y for x, y in zip(times[("after", v)], times[("before", v)]))
        print(f"| {v} | {b:.2f} | {a:.2f} | {a / b:.2f} | {paired:.2f} |")
    print(json.dumps({f"{s}:{v}": t for (s, v), t in times.items()}))


if __name__ == "__main__":
    child() if "--child" in sys.argv else main()
