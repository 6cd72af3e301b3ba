// Element-wise and attention kernels of the CUDA backend (`kernels::cuda`), compiled once per
// process with NVRTC. Each kernel mirrors the CPU function of the same name in `kernels::cpu`;
// the module is compiled with `--fmad=false` so products and sums round as the CPU's do.
//
// Conventions: every array is row-major f32 unless said otherwise; sizes are 32-bit (the Rust
// side checks they fit); reductions use shared memory and need `blockDim.x == BLOCK`, a power
// of two. Positions are 64-bit, as `usize` is on the host.

#define BLOCK 256
#define ATTN_BLOCK 128
// Output elements per thread in `attention`: head_dim <= ATTN_BLOCK * ATTN_DIMS.
#define ATTN_DIMS 4
// Columns of a key tile `attention` stages in shared memory at a time; a staged row is
// ATTN_CHUNK + 1 floats long, so thread t reading row t hits bank (t + c) % 32: no conflicts.
#define ATTN_CHUNK 64
// Query heads of one KV head that one `attention` block serves (more are split into slices).
#define ATTN_GROUP 4

typedef unsigned long long u64;

// NVRTC compiles without the C headers, so neither INFINITY nor isnan is assumed.
#define NEG_INF __int_as_float((int)0xff800000u)

// x rounded to bfloat16 (nearest, ties to even; NaN stays NaN), as raw bits. Done on the bits,
// so it needs neither cuda_bf16.h nor an sm_80 conversion instruction.
__device__ unsigned short bf16_of(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// Sum of `v` over the block; every thread gets the result. `buf` holds BLOCK floats.
__device__ float block_sum(float v, float* buf, int n) {
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int s = n / 2; s > 0; s /= 2) {
        if ((int)threadIdx.x < s) buf[threadIdx.x] += buf[threadIdx.x + s];
        __syncthreads();
    }
    float r = buf[0];
    __syncthreads();
    return r;
}

// Maximum of `v` over the block (-inf when every value is -inf); every thread gets it.
__device__ float block_max(float v, float* buf, int n) {
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int s = n / 2; s > 0; s /= 2) {
        if ((int)threadIdx.x < s) buf[threadIdx.x] = fmaxf(buf[threadIdx.x], buf[threadIdx.x + s]);
        __syncthreads();
    }
    float r = buf[0];
    __syncthreads();
    return r;
}

// yr = xr / sqrt(mean(xr^2) + eps) * w for the block's row xr of `d` elements, given each
// thread's share `acc` of the sum of squares (elements threadIdx.x, + BLOCK, ...), which are
// also the elements each thread reads back: it sees its own writes to xr without a barrier.
// With `hr` (else null) each output is also written rounded to bf16 (bf16_of): the input of a
// bf16 product, without a rounding launch of its own.
__device__ void rms_norm_row(const float* xr, const float* w, float* yr, unsigned short* hr,
                             int d, float eps, float acc, float* buf) {
    float ms = block_sum(acc, buf, BLOCK) / (float)d;
    float scale = 1.0f / sqrtf(ms + eps);
    for (int i = threadIdx.x; i < d; i += BLOCK) {
        float y = xr[i] * scale * w[i];
        yr[i] = y;
        if (hr) hr[i] = bf16_of(y);
    }
}

// out = x / sqrt(mean(x^2) + eps) * w, one block per row of `d` elements; `half` (or null)
// gets out rounded to bf16 too.
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int d, float eps,
                                    unsigned short* half) {
    __shared__ float buf[BLOCK];
    const float* xr = x + (u64)blockIdx.x * d;
    float acc = 0.0f;
    for (int i = threadIdx.x; i < d; i += BLOCK) acc += xr[i] * xr[i];
    unsigned short* hr = half ? half + (u64)blockIdx.x * d : 0;
    rms_norm_row(xr, w, out + (u64)blockIdx.x * d, hr, d, eps, acc, buf);
}

// x += y, then out = rms_norm(x): `add_assign` and `rms_norm` in one launch, with the same
// arithmetic per element, so the same bits. One block per row of `d` elements; `half` as for
// rms_norm.
extern "C" __global__ void add_rms_norm(float* x, const float* y, const float* w, float* out,
                                        int d, float eps, unsigned short* half) {
    __shared__ float buf[BLOCK];
    float* xr = x + (u64)blockIdx.x * d;
    const float* yr = y + (u64)blockIdx.x * d;
    float acc = 0.0f;
    for (int i = threadIdx.x; i < d; i += BLOCK) {
        float v = xr[i] + yr[i];
        xr[i] = v;
        acc += v * v;
    }
    unsigned short* hr = half ? half + (u64)blockIdx.x * d : 0;
    rms_norm_row(xr, w, out + (u64)blockIdx.x * d, hr, d, eps, acc, buf);
}

// The cosine and sine of rotated pair `i` (of rot_dim / 2) at position `p`, in double
// precision as on the CPU. `factors` (rot_dim / 2 of them, or null) divide each pair's
// frequency: Llama 3's, linear and longrope scaling; `attn_factor` multiplies both (longrope's
// attention factor, 1 otherwise).
__device__ void rope_angle(u64 p, int i, int rot_dim, float theta, const float* factors,
                           float attn_factor, float* c, float* s) {
    double inv_freq = pow((double)theta, -(double)(2 * i) / (double)rot_dim);
    if (factors) inv_freq /= (double)factors[i];
    double a = (double)p * inv_freq;
    *c = (float)(cos(a) * (double)attn_factor);
    *s = (float)(sin(a) * (double)attn_factor);
}

// Rotate-half rotary embedding of x[tokens, heads, head_dim] in place; one thread per rotated
// pair (see rope_angle).
extern "C" __global__ void rope(float* x, const u64* pos, int tokens, int heads, int head_dim,
                                int rot_dim, float theta, const float* factors,
                                float attn_factor) {
    int half = rot_dim / 2;
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 total = (u64)tokens * heads * half;
    if (idx >= total) return;
    int i = (int)(idx % half);
    u64 th = idx / half;
    int h = (int)(th % heads);
    u64 t = th / heads;
    float c, s;
    rope_angle(pos[t], i, rot_dim, theta, factors, attn_factor, &c, &s);
    float* v = x + (t * heads + h) * (u64)head_dim;
    float lo = v[i], hi = v[i + half];
    v[i] = lo * c - hi * s;
    v[i + half] = hi * c + lo * s;
}

