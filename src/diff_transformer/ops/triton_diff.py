"""Fused differential flash attention in Triton: the "triton" backend of ``diff_attention``.

Opt-in only ("auto" never picks it): verified in Triton's interpreter and compiled for sm_90,
not yet measured on a GPU; ``diff-transformer bench gpu`` checks and times it on yours.

    out = softmax(q1 k1ᵀ s) v − λ · softmax(q2 k2ᵀ s) v        q (B, H, T, d), k (B, Hkv, S, d), v (B, Hkv, S, 2d)

Forward (one program per block of BLOCK_M queries of one head): Q1 and Q2 are loaded once; one
pass over the key blocks loads K1, K2 and V once each and keeps two online-softmax states
(running max m, running sum l) and two fp32 accumulators, so the output is acc1/l1 − λ·acc2/l2.
It saves the two log-sum-exps and, when a backward will follow, O2 = softmax(q2 k2ᵀ s) v.

Backward (one program per block of BLOCK_N keys of one KV head, looping over the query heads of
its group and their query blocks): recomputes P1 and P2 from the saved log-sum-exps, computes
dP = dO·Vᵀ once for both maps and dV = (P1 − λP2)ᵀ·dO once; dK1, dK2, dV accumulate in
registers. dQ1 and dQ2 are either added atomically into fp32 buffers by the same kernel (fast,
but the order of the additions varies from run to run), or, when
``torch.use_deterministic_algorithms(True)`` is on, computed by a second kernel with one program
per query block that loops over the keys (no atomics, bitwise repeatable). A small pre-pass
computes the row sums both need from the saved O and O2 (O1 = O + λ·O2):

    dS1 = P1 ⊙ (dP − rowsum(dO ⊙ O1))            dS2 = −λ · P2 ⊙ (dP − rowsum(dO ⊙ O2))
    dλ  = −Σ rowsum(dO ⊙ O2)   (per head, summed over batch and queries)

Head dims that are not powers of two (96) are padded inside the kernels to BLOCK_D, the next
power of two, with masked loads and stores. An optional key-padding mask (B, S) (True = a real
token) hides padded keys; a query always keeps its own position visible, like the model's
padding mask, so that padded queries stay finite. The programs of all (batch, head, block)
triples are folded into grid axis 0 (limit 2³¹ − 1), never axes 1/2 (limit 65,535).

FLOPs in units of B·H·T·S·d (H DIFF heads): forward 12, backward 20 (24 with the separate dQ
pass, which recomputes QKᵀ and dP); in units of h·N²·d (as the paper's appendix counts FLOPs) \
(h = 2H) forward 6, backward 10.

Set ``TRITON_INTERPRET=1`` before this module is imported to run the kernels on CPU (slowly,
for tests); the interpreter gets fixed block sizes, a GPU autotunes them unless
``DIFF_TRANSFORMER_AUTOTUNE=0`` or :func:`set_autotune(False) <set_autotune>` (then every kernel
runs the first candidate config that fits its head dim). Importing this module imports Triton,
so ``diff_transformer.ops`` imports it only when the backend is first used.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Iterator, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .limits import TRITON_HEAD_DIMS

_TRUE = ("1", "true", "yes", "on")


def _interpret_mode() -> bool:
    """Whether Triton runs kernels in its interpreter. ``triton.knobs`` exists from Triton 3.4;
    older versions read the TRITON_INTERPRET environment variable directly."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


INTERPRET = _interpret_mode()  # read when the kernels below are decorated
_LOG2_E = 1.4426950408889634
# Block sizes under the interpreter: small, so that short test sequences span several blocks.
_INTERPRET_BLOCKS = dict(BLOCK_M=16, BLOCK_N=16)
MAX_GRID_PROGRAMS = 2**31 - 1  # CUDA's limit on grid axis 0 (axes 1 and 2: 65,535)

# --- autotuning switch ------------------------------------------------------------------

AUTOTUNE_ENV = "DIFF_TRANSFORMER_AUTOTUNE"
_autotune_override: bool | None = None


def set_autotune(enabled: bool | None) -> None:
    """Switch the autotuner on or off for later launches (None = follow DIFF_TRANSFORMER_AUTOTUNE).
    Off, each kernel runs the first candidate config that fits its head dim: quick to start,
    deterministic choice, useful for tests."""
    global _autotune_override
    _autotune_override = enabled


