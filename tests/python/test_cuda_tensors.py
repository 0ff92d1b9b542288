#!/usr/bin/env python3
"""dattn's GPU path from Python under mpiexec (1 and 2 ranks): torch "CUDA" tensors through
autograd on a Runtime(device="cuda"), for ring, Ulysses and hybrid on zigzag and contiguous
layouts, bf16 and fp16, GQA: out, lse, dq, dk, dv against float64 torch autograd and against the
CPU path's, leaves read without a copy, results left in GPU memory, repeated backward calls
bit-identical; the call's work on the tensors' stream, with no host wait; DeviceArray and
to_device for programs without torch; attention_local, KvCache and decode on device arrays; an
empty shard (a null data pointer); and bad input (host
arrays on a GPU Runtime, an interface naming host memory, device tensors on a CPU Runtime, a bad
device=) raised on every rank.

It runs on the CUDA emulation (PYTHONPATH=build/python-emu: dattn._C over the emulated library,
tests/emu), where no torch tensor is a CUDA tensor: there the package's _TorchCuda is replaced by
EmulatedTorchCuda below, whose "CUDA tensors" are CPU torch tensors over the fake runtime's
device memory (a torch tensor autograd makes, such as the gradient of out, is copied there, as
torch's CUDA allocator would have made it on the GPU) and whose current stream is one the fake
runtime made. Everything else (the package's device branch, the binding's
__cuda_array_interface__, the GPU Runtime over NCCL's semantics, the CUDA kernels) is what a GPU
runs. With a CUDA torch and a GPU it runs on torch's own CUDA tensors instead. Exits 77
(skipped) without numpy and torch, or without either.
  PYTHONPATH=build/python-emu bash launch/mpirun.sh -n 2 /usr/bin/python3 \\
      tests/python/test_cuda_tensors.py
"""

import sys
import time
import traceback

try:
    import numpy as np
    import torch
except ImportError as e:  # before dattn: MPI is not started yet, so a plain exit is clean
    print(f"test_cuda_tensors: SKIPPED: {e} (needs numpy and torch)")
    sys.exit(77)

import dattn

RANK, P = dattn.rank(), dattn.world_size()
EMULATED = hasattr(dattn._C, "emulation")
torch.set_num_threads(1)


# ---------------------------------------------------------------- the device, emulated or real

class _HostView:
    """A DeviceArray's memory as numpy sees host memory (on the emulation device memory is host
    memory); holds the array, so that a view keeps it alive."""

    def __init__(self, a):
        i = a.__cuda_array_interface__
        self.array = a
        typestr = "<i2" if i["typestr"] == "<u2" else i["typestr"]  # torch has no uint16
        self.__array_interface__ = {"shape": i["shape"], "typestr": typestr,
                                    "data": i["data"], "version": 3}


def _over(a, dtype):
    """A CPU torch tensor over a DeviceArray's memory, of `dtype` (bf16 from its patterns)."""
    t = torch.from_numpy(np.asarray(_HostView(a)))
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def _upload(t):
    """A DeviceArray copy of CPU tensor t on this rank's GPU (the extension's own copy, whatever
    _TorchCuda is installed)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return dattn._C.to_device((t.view(torch.int16).numpy(), "bf16"), DEVICE_INDEX)
    return dattn._C.to_device((t.numpy(), {torch.float32: "fp32", torch.float16: "fp16"}[t.dtype]),
                              DEVICE_INDEX)


class EmulatedTorchCuda:
    """dattn._TorchCuda on the emulation: every torch tensor passed while it is installed is a
    "CUDA tensor"; one over the fake runtime's device memory goes as it is (zero copy), any other
    is first copied there (counted in `uploads`); results become CPU tensors over their device
    memory; the current stream is `stream`."""

    uploads = 0
    stream_handle = None

    @staticmethod
    def is_device(x):
        return True

    @classmethod
    def view(cls, x, typestr):
        if dattn._C.emulation.is_device_memory(x.data_ptr()):
            return dattn._CudaView(x, typestr)
        cls.uploads += 1
        return _upload(x)

    @classmethod
    def stream(cls, x):
        return cls.stream_handle

    @staticmethod
    def tensor(a):
        return _over(a, torch.float32)


class OnDevice:
    """While installed (a with block), torch tensors are this rank's device tensors: the
    emulation's (EmulatedTorchCuda in the package) or, with a GPU, torch's own."""

    def __enter__(self):
        if EMULATED:
            self.saved = dattn._torch_cuda
            dattn._torch_cuda = EmulatedTorchCuda
        return self

    def __exit__(self, *exc):
        if EMULATED:
            dattn._torch_cuda = self.saved


def to_dev(t):
    """A copy of the CPU tensor t in this rank's GPU memory (a leaf)."""
    if not EMULATED:
        return t.to(DEVICE)
    return _over(_upload(t), t.dtype)


