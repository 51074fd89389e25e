"""The fused Triton kernel (backend "triton") against the fp32 reference.

Without CUDA the kernels run in Triton's interpreter (conftest.py sets TRITON_INTERPRET=1 before
they are decorated): slow, so the shapes are small, but the lengths are not multiples of the
interpreter's 16-wide blocks and span several of them. The GPU class runs only with CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from diff_transformer import ops  # noqa: E402
from diff_transformer.config import ModelConfig  # noqa: E402
from diff_transformer.model import LanguageModel  # noqa: E402
from diff_transformer.ops import diff_attention, resolve_backend  # noqa: E402

pytestmark = pytest.mark.gpu  # every case runs on the GPU when there is one (scripts/gpu_check.sh selects them)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(
    DEVICE == "cpu" and not INTERPRETED, reason="no CUDA and TRITON_INTERPRET is not 1"
)


def make_inputs(b, h, hkv, t, s, d, *, dtype=torch.float32, lam_per_head=False, device=DEVICE):
    """q1, q2 (B, H, T, d), k1, k2 (B, Hkv, S, d), v (B, Hkv, S, 2d), λ; all requiring grad."""
    q1, q2 = (torch.randn(b, h, t, d, device=device, dtype=dtype) for _ in range(2))
    k1, k2 = (torch.randn(b, hkv, s, d, device=device, dtype=dtype) for _ in range(2))
    v = torch.randn(b, hkv, s, 2 * d, device=device, dtype=dtype)
    lam = torch.rand(h, device=device) + 0.2 if lam_per_head else torch.tensor(0.7, device=device)
    return [x.requires_grad_() for x in (q1, q2, k1, k2, v, lam)]


def forward_backward(inputs, backend, causal, grad_out, *, upcast=False):
    """Output and the gradients of (q1, q2, k1, k2, v, λ); ``upcast`` runs on fp32 copies."""
    if upcast:
        inputs = [x.detach().float().requires_grad_() for x in inputs]
    out = diff_attention(*inputs, causal=causal, backend=backend)
    grads = torch.autograd.grad(out, inputs, grad_out.to(out.dtype))
    return out, grads


def forward_backward_masked(inputs, backend, causal, grad_out, key_padding_mask, *, upcast=False):
    if upcast:
        inputs = [x.detach().float().requires_grad_() for x in inputs]
    out = diff_attention(*inputs, causal=causal, backend=backend, key_padding_mask=key_padding_mask)
    return out, torch.autograd.grad(out, inputs, grad_out.to(out.dtype))


def left_padding(b, s, pads, device=DEVICE):
    """(B, S) bool, True = a real token; row i starts with pads[i] padding positions."""
    keys = torch.arange(s, device=device)
    return keys[None, :] >= torch.tensor(pads, device=device)[:, None]


def max_errors(got, want):
    out, grads = got
    ref_out, ref_grads = want
    names = ["out", "q1", "q2", "k1", "k2", "v", "lam"]
    values = [out, *grads]
    refs = [ref_out, *ref_grads]
    return {n: (x.float() - r.float()).abs().max().item() for n, x, r in zip(names, values, refs)}


# (B, H, Hkv, T, S, d, causal, λ per head): MHA, GQA, T < S (cache), non-causal, d = 16 ... 128.
CASES = {
    "mha-causal": (1, 2, 2, 37, 37, 16, True, False),
    "gqa-causal-cache": (2, 4, 2, 20, 45, 32, True, True),
    "gqa-noncausal-cache": (1, 2, 1, 33, 50, 16, False, True),
    "mha-d64": (1, 1, 1, 19, 19, 64, True, False),
    "gqa-d128-cache": (1, 2, 1, 9, 23, 128, True, True),
    "gqa-d96-cache": (2, 2, 1, 17, 30, 96, True, True),  # padded to 128 inside the kernel
    "mha-d256-noncausal": (1, 2, 2, 11, 18, 256, False, False),
}


@needs_kernels
@pytest.mark.parametrize("case", list(CASES))
def test_fp32_matches_reference(case):
    b, h, hkv, t, s, d, causal, per_head = CASES[case]
    inputs = make_inputs(b, h, hkv, t, s, d, lam_per_head=per_head)
    grad_out = torch.randn(b, h, t, 2 * d, device=DEVICE)
    errors = max_errors(forward_backward(inputs, "triton", causal, grad_out),
                        forward_backward(inputs, "reference", causal, grad_out))
    # λ's gradient sums B·T·2d products, so it gets a proportionally larger tolerance.
    assert all(err < 2e-5 for name, err in errors.items() if name != "lam"), errors
    assert errors["lam"] < 1e-4, errors


@needs_kernels
def test_fp16_matches_fp32_reference():
    """fp16 inputs, fp32 accumulation: errors of the order of fp16 rounding of the outputs."""
    inputs = make_inputs(1, 2, 1, 40, 40, 32, dtype=torch.float16, lam_per_head=True)
    grad_out = torch.randn(1, 2, 40, 64, device=DEVICE)
    got = forward_backward(inputs, "triton", True, grad_out)
    want = forward_backward(inputs, "reference", True, grad_out, upcast=True)
    errors = max_errors(got, want)
    assert got[0].dtype == torch.float16 and all(g.dtype == x.dtype for g, x in zip(got[1], inputs))
    assert errors["out"] < 5e-3, errors
    assert all(errors[n] < 2e-2 for n in ("q1", "q2", "k1", "k2", "v")), errors
    assert errors["lam"] < 5e-2, errors


@needs_kernels
def test_no_grad_forward_and_per_head_lambda_scalar_equivalence():
    """Without grad the kernel keeps no O2; a λ repeated per head equals the 0-d λ."""
    q1, q2, k1, k2, v, lam = (x.detach() for x in make_inputs(1, 2, 2, 21, 21, 16))
    with torch.no_grad():
        scalar = diff_attention(q1, q2, k1, k2, v, lam, backend="triton")
        per_head = diff_attention(q1, q2, k1, k2, v, lam.expand(2).clone(), backend="triton")
        ref = diff_attention(q1, q2, k1, k2, v, lam, backend="reference")
    assert torch.equal(scalar, per_head)
    torch.testing.assert_close(scalar, ref, atol=2e-5, rtol=0)


@pytest.mark.slow  # torch.compile over the interpreted kernel
@needs_kernels
def test_under_torch_compile():
    """The autograd.Function over two custom ops traces whole (fullgraph) and gives eager's numbers."""
    inputs = make_inputs(1, 2, 1, 20, 20, 16, lam_per_head=True)

    def loss(*xs):
        return diff_attention(*xs, backend="triton").square().sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(*inputs), inputs)
    want = torch.autograd.grad(loss(*inputs), inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)