// Element `idx` of a fused projection y[tokens, (q_heads + 2 kv_heads) head_dim] (the query
// heads, then the key heads, then the value heads), in order element d of head `slot` of row
// t; x is its value with the query and key heads rotated as `rope` rotates them (the same
// products, so the same bits as copy_cols then rope).
struct SplitElem {
    u64 t;
    int slot, d;
    float x;
};

// Element c of a head's projection, with its bias added when there is one (the sum add_rows
// makes).
__device__ float biased(const float* src, const float* b, int c) {
    return b ? src[c] + b[c] : src[c];
}

__device__ SplitElem split_rope_at(const float* y, u64 idx, const u64* pos, int q_heads,
                                   int kv_heads, int head_dim, int rot_dim, float theta,
                                   const float* factors, float attn_factor, const float* bias) {
    SplitElem e;
    e.d = (int)(idx % head_dim);
    u64 ts = idx / head_dim;
    int slots = q_heads + 2 * kv_heads;
    e.slot = (int)(ts % slots);
    e.t = ts / slots;
    const float* src = y + idx - e.d;
    const float* b = bias ? bias + (u64)e.slot * head_dim : nullptr;
    if (e.slot >= q_heads + kv_heads || e.d >= rot_dim) {
        e.x = biased(src, b, e.d);
        return e;
    }
    int half = rot_dim / 2;
    int i = e.d < half ? e.d : e.d - half;
    float c, s;
    rope_angle(pos[e.t], i, rot_dim, theta, factors, attn_factor, &c, &s);
    float lo = biased(src, b, i), hi = biased(src, b, i + half);
    e.x = e.d < half ? lo * c - hi * s : hi * c + lo * s;
    return e;
}

// A fused projection's rows split into queries q[tokens, q_heads, head_dim], keys k and values
// v[tokens, kv_heads, head_dim], the queries and keys rotated (split_rope_at), the
// projection's bias (a row of (q_heads + 2 kv_heads) head_dim, or null for none) added
// first. One thread per output element.
extern "C" __global__ void split_rope(const float* y, float* q, float* k, float* v,
                                      const u64* pos, int tokens, int q_heads, int kv_heads,
                                      int head_dim, int rot_dim, float theta,
                                      const float* factors, float attn_factor,
                                      const float* bias) {
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (u64)tokens * (q_heads + 2 * kv_heads) * head_dim) return;
    SplitElem e = split_rope_at(y, idx, pos, q_heads, kv_heads, head_dim, rot_dim, theta, factors,
                                attn_factor, bias);
    if (e.slot < q_heads) {
        q[(e.t * q_heads + e.slot) * (u64)head_dim + e.d] = e.x;
    } else if (e.slot < q_heads + kv_heads) {
        k[(e.t * kv_heads + (e.slot - q_heads)) * (u64)head_dim + e.d] = e.x;
    } else {
        v[(e.t * kv_heads + (e.slot - q_heads - kv_heads)) * (u64)head_dim + e.d] = e.x;
    }
}

// split_rope with each token's keys and values written into a paged pool instead of k and v:
// token t's key row (kv_heads head_dim elements) at element shift + places[t] of `pool`, its
// value row `values` elements after, in f32 or (bf16) rounded as to_bf16 rounds: a decode
// step's projection, rotation and KV append in one launch. One thread per element.
extern "C" __global__ void split_rope_append(const float* y, float* q, float* pool,
                                             const u64* places, u64 shift, u64 values, int bf16,
                                             const u64* pos, int tokens, int q_heads,
                                             int kv_heads, int head_dim, int rot_dim,
                                             float theta, const float* factors,
                                             float attn_factor, const float* bias) {
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (u64)tokens * (q_heads + 2 * kv_heads) * head_dim) return;
    SplitElem e = split_rope_at(y, idx, pos, q_heads, kv_heads, head_dim, rot_dim, theta, factors,
                                attn_factor, bias);
    if (e.slot < q_heads) {
        q[(e.t * q_heads + e.slot) * (u64)head_dim + e.d] = e.x;
        return;
    }
    bool key = e.slot < q_heads + kv_heads;
    int kv_slot = key ? e.slot - q_heads : e.slot - q_heads - kv_heads;
    u64 at = shift + places[e.t] + (key ? 0 : values) + (u64)kv_slot * head_dim + e.d;
    if (bf16) {
        ((unsigned short*)pool)[at] = bf16_of(e.x);
    } else {
        pool[at] = e.x;
    }
}

// silu(g) * u and gelu(g) * u, GELU in its tanh approximation (as cpu::activation's).
__device__ float silu_gate(float g, float u) { return g / (1.0f + expf(-g)) * u; }
__device__ float gelu_tanh_gate(float x, float u) {
    float t = tanhf(0.7978846f * x * (1.0f + 0.044715f * x * x));
    return 0.5f * x * (1.0f + t) * u;
}

// gate = silu(gate) * up.
extern "C" __global__ void silu_mul(float* gate, const float* up, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) gate[i] = silu_gate(gate[i], up[i]);
}

// gate = gelu(gate) * up.
extern "C" __global__ void gelu_tanh_mul(float* gate, const float* up, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) gate[i] = gelu_tanh_gate(gate[i], up[i]);
}

// out[r, j] = act(x[r, j]) * x[r, units + j]: the gated activation of a fused gate/up
// projection's rows (of 2 units), read in place; `gelu` chooses GELU over SiLU; `half` (or
// null) gets out rounded to bf16 too. One thread per output element.
extern "C" __global__ void gated_halves(const float* x, float* out, u64 n, int units, int gelu,
                                        unsigned short* half) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float* row = x + (i / (u64)units) * 2 * (u64)units;
    int j = (int)(i % (u64)units);
    float y = gelu ? gelu_tanh_gate(row[j], row[units + j]) : silu_gate(row[j], row[units + j]);
    out[i] = y;
    if (half) half[i] = bf16_of(y);
}

