"""Fused CPU kernels, in C (cpu_kernels.c), compiled on first use: for inference, and RMSNorm and
RoPE in training too.

    out = cpu_decode_diff_attention(q1, q2, k1, k2, v, lam, attn_mask=None, scale=None)
    out = cpu_rms_norm(x, weight, eps)
    grad_x, grad_weight = cpu_rms_norm_backward(x, weight, grad, eps)
    out = cpu_rope(x, rope)                  # cpu_rope(grad, rope, inverse=True): its backward
    out = cpu_linear(x, weight)

The "decode" backend (decode.py), ``attention.rms_norm``, ``attention.apply_rope`` and the
model's linear layers and LM head (``attention.Linear``, ``model._head_logits``) hand their
calls here where the kernels apply (:func:`decode_applies`, :func:`rms_norm_applies`,
:func:`rope_applies`, :func:`linear_applies`: CPU, fp32, no gradient wanted, not under
torch.compile). At small decoding shapes operator calls and memory traffic, not arithmetic, are
the cost: the PyTorch decode path takes eight calls where the kernel takes one pass over the
cache, F.rms_norm six (on CPU it is a composite), the complex-number RoPE nine; and the BLAS's
products of a few rows read weights that are not in cache slowly. Measured figures are in
BENCHMARKS.md.

In training, ``attention.rms_norm``'s autograd function runs ``cpu_rms_norm`` forward and
``cpu_rms_norm_backward`` backward (:func:`rms_norm_training_applies`): one pass each, where the
PyTorch ops take six and seven, about half the time of a norm's forward and backward at the
tiny model's shapes; ``attention.apply_rope``'s runs ``cpu_rope`` forward and turned back
(:func:`rope_training_applies`).

The source is compiled with the system C compiler (``$CC``, else ``cc``) into
``kernels/`` of the project's cache (``$DIFF_TRANSFORMER_CACHE``, else ``~/.cache/diff-transformer``),
keyed by the source, the flags and the CPU, and loaded with ctypes: no PyTorch headers, well under a second to build.
Without a compiler, after a failed build (which warns once) or with
``DIFF_TRANSFORMER_CPU_KERNEL=0`` the PyTorch ops run instead; they are the kernels' reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch
from torch import Tensor

from ..files import cache_root

SOURCE = Path(__file__).with_name("cpu_kernels.c")
ENV_SWITCH = "DIFF_TRANSFORMER_CPU_KERNEL"  # "0" turns the kernels off
# Tried in order: the first that builds is used (-march=native for the vector width of this CPU;
# Apple's clang has no -fopenmp, and then the kernel runs on one thread). The math flags let the
# compiler vectorise the dot products and sums; infinities (hidden keys) keep their meaning.
_FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp"],
    ["-O3", "-fopenmp"],
    ["-O3"],
)
_COMMON_FLAGS = ["-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math"]

_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = {
    "decode": [
        _P, _P, _I, _I,  # q1, q2 and their batch, head strides
        _P, _P, _I, _I, _I,  # k1, k2 and their batch, group, key strides
        _P, _I, _I, _I,  # v and its strides
        _P, _I,  # lam, its head stride (0 for one λ)
        _P, _I, _I, _I,  # mask (uint8) and its batch, head, key strides
        _P,  # out
        _I, _I, _I, _I, _I, ctypes.c_float, ctypes.c_int,  # B, H, Hkv, S, d, scale, threads
    ],
    "rms_norm": [_P, _I, _I, _I, _P, ctypes.c_float, _P, ctypes.c_int],  # x, rows, row stride, width, w, eps, out, threads
    "rms_norm_backward": [  # x, its row stride, grad, its row stride, rows, width, w, eps, grad_x, partial_w, parts, threads
        _P, _I, _P, _I, _I, _I, _P, ctypes.c_float, _P, _P, ctypes.c_int, ctypes.c_int,
    ],
    "linear": [_P, _I, _P, _P, _I, _I, _I, ctypes.c_int],  # x, its row stride, w, out, rows, in, out features, threads
    "rope": [  # x, its B/T/head strides, rope, its T stride, sign, out, its B/T/head strides, B, T, n, d, threads
        _P, _I, _I, _I, _P, _I, ctypes.c_float, _P, _I, _I, _I, _I, _I, _I, _I, ctypes.c_int,
    ],
}
_SYMBOLS = {"decode": "diff_decode_f32"}  # the C names that are not f"{name}_f32"
_state: dict[str, object] = {}  # the functions by name, or "error", once the build was tried


def _cpu_fingerprint() -> str:
    """What the compiled code depends on besides the source: -march=native's target."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            text += "".join(line for line in fh if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        pass
    return text