def on_device(t):
    """Whether torch tensor t lies in GPU memory."""
    if not EMULATED:
        return t.is_cuda
    return dattn._C.emulation.is_device_memory(t.data_ptr())


def host(t):
    return t.detach().cpu()


# ---------------------------------------------------------------- the float64 reference

def reference(q, k, v, causal, scale):
    """out [B,S,H,Dv] and lse [B,H,S] of float64 tensors, differentiable by torch autograd."""
    g = q.shape[2] // k.shape[2]
    kx, vx = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kx) * scale
    if causal:
        S = q.shape[1]
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), vx)
    return out, lse


def rel_err(got, ref):
    """max |got - ref| / max |ref|"""
    got, ref = host(got).double(), host(ref).double()
    return float((got - ref).abs().max() / max(ref.abs().max().item(), 1e-30))


# Relative to max |ref|, against float64 of the same rounded inputs: the flash kernel rounds P to
# the input dtype before P V (measured on the emulation at 2 and 4 ranks: out 7.7e-4 bf16,
# 1.3e-4 fp16; dq 1.0e-3 and 4.5e-4); lse comes from fp32 scores. Against the CPU path's
# gradients, which autograd returns rounded to the input dtype: that rounding too (measured
# 2.8e-3 and 5.3e-4).
TOL = {torch.bfloat16: 4e-3, torch.float16: 1e-3}
TOL_CPU = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
TOL_LSE = 1e-4


# ---------------------------------------------------------------- autograd through device tensors