// x *= s.
extern "C" __global__ void scale(float* x, float s, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}

// x = cap * tanh(x / cap) (Gemma 2's final logit soft-capping, as Backend::soft_cap on the CPU).
extern "C" __global__ void soft_cap(float* x, float cap, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = cap * tanhf(x[i] / cap);
}

// x += y.
extern "C" __global__ void add_assign(float* x, const float* y, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// x[r, c] += bias[c] for rows of `width` elements.
extern "C" __global__ void add_rows(float* x, const float* bias, u64 n, int width) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += bias[i % width];
}

// out[i, :] = table[ids[i], :]; ids were checked against the table on the host.
extern "C" __global__ void embedding(const float* table, const unsigned int* ids, float* out,
                                     int n_ids, int dim) {
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (u64)n_ids * dim) return;
    u64 r = idx / dim;
    int c = (int)(idx % dim);
    out[idx] = table[(u64)ids[r] * dim + c];
}

// The column of the largest element of `row` (the first on ties, NaN never wins; -1 when
// nothing qualifies), by every thread of the block over the block's shared `vals` and `idxs`
// (BLOCK each), where vals[0] is then that element.
__device__ int row_argmax(const float* row, int cols, float* vals, int* idxs) {
    float best = 0.0f;
    int bi = -1;
    for (int i = threadIdx.x; i < cols; i += BLOCK) {
        float v = row[i];
        // v == v skips NaN; strictly greater keeps the first of equal values.
        if (v == v && (bi < 0 || v > best)) {
            best = v;
            bi = i;
        }
    }
    vals[threadIdx.x] = best;
    idxs[threadIdx.x] = bi;
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s /= 2) {
        if ((int)threadIdx.x < s) {
            int j = idxs[threadIdx.x + s];
            float v = vals[threadIdx.x + s];
            int i0 = idxs[threadIdx.x];
            float v0 = vals[threadIdx.x];
            if (j >= 0 && (i0 < 0 || v > v0 || (v == v0 && j < i0))) {
                vals[threadIdx.x] = v;
                idxs[threadIdx.x] = j;
            }
        }
        __syncthreads();
    }
    return idxs[0];
}

// Index of the largest element of each row (first on ties, NaN never wins, 0 when nothing
// qualifies); one block per row.
extern "C" __global__ void argmax_rows(const float* x, int cols, unsigned int* out) {
    __shared__ float vals[BLOCK];
    __shared__ int idxs[BLOCK];
    int arg = row_argmax(x + (u64)blockIdx.x * cols, cols, vals, idxs);
    if (threadIdx.x == 0) out[blockIdx.x] = arg < 0 ? 0u : (unsigned int)arg;
}