@pytest.mark.slow  # Triton's interpreter under opcheck (2.5 s)
@needs_kernels
def test_custom_ops_pass_opcheck():
    from diff_transformer.ops import triton_diff

    q1, q2, k1, k2, v, lam = (x.detach() for x in make_inputs(1, 2, 1, 17, 17, 16, lam_per_head=True))
    torch.library.opcheck(triton_diff._forward_op, (q1, q2, k1, k2, v, lam, True, 0.25, True))
    out, o2, lse1, lse2 = triton_diff._forward_op(q1, q2, k1, k2, v, lam, True, 0.25, True)
    grad_out = torch.randn_like(out)
    torch.library.opcheck(triton_diff._backward_op, (grad_out, q1, q2, k1, k2, v, lam, out, o2, lse1, lse2, True, 0.25))


@needs_kernels
def test_model_with_triton_backend_matches_reference():
    """A whole debug-size DIFF model (d = 16, GQA): logits and parameter gradients."""
    config = ModelConfig.from_preset("debug", attention="diff", n_kv_heads=1)
    model = LanguageModel(config, device=DEVICE)
    tokens = torch.randint(0, config.vocab_size, (2, 24), device=DEVICE)
    results = {}
    for backend in ("reference", "triton"):
        model.set_attention_backend(backend)
        logits, loss = model(tokens, tokens)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        results[backend] = (logits, grads)
    torch.testing.assert_close(results["triton"][0], results["reference"][0], atol=1e-5, rtol=0)
    for g, r in zip(results["triton"][1], results["reference"][1]):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


@needs_kernels
def test_clear_errors():
    q1, q2, k1, k2, v, lam = make_inputs(1, 2, 2, 8, 8, 16)
    mask = torch.ones(8, 8, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="attn_mask"):
        diff_attention(q1, q2, k1, k2, v, lam, attn_mask=mask, backend="triton")
    q1, q2, k1, k2, v, lam = make_inputs(1, 2, 2, 8, 8, 24)
    with pytest.raises(ValueError, match="head dims"):
        diff_attention(q1, q2, k1, k2, v, lam, backend="triton")
    q1, q2, k1, k2, v, lam = make_inputs(1, 2, 2, 8, 8, 16)
    with pytest.raises(ValueError, match=r"takes v of width 2d = 32 .* got 16 \(a converted Transformer's heads"):
        diff_attention(q1, q2, k1, k2, v[..., :16], lam, backend="triton")  # value_factor=1: d wide