def _build(compiler: str, flags: list[str], target: Path) -> str | None:
    """Compile the source to ``target`` (atomically: parallel test workers may race); None or the error."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *flags, *_COMMON_FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            return f"{compiler} {' '.join(flags)}: {done.stderr.strip()[-500:]}"
        os.replace(tmp, target)
        return None
    finally:
        Path(tmp).unlink(missing_ok=True)


def _load() -> None:
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        _state["error"] = f"no C compiler: {compiler!r} is not on PATH (set CC)"
        return
    source, cpu = SOURCE.read_bytes(), _cpu_fingerprint().encode()
    errors = []
    for flags in _FLAG_SETS:
        key = hashlib.sha256(source + " ".join([compiler, *flags, *_COMMON_FLAGS]).encode() + cpu)
        target = cache_root() / "kernels" / f"cpu_kernels-{key.hexdigest()[:16]}.so"
        try:
            error = None if target.exists() else _build(compiler, flags, target)
            if error is None:
                library = ctypes.CDLL(str(target))
                for name in _ARGTYPES:
                    function = getattr(library, _SYMBOLS.get(name, f"{name}_f32"))
                    function.argtypes, function.restype = _ARGTYPES[name], ctypes.c_int
                    _state[name] = function
                return
        except (OSError, subprocess.SubprocessError) as e:
            error = f"{type(e).__name__}: {e}"
        errors.append(error)
    _state["error"] = "; ".join(errors)
    warnings.warn(f"the fused CPU kernels did not build, PyTorch ops are used instead: {_state['error']}", stacklevel=3)


def kernel_error() -> str | None:
    """Why the kernels cannot be used (no compiler, a failed build), or None; the build is tried once."""
    if not _state:
        _load()
    return _state.get("error")  # type: ignore[return-value]


def _switched_off() -> bool:
    return os.environ.get(ENV_SWITCH, "1") == "0"


def kernels_status() -> str:
    """One line for benchmark reports: "on", "off (DIFF_TRANSFORMER_CPU_KERNEL=0)" or why not built."""
    if _switched_off():
        return f"off ({ENV_SWITCH}=0)"
    error = kernel_error()
    return "on" if error is None else f"not built ({error})"


def _usable(*tensors: Tensor) -> bool:
    """CPU fp32 tensors with contiguous last dims, no gradient wanted, not traced by
    torch.compile, the switch not off, and the kernels built."""
    for x in tensors:
        if x.device.type != "cpu" or x.dtype != torch.float32 or x.stride(-1) != 1:
            return False
    if torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
        return False
    if torch.compiler.is_compiling() or _switched_off():
        return False
    return kernel_error() is None


def decode_applies(lam: Tensor, *tensors: Tensor) -> bool:
    """Whether the "decode" backend hands a call with these q, k, v tensors (either layout) to the kernel."""
    return _usable(*tensors) and not (torch.is_grad_enabled() and lam.requires_grad)


def rms_norm_applies(x: Tensor, weight: Tensor | None) -> bool:
    """Whether ``rms_norm`` hands this call to the kernel (rows of x must be one stride apart)."""
    if weight is not None and not (_usable(weight) and weight.dim() == 1):
        return False
    return _usable(x) and x.dim() >= 1 and x.numel() > 0 and _row_stride(x) is not None


def rope_applies(x: Tensor, rope: Tensor) -> bool:
    """Whether ``apply_rope`` hands x (B, T, n, d) and rope (T, d/2, 2) to the kernel."""
    return x.dim() == 4 and rope.dim() == 3 and rope.stride(1) == 2 and _usable(x, rope)


def rope_training_applies(x: Tensor, rope: Tensor) -> bool:
    """Whether ``apply_rope`` trains through the kernel (its autograd function): as
    :func:`rope_applies`, but with a gradient wanted for x (never for the table)."""
    if torch.compiler.is_compiling() or rope.requires_grad:
        return False
    with torch.no_grad():
        return rope_applies(x, rope)


# At most this many rows (a decoding step's batch) go to the linear kernel: beyond it the BLAS's
# blocked products win on small weights (measured on this project's 2-core machine; BENCHMARKS.md,
# eighth part).
LINEAR_MAX_ROWS = 8


def linear_applies(x: Tensor, weight: Tensor) -> bool:
    """Whether x (..., I) · weight (O, I)ᵀ goes to the kernel: at most LINEAR_MAX_ROWS rows, one
    stride apart, and a contiguous weight."""
    if torch.compiler.is_compiling():  # before any shape test: no guards on the row count
        return False
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    return (
        0 < rows <= LINEAR_MAX_ROWS and weight.dim() == 2 and weight.is_contiguous()
        and x.shape[-1] == weight.shape[1] and _usable(x, weight) and _row_stride(x) is not None
    )  # fmt: skip


def _row_stride(x: Tensor) -> int | None:
    """The stride between consecutive rows of x viewed as (rows, width), or None if there is none."""
    try:
        return x.view(-1, x.shape[-1]).stride(0)
    except RuntimeError:
        return None


def _decode(q: Tensor, q2_offset: int, q_head_stride: int, k: Tensor, k2_offset: int, k_group_stride: int,
            v: Tensor, lam: Tensor, attn_mask: Tensor | None, scale: float | None, heads: int) -> Tensor:
    """Call the kernel on raw views: Q2 starts q2_offset elements after Q1, K2 k2_offset after K1."""
    b, d = q.shape[0], q.shape[-1]
    kv_heads, s = v.shape[1], v.shape[2]
    lam = lam.detach().float()
    lam = lam.reshape(1) if lam.dim() == 0 else lam.contiguous()
    mask_args: tuple = (None, 0, 0, 0)
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            raise TypeError(f"attn_mask must be a bool tensor (True = may attend), got {attn_mask.dtype}")
        mask = attn_mask.expand(b, heads, 1, s)  # a view: broadcast dims get stride 0
        mask_args = (mask.data_ptr(), mask.stride(0), mask.stride(1), mask.stride(3))
    out = torch.empty(b, heads, 1, 2 * d)
    q_ptr, k_ptr = q.data_ptr(), k.data_ptr()
    failed = _state["decode"](  # type: ignore[operator]
        q_ptr, q_ptr + 4 * q2_offset, q.stride(0), q_head_stride,
        k_ptr, k_ptr + 4 * k2_offset, k.stride(0), k_group_stride, k.stride(2),
        v.data_ptr(), v.stride(0), v.stride(1), v.stride(2),
        lam.data_ptr(), 0 if lam.numel() == 1 else 1,
        *mask_args,
        out.data_ptr(),
        b, heads, kv_heads, s, d, d**-0.5 if scale is None else scale, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError(f"the fused CPU decode kernel could not allocate its buffers ({s} keys)")
    return out


def _require_kernels() -> None:
    error = kernel_error()
    if error is not None:
        raise RuntimeError(f"the fused CPU kernels are not available: {error}")


def cpu_decode_diff_attention(
    q1: Tensor, q2: Tensor, k1: Tensor, k2: Tensor, v: Tensor, lam: Tensor,
    *, attn_mask: Tensor | None = None, scale: float | None = None,
) -> Tensor:  # fmt: skip
    """q1, q2 (B, H, 1, d); k1, k2 (B, Hkv, S, d); v (B, Hkv, S, 2d); lam 0-d or (H,);
    attn_mask None or bool broadcastable to (B, H, 1, S), True = may attend -> (B, H, 1, 2d) fp32.
    The caller checks :func:`decode_applies`; q2 (k2) must have q1's (k1's) strides."""
    _require_kernels()
    if q2.stride() != q1.stride() or k2.stride() != k1.stride():
        raise ValueError("q2 (k2) must have the strides of q1 (k1) for the fused CPU kernel")
    # Q2 and K2 are passed as offsets from Q1 and K1 (in elements, through their data pointers)
    q2_offset, k2_offset = (q2.data_ptr() - q1.data_ptr()) // 4, (k2.data_ptr() - k1.data_ptr()) // 4
    return _decode(q1, q2_offset, q1.stride(1), k1, k2_offset, k1.stride(1), v, lam, attn_mask, scale, q1.shape[1])


def cpu_decode_diff_attention_packed(
    q: Tensor, k: Tensor, v: Tensor, lam: Tensor, *, attn_mask: Tensor | None = None, scale: float | None = None
) -> Tensor:
    """The model's layout (decode.py's ``decode_diff_attention_packed``): q (B, 2H, 1, d) with Q1, Q2
    of head h at sub-heads 2h, 2h+1; k (B, 2Hkv, S, d) likewise; v (B, Hkv, S, 2d) -> (B, H, 1, 2d).
    Read in place through strides: sub-head 2h + 1 is one sub-head stride after 2h."""
    _require_kernels()
    return _decode(q, q.stride(1), 2 * q.stride(1), k, k.stride(1), 2 * k.stride(1), v, lam, attn_mask, scale, q.shape[1] // 2)


def cpu_rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """x / sqrt(mean(x²) + eps) · weight over the last dim, fp32, a new contiguous tensor.
    The caller checks :func:`rms_norm_applies`."""
    _require_kernels()
    width = x.shape[-1]
    out = torch.empty(x.shape)
    _state["rms_norm"](  # type: ignore[operator]
        x.data_ptr(), x.numel() // width, _row_stride(x), width,
        None if weight is None else weight.data_ptr(), eps, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


# grad_w is summed over this many fixed slices of the rows (at most), whatever the thread count:
# the same inputs give the same gradient bits on any machine with the same kernel build.
RMS_NORM_GRAD_PARTS = 64


def rms_norm_training_applies(x: Tensor, weight: Tensor | None) -> bool:
    """Whether ``attention.rms_norm`` trains through the kernels (forward and backward): a weight,
    CPU fp32 and rows one stride apart, as :func:`rms_norm_applies`, but with gradients wanted."""
    if weight is None or weight.dim() != 1 or torch.compiler.is_compiling():
        return False
    with torch.no_grad():
        return rms_norm_applies(x, weight)


def cpu_rms_norm_backward(x: Tensor, weight: Tensor, grad: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The gradients of ``cpu_rms_norm(x, weight, eps)`` for the output's gradient ``grad`` (x's
    shape): grad_x (contiguous) and grad_weight. The caller checks :func:`rms_norm_training_applies`."""
    _require_kernels()
    if grad.shape != x.shape:
        raise ValueError(f"grad must have x's shape {tuple(x.shape)}, got {tuple(grad.shape)}")
    width = x.shape[-1]
    rows = x.numel() // width
    grad = grad.float()
    grad_stride = _row_stride(grad) if grad.stride(-1) == 1 else None
    if grad_stride is None:  # rows not one stride apart (or a strided last dim): copied once
        grad, grad_stride = grad.contiguous(), width
    parts = max(1, min(RMS_NORM_GRAD_PARTS, rows))
    grad_x, partial_w = torch.empty(x.shape), torch.zeros(parts, width)
    weight = weight.detach().contiguous()
    _state["rms_norm_backward"](  # type: ignore[operator]
        x.data_ptr(), _row_stride(x), grad.data_ptr(), grad_stride, rows, width, weight.data_ptr(), eps,
        grad_x.data_ptr(), partial_w.data_ptr(), parts, torch.get_num_threads(),
    )  # fmt: skip
    return grad_x, partial_w.sum(0)


