"""Decisions every replica must take alike are taken from what all the processes saw: two CPU processes on gloo.

LDM-RLS's precision guard reads the smallest whitening margin of its own process's batch. Decided from one
process alone, a trip would switch that replica to float64 and withhold its update while the others apply theirs,
and the replicas would drift apart (and a sharded run's next collectives would no longer match).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch


def _guard(rank: int, world: int, rendezvous: str, margins: list[float], out: str) -> None:
    import torch.distributed as dist

    import variants
    from harness.training.sharding import least_over_ranks

    # A file rendezvous: no port to race for with whatever else runs on the machine.
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        mixer = variants.build("ldm-rls(groups=2)", d_model=32, n_layers=2)
        mixer.margin.fill_(margins[rank])
        note = mixer.step_checks(least_over_ranks)
        again = mixer.step_checks(least_over_ranks)  # the minimum starts over after each step's check
        result = {"note": note, "again": again, "whiten_dtype": str(mixer.whiten_dtype)}
        Path(out, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tripped", [None, 0, 1])
def test_one_process_tripping_the_ldm_rls_guard_switches_every_process(tmp_path, rng_seed, tripped):
    rng = random.Random(rng_seed)
    margins = [rng.uniform(1.01, 100.0) for _ in range(2)]  # in units of the floor: 1 and above keep their digits
    if tripped is not None:
        margins[tripped] = rng.uniform(0.01, 0.99)
    torch.multiprocessing.spawn(_guard, args=(2, str(tmp_path / "rendezvous"), margins, str(tmp_path)), nprocs=2)
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]

    assert all(r["again"] is None for r in results)
    if tripped is None:
        assert all(r["note"] is None and r["whiten_dtype"] == "torch.float32" for r in results), results
        return
    worst = float(torch.tensor(margins[tripped]))  # as the float32 margin holds it
    for r in results:
        assert r["whiten_dtype"] == "torch.float64", results
        assert r["note"].startswith(f"a whitening margin of LDM-RLS fell to {worst:.2g} of its floor"), results