// A float's order as an unsigned key: a larger float has a larger key, -0 and +0 the same
// one; 0 is no float (a NaN maps to 0 here, as top_k_rows never takes one).
__device__ unsigned int order_key(float v) {
    if (v != v) return 0u;
    unsigned int u = v == 0.0f ? 0u : __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Whether candidate (ka, ia) comes before (kb, ib): the larger key, then the lower column.
__device__ bool before(unsigned int ka, unsigned int ia, unsigned int kb, unsigned int ib) {
    return ka > kb || (ka == kb && ia < ib);
}

// The most candidates of one row (the shared arrays below; TOP_K_MAX in kernels::select).
#define TOP_K_MAX 1024

// The k largest values of each row and their columns, the largest first and the lower column
// first among equal values, NaN never; past a row's numbers, (NaN, 0xffffffff). One block per
// row, k <= min(cols, TOP_K_MAX). First the k-th largest key, 8 bits at a time from the top
// (a histogram of the keys that match the bits found so far); then every key above it and
// the lowest columns of those equal to it, which each thread finds in its own contiguous
// stretch of the row; then a bitonic sort of those candidates.
extern "C" __global__ void top_k_rows(const float* x, int cols, int k, float* vals,
                                      unsigned int* ids) {
    __shared__ unsigned int hist[256];
    __shared__ unsigned int ties[BLOCK];
    __shared__ unsigned int keys[TOP_K_MAX];
    __shared__ unsigned int cols_of[TOP_K_MAX];
    __shared__ unsigned int prefix, want, count;
    const float* row = x + (u64)blockIdx.x * cols;
    unsigned int t = threadIdx.x;
    if (t == 0) {
        prefix = 0u;
        want = (unsigned int)k;
        count = 0u;
    }
    unsigned int high = 0u;  // the bits of the key found so far
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = t; b < 256; b += BLOCK) hist[b] = 0u;
        __syncthreads();
        for (int i = t; i < cols; i += BLOCK) {
            unsigned int key = order_key(row[i]);
            if (key != 0u && (key & high) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (t == 0 && want > 0u) {
            // From the top bin down: the bin where the want-th key of this prefix lies.
            unsigned int above = 0u;
            int b = 255;
            while (b >= 0 && above + hist[b] < want) above += hist[b--];
            if (b < 0) {
                // Fewer numbers than k: every number is a candidate (keys above 0).
                prefix = 0u;
                want = 0u;
            } else {
                want -= above;
                prefix |= (unsigned int)b << shift;
            }
        }
        high |= 255u << shift;
        __syncthreads();
        if (want == 0u) break;
    }
    // Every key above `prefix` is a candidate, and the `want` lowest columns whose key is
    // `prefix` (none when the row has fewer numbers than k: then prefix is 0, below them all).
    int stretch = (cols + BLOCK - 1) / BLOCK;
    int from = min((int)t * stretch, cols), to = min(from + stretch, cols);
    unsigned int mine = 0u;
    for (int i = from; i < to; i++) mine += order_key(row[i]) == prefix && prefix != 0u;
    ties[t] = mine;
    __syncthreads();
    if (t == 0) {
        unsigned int at = 0u;
        for (int i = 0; i < BLOCK; i++) {
            unsigned int n = ties[i];
            ties[i] = at;
            at += n;
        }
    }
    __syncthreads();
    unsigned int rank = ties[t];
    for (int i = from; i < to; i++) {
        unsigned int key = order_key(row[i]);
        bool take = key > prefix || (key == prefix && prefix != 0u && rank++ < want);
        if (take) {
            unsigned int at = atomicAdd(&count, 1u);
            keys[at] = key;
            cols_of[at] = (unsigned int)i;
        }
    }
    __syncthreads();
    // Sort the candidates (padding with key 0 last) by a bitonic network over a power of two.
    unsigned int n = count, size = 1u;
    while (size < n) size *= 2u;
    for (unsigned int i = n + t; i < size; i += BLOCK) {
        keys[i] = 0u;
        cols_of[i] = 0xffffffffu;
    }
    __syncthreads();
    for (unsigned int span = 2u; span <= size; span *= 2u) {
        for (unsigned int stride = span / 2u; stride > 0u; stride /= 2u) {
            for (unsigned int i = t; i < size; i += BLOCK) {
                unsigned int j = i ^ stride;
                if (j > i) {
                    bool forward = (i & span) == 0u;
                    bool swap = forward ? before(keys[j], cols_of[j], keys[i], cols_of[i])
                                        : before(keys[i], cols_of[i], keys[j], cols_of[j]);
                    if (swap) {
                        unsigned int kk = keys[i], cc = cols_of[i];
                        keys[i] = keys[j];
                        cols_of[i] = cols_of[j];
                        keys[j] = kk;
                        cols_of[j] = cc;
                    }
                }
            }
            __syncthreads();
        }
    }
    for (int j = t; j < k; j += BLOCK) {
        u64 at = (u64)blockIdx.x * k + j;
        bool real = (unsigned int)j < n;
        vals[at] = real ? row[cols_of[j]] : __uint_as_float(0x7fc00000u);
        ids[at] = real ? cols_of[j] : 0xffffffffu;
    }
}

// e^x for x <= 0 (0 below -708, for -inf and NaN) by the operations of kernels::exp_det, so
// the same bits as the CPU: n = round(x log2 e) (half away from zero), r = x - n ln 2 in two
// fused multiply-adds, e^r by its degree-13 Taylor polynomial in Horner's form (one fused
// multiply-add a degree), times 2^n from the exponent bits.
__device__ double exp_det(double x) {
    const double inv_factorial[14] = {1.0,
                                      1.0,
                                      0.5,
                                      0.16666666666666666,
                                      0.041666666666666664,
                                      0.008333333333333333,
                                      0.001388888888888889,
                                      0.0001984126984126984,
                                      2.48015873015873e-05,
                                      2.7557319223985893e-06,
                                      2.7557319223985894e-07,
                                      2.505210838544172e-08,
                                      2.08767569878681e-09,
                                      1.6059043836821616e-10};
    if (!(x >= -708.0 && x <= 0.0)) return x > 0.0 ? __longlong_as_double(0x7ff0000000000000LL) : 0.0;
    double n = round(x * 1.4426950408889634);
    double r = fma(-n, 1.9082149292705877e-10, fma(-n, 0.6931471803691238, x));
    double p = inv_factorial[13];
    for (int k = 12; k >= 0; k--) p = fma(p, r, inv_factorial[k]);
    return p * __longlong_as_double((long long)((int)n + 1023) << 52);
}

// The draw's weight of logit l (kernels::sample's `weight`): exp_det((l - top) / t), 0 below
// `floor`.
__device__ double draw_weight(float l, float top, double t, double floor) {
    double w = exp_det(((double)l - (double)top) / t);
    return w >= floor ? w : 0.0;
}

// Columns per chunk of a row's weight sums (DRAW_CHUNK), and the most chunks of a row
// (DRAW_MAX_COLUMNS / DRAW_CHUNK).
#define DRAW_CHUNK 256
#define DRAW_MAX_CHUNKS 2048

// Per chunk of this thread (chunks t, t + BLOCK, ...): the sum in column order of the weights
// `w` of the columns whose key is at least `kept` (a NaN column's weight is 0), into `sums`;
// returns the last such column with a weight among them (-1 for none).
__device__ int chunk_sums(const float* row, const double* w, int cols, unsigned int kept,
                          double* sums) {
    int chunks = (cols + DRAW_CHUNK - 1) / DRAW_CHUNK;
    int last = -1;
    for (int c = threadIdx.x; c < chunks; c += BLOCK) {
        double s = 0.0;
        int end = min((c + 1) * DRAW_CHUNK, cols);
        for (int i = c * DRAW_CHUNK; i < end; i++) {
            double x = order_key(row[i]) >= kept ? w[i] : 0.0;
            if (x > 0.0) last = i;
            s += x;
        }
        sums[c] = s;
    }
    return last;
}

// One token per row by kernels::draw_columns: params holds (temperature, min_p, u, top_p) per
// row, `weights` a row's worth of doubles per row. Greedy (temperature <= 0) is the argmax (the
// first of equal values, NaN never, 0 for none). Else each thread weighs its chunks' columns;
// with top-p < 1 the smallest key kept is found bit by bit, each trial's weight summed per
// chunk by the chunk's thread and the chunk sums in order by thread 0; then thread 0 walks the
// kept weights' chunk sums and the chosen chunk with u times their total; past the end
// (rounding), the last kept column with a weight (else the first number's). One block per row.
extern "C" __global__ void sample_rows(const float* x, int cols, const double* params,
                                       double* weights, unsigned int* out) {
    __shared__ float vals[BLOCK];
    __shared__ int idxs[BLOCK];
    __shared__ int lasts[BLOCK];
    __shared__ double sums[DRAW_MAX_CHUNKS];
    __shared__ unsigned int kept;
    __shared__ double target;
    const float* row = x + (u64)blockIdx.x * cols;
    double* w = weights + (u64)blockIdx.x * cols;
    const double* p = params + 4 * (u64)blockIdx.x;
    double t = p[0], floor = p[1], u = p[2], top_p = p[3];
    // The argmax: the top logit and the first column holding it.
    int arg = row_argmax(row, cols, vals, idxs);
    float top = vals[0];
    if (arg < 0 || t <= 0.0) {
        if (threadIdx.x == 0) out[blockIdx.x] = arg < 0 ? 0u : (unsigned int)arg;
        return;
    }
    // Each thread weighs the columns of its chunks (and only it reads them until the walk).
    int chunks = (cols + DRAW_CHUNK - 1) / DRAW_CHUNK;
    for (int c = threadIdx.x; c < chunks; c += BLOCK) {
        int end = min((c + 1) * DRAW_CHUNK, cols);
        for (int i = c * DRAW_CHUNK; i < end; i++) {
            float l = row[i];
            w[i] = l != l ? 0.0 : draw_weight(l, top, t, floor);
        }
    }
    if (threadIdx.x == 0) kept = 0u;
    if (top_p < 1.0) {
        chunk_sums(row, w, cols, 0u, sums);
        __syncthreads();
        if (threadIdx.x == 0) {
            double total = 0.0;
            for (int c = 0; c < chunks; c++) total += sums[c];
            target = total * top_p;
        }
        __syncthreads();
        for (int bit = 31; bit >= 0; bit--) {
            unsigned int trial = kept | (1u << bit);
            chunk_sums(row, w, cols, trial, sums);
            __syncthreads();
            if (threadIdx.x == 0) {
                double mass = 0.0;
                for (int c = 0; c < chunks; c++) mass += sums[c];
                if (mass >= target) kept = trial;
            }
            __syncthreads();
        }
    }
    __syncthreads();
    lasts[threadIdx.x] = chunk_sums(row, w, cols, kept, sums);
    __syncthreads();
    if (threadIdx.x != 0) return;
    int fallback = -1;
    double total = 0.0;
    for (int i = 0; i < BLOCK; i++) fallback = max(fallback, lasts[i]);
    for (int c = 0; c < chunks; c++) total += sums[c];
    if (fallback < 0) {
        // No weight: the first number's column (the lowest column with a number).
        for (int i = 0; i < cols && fallback < 0; i++)
            if (row[i] == row[i]) fallback = i;
    }
    double left = u * total;
    unsigned int pick = (unsigned int)fallback;
    for (int c = 0; c < chunks; c++) {
        if (left < sums[c]) {
            int end = min((c + 1) * DRAW_CHUNK, cols);
            for (int i = c * DRAW_CHUNK; i < end; i++) {
                if (row[i] != row[i]) continue;
                double wi = order_key(row[i]) >= kept ? w[i] : 0.0;
                if (left < wi) {
                    pick = (unsigned int)i;
                    break;
                }
                left -= wi;
            }
            break;
        }
        left -= sums[c];
    }
    out[blockIdx.x] = pick;
}

// Each row's normalizer (kernels::logprob's `Normalizer`): its largest number (the first of
// equal ones; -inf for none) into tops, and the sum of exp_det(l - top) over its numbers into
// sums, each chunk's weights summed in column order by the chunk's thread and the chunk sums
// in chunk order by thread 0 (the draws' sums). One block per row, cols <= DRAW_MAX_COLUMNS.
extern "C" __global__ void normalizers(const float* x, int cols, float* tops, double* sums) {
    __shared__ float vals[BLOCK];
    __shared__ int idxs[BLOCK];
    __shared__ double parts[DRAW_MAX_CHUNKS];
    const float* row = x + (u64)blockIdx.x * cols;
    int arg = row_argmax(row, cols, vals, idxs);
    float top = arg < 0 ? NEG_INF : vals[0];
    int chunks = (cols + DRAW_CHUNK - 1) / DRAW_CHUNK;
    for (int c = threadIdx.x; c < chunks; c += BLOCK) {
        double s = 0.0;
        int end = min((c + 1) * DRAW_CHUNK, cols);
        for (int i = c * DRAW_CHUNK; i < end; i++) {
            float l = row[i];
            s += l != l ? 0.0 : exp_det((double)l - (double)top);
        }
        parts[c] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (int c = 0; c < chunks; c++) total += parts[c];
        tops[blockIdx.x] = top;
        sums[blockIdx.x] = total;
    }
}

// out[r] = x[r, columns[r]] for each of `rows` rows of `cols` floats, NaN for a column past
// the row; one thread per row.
extern "C" __global__ void columns_at(const float* x, int cols, const unsigned int* columns,
                                      float* out, int rows) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    unsigned int c = columns[r];
    out[r] = c < (unsigned int)cols ? x[(u64)r * cols + c] : __int_as_float(0x7fc00000);
}