def autotune_enabled() -> bool:
    """On unless set_autotune(False) or DIFF_TRANSFORMER_AUTOTUNE is 0/false/no/off."""
    if _autotune_override is not None:
        return _autotune_override
    return os.environ.get(AUTOTUNE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _configs(shapes: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    return [triton.Config(dict(BLOCK_M=m, BLOCK_N=n), num_warps=w, num_stages=st) for m, n, w, st in shapes]


# (BLOCK_M, BLOCK_N, warps, stages) tried by the autotuner on a GPU. Chosen from ptxas reports
# for sm_90 (compiled without a GPU): these spill little or nothing at d = 32 and 64; the 16-row
# ones are the only candidates that fit d = 256 (two fp32 (BLOCK_M, 512) accumulators).
_FWD_CONFIGS = _configs([(64, 64, 4, 3), (64, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (64, 32, 8, 2),
                         (64, 32, 4, 3), (32, 64, 4, 2), (32, 32, 4, 2), (16, 64, 8, 2), (16, 32, 4, 2)])
_BWD_CONFIGS = _configs([(16, 64, 8, 2), (16, 32, 8, 2), (32, 32, 8, 2), (32, 64, 8, 2), (16, 32, 4, 2),
                         (32, 32, 4, 2), (32, 64, 4, 2), (16, 16, 4, 2)])


def _fits_registers(rows: int, block_d: int, num_warps: int) -> bool:
    """The fp32 accumulators of a program hold rows x 4d values (forward: two (BLOCK_M, 2d);
    backward: dK1, dK2 (BLOCK_N, d) and dV (BLOCK_N, 2d)); keep them to 128 registers a thread."""
    return 4 * rows * block_d <= 128 * 32 * num_warps


def _prune_fwd(configs, named_args, **kwargs):
    fit = [c for c in configs if _fits_registers(c.kwargs["BLOCK_M"], kwargs["BLOCK_D"], c.num_warps)]
    return fit or configs[-1:]


def _prune_bwd(configs, named_args, **kwargs):
    fit = [c for c in configs if _fits_registers(c.kwargs["BLOCK_N"], kwargs["BLOCK_D"], c.num_warps)]
    return fit or configs[-1:]


def block_d(head_dim: int) -> int:
    """Width the kernels compute with: the next power of two >= d, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(head_dim))


def grid_1d(blocks: int, heads: int) -> tuple[int]:
    """Grid of ``blocks`` programs for each of ``heads`` (batch x head) pairs, folded into axis 0.

    Axis 0 holds up to 2³¹ − 1 programs, axes 1 and 2 only 65,535, so B·H never goes there; the
    kernels unfold pid -> (pid // blocks, pid % blocks), the blocks of one head adjacent (they
    share its K and V in L2)."""
    total = blocks * heads
    if total > MAX_GRID_PROGRAMS:
        raise ValueError(f"triton_diff_attention: {total} programs ({heads} batch x heads x {blocks} blocks) exceed "
                         f"the CUDA grid limit of {MAX_GRID_PROGRAMS}")
    return (total,)


# --- kernels ------------------------------------------------------------------------------
# Shared conventions: HEAD_DIM = d, BLOCK_D = next power of two (loads and stores of the padded
# columns are masked off only when BLOCK_D != HEAD_DIM, a compile-time test); scores are kept
# in log2 units (exp2 is the cheap instruction); KEY_VALID (B, S) uint8 is read only if KEY_MASK.


@triton.jit
def _key_block(
    K1, K2, V, KEY_VALID_ROW, k_base, v_base, stride_kt, stride_vt,
    cols, query_pos, offs_d, offs_v, S,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, KEY_MASK: tl.constexpr,
):
    """One block of keys for a block of queries, as the forward and the dQ pass read it: k1, k2
    (BLOCK_N, BLOCK_D), v (BLOCK_N, 2·BLOCK_D), zero past S and past d, and which (query, key)
    pairs are visible: key < S, a real key or the query's own position (key mask), causal."""
    col_ok = cols < S
    k_mask = col_ok[:, None]
    v_mask = col_ok[:, None]
    if BLOCK_D != HEAD_DIM:  # padded head dim
        k_mask = k_mask & (offs_d < HEAD_DIM)[None, :]
        v_mask = v_mask & (offs_v < 2 * HEAD_DIM)[None, :]
    k1 = tl.load(K1 + k_base + cols[:, None] * stride_kt + offs_d[None, :], mask=k_mask, other=0.0)
    k2 = tl.load(K2 + k_base + cols[:, None] * stride_kt + offs_d[None, :], mask=k_mask, other=0.0)
    v = tl.load(V + v_base + cols[:, None] * stride_vt + offs_v[None, :], mask=v_mask, other=0.0)
    visible = col_ok[None, :]  # (1, BLOCK_N), (BLOCK_M, BLOCK_N) once a mask depends on the query
    if KEY_MASK:
        real = tl.load(KEY_VALID_ROW + cols, mask=col_ok, other=0) != 0
        visible = visible & (real[None, :] | (cols[None, :] == query_pos[:, None]))
    if CAUSAL:
        visible = visible & (cols[None, :] <= query_pos[:, None])
    return k1, k2, v, visible


def _diff_attn_fwd(
    Q1, Q2, K1, K2, V, LAM, KEY_VALID, OUT, OUT2, LSE1, LSE2,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh, stride_ot,
    stride_mb,
    H, N_REP, T, S, qk_scale, LENGTH_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, KEY_MASK: tl.constexpr,
    STORE_O2: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    n_m = tl.cdiv(T, BLOCK_M)  # grid axis 0 = (batch·head, query block), folded (see grid_1d)
    pid = tl.program_id(0)
    pid_bh = pid // n_m
    pid_m = pid % n_m
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    g = (h // N_REP).to(tl.int64)  # the KV head this query head reads (GQA)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = tl.arange(0, 2 * BLOCK_D)
    row_ok = offs_m < T
    q_mask = row_ok[:, None]
    o_mask = row_ok[:, None]
    if BLOCK_D != HEAD_DIM:  # padded head dim (d = 96): mask the columns past d / 2d
        q_mask = q_mask & (offs_d < HEAD_DIM)[None, :]
        o_mask = o_mask & (offs_v < 2 * HEAD_DIM)[None, :]

    q_rows = b * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :]
    q1 = tl.load(Q1 + q_rows, mask=q_mask, other=0.0)  # (BLOCK_M, BLOCK_D), loaded once
    q2 = tl.load(Q2 + q_rows, mask=q_mask, other=0.0)
    k_base = b * stride_kb + g * stride_kh
    v_base = b * stride_vb + g * stride_vh
    lam = tl.load(LAM + h)

    # Two online-softmax states and two fp32 accumulators (BLOCK_M, 2·BLOCK_D).
    m1 = tl.full([BLOCK_M], -1.0e30, tl.float32)
    m2 = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l1 = tl.zeros([BLOCK_M], tl.float32)
    l2 = tl.zeros([BLOCK_M], tl.float32)
    acc1 = tl.zeros([BLOCK_M, 2 * BLOCK_D], tl.float32)
    acc2 = tl.zeros([BLOCK_M, 2 * BLOCK_D], tl.float32)

    offset = S - T  # query i sits at absolute position offset + i (causal mask aligned to the end)
    hi = S
    if CAUSAL:
        hi = tl.minimum(S, offset + (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        k1, k2, v, visible = _key_block(K1, K2, V, KEY_VALID + b * stride_mb, k_base, v_base, stride_kt, stride_vt,
                                        start_n + offs_n, offset + offs_m, offs_d, offs_v, S,
                                        HEAD_DIM, BLOCK_D, CAUSAL, KEY_MASK)
        s1 = tl.dot(q1, tl.trans(k1), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        s2 = tl.dot(q2, tl.trans(k2), input_precision=PRECISION) * qk_scale
        s1 = tl.where(visible, s1, float("-inf"))
        s2 = tl.where(visible, s2, float("-inf"))

        m1_new = tl.maximum(m1, tl.max(s1, 1))
        p1 = tl.exp2(s1 - m1_new[:, None])
        alpha1 = tl.exp2(m1 - m1_new)
        l1 = l1 * alpha1 + tl.sum(p1, 1)
        acc1 = tl.dot(p1.to(v.dtype), v, acc1 * alpha1[:, None], input_precision=PRECISION)
        m1 = m1_new

        m2_new = tl.maximum(m2, tl.max(s2, 1))
        p2 = tl.exp2(s2 - m2_new[:, None])
        alpha2 = tl.exp2(m2 - m2_new)
        l2 = l2 * alpha2 + tl.sum(p2, 1)
        acc2 = tl.dot(p2.to(v.dtype), v, acc2 * alpha2[:, None], input_precision=PRECISION)
        m2 = m2_new

    # A row with no visible key (only possible non-causally with T > S and a key mask) gives 0.
    l1 = tl.where(l1 > 0.0, l1, 1.0)
    l2 = tl.where(l2 > 0.0, l2, 1.0)
    o2 = acc2 / l2[:, None]
    out = acc1 / l1[:, None] - lam * o2  # (BLOCK_M, 2·BLOCK_D)
    o_rows = b * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_ot + offs_v[None, :]
    tl.store(OUT + o_rows, out.to(OUT.dtype.element_ty), mask=o_mask)
    if STORE_O2:
        tl.store(OUT2 + o_rows, o2.to(OUT2.dtype.element_ty), mask=o_mask)
    lse_rows = pid_bh.to(tl.int64) * T + offs_m
    tl.store(LSE1 + lse_rows, m1 + tl.log2(l1), mask=row_ok)
    tl.store(LSE2 + lse_rows, m2 + tl.log2(l2), mask=row_ok)


def _diff_attn_bwd_rowsums(
    OUT, OUT2, DO, LAM, DELTA1, DELTA2,
    stride_ob, stride_oh, stride_ot,
    stride_dob, stride_doh, stride_dot,
    H, T,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """DELTA2 = rowsum(dO ⊙ O2), DELTA1 = rowsum(dO ⊙ O1) = rowsum(dO ⊙ O) + λ·DELTA2, fp32 (B, H, T)."""
    n_m = tl.cdiv(T, BLOCK_M)
    pid = tl.program_id(0)
    pid_bh = pid // n_m
    pid_m = pid % n_m
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_v = tl.arange(0, 2 * BLOCK_D)
    row_ok = rows < T
    mask = row_ok[:, None]
    if BLOCK_D != HEAD_DIM:
        mask = mask & (offs_v < 2 * HEAD_DIM)[None, :]
    o_rows = b * stride_ob + h * stride_oh + rows[:, None] * stride_ot + offs_v[None, :]
    do_rows = b * stride_dob + h * stride_doh + rows[:, None] * stride_dot + offs_v[None, :]
    o = tl.load(OUT + o_rows, mask=mask, other=0.0).to(tl.float32)
    o2 = tl.load(OUT2 + o_rows, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + do_rows, mask=mask, other=0.0).to(tl.float32)
    delta2 = tl.sum(do * o2, 1)
    delta1 = tl.sum(do * o, 1) + tl.load(LAM + h) * delta2
    tl.store(DELTA1 + pid_bh.to(tl.int64) * T + rows, delta1, mask=row_ok)
    tl.store(DELTA2 + pid_bh.to(tl.int64) * T + rows, delta2, mask=row_ok)


def _diff_attn_bwd(
    Q1, Q2, K1, K2, V, LAM, KEY_VALID, DO, LSE1, LSE2, DELTA1, DELTA2, DQ1, DQ2, DK1, DK2, DV,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    stride_dkb, stride_dkh, stride_dkt,
    stride_dvb, stride_dvh, stride_dvt,
    stride_mb,
    H, HKV, N_REP, T, S, qk_scale, sm_scale, LENGTH_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, KEY_MASK: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    n_n = tl.cdiv(S, BLOCK_N)  # grid axis 0 = (batch·KV head, key block), folded
    pid = tl.program_id(0)
    pid_bg = pid // n_n
    pid_n = pid % n_n
    b = (pid_bg // HKV).to(tl.int64)
    g = pid_bg % HKV
    start_n = pid_n * BLOCK_N
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = tl.arange(0, 2 * BLOCK_D)
    col_ok = cols < S
    k_mask = col_ok[:, None]
    v_mask = col_ok[:, None]
    if BLOCK_D != HEAD_DIM:
        k_mask = k_mask & (offs_d < HEAD_DIM)[None, :]
        v_mask = v_mask & (offs_v < 2 * HEAD_DIM)[None, :]

    k_rows = b * stride_kb + g.to(tl.int64) * stride_kh + cols[:, None] * stride_kt + offs_d[None, :]
    k1 = tl.load(K1 + k_rows, mask=k_mask, other=0.0)  # (BLOCK_N, BLOCK_D), loaded once
    k2 = tl.load(K2 + k_rows, mask=k_mask, other=0.0)
    v_rows = b * stride_vb + g.to(tl.int64) * stride_vh + cols[:, None] * stride_vt + offs_v[None, :]
    v = tl.load(V + v_rows, mask=v_mask, other=0.0)  # (BLOCK_N, 2·BLOCK_D)
    real = col_ok
    if KEY_MASK:
        real = tl.load(KEY_VALID + b * stride_mb + cols, mask=col_ok, other=0) != 0
    dk1 = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dk2 = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, 2 * BLOCK_D], tl.float32)

    offset = S - T
    lo = 0
    if CAUSAL:  # the first query that sees key start_n is start_n - offset
        lo = (tl.maximum(start_n - offset, 0) // BLOCK_M) * BLOCK_M
    for r in range(N_REP):  # every query head of this KV group
        h = (g * N_REP + r).to(tl.int64)
        lam = tl.load(LAM + h)
        q_base = b * stride_qb + h * stride_qh
        do_base = b * stride_dob + h * stride_doh
        row_base = (b * H + h) * T  # LSE, DELTA and the fp32 DQ buffers are contiguous (B, H, T[, d])
        for start_m in range(lo, T, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            row_ok = rows < T
            q_mask = row_ok[:, None]
            do_mask = row_ok[:, None]
            if BLOCK_D != HEAD_DIM:
                q_mask = q_mask & (offs_d < HEAD_DIM)[None, :]
                do_mask = do_mask & (offs_v < 2 * HEAD_DIM)[None, :]
            q1 = tl.load(Q1 + q_base + rows[:, None] * stride_qt + offs_d[None, :], mask=q_mask, other=0.0)
            q2 = tl.load(Q2 + q_base + rows[:, None] * stride_qt + offs_d[None, :], mask=q_mask, other=0.0)
            do = tl.load(DO + do_base + rows[:, None] * stride_dot + offs_v[None, :], mask=do_mask, other=0.0)
            lse1 = tl.load(LSE1 + row_base + rows, mask=row_ok, other=0.0)
            lse2 = tl.load(LSE2 + row_base + rows, mask=row_ok, other=0.0)
            delta1 = tl.load(DELTA1 + row_base + rows, mask=row_ok, other=0.0)
            delta2 = tl.load(DELTA2 + row_base + rows, mask=row_ok, other=0.0)

            # Transposed maps (BLOCK_N, BLOCK_M): keys are rows here.
            visible = col_ok[:, None] & row_ok[None, :]
            if KEY_MASK:
                visible = visible & (real[:, None] | (cols[:, None] == offset + rows[None, :]))
            if CAUSAL:
                visible = visible & (cols[:, None] <= offset + rows[None, :])
            s1t = tl.dot(k1, tl.trans(q1), input_precision=PRECISION) * qk_scale
            s2t = tl.dot(k2, tl.trans(q2), input_precision=PRECISION) * qk_scale
            p1t = tl.where(visible, tl.exp2(s1t - lse1[None, :]), 0.0)
            p2t = tl.where(visible, tl.exp2(s2t - lse2[None, :]), 0.0)

            dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # dP = dO·Vᵀ, shared by both maps
            dv = tl.dot((p1t - lam * p2t).to(do.dtype), do, dv, input_precision=PRECISION)
            ds1t = p1t * (dpt - delta1[None, :])
            ds2t = -lam * p2t * (dpt - delta2[None, :])
            dk1 = tl.dot(ds1t.to(q1.dtype), q1, dk1, input_precision=PRECISION)
            dk2 = tl.dot(ds2t.to(q2.dtype), q2, dk2, input_precision=PRECISION)

            if ATOMIC_DQ:  # else the deterministic dQ kernel below computes dQ
                dq_rows = (row_base + rows)[:, None] * HEAD_DIM + offs_d[None, :]
                dq1 = tl.dot(tl.trans(ds1t).to(k1.dtype), k1, input_precision=PRECISION) * sm_scale
                dq2 = tl.dot(tl.trans(ds2t).to(k2.dtype), k2, input_precision=PRECISION) * sm_scale
                tl.atomic_add(DQ1 + dq_rows, dq1, mask=q_mask)
                tl.atomic_add(DQ2 + dq_rows, dq2, mask=q_mask)

    dk_rows = b * stride_dkb + g.to(tl.int64) * stride_dkh + cols[:, None] * stride_dkt + offs_d[None, :]
    tl.store(DK1 + dk_rows, (dk1 * sm_scale).to(DK1.dtype.element_ty), mask=k_mask)
    tl.store(DK2 + dk_rows, (dk2 * sm_scale).to(DK2.dtype.element_ty), mask=k_mask)
    dv_rows = b * stride_dvb + g.to(tl.int64) * stride_dvh + cols[:, None] * stride_dvt + offs_v[None, :]
    tl.store(DV + dv_rows, dv.to(DV.dtype.element_ty), mask=v_mask)


def _diff_attn_bwd_dq(
    Q1, Q2, K1, K2, V, LAM, KEY_VALID, DO, LSE1, LSE2, DELTA1, DELTA2, DQ1, DQ2,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    stride_dqb, stride_dqh, stride_dqt,
    stride_mb,
    H, N_REP, T, S, qk_scale, sm_scale, LENGTH_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, KEY_MASK: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Deterministic dQ: one program per block of BLOCK_M queries of one head owns its dQ1, dQ2
    rows and loops over the key blocks (recomputing P1, P2 and dP), so nothing is added atomically."""
    n_m = tl.cdiv(T, BLOCK_M)
    pid = tl.program_id(0)
    pid_bh = pid // n_m
    pid_m = pid % n_m
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    g = (h // N_REP).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = tl.arange(0, 2 * BLOCK_D)
    row_ok = rows < T
    q_mask = row_ok[:, None]
    do_mask = row_ok[:, None]
    if BLOCK_D != HEAD_DIM:
        q_mask = q_mask & (offs_d < HEAD_DIM)[None, :]
        do_mask = do_mask & (offs_v < 2 * HEAD_DIM)[None, :]
    h64 = h.to(tl.int64)
    q_rows = b * stride_qb + h64 * stride_qh + rows[:, None] * stride_qt + offs_d[None, :]
    q1 = tl.load(Q1 + q_rows, mask=q_mask, other=0.0)  # (BLOCK_M, BLOCK_D)
    q2 = tl.load(Q2 + q_rows, mask=q_mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h64 * stride_doh + rows[:, None] * stride_dot + offs_v[None, :],
                 mask=do_mask, other=0.0)  # (BLOCK_M, 2·BLOCK_D)
    row_base = pid_bh.to(tl.int64) * T
    lse1 = tl.load(LSE1 + row_base + rows, mask=row_ok, other=0.0)
    lse2 = tl.load(LSE2 + row_base + rows, mask=row_ok, other=0.0)
    delta1 = tl.load(DELTA1 + row_base + rows, mask=row_ok, other=0.0)
    delta2 = tl.load(DELTA2 + row_base + rows, mask=row_ok, other=0.0)
    lam = tl.load(LAM + h)
    k_base = b * stride_kb + g * stride_kh
    v_base = b * stride_vb + g * stride_vh
    dq1 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq2 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    offset = S - T
    hi = S
    if CAUSAL:
        hi = tl.minimum(S, offset + (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        k1, k2, v, visible = _key_block(K1, K2, V, KEY_VALID + b * stride_mb, k_base, v_base, stride_kt, stride_vt,
                                        start_n + offs_n, offset + rows, offs_d, offs_v, S,
                                        HEAD_DIM, BLOCK_D, CAUSAL, KEY_MASK)
        visible = visible & row_ok[:, None]  # (BLOCK_M, BLOCK_N)
        s1 = tl.dot(q1, tl.trans(k1), input_precision=PRECISION) * qk_scale
        s2 = tl.dot(q2, tl.trans(k2), input_precision=PRECISION) * qk_scale
        p1 = tl.where(visible, tl.exp2(s1 - lse1[:, None]), 0.0)
        p2 = tl.where(visible, tl.exp2(s2 - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N)
        ds1 = p1 * (dp - delta1[:, None])
        ds2 = -lam * p2 * (dp - delta2[:, None])
        dq1 = tl.dot(ds1.to(k1.dtype), k1, dq1, input_precision=PRECISION)
        dq2 = tl.dot(ds2.to(k2.dtype), k2, dq2, input_precision=PRECISION)

    dq_rows = b * stride_dqb + h64 * stride_dqh + rows[:, None] * stride_dqt + offs_d[None, :]
    tl.store(DQ1 + dq_rows, (dq1 * sm_scale).to(DQ1.dtype.element_ty), mask=q_mask)
    tl.store(DQ2 + dq_rows, (dq2 * sm_scale).to(DQ2.dtype.element_ty), mask=q_mask)


_rowsums_kernel = triton.jit(_diff_attn_bwd_rowsums)
_ROWSUM_BLOCK = 16 if INTERPRET else 64
_fwd_jit = triton.jit(_diff_attn_fwd)
_bwd_jit = triton.jit(_diff_attn_bwd)
_dq_jit = triton.jit(_diff_attn_bwd_dq)
if INTERPRET:  # the autotuner needs a GPU: the interpreter launches the plain kernels
    _fwd_kernel, _bwd_kernel, _dq_kernel = _fwd_jit, _bwd_jit, _dq_jit
else:
    _fwd_kernel = triton.autotune(
        configs=_FWD_CONFIGS,
        key=["LENGTH_BUCKET", "HEAD_DIM", "CAUSAL", "KEY_MASK", "STORE_O2"],
        prune_configs_by={"early_config_prune": _prune_fwd},
    )(_fwd_jit)
    _bwd_kernel = triton.autotune(
        configs=_BWD_CONFIGS,
        key=["LENGTH_BUCKET", "HEAD_DIM", "CAUSAL", "KEY_MASK", "ATOMIC_DQ"],
        prune_configs_by={"early_config_prune": _prune_bwd},
        reset_to_zero=["DQ1", "DQ2"],  # dQ is accumulated atomically: zero it before every trial
    )(_bwd_jit)
    _dq_kernel = triton.autotune(  # holds two (BLOCK_M, d) accumulators and dO: sized like the forward
        configs=_FWD_CONFIGS,
        key=["LENGTH_BUCKET", "HEAD_DIM", "CAUSAL", "KEY_MASK"],
        prune_configs_by={"early_config_prune": _prune_fwd},
    )(_dq_jit)

# name -> (plain kernel, autotuned kernel, candidate configs, pruning function)
_KERNELS = {
    "fwd": (_fwd_jit, _fwd_kernel, _FWD_CONFIGS, _prune_fwd),
    "bwd": (_bwd_jit, _bwd_kernel, _BWD_CONFIGS, _prune_bwd),
    "dq": (_dq_jit, _dq_kernel, _FWD_CONFIGS, _prune_fwd),
}
_forced_configs: dict[str, triton.Config] = {}


@contextlib.contextmanager
def forced_configs(**configs: triton.Config) -> Iterator[None]:
    """Launch the named kernels ("fwd", "bwd", "dq") with these configs (block sizes, and warps and
    stages on a GPU) instead of autotuning or the interpreter's blocks; for tests of each config."""
    unknown = set(configs) - set(_KERNELS)
    if unknown:
        raise ValueError(f"unknown kernel(s) {sorted(unknown)}; choose from {sorted(_KERNELS)}")
    saved = dict(_forced_configs)
    _forced_configs.update(configs)
    try:
        yield
    finally:
        _forced_configs.clear()
        _forced_configs.update(saved)


def default_config(name: str, head_dim: int) -> triton.Config:
    """The config a kernel runs with the autotuner off: the first candidate that fits d."""
    _, _, configs, prune = _KERNELS[name]
    return prune(configs, {}, BLOCK_D=block_d(head_dim))[0]


def _launch(name: str, grid, args: tuple, constexprs: dict) -> None:
    """Run kernel ``name``: a forced config, else the interpreter's blocks, else autotuned, else
    (autotuning off) the default config."""
    plain, tuned, _, _ = _KERNELS[name]
    config = _forced_configs.get(name)
    if config is None and INTERPRET:
        plain[grid](*args, **constexprs, **_INTERPRET_BLOCKS)
        return
    if config is None and autotune_enabled():
        tuned[grid](*args, **constexprs)
        return
    config = config or default_config(name, constexprs["HEAD_DIM"])
    options = {} if INTERPRET else dict(num_warps=config.num_warps, num_stages=config.num_stages)
    plain[grid](*args, **constexprs, **config.kwargs, **options)


# --- host side ----------------------------------------------------------------------------


def _length_bucket(t: int, s: int) -> int:
    """Autotuning key: the next power of two of the longest length, so that every prompt length
    does not trigger a new tuning run."""
    return 1 << max(t, s, 16).bit_length()


def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products (not TF32) so the fp32 path matches the reference."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _device_guard(device: torch.device):
    """Launch on the tensors' GPU (cuda:1 ...), not on the current device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _unit_last_stride(*xs: Tensor) -> tuple[Tensor, ...]:
    return tuple(x if x.stride(-1) == 1 else x.contiguous() for x in xs)


def _same_strides(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """The kernels take one set of strides for each pair (q1, q2), (k1, k2) and (O, O2)."""
    return (a, b) if a.stride() == b.stride() else (a.contiguous(), b.contiguous())


def _prepare(q1, q2, k1, k2, v):
    q1, q2, k1, k2, v = _unit_last_stride(q1, q2, k1, k2, v)
    q1, q2 = _same_strides(q1, q2)
    k1, k2 = _same_strides(k1, k2)
    return q1, q2, k1, k2, v


def _key_mask_arg(key_valid: Tensor | None, like: Tensor) -> tuple[Tensor, int]:
    """(B, S) bool -> uint8 with unit last stride, and its batch stride; a dummy when absent."""
    if key_valid is None:
        return like, 0
    kv = key_valid.to(torch.uint8).contiguous()
    return kv, kv.stride(0)


@torch.library.custom_op("diff_transformer::triton_diff_attention_fwd", mutates_args=())
def _forward_op(
    q1: Tensor, q2: Tensor, k1: Tensor, k2: Tensor, v: Tensor, lam: Tensor,
    causal: bool, scale: float, store_o2: bool, key_valid: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> out (B, H, T, 2d), O2 (same, or empty unless store_o2), lse1, lse2 (B, H, T) fp32 log2 units.
    key_valid: optional (B, S) bool, True = a real key (a query also always sees its own position)."""
    q1, q2, k1, k2, v = _prepare(q1, q2, k1, k2, v)
    b, h, t, d = q1.shape
    hkv, s = k1.shape[1], k1.shape[2]
    out = torch.empty(b, h, t, 2 * d, device=q1.device, dtype=q1.dtype)
    o2 = torch.empty_like(out) if store_o2 else out.new_empty(0)
    lse1 = torch.empty(b, h, t, device=q1.device, dtype=torch.float32)
    lse2 = torch.empty_like(lse1)
    kv, stride_mb = _key_mask_arg(key_valid, q1)
    args = (
        q1, q2, k1, k2, v, lam, kv, out, o2 if store_o2 else out, lse1, lse2,
        q1.stride(0), q1.stride(1), q1.stride(2),
        k1.stride(0), k1.stride(1), k1.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        stride_mb,
        h, h // hkv, t, s, scale * _LOG2_E, _length_bucket(t, s),
    )
    constexprs = dict(HEAD_DIM=d, BLOCK_D=block_d(d), CAUSAL=causal, KEY_MASK=key_valid is not None,
                      STORE_O2=store_o2, PRECISION=_precision(q1.dtype))
    with _device_guard(q1.device):
        _launch("fwd", lambda meta: grid_1d(triton.cdiv(t, meta["BLOCK_M"]), b * h), args, constexprs)
    return out, o2, lse1, lse2


@_forward_op.register_fake
def _(q1, q2, k1, k2, v, lam, causal, scale, store_o2, key_valid=None):
    b, h, t, d = q1.shape
    out = q1.new_empty(b, h, t, 2 * d)
    o2 = q1.new_empty(b, h, t, 2 * d) if store_o2 else q1.new_empty(0)
    return out, o2, q1.new_empty(b, h, t, dtype=torch.float32), q1.new_empty(b, h, t, dtype=torch.float32)


@torch.library.custom_op("diff_transformer::triton_diff_attention_bwd", mutates_args=())
def _backward_op(
    grad_out: Tensor, q1: Tensor, q2: Tensor, k1: Tensor, k2: Tensor, v: Tensor, lam: Tensor,
    out: Tensor, o2: Tensor, lse1: Tensor, lse2: Tensor, causal: bool, scale: float,
    key_valid: Optional[Tensor] = None, deterministic: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> dq1, dq2 (B, H, T, d), dk1, dk2 (B, Hkv, S, d), dv (B, Hkv, S, 2d), dλ (H,) fp32.
    ``deterministic``: dQ by a separate pass without atomics (bitwise repeatable)."""
    q1, q2, k1, k2, v = _prepare(q1, q2, k1, k2, v)
    grad_out, out, o2 = _unit_last_stride(grad_out, out, o2)
    out, o2 = _same_strides(out, o2)
    b, h, t, d = q1.shape
    hkv, s = k1.shape[1], k1.shape[2]
    bd = block_d(d)
    kv, stride_mb = _key_mask_arg(key_valid, q1)
    delta1 = torch.empty(b, h, t, device=q1.device, dtype=torch.float32)
    delta2 = torch.empty_like(delta1)
    if deterministic:  # written (not accumulated) by the dQ kernel, in the inputs' dtype
        dq1 = torch.empty(b, h, t, d, device=q1.device, dtype=q1.dtype)
        dq2 = torch.empty_like(dq1)
        dq_acc1 = dq_acc2 = delta1  # unused by the main kernel (ATOMIC_DQ=False)
    else:  # fp32 buffers the main kernel adds into atomically
        dq_acc1 = torch.zeros(b, h, t, d, device=q1.device, dtype=torch.float32)
        dq_acc2 = torch.zeros_like(dq_acc1)
    dk1 = torch.empty(b, hkv, s, d, device=k1.device, dtype=k1.dtype)
    dk2 = torch.empty_like(dk1)
    dv = torch.empty(b, hkv, s, 2 * d, device=v.device, dtype=v.dtype)
    common = dict(HEAD_DIM=d, BLOCK_D=bd, CAUSAL=causal, KEY_MASK=key_valid is not None, PRECISION=_precision(q1.dtype))

    with _device_guard(q1.device):
        _rowsums_kernel[grid_1d(triton.cdiv(t, _ROWSUM_BLOCK), b * h)](
            out, o2, grad_out, lam, delta1, delta2,
            out.stride(0), out.stride(1), out.stride(2),
            grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
            h, t, HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=_ROWSUM_BLOCK,
        )
        bwd_args = (
            q1, q2, k1, k2, v, lam, kv, grad_out, lse1, lse2, delta1, delta2, dq_acc1, dq_acc2, dk1, dk2, dv,
            q1.stride(0), q1.stride(1), q1.stride(2),
            k1.stride(0), k1.stride(1), k1.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
            dk1.stride(0), dk1.stride(1), dk1.stride(2),
            dv.stride(0), dv.stride(1), dv.stride(2),
            stride_mb,
            h, hkv, h // hkv, t, s, scale * _LOG2_E, scale, _length_bucket(t, s),
        )
        _launch("bwd", lambda meta: grid_1d(triton.cdiv(s, meta["BLOCK_N"]), b * hkv), bwd_args,
                dict(common, ATOMIC_DQ=not deterministic))
        if deterministic:
            dq_args = (
                q1, q2, k1, k2, v, lam, kv, grad_out, lse1, lse2, delta1, delta2, dq1, dq2,
                q1.stride(0), q1.stride(1), q1.stride(2),
                k1.stride(0), k1.stride(1), k1.stride(2),
                v.stride(0), v.stride(1), v.stride(2),
                grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
                dq1.stride(0), dq1.stride(1), dq1.stride(2),
                stride_mb,
                h, h // hkv, t, s, scale * _LOG2_E, scale, _length_bucket(t, s),
            )
            _launch("dq", lambda meta: grid_1d(triton.cdiv(t, meta["BLOCK_M"]), b * h), dq_args, common)
        else:
            dq1, dq2 = dq_acc1.to(q1.dtype), dq_acc2.to(q2.dtype)
    dlam = -delta2.sum(dim=(0, 2))  # (H,)
    return dq1, dq2, dk1, dk2, dv, dlam


@_backward_op.register_fake
def _(grad_out, q1, q2, k1, k2, v, lam, out, o2, lse1, lse2, causal, scale, key_valid=None, deterministic=False):
    return (  # contiguous, like the real gradients
        q1.new_empty(q1.shape), q2.new_empty(q2.shape), k1.new_empty(k1.shape), k2.new_empty(k2.shape),
        v.new_empty(v.shape), lam.new_empty(lam.shape, dtype=torch.float32),
    )


def _setup_context(ctx, inputs, output):
    q1, q2, k1, k2, v, lam, causal, scale, store_o2, key_valid = inputs
    out, o2, lse1, lse2 = output
    ctx.save_for_backward(q1, q2, k1, k2, v, lam, out, o2, lse1, lse2, key_valid)
    ctx.causal, ctx.scale = causal, scale
    ctx.mark_non_differentiable(o2, lse1, lse2)  # saved for the backward, not results


def _backward(ctx, grad_out, *unused):
    q1, q2, k1, k2, v, lam, out, o2, lse1, lse2, key_valid = ctx.saved_tensors
    if o2.numel() == 0:
        raise RuntimeError("triton_diff_attention: the forward ran without gradients enabled, so it kept no O2")
    # torch.use_deterministic_algorithms(True) -> dQ without atomics (read when the backward runs
    # or, under torch.compile, when it is traced).
    deterministic = torch.are_deterministic_algorithms_enabled()
    grads = _backward_op(grad_out, q1, q2, k1, k2, v, lam, out, o2, lse1, lse2, ctx.causal, ctx.scale,
                         key_valid, deterministic)
    return (*grads, None, None, None, None)


# The forward op carries its own autograd formula, so torch.compile sees one custom op per call
# (forward) and one in the backward graph, with no Python autograd.Function to trace through.
_forward_op.register_autograd(_backward, setup_context=_setup_context)


class TritonDiffAttention:
    """Kept for callers of the former autograd.Function: ``apply`` runs the custom op."""

    @staticmethod
    def apply(q1, q2, k1, k2, v, lam, causal: bool, scale: float, store_o2: bool, key_valid=None):
        return _forward_op(q1, q2, k1, k2, v, lam, causal, scale, store_o2, key_valid)[0]


def check_supported(q1: Tensor) -> None:
    """Raise a clear error for inputs the kernels cannot take."""
    if q1.device.type == "cpu" and not INTERPRET:
        raise RuntimeError(
            "backend 'triton' needs a CUDA GPU; these tensors are on CPU. To run the kernels on CPU "
            "(slowly, for tests) set TRITON_INTERPRET=1 before diff_transformer.ops.triton_diff is imported."
        )
    if q1.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"backend 'triton' takes float16, bfloat16 or float32 tensors, got {q1.dtype}")
    d = q1.shape[-1]
    if d not in TRITON_HEAD_DIMS:
        raise ValueError(f"backend 'triton' supports head dims d in {TRITON_HEAD_DIMS} (v of width 2d), got d={d}")


def triton_diff_attention(
    q1: Tensor,
    q2: Tensor,
    k1: Tensor,
    k2: Tensor,
    v: Tensor,
    lam: Tensor,
    *,
    causal: bool = True,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """The fused kernel with the signature of the other backends (shapes checked by the caller).

    q1, q2 (B, H, T, d); k1, k2 (B, Hkv, S, d); v (B, Hkv, S, 2d); lam 0-d or (H,), any float
    dtype (its gradient flows back through the cast); key_padding_mask (B, S) bool, True = a real
    key (a query always keeps its own position S − T + i visible). Returns (B, H, T, 2d) in q1's dtype.
    """
    if attn_mask is not None:
        raise ValueError(
            "backend 'triton' takes no attn_mask (only the causal mask and a key_padding_mask (B, S) are "
            "fused); use 'sdpa_split', 'sdpa' or 'reference', or backend='auto', which avoids 'triton' "
            "when an attn_mask is given"
        )
    check_supported(q1)
    b, h, d, s = q1.shape[0], q1.shape[1], q1.shape[-1], k1.shape[2]
    if v.shape[-1] != 2 * d:
        raise ValueError(f"backend 'triton' takes v of width 2d = {2 * d} (the paper's DIFF heads), got {v.shape[-1]} "
                         "(a converted Transformer's heads, value_factor=1): use another backend")
    if key_padding_mask is not None and (key_padding_mask.dtype != torch.bool or key_padding_mask.shape != (b, s)):
        raise ValueError(f"key_padding_mask must be bool (B, S) = {(b, s)}, got "
                         f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}")
    lam_heads = lam.to(torch.float32).reshape(-1).expand(h).contiguous()  # (H,); the expand sums dλ back
    store_o2 = torch.is_grad_enabled() and any(x.requires_grad for x in (q1, q2, k1, k2, v, lam))
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    return _forward_op(q1, q2, k1, k2, v, lam_heads, causal, scale, store_o2, key_padding_mask)[0]
