/* Fused CPU kernels, fp32, for inference, and RMSNorm and RoPE in training (their backwards too):
   built and called by cpu_kernels.py.

   diff_decode_f32: differential attention for one query per sequence against a KV cache.
   For each (batch b, DIFF head h) with KV group g = h / n_rep, in one pass over the cache:
       l1[s] = scale · q1·k1[s],  l2[s] = scale · q2·k2[s]            (hidden keys: weight 0)
       p[s]  = softmax(l1)[s] − λ_h · softmax(l2)[s]
       out   = Σ_s p[s] · v[s]                                        (2d wide)
   K1, K2 and V are read once each; the maps (S floats each) stay in the thread's own buffer.
   The PyTorch path in decode.py computes the same thing and is what this is tested against.

   rms_norm_f32: x / sqrt(mean(x²) + eps) · w over rows, what F.rms_norm computes in six
   operator calls (attention.py's rms_norm is its reference). rms_norm_backward_f32: its
   gradients, for training (attention.py's _RMSNormFunction is their reference).

   rope_f32: the interleaved rotary embedding of attention.py's apply_rope (its reference): each
   pair (x[2i], x[2i+1]) of row t turned by the angle whose cos, sin are rope[t, i], or back by
   it (sign -1: the backward, as the rotation's transpose is its inverse). Eagerly apply_rope is
   nine operator calls.

   linear_f32: y = x·wᵀ for the few rows of a decoding step (nn.Linear without bias, the LM
   head), reading each weight row once from memory and keeping it in L1 while the input rows
   pass. The BLAS's small-row kernels leave much of the memory bandwidth unused when the
   weights are not in cache, as between the layers of a decoding step.

   Work is split across OpenMP threads (the runtime PyTorch itself uses, when both are loaded
   in one process). Strides are in elements; the last dim of every tensor must be contiguous. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* 8 floats, unaligned: GCC/clang vector extensions, AVX with -march=native, SSE pairs without */
typedef float vec8 __attribute__((vector_size(32), aligned(4)));

int diff_decode_f32(
    const float *q1, const float *q2, int64_t q_sb, int64_t q_sh,                 /* (B, H, d) */
    const float *k1, const float *k2, int64_t k_sb, int64_t k_sg, int64_t k_ss,   /* (B, Hkv, S, d) */
    const float *v, int64_t v_sb, int64_t v_sg, int64_t v_ss,                     /* (B, Hkv, S, 2d) */
    const float *lam, int64_t lam_sh,                                             /* λ_h = lam[h·lam_sh] */
    const uint8_t *mask, int64_t m_sb, int64_t m_sh, int64_t m_ss,                /* NULL, or 1 = may attend */
    float *out,                                                                   /* (B, H, 2d) contiguous */
    int64_t batch, int64_t heads, int64_t kv_heads, int64_t keys, int64_t d, float scale, int threads)
{
    const int64_t n_rep = heads / kv_heads, width = 2 * d, items = batch * heads;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *buf = malloc(sizeof(float) * (size_t)(2 * keys + width));
        if (!buf) {
            failed = 1;
        } else {
            float *e1 = buf, *e2 = buf + keys, *acc = buf + 2 * keys;
#pragma omp for schedule(static)
            for (int64_t item = 0; item < items; ++item) {
                const int64_t b = item / heads, h = item % heads, g = h / n_rep;
                const float *a1 = q1 + b * q_sb + h * q_sh, *a2 = q2 + b * q_sb + h * q_sh;
                const float *key1 = k1 + b * k_sb + g * k_sg, *key2 = k2 + b * k_sb + g * k_sg;
                const uint8_t *visible = mask ? mask + b * m_sb + h * m_sh : NULL;
                /* logits and their maxima over the visible keys */
                float max1 = -INFINITY, max2 = -INFINITY;
                for (int64_t s = 0; s < keys; ++s) {
                    const float *r1 = key1 + s * k_ss, *r2 = key2 + s * k_ss;
                    float dot1 = 0.f, dot2 = 0.f;
                    for (int64_t j = 0; j < d; ++j) {
                        dot1 += a1[j] * r1[j];
                        dot2 += a2[j] * r2[j];
                    }
                    e1[s] = dot1 * scale;
                    e2[s] = dot2 * scale;
                    if (!visible || visible[s * m_ss]) {
                        max1 = e1[s] > max1 ? e1[s] : max1;
                        max2 = e2[s] > max2 ? e2[s] : max2;
                    }
                }
                /* exponentials and sums; a hidden key weighs 0 (all hidden: 0/0, NaN, as softmax) */
                float sum1 = 0.f, sum2 = 0.f;
                for (int64_t s = 0; s < keys; ++s) {
                    const int shown = !visible || visible[s * m_ss];
                    e1[s] = shown ? expf(e1[s] - max1) : 0.f;
                    e2[s] = shown ? expf(e2[s] - max2) : 0.f;
                    sum1 += e1[s];
                    sum2 += e2[s];
                }
                const float c1 = 1.f / sum1, c2 = lam[h * lam_sh] / sum2;
                for (int64_t j = 0; j < width; ++j)
                    acc[j] = 0.f;
                const float *vals = v + b * v_sb + g * v_sg;
                for (int64_t s = 0; s < keys; ++s) {
                    const float p = e1[s] * c1 - e2[s] * c2, *row = vals + s * v_ss;
                    for (int64_t j = 0; j < width; ++j)
                        acc[j] += p * row[j];
                }
                float *o = out + item * width;
                for (int64_t j = 0; j < width; ++j)
                    o[j] = acc[j];
            }
            free(buf);
        }
    }
    return failed;
}