def check_autograd(gpu):
    # Zigzag chunks of about 20 rows: the flash kernel (blocks of up to 16 query rows take the
    # split-KV decode kernel, which the shorter rows of check_device_arrays reach).
    B, S, H, Hkv, D = 1, 40 * P + 3, 2 * P, P, 64
    scale = 1.0 / D ** 0.5
    n = 0
    for dtype in (torch.bfloat16, torch.float16):
        gen = torch.Generator().manual_seed(11)
        q, k, v = (torch.randn(B, S, h, D, generator=gen).to(dtype) for h in (H, Hkv, Hkv))
        dout = torch.randn(B, S, H, D, generator=gen)
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        out_ref, lse_ref = reference(q64, k64, v64, True, scale)
        (out_ref * dout).sum().backward()
        for strategy in ("ring", "ulysses", "hybrid"):
            for layout in ("zigzag", "contiguous"):
                pos = torch.from_numpy(dattn.layout_positions(layout, S))
                kw = dict(causal=True, layout=layout, strategy=strategy)
                name = f"{strategy} {layout} {dtype}"
                # The CPU path on the same shards.
                leaves = [t[:, pos].contiguous().requires_grad_() for t in (q, k, v)]
                cpu_out, cpu_lse = dattn.attention(*leaves, return_lse=True, **kw,
                                                   ulysses_degree=1 if strategy == "hybrid"
                                                   else None)
                (cpu_out * dout[:, pos]).sum().backward()
                # The GPU path: device leaves, autograd, device results.
                with OnDevice():
                    dl = [to_dev(t[:, pos].contiguous()).requires_grad_() for t in (q, k, v)]
                    before = EmulatedTorchCuda.uploads
                    out, lse = dattn.attention(*dl, return_lse=True, runtime=gpu, **kw)
                    assert EmulatedTorchCuda.uploads == before, f"{name}: q, k, v were copied"
                    assert on_device(out) and on_device(lse), f"{name}: results not on the GPU"
                    (out * to_dev(dout[:, pos].contiguous())).sum().backward()
                    # The backward again without autograd: bit-identical gradients.
                    grads = dattn.attention_backward(*(t.detach() for t in dl), out.detach(), lse,
                                                     to_dev(dout[:, pos].contiguous()),
                                                     runtime=gpu, **kw)
                for leaf, g, what in zip(dl, grads, ("dq", "dk", "dv")):
                    assert leaf.grad is not None and leaf.grad.dtype == dtype, f"{name}: {what}"
                    assert torch.equal(host(leaf.grad), host(g).to(dtype)), \
                        f"rank {RANK}: {name}: a repeated backward changed {what}"
                tol = TOL[dtype]
                errs = {"out": rel_err(out, out_ref[:, pos]),
                        "lse": rel_err(lse, lse_ref[:, :, pos]),
                        "dq": rel_err(grads[0], q64.grad[:, pos]),
                        "dk": rel_err(grads[1], k64.grad[:, pos]),
                        "dv": rel_err(grads[2], v64.grad[:, pos])}
                bad = {key: e for key, e in errs.items()
                       if not e <= (TOL_LSE if key == "lse" else tol)}
                assert not bad, f"rank {RANK}: {name}: errors against float64 above {tol}: {bad}"
                # The GPU's gradients against the CPU path's, of the same inputs.
                vs_cpu = {what: rel_err(g, leaf.grad)
                          for what, g, leaf in zip(("dq", "dk", "dv"), grads, leaves)}
                vs_cpu["out"] = rel_err(out, cpu_out)
                bad = {key: e for key, e in vs_cpu.items() if not e <= TOL_CPU[dtype]}
                assert not bad, f"rank {RANK}: {name}: GPU vs CPU path above {TOL_CPU}: {bad}"
                n += 1
        # attention_local (one process; with torch >= 2.4 through dattn's torch.library
        # operators) through autograd on device tensors.
        with OnDevice():
            dl = [to_dev(t).requires_grad_() for t in (q, k, v)]
            out, lse = dattn.attention_local(*dl, causal=True, return_lse=True)
            assert on_device(out) and on_device(lse), f"local {dtype}: results not on the GPU"
            (out * to_dev(dout)).sum().backward()
        errs = {"out": rel_err(out, out_ref), "lse": rel_err(lse, lse_ref),
                "dq": rel_err(dl[0].grad, q64.grad), "dk": rel_err(dl[1].grad, k64.grad),
                "dv": rel_err(dl[2].grad, v64.grad)}
        bad = {key: e for key, e in errs.items() if not e <= (TOL_LSE if key == "lse" else
                                                               TOL_CPU[dtype])}
        assert not bad, f"rank {RANK}: attention_local {dtype} on the GPU: {bad}"
        n += 1
    if RANK == 0:
        print(f"test_cuda_tensors: autograd through device tensors, {n} configurations on {P} "
              f"ranks: out, lse, dq, dk, dv (bf16, fp16) within {tuple(TOL.values())} of float64 "
              f"and {tuple(TOL_CPU.values())} of the CPU path, zero-copy leaves, device results, "
              "repeated backward bit-identical")


# ---------------------------------------------------------------- streams

class _NoStream:
    """A device array whose __cuda_array_interface__ names no stream (a version 2 producer)."""

    def __init__(self, a):
        self.a = a
        self.shape = a.shape
        self.__cuda_array_interface__ = {key: value for key, value in
                                         a.__cuda_array_interface__.items() if key != "stream"}