def cpu_rope(x: Tensor, rope: Tensor, *, inverse: bool = False) -> Tensor:
    """x (B, T, n, d) with each pair (x[2i], x[2i+1]) of row t rotated by the angle of rope[t, i]
    (cos, sin), or back by it with ``inverse`` (the backward): ``attention.apply_rope``. The caller
    checks :func:`rope_applies` (or :func:`rope_training_applies`).

    A new fp32 tensor shaped (B, T, n, d). Turned forward its memory is laid out (B, n, T, d), so
    that the attention's ``transpose(1, 2)`` to (B, n, T, d) is contiguous and the ops need not
    copy it; turned back (a gradient for the projection that made x) it is contiguous."""
    _require_kernels()
    b, t, n, d = x.shape
    if rope.shape != (t, d // 2, 2) or d % 2:
        raise ValueError(f"rope must be (T, d/2, 2) = {(t, d // 2, 2)} for x {tuple(x.shape)}, got {tuple(rope.shape)}")
    out = torch.empty(b, t, n, d) if inverse else torch.empty(b, n, t, d).transpose(1, 2)
    _state["rope"](  # type: ignore[operator]
        x.data_ptr(), x.stride(0), x.stride(1), x.stride(2), rope.data_ptr(), rope.stride(0), -1.0 if inverse else 1.0,
        out.data_ptr(), out.stride(0), out.stride(1), out.stride(2), b, t, n, d, torch.get_num_threads(),
    )  # fmt: skip
    return out


def cpu_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x (..., I) · weight (O, I)ᵀ -> (..., O), a new contiguous fp32 tensor: ``F.linear`` without
    bias, for a few rows. The caller checks :func:`linear_applies`."""
    _require_kernels()
    outs, width = weight.shape
    out = torch.empty(*x.shape[:-1], outs)
    _state["linear"](  # type: ignore[operator]
        x.data_ptr(), _row_stride(x), weight.data_ptr(), out.data_ptr(), x.numel() // width, width, outs, torch.get_num_threads()
    )
    return out
