"""The fused CPU kernels (ops/cpu_kernels.c): against few-line float64 oracles, and when they run.

Skipped only where no C compiler is on PATH; with one, a kernel that does not build fails here.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from diff_transformer.attention import Linear, apply_rope, rms_norm
from diff_transformer.ops import cpu_kernels, diff_attention
from diff_transformer.ops.cpu_kernels import (
    ENV_SWITCH,
    cpu_decode_diff_attention,
    cpu_decode_diff_attention_packed,
    cpu_linear,
    cpu_rms_norm,
    cpu_rms_norm_backward,
    cpu_rope,
    decode_applies,
    kernel_error,
    linear_applies,
    rms_norm_applies,
    rms_norm_training_applies,
    rope_applies,
    rope_training_applies,
)
from diff_transformer.ops.decode import decode_diff_attention_packed

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler on PATH: the kernels cannot be built"
)


def test_kernels_build():
    assert kernel_error() is None


def oracle_diff_decode(q1, q2, k1, k2, v, lam, mask, scale):
    """float64, one head at a time: (softmax(q1·k1ᵀ) − λ softmax(q2·k2ᵀ)) v over the visible keys."""
    b, h, _, d = q1.shape
    hkv = k1.shape[1]
    lam = lam.double().expand(h)
    out = torch.empty(b, h, 1, 2 * d, dtype=torch.float64)
    for i in range(b):
        for j in range(h):
            g = j // (h // hkv)
            seen = torch.ones(k1.shape[2], dtype=torch.bool) if mask is None else mask.expand(b, h, 1, -1)[i, j, 0]
            l1 = (k1[i, g].double() @ q1[i, j, 0].double()) * scale
            l2 = (k2[i, g].double() @ q2[i, j, 0].double()) * scale
            p1 = torch.softmax(l1.masked_fill(~seen, float("-inf")), 0)
            p2 = torch.softmax(l2.masked_fill(~seen, float("-inf")), 0)
            out[i, j, 0] = (p1 - lam[j] * p2) @ v[i, g].double()
    return out


def decode_inputs(b, h, hkv, s, d, *, lam_per_head, spare=0):
    """Queries as the model makes them (a transposed view), keys/values as the filled prefix of a
    longer cache buffer (strided views), as decoding passes them."""
    q1, q2 = (torch.randn(b, 1, h, d).transpose(1, 2) for _ in range(2))
    k1, k2 = (torch.randn(b, hkv, s + spare, d)[:, :, :s] for _ in range(2))
    v = torch.randn(b, hkv, s + spare, 2 * d)[:, :, :s]
    lam = torch.rand(h) + 0.2 if lam_per_head else torch.tensor(0.6)
    return q1, q2, k1, k2, v, lam


def masks(b, h, s):
    padding = torch.ones(b, 1, 1, s, dtype=torch.bool)
    padding[0, ..., : s // 2] = False  # sequence 0 left-padded
    per_head = torch.rand(b, h, 1, s) < 0.6
    per_head[..., -1] = True  # every row keeps a key
    static = torch.zeros(1, 1, 1, s, dtype=torch.bool)
    static[..., : max(1, s - 3)] = True  # a static cache: the end of the buffer not yet written
    return {"none": None, "padding": padding, "per-head": per_head, "static": static}


@pytest.mark.parametrize("h, hkv", [(3, 3), (4, 2), (6, 1)], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("lam_per_head", [False, True], ids=["lam0d", "lam-per-head"])
@pytest.mark.parametrize("mask", ["none", "padding", "per-head", "static"])
@pytest.mark.parametrize("s, d", [(1, 16), (37, 32), (300, 64)])
def test_decode_kernel_matches_oracle(h, hkv, lam_per_head, mask, s, d):
    torch.manual_seed(s + d + h)
    inputs = decode_inputs(3, h, hkv, s, d, lam_per_head=lam_per_head, spare=5)
    attn_mask = masks(3, h, s)[mask]
    if s == 1 and attn_mask is not None:
        attn_mask = attn_mask | True  # a single key must stay visible
    want = oracle_diff_decode(*inputs, attn_mask, d**-0.5)
    assert decode_applies(inputs[-1], *inputs[:-1])
    got = cpu_decode_diff_attention(*inputs, attn_mask=attn_mask)
    assert got.shape == (3, h, 1, 2 * d) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("h, hkv", [(3, 3), (4, 2)], ids=["mha", "gqa2"])
@pytest.mark.parametrize("mask", ["none", "padding"])
def test_packed_decode_kernel_reads_the_model_layout(h, hkv, mask):
    """Interleaved sub-heads (Q1, Q2 of head h at 2h, 2h+1) read in place, with a custom scale."""
    torch.manual_seed(h)
    q1, q2, k1, k2, v, lam = decode_inputs(2, h, hkv, 50, 32, lam_per_head=True)
    q = torch.stack([q1, q2], dim=2).flatten(1, 2).transpose(1, 2).contiguous().transpose(1, 2)  # (B, 2H, 1, d) view
    buffer = torch.zeros(2, 2 * hkv, 64, 32)
    buffer[:, :, :50] = torch.stack([k1, k2], dim=2).flatten(1, 2)
    k = buffer[:, :, :50]  # the cache's filled prefix
    attn_mask = masks(2, h, 50)[mask]
    want = oracle_diff_decode(q1, q2, k1, k2, v, lam, attn_mask, 0.3)
    got = cpu_decode_diff_attention_packed(q, k, v, lam, attn_mask=attn_mask, scale=0.3)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)


def test_decode_backend_uses_the_kernel_only_where_it_applies(monkeypatch):
    """No gradient wanted: the kernel; gradients wanted, or the switch off: the PyTorch path,
    which gives the same output (and the gradients)."""
    calls = []
    kernel = cpu_kernels._decode
    monkeypatch.setattr(cpu_kernels, "_decode", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    inputs = decode_inputs(2, 4, 2, 20, 16, lam_per_head=True)
    with torch.no_grad():
        fused = diff_attention(*inputs, backend="decode")
    assert len(calls) == 1
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert not decode_applies(inputs[-1], *inputs[:-1])
    plain = diff_attention(*inputs, backend="decode")
    monkeypatch.delenv(ENV_SWITCH)
    leaves = [x.detach().requires_grad_() for x in inputs]
    out = diff_attention(*leaves, backend="decode")
    assert len(calls) == 1 and out.requires_grad
    out.sum().backward()
    assert all(x.grad is not None for x in leaves)
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.detach(), plain, atol=1e-5, rtol=1e-5)
    assert not decode_applies(inputs[-1], *(x.double() for x in inputs[:-1]))  # fp32 only


def test_packed_pytorch_path_matches_oracle(monkeypatch):
    """The reference the kernel replaces (decode.py) still computes the same thing."""
    monkeypatch.setenv(ENV_SWITCH, "0")
    q1, q2, k1, k2, v, lam = decode_inputs(2, 4, 2, 29, 16, lam_per_head=True)
    q, k = torch.stack([q1, q2], dim=2).flatten(1, 2), torch.stack([k1, k2], dim=2).flatten(1, 2)
    attn_mask = masks(2, 4, 29)["padding"]
    got = decode_diff_attention_packed(q, k, v, lam, attn_mask=attn_mask)
    torch.testing.assert_close(got.double(), oracle_diff_decode(q1, q2, k1, k2, v, lam, attn_mask, 0.25), atol=2e-5, rtol=1e-4)


def oracle_rms_norm(x, weight, eps):
    x = x.double()
    out = x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps)
    return out if weight is None else out * weight.double()


@pytest.mark.parametrize(
    "shape", [(8, 1, 192), (8, 3, 1, 64), (2, 300, 256), (5,)], ids=["decode-step", "head-norm", "threaded", "one-row"]
)
@pytest.mark.parametrize("weighted", [True, False], ids=["weight", "no-weight"])
def test_rms_norm_kernel_matches_oracle(shape, weighted):
    x = torch.randn(shape) * 3 + 1
    weight = torch.randn(shape[-1]) if weighted else None
    assert rms_norm_applies(x, weight)
    got = cpu_rms_norm(x, weight, 1e-5)
    assert got.shape == x.shape
    torch.testing.assert_close(got.double(), oracle_rms_norm(x, weight, 1e-5), atol=1e-5, rtol=1e-5)


def test_rms_norm_kernel_reads_strided_rows():
    """Rows of a wider buffer (one stride apart): read in place; rows that are not: PyTorch."""
    buffer = torch.randn(4, 6, 100)
    x, weight = buffer[..., :64], torch.randn(64)
    assert rms_norm_applies(x, weight)
    torch.testing.assert_close(cpu_rms_norm(x, weight, 1e-6).double(), oracle_rms_norm(x, weight, 1e-6), atol=1e-5, rtol=1e-5)
    scattered = buffer.transpose(0, 1)[..., :64]  # (6, 4, 64): no single row stride
    assert not rms_norm_applies(scattered, weight)
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(scattered, weight, 1e-6).double(), oracle_rms_norm(scattered, weight, 1e-6), atol=1e-5, rtol=1e-5)


def test_rms_norm_uses_the_kernel_without_gradients_and_inside_the_training_function(monkeypatch):
    calls = []
    kernel = cpu_kernels.cpu_rms_norm
    monkeypatch.setattr("diff_transformer.attention.cpu_rms_norm", lambda *a: calls.append(1) or kernel(*a))
    x, weight = torch.randn(4, 32), torch.randn(32, requires_grad=True)
    with torch.no_grad():
        rms_norm(x, weight, 1e-5)
    assert len(calls) == 1
    assert not rms_norm_applies(x, weight)  # a gradient wanted: not the bare kernel ...
    out = rms_norm(x, weight, 1e-5)  # ... but the training function, whose forward is the kernel
    out.sum().backward()
    assert len(calls) == 2 and weight.grad is not None
    assert not rms_norm_applies(x.half(), None) and not rms_norm_applies(x, weight.double())


def oracle_rms_norm_grads(x, weight, grad, eps):
    """float64 autograd through the formula: the gradients of x and weight."""
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    oracle_rms_norm(x64, w64, eps).backward(grad.double())
    return x64.grad, w64.grad


@pytest.mark.parametrize(
    "shape, grad_layout",
    [
        ((8, 256, 192), "contiguous"),  # a block's norm at tiny, batch 8: threaded
        ((8, 3, 256, 64), "transposed"),  # the DIFF head norm: its gradient comes back through o_proj's reshape
        ((3, 5, 7), "contiguous"),  # 15 rows: fewer than the grad_w slices
        ((130, 24), "every-other-row"),  # rows of the gradient two strides apart
    ],
)
def test_rms_norm_training_kernels_match_oracle(shape, grad_layout):
    """Forward and both gradients of ``rms_norm`` trained through the kernels, against float64."""
    x = (torch.randn(shape) * 3 + 1).requires_grad_()
    weight = torch.empty(shape[-1]).uniform_(0.5, 1.5).requires_grad_()
    grad = torch.randn(shape)
    if grad_layout == "transposed":
        grad = grad.transpose(1, 2).contiguous().transpose(1, 2)
    elif grad_layout == "every-other-row":
        grad = torch.randn(shape[0] * 2, shape[1])[::2]
    assert rms_norm_training_applies(x, weight)
    out = rms_norm(x, weight, 1e-5)
    out.backward(grad)
    torch.testing.assert_close(out.double(), oracle_rms_norm(x.detach(), weight.detach(), 1e-5), atol=1e-5, rtol=1e-5)
    grad_x, grad_w = oracle_rms_norm_grads(x, weight, grad, 1e-5)
    torch.testing.assert_close(x.grad.double(), grad_x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight.grad.double(), grad_w, atol=1e-4, rtol=1e-5)


def test_rms_norm_backward_kernel_reads_strided_rows_and_refuses_a_wrong_grad():
    buffer = torch.randn(40, 100)
    x, weight, grad = buffer[:, :64], torch.randn(64), torch.randn(40, 64)
    grad_x, grad_w = cpu_rms_norm_backward(x, weight, grad, 1e-6)
    want_x, want_w = oracle_rms_norm_grads(x, weight, grad, 1e-6)
    torch.testing.assert_close(grad_x.double(), want_x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad_w.double(), want_w, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match=r"grad must have x's shape \(40, 64\), got \(40, 63\)"):
        cpu_rms_norm_backward(x, weight, grad[:, :63], 1e-6)


def test_rms_norm_weight_gradient_does_not_depend_on_the_thread_count():
    """grad_w is summed over fixed slices of the rows, not per thread: the same bits on 1 and 2 threads."""
    x, weight, grad = torch.randn(1000, 192), torch.randn(192), torch.randn(1000, 192)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_rms_norm_backward(x, weight, grad, 1e-5)
        torch.set_num_threads(2)
        two = cpu_rms_norm_backward(x, weight, grad, 1e-5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_rms_norm_trains_through_the_kernels_in_fp32_with_a_weight_only(monkeypatch):
    calls = []
    backward = cpu_kernels.cpu_rms_norm_backward
    monkeypatch.setattr("diff_transformer.attention.cpu_rms_norm_backward", lambda *a: calls.append(1) or backward(*a))
    x, weight = torch.randn(4, 32, requires_grad=True), torch.randn(32, requires_grad=True)
    rms_norm(x, weight, 1e-5).sum().backward()
    assert len(calls) == 1 and x.grad is not None and weight.grad is not None
    assert not rms_norm_training_applies(x, None)  # no weight: F.rms_norm's own autograd
    assert not rms_norm_training_applies(x.double(), weight.double())  # float64: the PyTorch reference
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert not rms_norm_training_applies(x, weight)
    rms_norm(x, weight, 1e-5).sum().backward()
    assert len(calls) == 1


def oracle_rope(x, positions, theta):
    """float64 from the definition: pair i of the row at position p turned by p·θ^(−2i/d)."""
    d = x.shape[-1]
    angle = positions.double()[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (T, d/2)
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]  # (T, 1, d/2) against x's (B, T, n, d/2)
    re, im = x.double()[..., 0::2], x.double()[..., 1::2]
    return torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1).flatten(-2)


def rope_table(positions, d, theta):
    """The model's (T, d/2, 2) table of cos, sin, computed here from the definition."""
    angle = positions.double()[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    return torch.stack([angle.cos(), angle.sin()], dim=-1).float()


@pytest.mark.parametrize(
    "b, t, n, d, start", [(8, 1, 6, 32, 200), (2, 37, 3, 64, 0), (8, 256, 6, 32, 5)], ids=["decode-step", "prefill", "threaded"]
)
def test_rope_kernel_matches_oracle(b, t, n, d, start):
    """x as the model passes it: the heads of a projection's output, a view with a row stride
    wider than n·d (q, k and v come out of one buffer here)."""
    qkv = torch.randn(b, t, 3 * n * d)
    x = qkv.unflatten(-1, (3, n, d))[:, :, 1]  # (B, T, n, d), rows 3·n·d apart
    positions = torch.arange(start, start + t)
    table = rope_table(positions, d, 10000.0)
    assert rope_applies(x, table)
    got = cpu_rope(x, table)
    assert got.shape == x.shape and got.transpose(1, 2).is_contiguous()  # laid out (B, n, T, d) for the attention
    torch.testing.assert_close(got.double(), oracle_rope(x, positions, 10000.0), atol=2e-5, rtol=1e-5)
    back = cpu_rope(x, table, inverse=True)  # turned back: by the opposite angles, contiguous (a projection's gradient)
    assert back.shape == x.shape and back.is_contiguous()
    torch.testing.assert_close(back.double(), oracle_rope(x, -positions, 10000.0), atol=2e-5, rtol=1e-5)


def test_rope_runs_on_the_kernel_with_and_without_gradients(monkeypatch):
    """apply_rope hands fp32 CPU calls to the kernel: without gradients one call, in training one
    forward and one backward (turned back); output and x's gradient agree with the oracle, and
    with the PyTorch path (kernels off). A table of the wrong shape is named in the error."""
    calls = []
    kernel = cpu_kernels.cpu_rope
    monkeypatch.setattr("diff_transformer.attention.cpu_rope", lambda *a, **k: calls.append(k) or kernel(*a, **k))
    x, positions = torch.randn(2, 5, 3, 16, requires_grad=True), torch.arange(7, 12)
    table = rope_table(positions, 16, 500.0)
    with torch.no_grad():
        fused = apply_rope(x, table)
    assert calls == [{}]
    assert rope_training_applies(x, table) and not rope_applies(x, table)
    grad = torch.randn(2, 3, 5, 16).transpose(1, 2)  # as the attention hands it back: (B, n, T, d) memory
    trained = apply_rope(x, table)
    trained.backward(grad)
    assert calls == [{}, {}, {"inverse": True}]
    for out in (fused, trained):
        torch.testing.assert_close(out.detach().double(), oracle_rope(x.detach(), positions, 500.0), atol=2e-5, rtol=1e-5)
    # d(rotate x)/dx applied to a gradient: the gradient turned back by the same angles
    torch.testing.assert_close(x.grad.double(), oracle_rope(grad, -positions, 500.0), atol=2e-5, rtol=1e-5)
    kernel_grad, x.grad = x.grad, None
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert not rope_training_applies(x, table)
    apply_rope(x, table).backward(grad)  # the PyTorch reference path
    assert len(calls) == 3
    torch.testing.assert_close(kernel_grad, x.grad, atol=1e-6, rtol=1e-6)
    assert not rope_applies(x.detach().half(), table) and not rope_applies(x.detach(), table.double())
    with pytest.raises(ValueError, match=r"rope must be \(T, d/2, 2\) = \(5, 8, 2\)"):
        cpu_rope(x.detach(), table[:4])


@pytest.mark.parametrize(
    "rows, width, outs",
    [(1, 192, 192), (8, 192, 512), (7, 37, 9), (2, 512, 8192), (3, 8, 1)],
    ids=["one-row", "decode-step", "odd-tails", "lm-head", "single-output"],
)
def test_linear_kernel_matches_oracle(rows, width, outs):
    """Rows of a wider buffer (one stride apart, as a slice of a projection's output), sizes that
    leave tails: width not a multiple of 8, outputs not of 4, an odd number of rows."""
    x = torch.randn(rows, 1, width + 5)[..., 2 : 2 + width]
    weight = torch.randn(outs, width)
    assert linear_applies(x, weight)
    got = cpu_linear(x, weight)
    assert got.shape == (rows, 1, outs) and got.is_contiguous()
    oracle = torch.einsum("rti,oi->rto", x.double(), weight.double())
    torch.testing.assert_close(got.double(), oracle, atol=1e-5 * width**0.5, rtol=1e-5)


def test_linear_uses_the_kernel_for_few_rows_without_gradients_only(monkeypatch):
    """Linear hands at most LINEAR_MAX_ROWS rows without gradients to the kernel; more rows,
    training, a bias or half precision take F.linear. Same results either way."""
    calls = []
    kernel = cpu_kernels.cpu_linear
    monkeypatch.setattr("diff_transformer.attention.cpu_linear", lambda *a: calls.append(a[0].shape) or kernel(*a))
    layer = Linear(24, 40, bias=False)
    few, many = torch.randn(cpu_kernels.LINEAR_MAX_ROWS, 1, 24), torch.randn(cpu_kernels.LINEAR_MAX_ROWS + 1, 24)
    with torch.no_grad():
        for x in (few, many):
            torch.testing.assert_close(layer(x).double(), x.double() @ layer.weight.double().t(), atol=1e-5, rtol=1e-5)
        assert calls == [few.shape]
        biased = Linear(24, 40)
        torch.testing.assert_close(biased(few), few @ biased.weight.t() + biased.bias, atol=1e-5, rtol=1e-5)
        assert not linear_applies(few.half(), layer.weight.half())
    layer(few).sum().backward()  # training: F.linear and autograd
    assert len(calls) == 1 and layer.weight.grad is not None
    assert set(layer.state_dict()) == {"weight"}  # an nn.Linear's state dict, as checkpoints hold it


@pytest.mark.parametrize("compiler", ["no-such-compiler-xyz", "false"], ids=["missing", "failing"])
def test_without_a_working_compiler_the_pytorch_path_runs(compiler, monkeypatch, tmp_path):
    """No compiler: an error string, no warning; a compiler that fails: one warning naming it.
    Either way decoding, RMSNorm (and its training), RoPE and Linear fall back to PyTorch with the
    same results."""
    monkeypatch.setattr(cpu_kernels, "_state", {})  # as if never built in this process
    monkeypatch.setenv("CC", compiler)
    monkeypatch.setenv("DIFF_TRANSFORMER_CACHE", str(tmp_path))  # no earlier build to reuse
    if compiler == "false":
        with pytest.warns(UserWarning, match="did not build.*false"):
            error = kernel_error()
    else:
        error = kernel_error()
        assert "no C compiler" in error and compiler in error
    assert error and "not built" in cpu_kernels.kernels_status()
    inputs = decode_inputs(2, 4, 2, 9, 16, lam_per_head=True)
    assert not decode_applies(inputs[-1], *inputs[:-1])
    got = diff_attention(*inputs, backend="decode")
    torch.testing.assert_close(got.double(), oracle_diff_decode(*inputs, None, 0.25), atol=2e-5, rtol=1e-4)
    x = torch.randn(3, 8)
    assert not rms_norm_applies(x, None)
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x, None, 1e-5).double(), oracle_rms_norm(x, None, 1e-5), atol=1e-5, rtol=1e-5)
    rows, positions = torch.randn(2, 4, 3, 16), torch.arange(4)
    table = rope_table(positions, 16, 10000.0)
    assert not rope_applies(rows, table)
    with torch.no_grad():
        torch.testing.assert_close(apply_rope(rows, table).double(), oracle_rope(rows, positions, 10000.0), atol=2e-5, rtol=1e-5)
    layer = Linear(8, 5, bias=False)
    assert not linear_applies(x, layer.weight)
    with torch.no_grad():
        torch.testing.assert_close(layer(x).double(), x.double() @ layer.weight.double().t(), atol=1e-5, rtol=1e-5)
    trained, weight = x.clone().requires_grad_(), torch.randn(8, requires_grad=True)
    assert not rms_norm_training_applies(trained, weight)
    grad = torch.randn(3, 8)
    rms_norm(trained, weight, 1e-5).backward(grad)
    want_x, want_w = oracle_rms_norm_grads(x, weight, grad, 1e-5)
    torch.testing.assert_close(trained.grad.double(), want_x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight.grad.double(), want_w, atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match="not available"):
        cpu_rms_norm(x, None, 1e-5)