def check_streams(gpu):
    """A call runs on its tensors' stream: every stream-ordered operation of the forward and the
    backward goes there (none on the legacy default stream) and the host never waits."""
    if not EMULATED:
        return  # the fake runtime's accounting is what shows it
    emu = dattn._C.emulation
    B, S, H, Hkv, D = 1, 29, 2 * P, P, 64
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(B, S, h, D, generator=gen).to(torch.bfloat16)
                     for h in (H, Hkv, Hkv, H))
    pos = torch.from_numpy(dattn.layout_positions("zigzag", S))
    with OnDevice():
        dq, dk, dv, ddout = (to_dev(t[:, pos].contiguous()) for t in (q, k, v, dout))
        ref_out, ref_lse = dattn.attention(dq, dk, dv, causal=True, layout="zigzag", runtime=gpu,
                                           return_lse=True)
        stream = emu.stream_create()
        EmulatedTorchCuda.stream_handle = stream
        try:
            legacy, waits = emu.ops_on(0), emu.device_waits()
            out, lse = dattn.attention(dq, dk, dv, causal=True, layout="zigzag", runtime=gpu,
                                       return_lse=True)
            grads = dattn.attention_backward(dq, dk, dv, out, lse, ddout, causal=True,
                                             layout="zigzag", runtime=gpu)
            ops = emu.ops_on(stream)
            assert ops > 0, f"rank {RANK}: no work on the tensors' stream"
            assert emu.ops_on(0) == legacy, \
                f"rank {RANK}: {emu.ops_on(0) - legacy} operations on the legacy default stream"
            assert emu.device_waits() == waits and emu.waits_on(stream) == 0, \
                f"rank {RANK}: the host waited for the device"
            assert gpu.stream == 0, f"rank {RANK}: the call left the runtime on stream {gpu.stream}"
        finally:
            EmulatedTorchCuda.stream_handle = None
        # The same results as on the default stream.
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse), f"rank {RANK}: streams"
        assert all(on_device(g) for g in grads)
    # A Runtime made with stream= runs arrays whose interface names no stream on it; a
    # DeviceArray names its own (to_device's: the legacy default stream), which the call runs on.
    s2 = emu.stream_create()
    rt2 = dattn.Runtime(device="cuda", stream=s2)
    assert rt2.stream == s2, f"rank {RANK}: Runtime.stream {rt2.stream} != {s2}"
    arrays = [dattn.to_device(t[:, pos].contiguous()) for t in (q, k, v)]
    assert all(x.__cuda_array_interface__["stream"] == 1 for x in arrays)
    before = emu.ops_on(s2)
    _ = dattn.attention(*arrays, causal=True, layout="zigzag", runtime=rt2)
    assert emu.ops_on(s2) == before, \
        f"rank {RANK}: a call ran on the Runtime's stream, not on its arrays' stream"
    a = [_NoStream(x) for x in arrays]
    got = dattn.attention(*a, causal=True, layout="zigzag", runtime=rt2)
    assert emu.ops_on(s2) > before, f"rank {RANK}: the Runtime's stream got no work"
    assert np.array_equal(got.to_host(), ref_out.numpy()), f"rank {RANK}: Runtime stream result"
    if RANK == 0:
        print(f"test_cuda_tensors: streams: {ops} operations on the tensors' stream, none on the "
              "legacy default stream, no host wait; Runtime(stream=) honoured")


# ---------------------------------------------------------------- device arrays without torch