def test_missing_triton_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(ops, "TRITON_INSTALLED", False)
    q1, q2, k1, k2, v, lam = make_inputs(1, 2, 2, 8, 8, 16, device="cpu")
    with pytest.raises(RuntimeError, match="needs the 'triton' package"):
        diff_attention(q1, q2, k1, k2, v, lam, backend="triton")


@pytest.mark.slow  # a new process (3 s)
def test_cpu_without_interpreter_is_a_clear_error():
    code = textwrap.dedent(
        """
        import torch
        from diff_transformer.ops import diff_attention
        q = torch.randn(1, 2, 8, 16); k = torch.randn(1, 2, 8, 16); v = torch.randn(1, 2, 8, 32)
        try:
            diff_attention(q, q, k, k, v, torch.tensor(0.5), backend="triton")
        except RuntimeError as e:
            print(e)
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "needs a CUDA GPU" in done.stdout and "TRITON_INTERPRET=1" in done.stdout, done.stdout + done.stderr


def test_auto_never_picks_triton(monkeypatch):
    """"auto" on CUDA is PyTorch's SDPA even where the fused kernel could run: it is opt-in."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend("auto", cpu, queries=1) == "decode"
    assert resolve_backend("auto", cuda, queries=1) == "decode"
    assert resolve_backend("auto", cpu, queries=64) == "sdpa_split"
    monkeypatch.setattr(ops, "_TRITON_INTERPRET", False)
    monkeypatch.setattr(ops, "TRITON_INSTALLED", True)
    monkeypatch.setattr(ops, "_triton_import", [None])  # as if the kernels imported on a GPU machine
    assert ops.triton_available()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert resolve_backend("auto", cuda, queries=64, dtype=dtype) == "sdpa"
    assert resolve_backend("triton", cuda, queries=64) == "triton"  # asked for: used


AOT_COMPILE = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from diff_transformer.ops import triton_diff as td

    HALF = ("Q1", "Q2", "K1", "K2", "V", "OUT", "OUT2", "DO", "DK1", "DK2", "DV")  # bf16 tensors
    FP32 = ("LAM", "LSE1", "LSE2", "DELTA1", "DELTA2")

    def compile_kernel(kernel, constexprs, config, dq_type="*fp32"):
        fn = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel
        def arg_type(name):
            if name in constexprs:
                return "constexpr"
            if name in HALF:
                return "*bf16"
            if name in FP32:
                return "*fp32"
            if name in ("DQ1", "DQ2"):
                return dq_type
            if name == "KEY_VALID":
                return "*u8"
            return "fp32" if name in ("qk_scale", "sm_scale") else "i32"
        constexprs = {**constexprs, **config.kwargs}
        src = ASTSource(fn, {n: arg_type(n) for n in fn.arg_names},
                        constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
        options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)

    # d = 128, and 96 (padded to 128) with the key mask and the deterministic dQ kernel. (d = 256
    # compiles too, in ~30 s: too slow for this suite; the GPU tests run it.)
    for d, key_mask in ((128, False), (96, True)):
        common = dict(HEAD_DIM=d, BLOCK_D=td.block_d(d), CAUSAL=True, KEY_MASK=key_mask, PRECISION="tf32")
        fwd = compile_kernel(td._fwd_kernel, dict(common, STORE_O2=True), td.default_config("fwd", d))
        bwd = compile_kernel(td._bwd_kernel, dict(common, ATOMIC_DQ=not key_mask), td.default_config("bwd", d))
        kernels = [fwd, bwd]
        if key_mask:
            kernels.append(compile_kernel(td._dq_kernel, common, td.default_config("dq", d), dq_type="*bf16"))
        kernels.append(compile_kernel(td._rowsums_kernel, dict(HEAD_DIM=d, BLOCK_D=td.block_d(d), BLOCK_M=64),
                                      triton.Config({})))
        assert all("cubin" in k.asm for k in kernels)
        print("compiled", d, [k.metadata.shared for k in kernels])
    """
)


@pytest.mark.slow  # compiles every kernel (5 s)
def test_kernels_compile_for_a_gpu_without_one():
    """The GPU path (no interpreter): lower every kernel to sm_90 machine code (bf16; d = 128, and 96
    padded, with the key mask and the deterministic dQ kernel) with Triton's bundled ptxas,
    in the configs used with autotuning off, catching what only the GPU compiler rejects."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", AOT_COMPILE], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode and "ptxas" in done.stderr and "not found" in done.stderr.lower():
        pytest.skip("Triton's NVIDIA toolchain (ptxas) is not available")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled" in done.stdout