// Dequantizes a repacked `QMatrix` (see `kernels::cpu::qmatrix`), by `kind`: 0, 8-bit w = d*q
// (a scale per 32); 1, 4-bit w = d*nibble + m with nibbles 0..16 of a block in the low halves
// of its 16 bytes; 2, 8-bit w = d*q with a scale per 16; 3, as 2 with w = d*q + m, a minimum
// per 16.
extern "C" __global__ void dequantize(const float* scales, const float* mins,
                                      const unsigned char* qs, float* out, u64 n, int kind) {
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n) return;
    u64 b = idx / 32;
    int j = (int)(idx % 32);
    if (kind == 1) {
        unsigned char q = qs[b * 16 + (j % 16)];
        float nib = (float)(j < 16 ? (q & 15) : (q >> 4));
        out[idx] = scales[b] * nib + mins[b];
    } else if (kind >= 2) {
        u64 g = idx / 16;
        float w = scales[g] * (float)(signed char)qs[idx];
        out[idx] = kind == 3 ? w + mins[g] : w;
    } else {
        out[idx] = scales[b] * (float)(signed char)qs[idx];
    }
}

// The logits of row i of x (cols floats: the vocabulary's columns first..first + cols) changed
// by the edits offsets[i]..offsets[i + 1] of `edits` (three words each: token, kind, the
// value's bits), in order, by one thread per row (edits of one token must keep their order):
// kind 0 divides a positive logit by the value and multiplies any other by it (a repetition
// penalty), 1 subtracts the value, 2 adds it; a token outside the columns is skipped. The
// host sampler's `LogitEdit::apply`, operation for operation.
extern "C" __global__ void edit_rows(float* x, int cols, const unsigned int* offsets,
                                     const unsigned int* edits, u64 first) {
    if (threadIdx.x != 0) return;
    float* row = x + (u64)blockIdx.x * cols;
    for (unsigned int e = offsets[blockIdx.x]; e < offsets[blockIdx.x + 1]; e++) {
        u64 token = edits[3 * (u64)e];
        if (token < first || token - first >= (u64)cols) continue;
        float* l = row + (token - first);
        unsigned int kind = edits[3 * (u64)e + 1];
        float v = __uint_as_float(edits[3 * (u64)e + 2]);
        if (kind == 0) {
            *l = *l > 0.0f ? *l / v : *l * v;
        } else if (kind == 1) {
            *l = *l - v;
        } else {
            *l = *l + v;
        }
    }
}