def check_device_arrays(gpu):
    """dattn.to_device and DeviceArray: forward and backward on a GPU Runtime from numpy inputs
    copied to the GPU, results as DeviceArrays whose to_host() matches the CPU path; and
    attention_local on device arrays."""
    B, S, H, Hkv, D = 2, 23, 2 * P, P, 64
    rng = np.random.default_rng(3 + RANK)
    q, k, v, dout = (rng.standard_normal((B, S, h, D)).astype(np.float16) for h in (H, Hkv, Hkv, H))
    a = [dattn.to_device(x, DEVICE_INDEX) for x in (q, k, v, dout)]
    for x, d in zip(a, (q, k, v, dout)):
        i = x.__cuda_array_interface__
        assert isinstance(x, dattn.DeviceArray) and x.device == DEVICE_INDEX and x.dtype == "fp16"
        assert i["shape"] == d.shape and i["typestr"] == "<f2" and i["version"] == 3
        assert np.array_equal(x.to_host(), d)
    out, lse = dattn.attention(*a[:3], causal=True, runtime=gpu, return_lse=True)
    assert isinstance(out, dattn.DeviceArray) and out.shape == (B, S, H, D)
    cpu_out, cpu_lse = dattn.attention(q, k, v, causal=True, return_lse=True)
    assert rel_err(torch.from_numpy(out.to_host()), torch.from_numpy(cpu_out)) <= TOL[torch.float16]
    assert np.abs(lse.to_host() - cpu_lse).max() <= 1e-3, f"rank {RANK}: lse"
    grads = dattn.attention_backward(*a[:3], out, lse, a[3], causal=True, runtime=gpu)
    cpu_grads = dattn.attention_backward(q, k, v, cpu_out, cpu_lse, dout, causal=True)
    for g, c, what in zip(grads, cpu_grads, ("dq", "dk", "dv")):
        assert isinstance(g, dattn.DeviceArray), f"rank {RANK}: {what} {type(g)}"
        e = rel_err(torch.from_numpy(g.to_host()), torch.from_numpy(c))
        assert e <= TOL[torch.float16], f"rank {RANK}: DeviceArray {what}: {e}"
    # attention_local (one process, no Runtime) on device arrays, forward and backward.
    lo, ll = dattn.attention_local(*a[:3], causal=True, return_lse=True)
    ref, rl = dattn.attention_local(q, k, v, causal=True, return_lse=True)
    assert isinstance(lo, dattn.DeviceArray)
    assert rel_err(torch.from_numpy(lo.to_host()), torch.from_numpy(ref)) <= TOL[torch.float16]
    lg = dattn.attention_local_backward(*a[:3], lo, ll, a[3], causal=True)
    rg = dattn.attention_local_backward(q, k, v, ref, rl, dout, causal=True)
    for g, c in zip(lg, rg):
        assert rel_err(torch.from_numpy(g.to_host()), torch.from_numpy(c)) <= TOL[torch.float16]
    # A KvCache on the GPU, prefilled and appended from device arrays, and a decode step.
    caches = [dattn.KvCache(H, Hkv, D, B, "fp16", S + 1, runtime=r) for r in (gpu, None)]
    qn, kn, vn = (rng.standard_normal((B, 1, h, D)).astype(np.float16) for h in (H, Hkv, Hkv))
    for c, put in zip(caches, (lambda x: dattn.to_device(x, DEVICE_INDEX), lambda x: x)):
        c.prefill(put(k), put(v))
        c.append(put(np.ascontiguousarray(np.broadcast_to(kn, kn.shape))),
                 put(np.ascontiguousarray(vn)))
    for strategy in ("tree", "ring", "allgather"):
        got, got_lse = dattn.decode(dattn.to_device(qn, DEVICE_INDEX), caches[0],
                                    strategy=strategy, return_lse=True)
        want, want_lse = dattn.decode(qn, caches[1], strategy=strategy, return_lse=True)
        assert isinstance(got, dattn.DeviceArray), f"rank {RANK}: decode {type(got)}"
        e = rel_err(torch.from_numpy(got.to_host()), torch.from_numpy(want))
        assert e <= TOL[torch.float16], f"rank {RANK}: decode {strategy} on the GPU: {e}"
        assert np.abs(got_lse.to_host() - want_lse).max() <= 1e-3, f"rank {RANK}: decode lse"
    if RANK == 0:
        print("test_cuda_tensors: DeviceArray and to_device: attention, attention_backward, "
              "attention_local(_backward), KvCache and decode on a GPU match the CPU path")


class _Null:
    """An empty device array as torch gives one: data pointer 0 (no memory to point into)."""

    def __init__(self, shape):
        self.shape = shape
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<f2", "data": (0, False),
                                         "version": 3}