def relative_errors(got, want):
    """max |x − ref| / max |ref| per output: a criterion that scales with the values' size."""
    out, grads = got
    ref_out, ref_grads = want
    return {
        n: ((x.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-12)).item()
        for n, x, r in zip(["out", "q1", "q2", "k1", "k2", "v", "lam"], [out, *grads], [ref_out, *ref_grads])
    }


# Relative tolerances (max error / max |reference|) of half-precision inputs against the fp32
# reference: a few units of the format's rounding (bf16 2^-8, fp16 2^-11) for the output, more for
# the gradients, which go through P and dS rounded to the input dtype before their products.
HALF_RTOL = {torch.bfloat16: dict(out=1.5e-2, grad=3e-2), torch.float16: dict(out=3e-3, grad=1e-2)}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def assert_half_close(errors, dtype):
    tol = HALF_RTOL[dtype]
    assert errors["out"] < tol["out"], errors
    assert all(errors[n] < tol["grad"] for n in ("q1", "q2", "k1", "k2", "v", "lam")), errors


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_half_precision_matches_reference(d, dtype):
    inputs = make_inputs(2, 8, 2, 300, 300, d, dtype=dtype, lam_per_head=True, device="cuda")
    grad_out = torch.randn(2, 8, 300, 2 * d, device="cuda")
    errors = relative_errors(
        forward_backward(inputs, "triton", True, grad_out),
        forward_backward(inputs, "reference", True, grad_out, upcast=True),
    )
    assert_half_close(errors, dtype)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_key_padding_cache_bf16(deterministic):
    """bf16, GQA, T < S, left padding, both dQ paths."""
    inputs = make_inputs(3, 8, 2, 100, 357, 64, dtype=torch.bfloat16, lam_per_head=True, device="cuda")
    grad_out = torch.randn(3, 8, 100, 128, device="cuda")
    valid = left_padding(3, 357, (0, 40, 300), device="cuda")
    torch.use_deterministic_algorithms(deterministic)
    try:
        got = forward_backward_masked(inputs, "triton", True, grad_out, valid)
    finally:
        torch.use_deterministic_algorithms(False)
    assert_half_close(relative_errors(got, forward_backward_masked(inputs, "reference", True, grad_out, valid,
                                                                   upcast=True)),
                      torch.bfloat16)


@pytest.mark.gpu
@gpu
def test_gpu_fp32_cache_matches_reference():
    inputs = make_inputs(1, 4, 1, 100, 700, 64, lam_per_head=False, device="cuda")
    grad_out = torch.randn(1, 4, 100, 128, device="cuda")
    errors = relative_errors(forward_backward(inputs, "triton", True, grad_out),
                             forward_backward(inputs, "reference", True, grad_out))
    assert all(err < 1e-5 for err in errors.values()), errors


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_every_autotune_config_on_partial_blocks(d):
    """Each candidate config the autotuner would try for d (after pruning), compiled for this GPU,
    on lengths that are multiples of no block size; configs the GPU cannot hold (out of shared
    memory) are skipped as the autotuner skips them, but each kernel must run at least one."""
    import triton

    from diff_transformer.ops import triton_diff as td

    inputs = make_inputs(2, 4, 2, 301, 333, d, dtype=torch.float16, lam_per_head=True, device="cuda")
    grad_out = torch.randn(2, 4, 301, 2 * d, device="cuda")
    want = forward_backward(inputs, "reference", True, grad_out, upcast=True)
    bd = td.block_d(d)
    ran = {"fwd": 0, "bwd": 0, "dq": 0}
    for name, configs in (("fwd", td._prune_fwd(td._FWD_CONFIGS, {}, BLOCK_D=bd)),
                          ("bwd", td._prune_bwd(td._BWD_CONFIGS, {}, BLOCK_D=bd)),
                          ("dq", td._prune_fwd(td._FWD_CONFIGS, {}, BLOCK_D=bd))):
        for config in configs:
            torch.use_deterministic_algorithms(name == "dq")
            try:
                with td.forced_configs(**{name: config}):
                    got = forward_backward(inputs, "triton", True, grad_out)
            except triton.runtime.errors.OutOfResources:
                continue
            finally:
                torch.use_deterministic_algorithms(False)
            assert_half_close(relative_errors(got, want), torch.float16)
            ran[name] += 1
    assert all(ran.values()), ran