// Threads per block of `qmatvec`, and the activation rows one block takes.
#define QMV_BLOCK 64
#define QMV_ROWS 8

// out[i * n + r] = sum over c of x[i * k + c] * W[r, c], for rows i < m of x and every row
// r < n of W, a repacked QMatrix (kinds as `dequantize`) of k columns (a multiple of 32),
// dequantized in registers: a decode step's product reads the packed weight (4 to 7 times
// fewer bytes than f32) and nothing else of it. Block (r, c) takes row r of W and rows
// [c * QMV_ROWS, c * QMV_ROWS + QMV_ROWS) of x: thread t takes the row's groups of 32 columns
// t, t + QMV_BLOCK, ..., dequantizing each once for all those rows of x (a group's 32 products
// summed in column order, then added to the thread's sum), and the block adds its threads'
// sums in a fixed tree, so a result never depends on the launch.
extern "C" __global__ void qmatvec(const float* scales, const float* mins,
                                   const unsigned char* qs, const float* x, float* out, int n,
                                   int k, int m, int kind) {
    __shared__ float part[QMV_ROWS][QMV_BLOCK];
    int r = blockIdx.x, t = threadIdx.x, first = blockIdx.y * QMV_ROWS;
    x += (u64)first * k;
    out += (u64)first * n;
    m = min(QMV_ROWS, m - first);
    float acc[QMV_ROWS];
    for (int i = 0; i < QMV_ROWS; i++) acc[i] = 0.0f;
    int groups = k / 32;
    for (int g = t; g < groups; g += QMV_BLOCK) {
        u64 b = (u64)r * groups + g;
        float w[32];
        if (kind == 1) {
            const unsigned char* q = qs + b * 16;
            float d = scales[b], lo = mins[b];
            for (int j = 0; j < 16; j++) {
                unsigned char v = q[j];
                w[j] = d * (float)(v & 15) + lo;
                w[j + 16] = d * (float)(v >> 4) + lo;
            }
        } else if (kind >= 2) {
            const signed char* q = (const signed char*)qs + b * 32;
            for (int h = 0; h < 2; h++) {
                float d = scales[2 * b + h], lo = kind == 3 ? mins[2 * b + h] : 0.0f;
                for (int j = 16 * h; j < 16 * h + 16; j++) {
                    float v = d * (float)q[j];
                    w[j] = kind == 3 ? v + lo : v;
                }
            }
        } else {
            const signed char* q = (const signed char*)qs + b * 32;
            float d = scales[b];
            for (int j = 0; j < 32; j++) w[j] = d * (float)q[j];
        }
        for (int i = 0; i < m; i++) {
            const float* xi = x + (u64)i * k + (u64)g * 32;
            float s = 0.0f;
            for (int j = 0; j < 32; j++) s += xi[j] * w[j];
            acc[i] += s;
        }
    }
    for (int i = 0; i < QMV_ROWS; i++) part[i][t] = acc[i];
    __syncthreads();
    for (int half = QMV_BLOCK / 2; half > 0; half /= 2) {
        if (t < half) {
            for (int i = 0; i < m; i++) part[i][t] += part[i][t + half];
        }
        __syncthreads();
    }
    if (t < m) out[(u64)t * n + r] = part[t][0];
}

// Offset in floats of key (and value) row j from `k` (and `v`): j * stride for contiguous
// keys (table == 0); with a paged cache's block table, row j % block_size of block
// table[j / block_size], blocks `block_stride` floats apart.
__device__ u64 kv_row(int j, const unsigned int* table, int block_size, u64 block_stride,
                      u64 stride) {
    if (table == 0) return (u64)j * stride;
    return (u64)table[j / block_size] * block_stride + (u64)(j % block_size) * stride;
}

// Element `i` of keys or values stored as f32, or as bf16 (`bf16`: raw bits, two bytes each;
// widening is exact).
__device__ float kv_at(const float* base, u64 i, int bf16) {
    if (!bf16) return base[i];
    return __uint_as_float((unsigned int)((const unsigned short*)base)[i] << 16);
}