def check_empty_shard(gpu):
    """P - 1 tokens on P ranks: the last rank's shard is empty, its arrays null pointers (taken
    as the Runtime's device); every rank's result matches the CPU path."""
    S = max(P - 1, 1)
    pos = dattn.layout_positions("contiguous", S)
    x = np.random.default_rng(9).standard_normal((1, S, 2, 64)).astype(np.float16)
    mine = np.ascontiguousarray(x[:, pos])
    dev = _Null(mine.shape) if mine.shape[1] == 0 else dattn.to_device(mine, DEVICE_INDEX)
    out, lse = dattn.attention(dev, dev, dev, causal=True, runtime=gpu, return_lse=True)
    ref, ref_lse = dattn.attention(mine, mine, mine, causal=True, return_lse=True)
    assert out.shape == ref.shape and lse.shape == ref_lse.shape, f"rank {RANK}: {out.shape}"
    assert np.abs(out.to_host() - ref).max(initial=0) <= 1e-3, f"rank {RANK}: empty-shard out"
    if RANK == 0:
        empty = ", the last rank's shard empty," if P > 1 else ""
        print(f"test_cuda_tensors: {S} tokens on {P} ranks{empty} match the CPU path")


# ---------------------------------------------------------------- bad input

def expect_error(fn, cls, words, what):
    try:
        fn()
    except cls as e:
        for w in words:
            assert w in str(e), f"rank {RANK}: {what}: {w!r} not in {e}"
        return
    raise AssertionError(f"rank {RANK}: {what}: no {cls.__name__}")


class _HostInterface:
    """An object whose __cuda_array_interface__ names host memory (a bug in its producer)."""

    def __init__(self, a):
        self.a = a
        self.shape = a.shape
        self.__cuda_array_interface__ = {"shape": a.shape, "typestr": "<f2",
                                         "data": (a.ctypes.data, False), "version": 3}


def check_bad_input(gpu):
    B, S, H, D = 1, 8, P, 64
    x = np.zeros((B, S, H, D), np.float16)
    d = dattn.to_device(x, DEVICE_INDEX)
    # Host arrays on a GPU Runtime: rejected on every rank, naming the tensor and the device.
    expect_error(lambda: dattn.attention(x, x, x, runtime=gpu), dattn.InvalidArgumentError,
                 ["q device", "cuda"], "host arrays on a GPU Runtime")
    # An interface naming host memory as GPU memory.
    expect_error(lambda: dattn.attention(_HostInterface(x), d, d, runtime=gpu),
                 dattn.InvalidArgumentError, ["q data", "GPU memory"], "host memory as device")
    # Device arrays on the default (CPU) runtime.
    expect_error(lambda: dattn.attention(d, d, d), dattn.InvalidArgumentError,
                 ["q device", "cpu", 'Runtime(device="cuda")'], "device arrays on a CPU Runtime")
    expect_error(lambda: dattn.attention(d, d, d, runtime=dattn.Runtime()),
                 dattn.InvalidArgumentError, ["q device", "cpu"], "device arrays, CPU Runtime=")
    # A bad device.
    expect_error(lambda: dattn.Runtime(device="gpu"), dattn.InvalidArgumentError,
                 ["device", "'gpu'"], "device='gpu'")
    expect_error(lambda: dattn.Runtime(device="cuda:99"), dattn.InvalidArgumentError,
                 ["device", "cuda:99"], "device='cuda:99'")
    if RANK == 0:
        print("test_cuda_tensors: bad input raised on every rank")


def main():
    global DEVICE, DEVICE_INDEX
    t0 = time.time()
    if not EMULATED and not torch.cuda.is_available():
        if RANK == 0:
            print("test_cuda_tensors: SKIPPED: neither the CUDA emulation's module nor a GPU")
        dattn.finalize()
        sys.exit(77)
    gpu = dattn.Runtime(device="cuda")
    DEVICE = torch.device(gpu.device)
    DEVICE_INDEX = DEVICE.index
    if RANK == 0:
        print(f"test_cuda_tensors: dattn from {dattn.__file__} ({'emulated' if EMULATED else 'GPU'}"
              f"), torch {torch.__version__}; {gpu}")
    check_autograd(gpu)
    check_streams(gpu)
    check_device_arrays(gpu)
    check_empty_shard(gpu)
    check_bad_input(gpu)
    if RANK == 0:
        print(f"test_cuda_tensors: all passed on {P} ranks in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except BaseException:  # noqa: B902 - any failure on any rank ends the whole job
        sys.stderr.write(f"test_cuda_tensors: FAILED on rank {RANK} of {P}:\n"
                         f"{traceback.format_exc()}")
        sys.stderr.flush()
        dattn.abort(1)