int rms_norm_f32(const float *x, int64_t rows, int64_t row_stride, int64_t width, const float *w, float eps, float *out,
                 int threads)
{
    /* small inputs (a decoding step) on one thread: waking the others costs more than the work */
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * width >= 65536)
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * row_stride;
        float *o = out + r * width;
        float squares = 0.f;
        for (int64_t j = 0; j < width; ++j)
            squares += row[j] * row[j];
        const float inv_rms = 1.f / sqrtf(squares / (float)width + eps);
        if (w)
            for (int64_t j = 0; j < width; ++j)
                o[j] = row[j] * inv_rms * w[j];
        else
            for (int64_t j = 0; j < width; ++j)
                o[j] = row[j] * inv_rms;
    }
    return 0;
}

/* The backward of rms_norm_f32 with a weight, for training: with r = 1 / sqrt(mean(x²) + eps)
   and u = g · w per row,
       grad_x = r · (u − x · r² · mean(u · x))          (written contiguous, rows × width)
       grad_w = Σ_rows g · x · r
   Rows go to `parts` fixed slices (not OpenMP's schedule), and slice c adds its rows' share of
   grad_w into partial_w[c]: the caller sums the parts, so that the result does not depend on
   which thread ran what. partial_w (parts × width) must be zeros. */
int rms_norm_backward_f32(const float *x, int64_t x_stride, const float *grad, int64_t g_stride, int64_t rows,
                          int64_t width, const float *w, float eps, float *grad_x, float *partial_w, int parts,
                          int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * width >= 65536)
    for (int c = 0; c < parts; ++c) {
        float *part = partial_w + (int64_t)c * width;
        for (int64_t r = rows * c / parts; r < rows * (c + 1) / parts; ++r) {
            const float *xr = x + r * x_stride, *gr = grad + r * g_stride;
            float *o = grad_x + r * width;
            float squares = 0.f, dot = 0.f;
            for (int64_t j = 0; j < width; ++j) {
                squares += xr[j] * xr[j];
                dot += gr[j] * w[j] * xr[j];
            }
            const float inv_rms = 1.f / sqrtf(squares / (float)width + eps);
            const float k = inv_rms * inv_rms * dot / (float)width;
            for (int64_t j = 0; j < width; ++j) {
                o[j] = inv_rms * (gr[j] * w[j] - xr[j] * k);
                part[j] += gr[j] * xr[j] * inv_rms;
            }
        }
    }
    return 0;
}

int rope_f32(
    const float *x, int64_t x_sb, int64_t x_st, int64_t x_sn,      /* (B, T, n, d) */
    const float *rope, int64_t rope_st,                           /* (T, d/2, 2): cos, sin */
    float sign,                                                   /* 1: turn by the angle; -1: back (the backward) */
    float *out, int64_t o_sb, int64_t o_st, int64_t o_sn,         /* (B, T, n, d) */
    int64_t batch, int64_t rows, int64_t heads, int64_t d, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static) if (batch * rows * heads * d >= 65536)
    for (int64_t bt = 0; bt < batch * rows; ++bt) {
        const int64_t b = bt / rows, t = bt % rows;
        const float *angle = rope + t * rope_st;
        for (int64_t h = 0; h < heads; ++h) {
            const float *src = x + b * x_sb + t * x_st + h * x_sn;
            float *dst = out + b * o_sb + t * o_st + h * o_sn;
            for (int64_t i = 0; i < d / 2; ++i) {
                const float re = src[2 * i], im = src[2 * i + 1], c = angle[2 * i], s = sign * angle[2 * i + 1];
                dst[2 * i] = re * c - im * s;
                dst[2 * i + 1] = re * s + im * c;
            }
        }
    }
    return 0;
}

static inline float sum8(vec8 v)
{
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

int linear_f32(const float *x, int64_t x_sr, const float *w, float *out,  /* x (M, I) rows x_sr apart; w (O, I); out (M, O) */
               int64_t rows, int64_t in, int64_t outs, int threads)
{
    const int64_t blocks = (outs + 7) / 8, in8 = in - in % 8;
#pragma omp parallel for num_threads(threads) schedule(static) if (outs * in >= 16384)
    for (int64_t blk = 0; blk < blocks; ++blk) {
        /* 8 weight rows, 8 dot products at once; the last block repeats its final row instead of
           running past w. The block (8·I floats) stays in L1 while the input rows pass. */
        const int64_t o = 8 * blk, n = outs - o < 8 ? outs - o : 8;
        const float *wr[8];
        for (int j = 0; j < 8; ++j)
            wr[j] = w + (o + (j < n ? j : n - 1)) * in;
        for (int64_t m = 0; m < rows; ++m) {
            const float *xr = x + m * x_sr;
            vec8 acc[8] = {{0}};
            for (int64_t i = 0; i < in8; i += 8) {
                const vec8 u = *(const vec8 *)(xr + i);
                for (int j = 0; j < 8; ++j)
                    acc[j] += u * *(const vec8 *)(wr[j] + i);
            }
            for (int64_t j = 0; j < n; ++j) {
                float y = sum8(acc[j]);
                for (int64_t i = in8; i < in; ++i)
                    y += xr[i] * wr[j][i];
                out[m * outs + o + j] = y;
            }
        }
    }
    return 0;
}