// Causal grouped-query attention with the log-sum-exp of each row. One block per query token,
// KV head g and slice of up to ATTN_GROUP of the query heads that share g, and per range of
// keys: block (b, s) visits keys [s*chunk, (s+1)*chunk) in tiles of ATTN_BLOCK, staging each
// tile's keys through shared memory once for all its heads (so K and V are read once per
// group, not once per query head), with an online softmax per head (running maximum `m` and
// sum `l`); thread t scores key t for every head, summing over the columns in order as the
// CPU does, and owns output elements t, t+ATTN_BLOCK, ... of every head. Rows are query token
// i, head h at i*q_heads + h; the block writes its heads' partial results at row
// s*rows + row of out and lse. With one range (chunk >= n_kv) that is the answer; with
// several, `attention_merge` combines them (flash decoding: a decode step has few rows, and
// splitting the keys is what fills the GPU). The grid is tokens*kv_heads*slices by ranges,
// slices = ceil((q_heads / kv_heads) / ATTN_GROUP).
// Query i sees key j when kv_pos[j] <= q_pos[i] and, with a sliding window (`window` positions;
// ~0 for none), kv_pos[j] >= q_pos[i] + 1 - window (as cpu::attention's first_visible); a row
// that sees no key gets zeros and -inf. Scores are q.k * scale, then, when softcap > 0,
// softcap * tanh(score / softcap) (Gemma 2's soft-capping), before the softmax.
// Keys and values are contiguous rows, or blocks of a paged cache named by `table` (kv_row),
// in f32 or (kv_bf16) bf16; offsets count elements either way.
// With `seqs` (null: every query token sees the same n_kv keys), query token i is one
// sequence's row of a step over a shared paged pool: seqs[3i..3i+3] are the offset of its key
// positions in kv_pos, of its blocks in table, and its number of keys; a range past its keys
// is empty (zeros and -inf, which attention_merge weighs 0). With one range, `half` (or null)
// gets the outputs rounded to bf16 too (bf16_of: a bf16 product's input).
// `chunk` <= 0 splits each query token's keys evenly over the grid's ranges, in whole tiles
// (max(ATTN_BLOCK, ceil(n_kv / ranges) rounded up to ATTN_BLOCK): kernels::cuda::attention_chunk),
// so the launch's shape and arguments do not depend on the number of keys (a decode step's);
// ranges past a token's keys are empty.
extern "C" __global__ void attention(const float* q, const u64* q_pos, const float* k,
                                     const float* v, const u64* kv_pos,
                                     const unsigned int* table, int block_size,
                                     u64 block_stride, int n_kv, int q_heads, int kv_heads,
                                     int head_dim, float scale, float softcap, u64 window,
                                     int chunk, int kv_bf16, const u64* seqs, float* out,
                                     float* lse, unsigned short* half) {
    __shared__ float qs[ATTN_GROUP * ATTN_BLOCK * ATTN_DIMS];
    __shared__ float p[ATTN_GROUP * ATTN_BLOCK];
    __shared__ float buf[ATTN_BLOCK];
    // The tile's keys, ATTN_CHUNK columns at a time, and where each key's (and value's) head
    // g starts.
    __shared__ float ks[ATTN_BLOCK * (ATTN_CHUNK + 1)];
    __shared__ u64 roff[ATTN_BLOCK];
    int per_group = q_heads / kv_heads;
    int slices = (per_group + ATTN_GROUP - 1) / ATTN_GROUP;
    int slice = blockIdx.x % slices;
    int g = (blockIdx.x / slices) % kv_heads;
    int i = blockIdx.x / slices / kv_heads;
    int nh = min(ATTN_GROUP, per_group - slice * ATTN_GROUP);
    u64 rows = (u64)(gridDim.x / (slices * kv_heads)) * q_heads;
    u64 row0 = (u64)i * q_heads + (u64)g * per_group + (u64)slice * ATTN_GROUP;
    if (seqs) {
        kv_pos += seqs[3 * (u64)i];
        if (table) table += seqs[3 * (u64)i + 1];
        n_kv = (int)seqs[3 * (u64)i + 2];
    }
    if (chunk <= 0) {
        int per = (n_kv + (int)gridDim.y - 1) / (int)gridDim.y;
        chunk = max(ATTN_BLOCK, (per + ATTN_BLOCK - 1) / ATTN_BLOCK * ATTN_BLOCK);
    }
    int j_begin = blockIdx.y * chunk;
    int j_end = min(n_kv, j_begin + chunk);
    int tid = threadIdx.x;
    u64 qp = q_pos[i];
    // The oldest position the query sees: (qp + 1) - window, saturating at 0.
    u64 first = qp + 1 > window ? qp + 1 - window : 0;
    u64 stride = (u64)kv_heads * head_dim;
    const int qstride = ATTN_BLOCK * ATTN_DIMS;
    for (int hh = 0; hh < nh; hh++) {
        const float* qr = q + (row0 + hh) * head_dim;
        for (int c = tid; c < head_dim; c += ATTN_BLOCK) qs[hh * qstride + c] = qr[c];
    }
    __syncthreads();
    float acc[ATTN_GROUP][ATTN_DIMS];
    float m[ATTN_GROUP];
    float l[ATTN_GROUP];
    for (int hh = 0; hh < ATTN_GROUP; hh++) {
        for (int e = 0; e < ATTN_DIMS; e++) acc[hh][e] = 0.0f;
        m[hh] = NEG_INF;
        l[hh] = 0.0f;
    }
    for (int j0 = j_begin; j0 < j_end; j0 += ATTN_BLOCK) {
        int j = j0 + tid;
        int tile = min(ATTN_BLOCK, j_end - j0);
        bool live = j < j_end && kv_pos[j] <= qp && kv_pos[j] >= first;
        if (j < j_end) {
            roff[tid] = kv_row(j, table, block_size, block_stride, stride) + (u64)g * head_dim;
        }
        float dot[ATTN_GROUP];
        for (int hh = 0; hh < ATTN_GROUP; hh++) dot[hh] = 0.0f;
        for (int c0 = 0; c0 < head_dim; c0 += ATTN_CHUNK) {
            int width = min(ATTN_CHUNK, head_dim - c0);
            // roff is written, and the previous chunk read, before the stage is overwritten.
            __syncthreads();
            // Consecutive threads read consecutive columns of a key row: coalesced.
            for (int e = tid; e < tile * ATTN_CHUNK; e += ATTN_BLOCK) {
                int r = e / ATTN_CHUNK;
                int c = e % ATTN_CHUNK;
                if (c < width) {
                    ks[r * (ATTN_CHUNK + 1) + c] = kv_at(k, roff[r] + (u64)(c0 + c), kv_bf16);
                }
            }
            __syncthreads();
            if (live) {
                const float* kr = ks + tid * (ATTN_CHUNK + 1);
                for (int hh = 0; hh < nh; hh++) {
                    const float* qh = qs + hh * qstride + c0;
                    float d = dot[hh];
                    for (int c = 0; c < width; c++) d += qh[c] * kr[c];
                    dot[hh] = d;
                }
            }
        }
        // Per head: the tile's softmax weights in p, and the factor its running sums change by
        // (1 for a head this tile adds nothing to, so its sums stay as they are).
        float corr[ATTN_GROUP];
        for (int hh = 0; hh < nh; hh++) {
            float s = live ? dot[hh] * scale : NEG_INF;
            if (live && softcap > 0.0f) s = softcap * tanhf(s / softcap);
            float tile_max = block_max(s, buf, ATTN_BLOCK);
            // Uniform across the block: every thread read the same reduced value.
            if (tile_max == NEG_INF) {
                p[hh * ATTN_BLOCK + tid] = 0.0f;
                corr[hh] = 1.0f;
                continue;
            }
            float m_new = fmaxf(m[hh], tile_max);
            float e = s == NEG_INF ? 0.0f : expf(s - m_new);
            p[hh * ATTN_BLOCK + tid] = e;
            float tile_sum = block_sum(e, buf, ATTN_BLOCK);
            corr[hh] = m[hh] == NEG_INF ? 0.0f : expf(m[hh] - m_new);
            l[hh] = l[hh] * corr[hh] + tile_sum;
            m[hh] = m_new;
        }
        // p is complete for every head.
        __syncthreads();
        for (int d = 0; d < ATTN_DIMS; d++) {
            int c = tid + d * ATTN_BLOCK;
            if (c >= head_dim) break;
            float a[ATTN_GROUP];
            for (int hh = 0; hh < nh; hh++) a[hh] = acc[hh][d] * corr[hh];
            for (int jj = 0; jj < tile; jj++) {
                float vv = kv_at(v, roff[jj] + (u64)c, kv_bf16);
                for (int hh = 0; hh < nh; hh++) {
                    float w = p[hh * ATTN_BLOCK + jj];
                    if (w != 0.0f) a[hh] += w * vv;
                }
            }
            for (int hh = 0; hh < nh; hh++) acc[hh][d] = a[hh];
        }
        // p and roff are rewritten by the next tile.
        __syncthreads();
    }
    for (int hh = 0; hh < nh; hh++) {
        u64 part = (u64)blockIdx.y * rows + row0 + hh;
        float* orow = out + part * head_dim;
        for (int d = 0; d < ATTN_DIMS; d++) {
            int c = tid + d * ATTN_BLOCK;
            if (c >= head_dim) break;
            float o = m[hh] == NEG_INF ? 0.0f : acc[hh][d] / l[hh];
            orow[c] = o;
            if (half) half[part * head_dim + c] = bf16_of(o);
        }
        if (tid == 0) lse[part] = m[hh] == NEG_INF ? NEG_INF : m[hh] + logf(l[hh]);
    }
}

