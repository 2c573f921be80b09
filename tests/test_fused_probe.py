"""The fused-kernel probe's C++ loops compute what the fast paths compute, checked against float64 brute force, and
the probe refuses to time a kernel that disagrees with the eager operators."""

import shutil

import pytest
import torch

from harness.benchmarks import fused_probe
from harness.errors import DepthmemError

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="the probe builds C++ kernels and needs g++")


@pytest.fixture(scope="module")
def kernels():
    return fused_probe.kernels()  # built on first use: about a minute on two cores, then cached


@pytest.mark.parametrize("argv", [["--tokens", "0"], ["--depth", "x"], ["--repeats", "-3"]])
def test_bad_sizes_end_with_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        fused_probe.main(argv)
    assert exit_info.value.code == 2
    assert "expected an integer of at least 1" in capsys.readouterr().err


def test_a_failed_build_is_one_plain_sentence(monkeypatch):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr("torch.utils.cpp_extension.load_inline", no_compiler)
    with pytest.raises(SystemExit) as exit_info:
        fused_probe.main(["--tokens", "8"])
    message = str(exit_info.value.code)
    assert message.startswith("depthmem: the fused-kernel probe could not build its C++ kernels")
    assert "Ninja is required" in message and "needs g++ with OpenMP" in message


@needs_compiler
@pytest.mark.slow
@pytest.mark.parametrize("m, with_partial", [(1, False), (3, True), (5, False)])
def test_read_kernels_equal_the_weighted_sum_and_its_gradients(kernels, m, with_partial, rng_seed):
    n, sources, d = 37, 6, 24
    blocks = torch.randn(n, sources, d)
    partial, da = torch.randn(n, d), torch.randn(n, d)
    p = torch.softmax(torch.randn(n, m + with_partial), -1)
    dblocks0 = torch.randn(n, sources + 1, d)  # the rows already hold earlier readers' shares

    dblocks = dblocks0.clone()
    a = kernels.read_forward(p, blocks, m, partial if with_partial else None)
    dp = kernels.read_backward(da, p, blocks, m, dblocks, partial if with_partial else None)

    src = blocks[:, :m].double()
    if with_partial:
        src = torch.cat([src, partial[:, None].double()], 1)
    want_a = torch.einsum("ns,nsd->nd", p.double(), src)
    want_dp = torch.einsum("nsd,nd->ns", src, da.double())
    want_rows = dblocks0.double()
    want_rows[:, : src.shape[1]] += p.double()[:, :, None] * da.double()[:, None, :]
    torch.testing.assert_close(a.double(), want_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dp.double(), want_dp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dblocks.double(), want_rows, rtol=1e-5, atol=1e-5)


@needs_compiler
@pytest.mark.slow
def test_write_kernels_equal_the_stream_write_and_its_gradients(kernels, rng_seed):
    n, streams, d = 29, 4, 40
    res, X = torch.randn(n, streams, streams, dtype=torch.float64), torch.randn(n, streams, d, dtype=torch.float64)
    post, v = torch.randn(n, streams, dtype=torch.float64), torch.randn(n, d, dtype=torch.float64)
    dY = torch.randn(n, streams, d, dtype=torch.float64)
    inputs = [t.requires_grad_() for t in (res, X, post, v)]
    Y = torch.einsum("njk,nkd->njd", res, X) + post[:, :, None] * v[:, None, :]
    want = [Y.detach()] + list(torch.autograd.grad(Y, inputs, dY))

    f32 = [t.detach().float() for t in inputs]
    got = [kernels.write_forward(*f32)] + list(kernels.write_backward(dY.float(), *f32))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)


@needs_compiler
@pytest.mark.slow
def test_probe_times_both_operations_and_refuses_a_kernel_that_disagrees(kernels, rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    sizes = dict(tokens=64, width=32, repeats=1, gen=gen)
    row = fused_probe.block_reads(kernels, depth=8, block_size=4, **sizes)
    assert row["operation"] == "block AttnRes reads" and row["eager_ms"] > 0 and row["fused_ms"] > 0
    assert fused_probe.stream_write(kernels, streams=4, **sizes)["fused_ms"] > 0

    class Off:  # the same kernels, with the forward read off by one part in 10⁴
        def __getattr__(self, name):
            return getattr(kernels, name)

        def read_forward(self, *args):
            return kernels.read_forward(*args) * (1 + 1e-4)

    with pytest.raises(DepthmemError, match="differs from the eager one"):
        fused_probe.block_reads(Off(), depth=8, block_size=4, **sizes)