# --- coverage, determinism, grid, switches, dispatch ------------------------------

from diff_transformer.ops import MATH_MAX_KEYS, choose_backend, key_padding_to_attn_mask  # noqa: E402

NAMES = ("out", "q1", "q2", "k1", "k2", "v", "lam")


# (B, H, Hkv, T, S, d, causal, padding per row): left padding (batched generation) incl. a row
# that is all padding up to late queries; T < S (a cache); GQA; d = 96 padded.
PADDED_CASES = {
    "mha-causal-left-pad": (3, 2, 2, 29, 29, 16, True, (0, 5, 20)),
    "gqa-cache-left-pad-d96": (2, 4, 2, 13, 31, 96, True, (3, 25)),
    "gqa-noncausal-pad": (2, 2, 1, 21, 26, 32, False, (7, 0)),
}


@pytest.mark.slow  # Triton's interpreter (3 s)
@needs_kernels
@pytest.mark.parametrize("case", list(PADDED_CASES))
def test_key_padding_mask_matches_reference(case):
    """The fused key-padding mask (a query also sees itself) against "reference" given the
    equivalent (B, 1, T, S) attn_mask: output and all six gradients."""
    b, h, hkv, t, s, d, causal, pads = PADDED_CASES[case]
    inputs = make_inputs(b, h, hkv, t, s, d, lam_per_head=True)
    grad_out = torch.randn(b, h, t, 2 * d, device=DEVICE)
    valid = left_padding(b, s, pads)
    got = forward_backward_masked(inputs, "triton", causal, grad_out, valid)
    want_out = diff_attention(*inputs, causal=causal, backend="reference",
                              attn_mask=key_padding_to_attn_mask(valid, t, s))
    want = (want_out, torch.autograd.grad(want_out, inputs, grad_out))
    errors = max_errors(got, want)
    assert all(errors[n] < 2e-5 for n in NAMES if n != "lam"), errors
    assert errors["lam"] < 1e-4, errors
    # The other backends take the same argument (as an attn_mask) and agree.
    split = forward_backward_masked(inputs, "sdpa_split", causal, grad_out, valid)
    assert max(max_errors(split, want).values()) < 1e-4


@needs_kernels
def test_key_padding_mask_fp16():
    inputs = make_inputs(2, 2, 1, 24, 24, 64, dtype=torch.float16, lam_per_head=True)
    grad_out = torch.randn(2, 2, 24, 128, device=DEVICE)
    valid = left_padding(2, 24, (0, 9))
    got = forward_backward_masked(inputs, "triton", True, grad_out, valid)
    want = forward_backward_masked(inputs, "reference", True, grad_out, valid, upcast=True)
    errors = max_errors(got, want)
    assert errors["out"] < 5e-3 and all(errors[n] < 2e-2 for n in NAMES[1:6]) and errors["lam"] < 5e-2, errors


@needs_kernels
@pytest.mark.parametrize("d", [96, 256])
def test_fp16_padded_and_wide_head_dims(d):
    """fp16 inputs, fp32 accumulation, at the two head dims beyond the original four (GQA, T < S)."""
    inputs = make_inputs(1, 2, 1, 19, 27, d, dtype=torch.float16, lam_per_head=True)
    grad_out = torch.randn(1, 2, 19, 2 * d, device=DEVICE)
    got = forward_backward(inputs, "triton", True, grad_out)
    want = forward_backward(inputs, "reference", True, grad_out, upcast=True)
    errors = max_errors(got, want)
    assert errors["out"] < 5e-3 and all(errors[n] < 2e-2 for n in NAMES[1:6]) and errors["lam"] < 5e-2, errors