// Combines the `splits` partial results of `attention` over disjoint key ranges (row s*rows + r
// of part and part_lse) into row r of out and lse, as the CPU merges context-parallel partial
// results: weights exp(lse_s - max), the output their weighted mean, lse = max + log(sum).
// One block per row; a row no range saw stays zeros and -inf. `half` (or null) gets out rounded
// to bf16 too.
extern "C" __global__ void attention_merge(const float* part, const float* part_lse, int splits,
                                           int rows, int head_dim, float* out, float* lse,
                                           unsigned short* half) {
    int row = blockIdx.x;
    float mx = NEG_INF;
    for (int s = 0; s < splits; s++) mx = fmaxf(mx, part_lse[(u64)s * rows + row]);
    float total = 0.0f;
    if (mx != NEG_INF) {
        for (int s = 0; s < splits; s++) total += expf(part_lse[(u64)s * rows + row] - mx);
    }
    float* orow = out + (u64)row * head_dim;
    for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
        float a = 0.0f;
        if (mx != NEG_INF) {
            for (int s = 0; s < splits; s++) {
                u64 at = (u64)s * rows + row;
                float w = expf(part_lse[at] - mx);
                if (w != 0.0f) a += w * part[at * head_dim + c];
            }
            a /= total;
        }
        orow[c] = a;
        if (half) half[(u64)row * head_dim + c] = bf16_of(a);
    }
    if (threadIdx.x == 0) lse[row] = mx == NEG_INF ? NEG_INF : mx + logf(total);
}

// y[i] = x[i] rounded to bfloat16 (bf16_of).
extern "C" __global__ void to_bf16(const float* x, unsigned short* y, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = bf16_of(x[i]);
}

// Rows of `src` (`row` floats each) written into `dst` at element offsets: row moves[2m] of
// src to elements shift + moves[2m + 1] .. + row of dst, f32, or rounded to bf16 bits as to_bf16
// rounds when `bf16` (dst then holds two-byte elements). A step's new key (or value) rows of
// every sequence into the paged pool in one launch (`shift` is the layer's place in a block, so
// the moves are the same in every layer). One thread per element written.
extern "C" __global__ void write_rows(const float* src, float* dst, const u64* moves, u64 shift,
                                      int n, int row, int bf16) {
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (u64)n * row) return;
    u64 m = idx / row;
    int c = (int)(idx % row);
    float x = src[moves[2 * m] * row + c];
    u64 at = shift + moves[2 * m + 1] + c;
    if (bf16) {
        ((unsigned short*)dst)[at] = bf16_of(x);
    } else {
        dst[at] = x;
    }
}

// y[i] = x[i] rounded to IEEE half (nearest, ties to even; saturating to infinity), as raw
// bits, with the PTX conversion every architecture has.
extern "C" __global__ void to_f16(const float* x, unsigned short* y, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x[i]));
    y[i] = h;
}

// out[r, c] = x[r, offset + c] for c < size: one column block of rows of `width` (splitting a
// fused projection's output). One thread per output element.
extern "C" __global__ void copy_cols(const float* x, float* out, u64 n, int width, int offset,
                                     int size) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    u64 r = i / (u64)size;
    out[i] = x[r * (u64)width + (u64)offset + i % (u64)size];
}