@needs_kernels
def test_bf16_row_sums_kernel():
    """bf16 through the parts without tl.dot (the backward's row-sum pre-pass; the interpreter's
    bf16 dot is wrong, so the full bf16 kernels are tested on GPU only, below)."""
    from diff_transformer.ops import triton_diff as td

    b, h, t, d = 2, 3, 21, 96
    out, o2, do = (torch.randn(b, h, t, 2 * d, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    lam = torch.rand(h, device=DEVICE) + 0.2
    delta1 = torch.empty(b, h, t, device=DEVICE)
    delta2 = torch.empty_like(delta1)
    td._rowsums_kernel[td.grid_1d(triton_cdiv(t, 16), b * h)](
        out, o2, do, lam, delta1, delta2, *out.stride()[:3], *do.stride()[:3], h, t,
        HEAD_DIM=d, BLOCK_D=td.block_d(d), BLOCK_M=16,
    )
    want2 = (do.float() * o2.float()).sum(-1)
    want1 = (do.float() * out.float()).sum(-1) + lam[:, None] * want2
    torch.testing.assert_close(delta2, want2, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(delta1, want1, atol=1e-4, rtol=1e-5)


def triton_cdiv(a, b):
    return -(-a // b)


@needs_kernels
def test_bf16_full_kernel_interpreter():
    if INTERPRETED:
        pytest.skip("Triton's interpreter computes tl.dot on bf16 inputs wrongly; bf16 runs in the GPU tests")
    inputs = make_inputs(1, 2, 1, 40, 40, 32, dtype=torch.bfloat16, lam_per_head=True)
    grad_out = torch.randn(1, 2, 40, 64, device=DEVICE)
    errors = max_errors(forward_backward(inputs, "triton", True, grad_out),
                        forward_backward(inputs, "reference", True, grad_out, upcast=True))
    assert errors["out"] < 3e-2, errors


@pytest.mark.slow  # Triton's interpreter (11 s)
@needs_kernels
@pytest.mark.parametrize("case", ["gqa-causal-cache", "gqa-d96-cache"])
def test_deterministic_mode_uses_the_dq_pass_and_matches_reference(case, monkeypatch):
    """torch.use_deterministic_algorithms(True) -> the backward computes dQ in its own pass (no
    atomics); its gradients match the reference and the atomic path's."""
    from diff_transformer.ops import triton_diff as td

    b, h, hkv, t, s, d, causal, per_head = CASES[case]
    inputs = make_inputs(b, h, hkv, t, s, d, lam_per_head=per_head)
    grad_out = torch.randn(b, h, t, 2 * d, device=DEVICE)
    calls = []
    real_backward = td._backward_op

    def spy(*args):
        calls.append(args[-1])  # the ``deterministic`` flag
        return real_backward(*args)

    monkeypatch.setattr(td, "_backward_op", spy)
    atomic = forward_backward(inputs, "triton", causal, grad_out)
    torch.use_deterministic_algorithms(True)
    try:
        det = forward_backward(inputs, "triton", causal, grad_out)
        again = forward_backward(inputs, "triton", causal, grad_out)
    finally:
        torch.use_deterministic_algorithms(False)
    assert calls == [False, True, True]
    errors = max_errors(det, forward_backward(inputs, "reference", causal, grad_out))
    assert all(errors[n] < 2e-5 for n in NAMES if n != "lam"), errors
    assert errors["lam"] < 1e-4, errors
    assert max(max_errors(det, atomic).values()) < 2e-5
    assert all(torch.equal(x, y) for x, y in zip(det[1], again[1]))


@pytest.mark.slow  # Triton's interpreter (2 s)
@needs_kernels
def test_deterministic_dq_with_key_padding_fp16():
    from diff_transformer.ops import triton_diff as td

    q1, q2, k1, k2, v, lam = (x.detach()
                              for x in make_inputs(2, 2, 1, 19, 25, 32, dtype=torch.float16, lam_per_head=True))
    valid = left_padding(2, 25, (4, 0))
    out, o2, lse1, lse2 = td._forward_op(q1, q2, k1, k2, v, lam, True, 32**-0.5, True, valid)
    grad_out = torch.randn_like(out)
    args = (grad_out, q1, q2, k1, k2, v, lam, out, o2, lse1, lse2, True, 32**-0.5, valid)
    det = td._backward_op(*args, True)
    atomic = td._backward_op(*args, False)
    for x, y, name in zip(det, atomic, NAMES[1:]):
        assert x.dtype == y.dtype and (x.float() - y.float()).abs().max() < 2e-3, name


def test_grid_is_one_dimensional_and_holds_any_batch_times_heads():
    from diff_transformer.ops import triton_diff as td

    assert td.grid_1d(3, 4) == (12,)
    assert td.grid_1d(128, 70_000) == (8_960_000,)  # B·H = 70,000 > 65,535: still one axis
    with pytest.raises(ValueError, match="grid limit"):
        td.grid_1d(2**20, 2**12)


def test_block_d_pads_to_a_power_of_two():
    from diff_transformer.ops import triton_diff as td

    assert [td.block_d(d) for d in (16, 32, 64, 96, 128, 256)] == [16, 32, 64, 128, 128, 256]
    for name in ("fwd", "bwd", "dq"):  # every head dim gets a config that fits its registers
        for d in ops.TRITON_HEAD_DIMS:
            c = td.default_config(name, d)
            rows = c.kwargs["BLOCK_N" if name == "bwd" else "BLOCK_M"]
            assert td._fits_registers(rows, td.block_d(d), c.num_warps), (name, d, c)


class _RecordingKernel:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kw)`` records kw."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append(kw)


def test_autotune_switch(monkeypatch):
    from diff_transformer.ops import triton_diff as td

    monkeypatch.delenv(td.AUTOTUNE_ENV, raising=False)
    assert td.autotune_enabled()
    for off in ("0", "false", "off"):
        monkeypatch.setenv(td.AUTOTUNE_ENV, off)
        assert not td.autotune_enabled()
    monkeypatch.setenv(td.AUTOTUNE_ENV, "1")
    assert td.autotune_enabled()
    # The GPU launch path (INTERPRET off): autotuned kernel when on, the plain kernel with the
    # default config (blocks, warps, stages) when off.
    plain, tuned = _RecordingKernel(), _RecordingKernel()
    monkeypatch.setattr(td, "INTERPRET", False)
    monkeypatch.setitem(td._KERNELS, "fwd", (plain, tuned, td._FWD_CONFIGS, td._prune_fwd))
    td._launch("fwd", None, (), dict(HEAD_DIM=256, BLOCK_D=256))
    assert len(tuned.calls) == 1 and not plain.calls
    try:
        td.set_autotune(False)
        td._launch("fwd", None, (), dict(HEAD_DIM=256, BLOCK_D=256))
    finally:
        td.set_autotune(None)
    want = td.default_config("fwd", 256)
    assert plain.calls == [dict(HEAD_DIM=256, BLOCK_D=256, **want.kwargs, num_warps=want.num_warps,
                                num_stages=want.num_stages)]
    assert want.kwargs["BLOCK_M"] == 16  # the only rows that fit d = 256


@pytest.mark.slow  # Triton's interpreter at every config (3 s)
@needs_kernels
def test_every_autotune_config_on_partial_blocks():
    """Each candidate config's block sizes (forced, in turn) on lengths that are multiples of
    none of them (GQA, T < S, causal): the forward, both backward variants against the reference."""
    from diff_transformer.ops import triton_diff as td

    inputs = make_inputs(1, 2, 1, 37, 45, 16, lam_per_head=True)
    grad_out = torch.randn(1, 2, 37, 32, device=DEVICE)
    want = forward_backward(inputs, "reference", True, grad_out)
    fwd, bwd = td._FWD_CONFIGS, td._BWD_CONFIGS
    for i in range(max(len(fwd), len(bwd))):
        with td.forced_configs(fwd=fwd[i % len(fwd)], bwd=bwd[i % len(bwd)], dq=fwd[(i + 3) % len(fwd)]):
            torch.use_deterministic_algorithms(bool(i % 2))
            try:
                got = forward_backward(inputs, "triton", True, grad_out)
            finally:
                torch.use_deterministic_algorithms(False)
        errors = max_errors(got, want)
        assert all(errors[n] < 2e-5 for n in NAMES if n != "lam") and errors["lam"] < 1e-4, (i, errors)


@needs_kernels
def test_launches_run_under_the_tensors_device(monkeypatch):
    """Every launch sits inside torch.cuda.device(q.device) (tensors on cuda:1 launch there)."""
    from diff_transformer.ops import triton_diff as td

    guard = td._device_guard(torch.device("cuda", 1))  # built without touching CUDA
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    seen = []
    real = td._device_guard
    monkeypatch.setattr(td, "_device_guard", lambda device: seen.append(device) or real(device))
    inputs = make_inputs(1, 2, 1, 9, 9, 16)
    forward_backward(inputs, "triton", True, torch.randn(1, 2, 9, 32, device=DEVICE))
    assert seen == [inputs[0].device] * 2  # forward, backward


def test_interpret_flag_without_triton_knobs(monkeypatch):
    """Triton < 3.4 has no ``triton.knobs``: the flag comes from TRITON_INTERPRET instead."""
    import triton

    from diff_transformer.ops import triton_diff as td

    monkeypatch.delattr(triton, "knobs")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert td._interpret_mode() is True
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert td._interpret_mode() is False


@pytest.mark.slow  # a fresh interpreter importing Triton
def test_import_without_triton_knobs_in_a_fresh_process():
    code = textwrap.dedent(
        """
        import triton
        del triton.knobs  # as on Triton < 3.4
        import torch
        from diff_transformer.ops import diff_attention, triton_diff
        q = torch.randn(1, 1, 5, 16); k = torch.randn(1, 1, 5, 16); v = torch.randn(1, 1, 5, 32)
        out = diff_attention(q, q, k, k, v, torch.tensor(0.5), backend="triton")
        ref = diff_attention(q, q, k, k, v, torch.tensor(0.5), backend="reference")
        print("interpret", triton_diff.INTERPRET, float((out - ref).abs().max()))
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    word, flag, err = done.stdout.split()
    assert flag == "True" and float(err) < 1e-5, done.stdout


def test_triton_availability_says_why_not(monkeypatch):
    """What ``bench gpu`` reports: the kernels not importing, the interpreter, no package."""
    monkeypatch.setattr(ops, "_TRITON_INTERPRET", False)
    monkeypatch.setattr(ops, "TRITON_INSTALLED", True)
    monkeypatch.setattr(ops, "_triton_import", [])
    monkeypatch.setitem(sys.modules, "diff_transformer.ops.triton_diff", None)  # import raises ImportError
    assert "triton_diff" in ops.triton_import_error() and not ops.triton_available()
    monkeypatch.setattr(ops, "_triton_import", [None])
    assert ops.triton_import_error() is None and ops.triton_available()
    monkeypatch.setattr(ops, "_TRITON_INTERPRET", True)  # the interpreter is for tests
    assert not ops.triton_available()
    monkeypatch.setattr(ops, "TRITON_INSTALLED", False)
    assert "not installed" in ops.triton_import_error()


def test_choose_backend_routing():
    """The decision "auto" makes, from device, dtype and shape (its only inputs); never "triton"."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    fast = dict(queries=128)
    for dtype in (bf16, fp16, fp32):
        assert choose_backend("cuda", dtype=dtype, **fast) == "sdpa"
    with pytest.raises(TypeError):  # arguments that would change nothing are not taken
        choose_backend("cuda", dtype=bf16, masked=True, **fast)
    assert choose_backend("cpu", dtype=bf16, **fast) == "sdpa_split"
    assert choose_backend("cuda", dtype=bf16, **{**fast, "queries": 1}) == "decode"
    # resolve_backend passes the dtype through; diff_attention passes q1's.
    assert resolve_backend("auto", torch.device("cpu"), queries=8, dtype=fp32) == "sdpa_split"
    # CPU, fp32: "math" up to MATH_MAX_KEYS keys, the flash-style split beyond; other dtypes split
    assert choose_backend("cpu", dtype=fp32, queries=256, keys=MATH_MAX_KEYS) == "math"
    assert choose_backend("cpu", dtype=fp32, queries=256, keys=MATH_MAX_KEYS + 1) == "sdpa_split"
    assert choose_backend("cpu", dtype=bf16, queries=256, keys=256) == "sdpa_split"
    assert choose_backend("cuda", dtype=fp32, queries=256, keys=256) == "sdpa"


@pytest.mark.slow  # Triton's interpreter under opcheck (5 s)
@needs_kernels
def test_custom_ops_pass_opcheck_with_key_mask_and_deterministic():
    from diff_transformer.ops import triton_diff as td

    q1, q2, k1, k2, v, lam = (x.detach() for x in make_inputs(2, 2, 1, 13, 17, 16, lam_per_head=True))
    valid = left_padding(2, 17, (5, 0))
    torch.library.opcheck(td._forward_op, (q1, q2, k1, k2, v, lam, True, 0.25, True, valid))
    out, o2, lse1, lse2 = td._forward_op(q1, q2, k1, k2, v, lam, True, 0.25, True, valid)
    grad_out = torch.randn_like(out)
    torch.library.opcheck(td._backward_op,
                          (grad_out, q1, q2, k1, k2, v, lam, out, o2, lse1, lse2, True, 0.25, valid, True))


@pytest.mark.slow  # torch.compile over the interpreted kernel
@needs_kernels
def test_model_compiles_without_graph_breaks():
    """A debug DIFF model on the "triton" backend under torch.compile(fullgraph=True): traced in
    one graph (the custom op and its registered autograd), same loss and gradients as eager."""
    config = ModelConfig.from_preset("debug", attention="diff", n_kv_heads=1)
    model = LanguageModel(config, device=DEVICE, attn_backend="triton")
    tokens = torch.randint(0, config.vocab_size, (2, 19), device=DEVICE)

    def step(tokens):
        _, loss = model(tokens, tokens)
        return loss

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    loss = compiled(tokens)
    got = torch.autograd.grad(loss, list(model.parameters()))
    want_loss = step(tokens)
    want = torch.autograd.grad(want_loss, list(model.parameters()))
    torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=0)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)
