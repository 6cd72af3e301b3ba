// The kernels of kernels.cu, run on the CPU emulator (emulator.h), against plain references:
// attention in double precision over one key range and several (attention_merge), contiguous
// and paged keys, head sizes that are and are not multiples of the staged chunk, queries that
// see no key, Gemma's score rules (query scale, soft-cap, sliding window; each case also
// fails if the rules change nothing); RMSNorm (alone, and fused with the residual add, also against add_assign then
// rms_norm bit for bit), RoPE (with frequency factors), the fused split_rope and gated_halves
// (against the kernels they replace, bit for bit), argmax (ties, NaN), row normalizers and
// columns (bit for bit against kernels::logprob's definition), dequantization of
// each packing, logit soft-capping, bf16 rounding, embedding rows and column splits. Exits non-zero with the
// first difference. Built and run by xtask's tidy tests.
#include <cstdio>
#include <cstdlib>
#include <cstring>

typedef unsigned long long u64;
extern "C" void attention(const float* q, const u64* q_pos, const float* k, const float* v,
                          const u64* kv_pos, const unsigned int* table, int block_size,
                          u64 block_stride, int n_kv, int q_heads, int kv_heads, int head_dim,
                          float scale, float softcap, u64 window, int chunk, int kv_bf16,
                          const u64* seqs, float* out, float* lse, unsigned short* half);
extern "C" void attention_merge(const float* part, const float* part_lse, int splits, int rows,
                                int head_dim, float* out, float* lse, unsigned short* half);
extern "C" void rms_norm(const float* x, const float* w, float* out, int d, float eps,
                         unsigned short* half);
extern "C" void add_rms_norm(float* x, const float* y, const float* w, float* out, int d,
                             float eps, unsigned short* half);
extern "C" void add_assign(float* x, const float* y, u64 n);
extern "C" void soft_cap(float* x, float cap, u64 n);
extern "C" void rope(float* x, const u64* pos, int tokens, int heads, int head_dim, int rot_dim,
                     float theta, const float* factors, float attn_factor);
extern "C" void split_rope(const float* y, float* q, float* k, float* v, const u64* pos,
                           int tokens, int q_heads, int kv_heads, int head_dim, int rot_dim,
                           float theta, const float* factors, float attn_factor,
                           const float* bias);
extern "C" void split_rope_append(const float* y, float* q, float* pool, const u64* places,
                                  u64 shift, u64 values, int bf16, const u64* pos, int tokens,
                                  int q_heads, int kv_heads, int head_dim, int rot_dim,
                                  float theta, const float* factors, float attn_factor,
                                  const float* bias);
extern "C" void add_rows(float* x, const float* bias, u64 n, int width);
extern "C" void silu_mul(float* gate, const float* up, u64 n);
extern "C" void gelu_tanh_mul(float* gate, const float* up, u64 n);
extern "C" void gated_halves(const float* x, float* out, u64 n, int units, int gelu,
                             unsigned short* half);
extern "C" void argmax_rows(const float* x, int cols, unsigned int* out);
extern "C" void top_k_rows(const float* x, int cols, int k, float* vals, unsigned int* ids);
extern "C" void sample_rows(const float* x, int cols, const double* params, double* weights,
                            unsigned int* out);
extern "C" void normalizers(const float* x, int cols, float* tops, double* sums);
extern "C" void columns_at(const float* x, int cols, const unsigned int* columns, float* out,
                           int rows);
extern "C" void dequantize(const float* scales, const float* mins, const unsigned char* qs,
                           float* out, u64 n, int kind);
extern "C" void to_bf16(const float* x, unsigned short* y, u64 n);
extern "C" void edit_rows(float* x, int cols, const unsigned int* offsets,
                          const unsigned int* edits, u64 first);
extern "C" void qmatvec(const float* scales, const float* mins, const unsigned char* qs,
                        const float* x, float* out, int n, int k, int m, int kind);

extern "C" void embedding(const float* table, const unsigned int* ids, float* out, int n_ids,
                          int dim);
extern "C" void copy_cols(const float* x, float* out, u64 n, int width, int offset, int size);
extern "C" void write_rows(const float* src, float* dst, const u64* moves, u64 shift, int n,
                           int row, int bf16);

static const unsigned int BLOCK_THREADS = 256;  // BLOCK
static float next_value(u64& state);

// Blocks of BLOCK_THREADS for one thread per element.
static unsigned int elementwise(u64 n) { return (unsigned int)((n + BLOCK_THREADS - 1) / BLOCK_THREADS); }

static int fail(const char* what, size_t at, double got, double want) {
    std::printf("%s: element %zu is %.9g, want %.9g\n", what, at, got, want);
    return 1;
}

static bool near(double got, double want, double tol) {
    return std::fabs(got - want) <= tol * std::max(1.0, std::fabs(want));
}

// top_k_rows against a sort of each row (the larger value first, the lower column among equal
// values, NaN never, padding past a row's numbers): rows with few distinct values (ties across
// the threads' stretches and at the k-th value), NaN, infinities and signed zeros (equal), k from 1 to
// the row's length and past its numbers, and k = 1024 over 3000 columns.
static int check_top_k(u64& seed) {
    struct TopCase {
        int cols, k, levels;  // levels: distinct values (0: any)
        bool holes;           // NaN, infinities and zeros among them
    };
    const TopCase cases[] = {{7, 3, 3, true},   {300, 1, 0, false}, {300, 5, 4, true},
                             {300, 300, 0, true}, {513, 40, 2, false}, {3000, 1024, 0, false},
                             {3000, 700, 50, true}, {16, 16, 0, true}};
    for (const TopCase& c : cases) {
        const int rows = 3;
        std::vector<float> x((size_t)rows * c.cols);
        for (size_t i = 0; i < x.size(); i++) {
            float v = next_value(seed);
            if (c.levels > 0) v = std::floor((v + 1.0f) * 0.5f * c.levels);
            if (c.holes) {
                u64 r = (u64)(std::fabs(next_value(seed)) * 16.0f);
                if (r == 0) v = std::nanf("");
                if (r == 1) v = -INFINITY;
                if (r == 2) v = INFINITY;
                if (r == 3) v = -0.0f;
                if (r == 4) v = 0.0f;
            }
            x[i] = v;
        }
        // The last row: NaN but for two numbers, so k runs past its numbers.
        for (int i = 0; i < c.cols; i++) x[(size_t)2 * c.cols + i] = std::nanf("");
        x[(size_t)2 * c.cols + c.cols / 2] = 1.0f;
        x[(size_t)2 * c.cols] = -1.0f;
        std::vector<float> vals((size_t)rows * c.k, 7.0f);
        std::vector<unsigned int> ids((size_t)rows * c.k, 7u);
        tpctl_launch(rows, 1, BLOCK_THREADS,
                     [&] { top_k_rows(x.data(), c.cols, c.k, vals.data(), ids.data()); });
        for (int r = 0; r < rows; r++) {
            std::vector<std::pair<float, unsigned int>> want;
            for (int i = 0; i < c.cols; i++) {
                float v = x[(size_t)r * c.cols + i];
                if (v == v) want.push_back({v, (unsigned int)i});
            }
            auto key = [](float v) {
                unsigned int u = 0;
                if (v != 0.0f) std::memcpy(&u, &v, 4);
                return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
            };
            std::stable_sort(want.begin(), want.end(), [&](auto& a, auto& b) {
                return key(a.first) > key(b.first);
            });
            for (int j = 0; j < c.k; j++) {
                size_t at = (size_t)r * c.k + j;
                bool real = (size_t)j < want.size();
                unsigned int want_id = real ? want[j].second : 0xffffffffu;
                if (ids[at] != want_id) {
                    std::printf("top_k_rows (%d columns, k %d, row %d): ", c.cols, c.k, r);
                    return fail("id", j, ids[at], want_id);
                }
                bool same = real ? std::memcmp(&vals[at], &want[j].first, 4) == 0 : vals[at] != vals[at];
                if (!same) {
                    std::printf("top_k_rows (%d columns, k %d, row %d): ", c.cols, c.k, r);
                    return fail("value", j, vals[at], real ? want[j].first : NAN);
                }
            }
        }
    }
    return 0;
}

// kernels::exp_det's definition, written out again: range reduction and Taylor polynomial.
static double ref_exp(double x) {
    static const double inv_factorial[14] = {
        1.0, 1.0, 0.5, 0.16666666666666666, 0.041666666666666664, 0.008333333333333333,
        0.001388888888888889, 0.0001984126984126984, 2.48015873015873e-05,
        2.7557319223985893e-06, 2.7557319223985894e-07, 2.505210838544172e-08,
        2.08767569878681e-09, 1.6059043836821616e-10};
    if (!(x >= -708.0 && x <= 0.0)) return x > 0.0 ? INFINITY : 0.0;
    double n = std::round(x * 1.4426950408889634);
    double r = std::fma(-n, 0.6931471803691238, x);
    r = std::fma(-n, 1.9082149292705877e-10, r);
    double p = inv_factorial[13];
    for (int k = 12; k >= 0; k--) p = std::fma(p, r, inv_factorial[k]);
    return std::ldexp(p, (int)n);
}

// A float's order key, -0 and +0 the same, NaN 0 (the kernels' order_key).
static unsigned int ref_key(float v) {
    if (v != v) return 0u;
    unsigned int b = 0;
    if (v != 0.0f) std::memcpy(&b, &v, 4);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// kernels::draw_columns over a whole row, written out plainly: every column's weight, the
// top-p key found bit by bit (each weight summed per chunk in column order, then the chunk
// sums), the kept weights' chunk sums, their total, the walk.
static unsigned int ref_draw(const float* row, int cols, double t, double floor, double u,
                             double top_p) {
    int first = -1, best = -1;
    for (int i = 0; i < cols; i++) {
        if (row[i] != row[i]) continue;
        if (first < 0) first = i;
        if (best < 0 || row[i] > row[best]) best = i;
    }
    if (first < 0) return 0;
    if (t <= 0.0) return (unsigned int)best;
    std::vector<double> w(cols, 0.0);
    for (int i = 0; i < cols; i++) {
        if (row[i] != row[i]) continue;
        double x = ref_exp(((double)row[i] - (double)row[best]) / t);
        w[i] = x >= floor ? x : 0.0;
    }
    auto mass = [&](unsigned int at_least) {
        double total = 0.0;
        for (int c = 0; c < cols; c += 256) {
            double s = 0.0;
            for (int i = c; i < std::min(c + 256, cols); i++)
                if (ref_key(row[i]) >= at_least) s += w[i];
            total += s;
        }
        return total;
    };
    unsigned int kept = 0;
    if (top_p < 1.0) {
        double target = mass(0) * top_p;
        for (int bit = 31; bit >= 0; bit--)
            if (mass(kept | (1u << bit)) >= target) kept |= 1u << bit;
    }
    int last = -1;
    for (int i = 0; i < cols; i++) {
        if (ref_key(row[i]) < kept) w[i] = 0.0;
        if (w[i] > 0.0) last = i;
    }
    unsigned int fallback = (unsigned int)(last >= 0 ? last : first);
    std::vector<double> sums;
    for (int c = 0; c < cols; c += 256) {
        double s = 0.0;
        for (int i = c; i < std::min(c + 256, cols); i++) s += w[i];
        sums.push_back(s);
    }
    double total = 0.0;
    for (double s : sums) total += s;
    double left = u * total;
    for (size_t c = 0; c < sums.size(); c++) {
        if (left < sums[c]) {
            for (int i = (int)c * 256; i < std::min((int)c * 256 + 256, cols); i++) {
                if (row[i] != row[i]) continue;
                if (left < w[i]) return (unsigned int)i;
                left -= w[i];
            }
            return fallback;
        }
        left -= sums[c];
    }
    return fallback;
}

// sample_rows against ref_draw, id for id: rows of few levels (ties), NaN and -inf, greedy,
// temperatures from 0.2 to 3, min-p, top-p of 0.9 and 0.3, u near 0 and near 1, a row of NaN,
// a row of one number, a row narrower than a chunk and one of 3,000 columns; and ref_exp within
// 4 ulps of exp.
static int check_sample(u64& seed) {
    for (int i = 0; i <= 7000; i++) {
        double x = -0.1013 * i;
        double got = ref_exp(x), want = std::exp(x);
        if (x >= -708.0 && std::fabs(got - want) > 4.0 * 2.220446049250313e-16 * want)
            return fail("exp_det", (size_t)i, got, want);
    }
    for (int cols : {100, 3000}) {
        const int rows = 20;
        std::vector<float> x((size_t)rows * cols);
        std::vector<double> params(4 * rows);
        for (int r = 0; r < rows; r++) {
            for (int i = 0; i < cols; i++) {
                float v = std::floor((next_value(seed) + 1.0f) * 4.0f) - 4.0f;
                float h = std::fabs(next_value(seed));
                if (r % 3 == 0 && h < 0.1f) v = std::nanf("");
                if (r % 3 == 0 && h >= 0.1f && h < 0.15f) v = -INFINITY;
                x[(size_t)r * cols + i] = v;
            }
            double u = std::fabs((double)next_value(seed));
            if (r == 5) u = 0.0;
            if (r == 6) u = 0.9999999999;
            params[4 * r] = (double)(float)(r % 4 == 0 ? 0.0 : 0.2 + 0.1 * r);
            params[4 * r + 1] = (double)(float)(r % 2 == 0 ? 0.0 : 0.05);
            params[4 * r + 2] = u;
            params[4 * r + 3] = (double)(float)(r % 3 == 0 ? 1.0 : r % 3 == 1 ? 0.9 : 0.3);
        }
        for (int i = 0; i < cols; i++) x[(size_t)(rows - 2) * cols + i] = std::nanf("");
        for (int i = 0; i < cols; i++) x[(size_t)(rows - 1) * cols + i] = std::nanf("");
        x[(size_t)(rows - 1) * cols + cols / 3] = -2.0f;
        params[4 * (rows - 2)] = params[4 * (rows - 1)] = 1.0;
        std::vector<unsigned int> ids(rows, 99999);
        std::vector<double> weights((size_t)rows * cols, -1.0);
        tpctl_launch(rows, 1, BLOCK_THREADS, [&] {
            sample_rows(x.data(), cols, params.data(), weights.data(), ids.data());
        });
        for (int r = 0; r < rows; r++) {
            const double* p = &params[4 * r];
            unsigned int want = ref_draw(&x[(size_t)r * cols], cols, p[0], p[1], p[2], p[3]);
            if (ids[r] != want) {
                std::printf("sample_rows (%d columns): ", cols);
                return fail("row", (size_t)r, ids[r], want);
            }
        }
    }
    return 0;
}

// normalizers against kernels::logprob's definition (the row's first largest number, each
// number's ref_exp(l - top) summed per chunk of 256 in column order, the chunk sums in
// order), bit for bit: NaN and -inf in rows, a row of NaN only, one of -inf only, signed
// zeros, rows narrower than a chunk and of 3,000 columns; and columns_at inside and past a row.
static int check_normalizers(u64& seed) {
    for (int cols : {100, 3000}) {
        const int rows = 9;
        std::vector<float> x((size_t)rows * cols);
        for (size_t i = 0; i < x.size(); i++) {
            float v = next_value(seed) * 12.0f;
            float h = std::fabs(next_value(seed));
            if (h < 0.05f) v = std::nanf("");
            if (h >= 0.05f && h < 0.08f) v = -INFINITY;
            x[i] = v;
        }
        for (int i = 0; i < cols; i++) x[(size_t)6 * cols + i] = std::nanf("");
        for (int i = 0; i < cols; i++) x[(size_t)7 * cols + i] = -INFINITY;
        for (int i = 0; i < cols; i++) x[(size_t)8 * cols + i] = i % 2 ? 0.0f : -0.0f;
        std::vector<float> tops(rows, 7.0f);
        std::vector<double> sums(rows, -1.0);
        tpctl_launch(rows, 1, BLOCK_THREADS, [&] { normalizers(x.data(), cols, tops.data(), sums.data()); });
        for (int r = 0; r < rows; r++) {
            const float* row = &x[(size_t)r * cols];
            float top = -INFINITY;
            bool any = false;
            for (int i = 0; i < cols; i++) {
                if (row[i] == row[i] && (!any || row[i] > top)) {
                    top = row[i];
                    any = true;
                }
            }
            double total = 0.0;
            for (int c = 0; c * 256 < cols; c++) {
                double s = 0.0;
                for (int i = c * 256; i < std::min(cols, (c + 1) * 256); i++)
                    s += row[i] != row[i] ? 0.0 : ref_exp((double)row[i] - (double)top);
                total += s;
            }
            if (std::memcmp(&tops[r], &top, 4) != 0) return fail("normalizers top", (size_t)r, tops[r], top);
            if (std::memcmp(&sums[r], &total, 8) != 0) return fail("normalizers sum", (size_t)r, sums[r], total);
            if (r == 6 || r == 7 ? total != 0.0 : total < 1.0) return fail("normalizers sum", (size_t)r, total, 1.0);
        }
        std::vector<unsigned int> at(rows);
        for (int r = 0; r < rows; r++) at[r] = r == 3 ? (unsigned int)cols : (unsigned int)((r * 37) % cols);
        std::vector<float> got(rows, 5.0f);
        tpctl_launch(1, 1, BLOCK_THREADS, [&] { columns_at(x.data(), cols, at.data(), got.data(), rows); });
        for (int r = 0; r < rows; r++) {
            float want = r == 3 ? std::nanf("") : x[(size_t)r * cols + at[r]];
            if (std::memcmp(&got[r], &want, 4) != 0 && !(got[r] != got[r] && want != want))
                return fail("columns_at", (size_t)r, got[r], want);
        }
    }
    return 0;
}

// The fused kernels against the kernels they replace, bit for bit:// The fused kernels against the kernels they replace, bit for bit: split_rope against
// copy_cols then rope (GQA, a partial rotation with factors and an attention factor, and a
// whole one), gated_halves against copy_cols then silu_mul / gelu_tanh_mul (and SiLU against
// its formula, so a kernel that swapped the halves or the activation fails). Each split also
// with the projection's bias: against add_rows then the same kernels.
static int check_fused(u64& seed) {
    struct Rope {
        int tokens, q_heads, kv_heads, head_dim, rot;
        bool factors;
    };
    const Rope ropes[] = {{3, 6, 2, 8, 6, true}, {2, 4, 4, 16, 16, false}, {1, 3, 1, 10, 4, true}};
    for (int biased = 0; biased < 2; biased++)
    for (const Rope& c : ropes) {
        int width = (c.q_heads + 2 * c.kv_heads) * c.head_dim;
        std::vector<float> y((size_t)c.tokens * width);
        for (auto& v : y) v = next_value(seed);
        // The references read y with the bias added (add_rows); the fused kernels add it.
        std::vector<float> bias(width), yb = y;
        for (auto& v : bias) v = next_value(seed);
        const float* bp = biased ? bias.data() : nullptr;
        if (biased) {
            tpctl_launch(elementwise(yb.size()), 1, BLOCK_THREADS, [&] {
                add_rows(yb.data(), bias.data(), yb.size(), width);
            });
        }
        std::vector<u64> pos;
        for (int t = 0; t < c.tokens; t++) pos.push_back(7 + 1000 * (u64)t);
        std::vector<float> factors;
        for (int i = 0; i < c.rot / 2; i++) factors.push_back(1.0f + (float)(i % 3));
        const float* f = c.factors ? factors.data() : nullptr;
        float attn = c.factors ? 1.25f : 1.0f;
        int qw = c.q_heads * c.head_dim, kw = c.kv_heads * c.head_dim;
        std::vector<float> q((size_t)c.tokens * qw), k((size_t)c.tokens * kw), v(k.size());
        u64 n = (u64)c.tokens * width;
        tpctl_launch(elementwise(n), 1, BLOCK_THREADS, [&] {
            split_rope(y.data(), q.data(), k.data(), v.data(), pos.data(), c.tokens, c.q_heads,
                       c.kv_heads, c.head_dim, c.rot, 10000.0f, f, attn, bp);
        });
        std::vector<float> q2(q.size()), k2(k.size()), v2(v.size());
        const int offsets[] = {0, qw, qw + kw}, sizes[] = {qw, kw, kw};
        std::vector<float>* parts[] = {&q2, &k2, &v2};
        for (int p = 0; p < 3; p++) {
            tpctl_launch(elementwise(parts[p]->size()), 1, BLOCK_THREADS, [&] {
                copy_cols(yb.data(), parts[p]->data(), parts[p]->size(), width, offsets[p], sizes[p]);
            });
        }
        const int heads[] = {c.q_heads, c.kv_heads};
        for (int p = 0; p < 2; p++) {
            u64 pairs = (u64)c.tokens * heads[p] * (c.rot / 2);
            tpctl_launch(elementwise(pairs), 1, BLOCK_THREADS, [&] {
                rope(parts[p]->data(), pos.data(), c.tokens, heads[p], c.head_dim, c.rot, 10000.0f,
                     f, attn);
            });
        }
        const std::vector<float>* got[] = {&q, &k, &v};
        const char* names[] = {"split_rope q", "split_rope k", "split_rope v"};
        for (int p = 0; p < 3; p++)
            for (size_t i = 0; i < got[p]->size(); i++)
                if (__float_as_uint((*got[p])[i]) != __float_as_uint((*parts[p])[i]))
                    return fail(names[p], i, (*got[p])[i], (*parts[p])[i]);
        // With the keys and values written into a pool (scattered places, a shift, f32 and
        // bf16): the same queries, and the pool as write_rows writes split_rope's k and v.
        for (int bf16 = 0; bf16 < 2; bf16++) {
            u64 stride = 2 * (u64)kw + 5, shift = 7, values = (u64)kw;
            std::vector<u64> places, moves;
            for (int t = 0; t < c.tokens; t++) {
                places.push_back((u64)(c.tokens - 1 - t) * stride);
                moves.push_back((u64)t);
                moves.push_back(places.back());
            }
            size_t cells = (size_t)(shift + c.tokens * stride);
            // Two-byte cells for bf16 live in the same buffer (as the pool's memory would).
            std::vector<float> pa(cells, -3.0f), pb(cells, -3.0f), qa(q.size());
            tpctl_launch(elementwise(n), 1, BLOCK_THREADS, [&] {
                split_rope_append(y.data(), qa.data(), pa.data(), places.data(), shift, values,
                                  bf16, pos.data(), c.tokens, c.q_heads, c.kv_heads, c.head_dim,
                                  c.rot, 10000.0f, f, attn, bp);
            });
            u64 rows_n = (u64)c.tokens * kw;
            tpctl_launch(elementwise(rows_n), 1, BLOCK_THREADS, [&] {
                write_rows(k.data(), pb.data(), moves.data(), shift, c.tokens, kw, bf16);
                write_rows(v.data(), pb.data(), moves.data(), shift + values, c.tokens, kw, bf16);
            });
            for (size_t i = 0; i < qa.size(); i++)
                if (__float_as_uint(qa[i]) != __float_as_uint(q[i]))
                    return fail("split_rope_append q", i, qa[i], q[i]);
            for (size_t i = 0; i < cells; i++)
                if (__float_as_uint(pa[i]) != __float_as_uint(pb[i]))
                    return fail(bf16 ? "split_rope_append pool (bf16)" : "split_rope_append pool", i,
                                pa[i], pb[i]);
        }
        // The rotation happened: some query differs from its unrotated value.
        bool rotated = false;
        for (size_t i = 0; i < q.size(); i++) rotated |= q[i] != yb[(i / qw) * width + i % qw];
        if (!rotated) return fail("split_rope rotates nothing", 0, 0, 1);
        // The bias was added: some value differs from y's.
        bool added = false;
        for (size_t i = 0; i < v.size(); i++)
            added |= v[i] != y[(i / kw) * width + qw + kw + i % kw];
        if (added != (biased == 1)) return fail("split_rope's bias", 0, added, biased);
    }
    for (int gelu = 0; gelu < 2; gelu++) {
        int rows = 3, units = 300;
        std::vector<float> x((size_t)rows * 2 * units), out((size_t)rows * units);
        for (auto& v : x) v = 4.0f * next_value(seed);
        std::vector<unsigned short> half(out.size()), rounded(out.size());
        tpctl_launch(elementwise(out.size()), 1, BLOCK_THREADS, [&] {
            gated_halves(x.data(), out.data(), out.size(), units, gelu, half.data());
        });
        tpctl_launch(elementwise(out.size()), 1, BLOCK_THREADS, [&] {
            to_bf16(out.data(), rounded.data(), out.size());
        });
        for (size_t i = 0; i < half.size(); i++)
            if (half[i] != rounded[i]) return fail("gated_halves' bf16 outputs", i, half[i], rounded[i]);
        std::vector<float> g(out.size()), u(out.size());
        tpctl_launch(elementwise(g.size()), 1, BLOCK_THREADS, [&] {
            copy_cols(x.data(), g.data(), g.size(), 2 * units, 0, units);
            copy_cols(x.data(), u.data(), u.size(), 2 * units, units, units);
        });
        tpctl_launch(elementwise(g.size()), 1, BLOCK_THREADS, [&] {
            if (gelu) gelu_tanh_mul(g.data(), u.data(), g.size());
            else silu_mul(g.data(), u.data(), g.size());
        });
        for (size_t i = 0; i < out.size(); i++) {
            if (__float_as_uint(out[i]) != __float_as_uint(g[i]))
                return fail(gelu ? "gated_halves (gelu)" : "gated_halves (silu)", i, out[i], g[i]);
            if (gelu) continue;
            double gv = x[(i / units) * 2 * units + i % units];
            double uv = x[(i / units) * 2 * units + units + i % units];
            double want = gv / (1.0 + std::exp(-gv)) * uv;
            if (!near(out[i], want, 1e-5)) return fail("gated_halves formula", i, out[i], want);
        }
    }
    return 0;
}

static int check_rows() {
    u64 seed = 77;
    // RMSNorm of 3 rows of 300 (over a block's width, so threads take two elements).
    int rows = 3, d = 300;
    std::vector<float> x((size_t)rows * d), w(d), out(x.size());
    for (auto& v : x) v = next_value(seed);
    for (auto& v : w) v = next_value(seed);
    // Also its outputs rounded to bf16 (the input of a bf16 product), as to_bf16 rounds them.
    std::vector<unsigned short> half(x.size()), rounded(x.size());
    tpctl_launch(rows, 1, BLOCK_THREADS, [&] {
        rms_norm(x.data(), w.data(), out.data(), d, 1e-5f, half.data());
    });
    tpctl_launch(elementwise(out.size()), 1, BLOCK_THREADS, [&] {
        to_bf16(out.data(), rounded.data(), out.size());
    });
    for (size_t i = 0; i < half.size(); i++)
        if (half[i] != rounded[i]) return fail("rms_norm's bf16 outputs", i, half[i], rounded[i]);
    for (int r = 0; r < rows; r++) {
        double ms = 0.0;
        for (int c = 0; c < d; c++) ms += (double)x[r * d + c] * x[r * d + c];
        double scale = 1.0 / std::sqrt(ms / d + 1e-5);
        for (int c = 0; c < d; c++) {
            double want = x[r * d + c] * scale * w[c];
            if (!near(out[r * d + c], want, 1e-5)) return fail("rms_norm", r * d + c, out[r * d + c], want);
        }
    }
    // The residual add fused with RMSNorm, on the same rows: the sum written back exactly
    // (one float addition per element), the norm of the sum as above, and both the same bits
    // as the add_assign and rms_norm kernels run one after the other.
    std::vector<float> y(x.size()), fx = x, fout(x.size()), sx = x, sout(x.size());
    for (auto& v : y) v = next_value(seed);
    tpctl_launch(rows, 1, BLOCK_THREADS, [&] {
        add_rms_norm(fx.data(), y.data(), w.data(), fout.data(), d, 1e-5f, half.data());
    });
    tpctl_launch(elementwise(fout.size()), 1, BLOCK_THREADS, [&] {
        to_bf16(fout.data(), rounded.data(), fout.size());
    });
    for (size_t i = 0; i < half.size(); i++)
        if (half[i] != rounded[i]) return fail("add_rms_norm's bf16 outputs", i, half[i], rounded[i]);
    tpctl_launch(elementwise(sx.size()), 1, BLOCK_THREADS, [&] { add_assign(sx.data(), y.data(), sx.size()); });
    tpctl_launch(rows, 1, BLOCK_THREADS, [&] {
        rms_norm(sx.data(), w.data(), sout.data(), d, 1e-5f, nullptr);
    });
    for (int r = 0; r < rows; r++) {
        double ms = 0.0;
        for (int c = 0; c < d; c++) {
            float sum = x[r * d + c] + y[r * d + c];
            if (fx[r * d + c] != sum) return fail("add_rms_norm sum", r * d + c, fx[r * d + c], sum);
            ms += (double)sum * sum;
        }
        double scale = 1.0 / std::sqrt(ms / d + 1e-5);
        for (int c = 0; c < d; c++) {
            size_t at = (size_t)r * d + c;
            double want = fx[at] * scale * w[c];
            if (!near(fout[at], want, 1e-5)) return fail("add_rms_norm", at, fout[at], want);
            if (__float_as_uint(fout[at]) != __float_as_uint(sout[at]) || fx[at] != sx[at])
                return fail("add_rms_norm vs add_assign then rms_norm", at, fout[at], sout[at]);
        }
    }
    // RoPE of 2 tokens x 3 heads of 8, rotating 6 dimensions, with frequency factors and
    // longrope's attention factor on the rotated elements.
    int tokens = 2, heads = 3, head_dim = 8, rot = 6;
    std::vector<u64> pos = {5, 1000};
    std::vector<float> factors = {1.0f, 2.0f, 8.0f};
    const float attn = 1.25f;
    std::vector<float> r0((size_t)tokens * heads * head_dim);
    for (auto& v : r0) v = next_value(seed);
    std::vector<float> r1 = r0;
    u64 pairs = (u64)tokens * heads * (rot / 2);
    tpctl_launch(elementwise(pairs), 1, BLOCK_THREADS, [&] {
        rope(r1.data(), pos.data(), tokens, heads, head_dim, rot, 10000.0f, factors.data(), attn);
    });
    for (int t = 0; t < tokens; t++)
        for (int h = 0; h < heads; h++)
            for (int i = 0; i < head_dim; i++) {
                size_t at = ((size_t)t * heads + h) * head_dim + i;
                double want = r0[at];
                if (i < rot) {
                    int p = i % (rot / 2);
                    double a = (double)pos[t] * std::pow(10000.0, -(double)(2 * p) / rot) / factors[p];
                    double lo = r0[at - i + p], hi = r0[at - i + p + rot / 2];
                    double c = std::cos(a) * attn, s = std::sin(a) * attn;
                    want = i < rot / 2 ? lo * c - hi * s : hi * c + lo * s;
                }
                if (!near(r1[at], want, 1e-5)) return fail("rope", at, r1[at], want);
            }
    if (check_fused(seed) != 0) return 1;
    // Argmax: the first of equal maxima, NaN never wins, a row of NaN gives 0.
    float nan = std::nanf("");
    std::vector<float> am = {1.0f, 3.0f, nan, 3.0f, -2.0f,   // ties: index 1
                             nan, nan, nan, nan, nan,        // nothing qualifies: 0
                             -5.0f, -1.0f, -1.5f, nan, -1.0f};  // index 1
    std::vector<unsigned int> idx(3, 99);
    tpctl_launch(3, 1, BLOCK_THREADS, [&] { argmax_rows(am.data(), 5, idx.data()); });
    unsigned int want_idx[] = {1, 0, 1};
    for (int r = 0; r < 3; r++)
        if (idx[r] != want_idx[r]) return fail("argmax_rows", r, idx[r], want_idx[r]);
    if (check_top_k(seed) != 0) return 1;
    if (check_sample(seed) != 0) return 1;
    if (check_normalizers(seed) != 0) return 1;
    // Logit soft-capping of 300 values up to +-6 with a cap of 1.5: most are pulled in far.
    std::vector<float> logits(300), capped;
    for (auto& v : logits) v = 6.0f * next_value(seed);
    capped = logits;
    tpctl_launch(elementwise(capped.size()), 1, BLOCK_THREADS, [&] {
        soft_cap(capped.data(), 1.5f, capped.size());
    });
    for (size_t i = 0; i < logits.size(); i++) {
        double want = 1.5 * std::tanh((double)logits[i] / 1.5);
        if (!near(capped[i], want, 1e-6)) return fail("soft_cap", i, capped[i], want);
    }
    std::printf("ok: rms_norm, add_rms_norm, rope with factors and an attention factor, split_rope, gated_halves, argmax_rows, top_k_rows, sample_rows, normalizers, columns_at, soft_cap\n");
    return 0;
}

static int check_formats() {
    u64 seed = 99;
    // Dequantization, 64 weights per packing: kinds 0 (8-bit, a scale per 32), 1 (4-bit with a
    // minimum, 16 bytes per 32), 2 (8-bit, a scale per 16), 3 (as 2, plus a minimum).
    u64 n = 64;
    std::vector<float> scales(4), mins(4);
    for (auto& v : scales) v = next_value(seed);
    for (auto& v : mins) v = next_value(seed);
    std::vector<unsigned char> qs(64);
    for (size_t i = 0; i < qs.size(); i++) qs[i] = (unsigned char)(i * 37 + 11);
    for (int kind = 0; kind < 4; kind++) {
        std::vector<float> out(n, -7.0f);
        tpctl_launch(elementwise(n), 1, BLOCK_THREADS, [&] {
            dequantize(scales.data(), mins.data(), qs.data(), out.data(), n, kind);
        });
        for (u64 i = 0; i < n; i++) {
            double want;
            if (kind == 1) {
                unsigned char q = qs[(i / 32) * 16 + (i % 32) % 16];
                int nib = (i % 32) < 16 ? (q & 15) : (q >> 4);
                want = (double)scales[i / 32] * nib + mins[i / 32];
            } else if (kind >= 2) {
                want = (double)scales[i / 16] * (signed char)qs[i] + (kind == 3 ? mins[i / 16] : 0.0);
            } else {
                want = (double)scales[i / 32] * (signed char)qs[i];
            }
            if (!near(out[i], want, 1e-6)) return fail("dequantize", i, out[i], want);
        }
    }
    // bf16 rounding: nearest, ties to even, NaN kept (quiet), infinities kept.
    std::vector<float> f = {1.0f, -2.5f, __int_as_float(0x3f808000), __int_as_float(0x3f818000),
                            __int_as_float(0x3f80c000), INFINITY, std::nanf("")};
    std::vector<unsigned short> bits(f.size());
    tpctl_launch(1, 1, BLOCK_THREADS, [&] { to_bf16(f.data(), bits.data(), f.size()); });
    unsigned short want_bits[] = {0x3f80, 0xc020, 0x3f80, 0x3f82, 0x3f81, 0x7f80, 0x7fc0};
    for (size_t i = 0; i < f.size(); i++)
        if (bits[i] != want_bits[i]) return fail("to_bf16", i, bits[i], want_bits[i]);
    // Embedding rows and a column split.
    int vocab = 5, dim = 7;
    std::vector<float> table((size_t)vocab * dim);
    for (auto& v : table) v = next_value(seed);
    std::vector<unsigned int> ids = {4, 0, 4, 2};
    std::vector<float> emb(ids.size() * dim);
    tpctl_launch(elementwise(emb.size()), 1, BLOCK_THREADS, [&] {
        embedding(table.data(), ids.data(), emb.data(), (int)ids.size(), dim);
    });
    for (size_t i = 0; i < emb.size(); i++) {
        float want = table[ids[i / dim] * dim + i % dim];
        if (emb[i] != want) return fail("embedding", i, emb[i], want);
    }
    std::vector<float> cols(ids.size() * 3);
    tpctl_launch(elementwise(cols.size()), 1, BLOCK_THREADS, [&] {
        copy_cols(emb.data(), cols.data(), cols.size(), dim, 2, 3);
    });
    for (size_t i = 0; i < cols.size(); i++) {
        float want = emb[(i / 3) * dim + 2 + i % 3];
        if (cols[i] != want) return fail("copy_cols", i, cols[i], want);
    }
    // write_rows: rows 2, 0 and 3 of 4 rows of 5 to scattered offsets shifted by 2, f32 and bf16
    // (as to_bf16 rounds); elements not written stay as they were.
    {
        std::vector<float> src(20), dst(64, -7.0f);
        for (auto& v : src) v = next_value(seed);
        std::vector<u64> moves = {2, 38, 0, 1, 3, 19};
        tpctl_launch(elementwise(15), 1, BLOCK_THREADS, [&] {
            write_rows(src.data(), dst.data(), moves.data(), 2, 3, 5, 0);
        });
        std::vector<float> want(64, -7.0f);
        for (int m = 0; m < 3; m++)
            for (int c = 0; c < 5; c++) want[2 + moves[2 * m + 1] + c] = src[moves[2 * m] * 5 + c];
        for (size_t i = 0; i < dst.size(); i++)
            if (__float_as_uint(dst[i]) != __float_as_uint(want[i])) return fail("write_rows", i, dst[i], want[i]);
        std::vector<unsigned short> half(64, 0xffff), rounded(20);
        tpctl_launch(elementwise(20), 1, BLOCK_THREADS, [&] { to_bf16(src.data(), rounded.data(), 20); });
        tpctl_launch(elementwise(15), 1, BLOCK_THREADS, [&] {
            write_rows(src.data(), (float*)half.data(), moves.data(), 2, 3, 5, 1);
        });
        std::vector<unsigned short> hwant(64, 0xffff);
        for (int m = 0; m < 3; m++)
            for (int c = 0; c < 5; c++) hwant[2 + moves[2 * m + 1] + c] = rounded[moves[2 * m] * 5 + c];
        for (size_t i = 0; i < half.size(); i++)
            if (half[i] != hwant[i]) return fail("write_rows (bf16)", i, half[i], hwant[i]);
    }
    std::printf("ok: dequantize (4 packings), to_bf16, embedding, copy_cols, write_rows\n");
    return 0;
}

static const unsigned int THREADS = 128;  // ATTN_BLOCK

float next_value(u64& state) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(state >> 40) / (double)(1ull << 24) * 2.0 - 1.0);
}

struct Case {
    int q_heads, kv_heads, head_dim, queries, keys, splits, block_size;
    bool scattered;
    bool bf16 = false;
    // Score rules: a query scale (0: 1/sqrt(head_dim)), a soft-cap (0: none) and a sliding
    // window in positions (0: none).
    float qscale = 0.0f, cap = 0.0f;
    u64 window = 0;
    bool ruled() const { return qscale != 0.0f || cap != 0.0f || window != 0; }
};

// The reference of one row of attention in double precision: the output (head_dim values)
// and the log-sum-exp, with or without the case's score rules. Query at q_pos sees the keys
// at q_pos - window + 1 ..= q_pos (cpu::attention's rule), scores capped before the softmax.
static double reference_row(const Case& c, bool rules, const float* qr, u64 qp,
                            const std::vector<u64>& kv_pos, const std::vector<float>& kl,
                            const std::vector<float>& vl, int g, std::vector<double>& out) {
    u64 stride = (u64)c.kv_heads * c.head_dim;
    double scale = rules && c.qscale != 0.0f ? (double)c.qscale : 1.0 / std::sqrt((double)c.head_dim);
    std::vector<double> s;
    double mx = -INFINITY;
    for (int j = 0; j < c.keys; j++) {
        double score = -INFINITY;
        bool in_window = !rules || c.window == 0 || kv_pos[j] + c.window > qp;
        if (kv_pos[j] <= qp && in_window) {
            double dot = 0.0;
            for (int d = 0; d < c.head_dim; d++)
                dot += (double)qr[d] * kl[(size_t)j * stride + (size_t)g * c.head_dim + d];
            score = dot * scale;
            if (rules && c.cap != 0.0f) score = c.cap * std::tanh(score / c.cap);
        }
        s.push_back(score);
        mx = std::max(mx, score);
    }
    out.assign(c.head_dim, 0.0);
    if (mx == -INFINITY) return -INFINITY;
    double sum = 0.0;
    for (double x : s) sum += x == -INFINITY ? 0.0 : std::exp(x - mx);
    for (int j = 0; j < c.keys; j++) {
        if (s[j] == -INFINITY) continue;
        double w = std::exp(s[j] - mx) / sum;
        for (int d = 0; d < c.head_dim; d++)
            out[d] += w * vl[(size_t)j * stride + (size_t)g * c.head_dim + d];
    }
    return mx + std::log(sum);
}

// `x` rounded to bf16 bits (nearest, ties to even), as the to_bf16 kernel does.
static unsigned short bf16_bits(float x) {
    unsigned int u = __float_as_uint(x);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

static int check(const Case& c) {
    u64 seed = 12345 + c.keys * 7 + c.head_dim;
    int rows = c.queries * c.q_heads;
    u64 stride = (u64)c.kv_heads * c.head_dim;
    std::vector<float> q((size_t)rows * c.head_dim);
    for (auto& x : q) x = next_value(seed);
    std::vector<u64> q_pos(c.queries), kv_pos(c.keys);
    for (int i = 0; i < c.queries; i++) q_pos[i] = c.scattered ? (u64)i * 3 : (u64)(c.keys - c.queries + i);
    for (int j = 0; j < c.keys; j++) kv_pos[j] = c.scattered ? (u64)((j * 37) % (c.keys + 11) + 2) : (u64)j;
    // Logical key rows; with a block table they are stored in reversed blocks.
    std::vector<float> kl((size_t)c.keys * stride), vl((size_t)c.keys * stride);
    for (auto& x : kl) x = next_value(seed);
    for (auto& x : vl) x = next_value(seed);
    std::vector<float> ks = kl, vs = vl;
    std::vector<unsigned int> table;
    u64 block_stride = 0;
    if (c.block_size > 0) {
        int blocks = (c.keys + c.block_size - 1) / c.block_size;
        block_stride = (u64)c.block_size * stride;
        ks.assign((size_t)blocks * block_stride, 0.0f);
        vs.assign(ks.size(), 0.0f);
        for (int b = 0; b < blocks; b++) table.push_back((unsigned int)(blocks - 1 - b));
        for (int j = 0; j < c.keys; j++) {
            u64 at = table[j / c.block_size] * block_stride + (u64)(j % c.block_size) * stride;
            std::copy_n(&kl[(size_t)j * stride], stride, &ks[at]);
            std::copy_n(&vl[(size_t)j * stride], stride, &vs[at]);
        }
    }
    // bf16 keys and values: the reference uses the rounded values, the kernel their bits.
    std::vector<unsigned short> kh, vh;
    if (c.bf16) {
        for (auto* pair : {&kl, &vl})
            for (auto& x : *pair) x = __uint_as_float((unsigned int)bf16_bits(x) << 16);
        for (float x : ks) kh.push_back(bf16_bits(x));
        for (float x : vs) vh.push_back(bf16_bits(x));
    }
    const float* kp = c.bf16 ? (const float*)kh.data() : ks.data();
    const float* vp = c.bf16 ? (const float*)vh.data() : vs.data();
    float scale = c.qscale != 0.0f ? c.qscale : 1.0f / std::sqrt((float)c.head_dim);
    u64 window = c.window != 0 ? c.window : ~0ull;
    int chunk = (c.keys + c.splits - 1) / c.splits;
    chunk = (chunk + 127) / 128 * 128;
    int splits = (c.keys + chunk - 1) / chunk;
    std::vector<float> part((size_t)splits * rows * c.head_dim), part_lse((size_t)splits * rows);
    const unsigned int* tp = table.empty() ? nullptr : table.data();
    // One block per query token, KV head and slice of up to ATTN_GROUP (4) of its query heads.
    int per_group = c.q_heads / c.kv_heads;
    unsigned int blocks = (unsigned int)(c.queries * c.kv_heads * ((per_group + 3) / 4));
    // The final outputs rounded to bf16 too: by the attention kernel with one range, by the
    // merge with several.
    std::vector<unsigned short> half((size_t)rows * c.head_dim), rounded(half.size());
    tpctl_launch(blocks, splits, THREADS, [&] {
        attention(q.data(), q_pos.data(), kp, vp, kv_pos.data(), tp,
                  c.block_size > 0 ? c.block_size : 1, block_stride, c.keys, c.q_heads,
                  c.kv_heads, c.head_dim, scale, c.cap, window, chunk, c.bf16 ? 1 : 0, nullptr,
                  part.data(), part_lse.data(), splits == 1 ? half.data() : nullptr);
    });
    std::vector<float> out = part, lse = part_lse;
    if (splits > 1) {
        out.assign((size_t)rows * c.head_dim, 0.0f);
        lse.assign(rows, 0.0f);
        tpctl_launch(rows, 1, THREADS, [&] {
            attention_merge(part.data(), part_lse.data(), splits, rows, c.head_dim, out.data(),
                            lse.data(), half.data());
        });
    }
    tpctl_launch(elementwise(out.size()), 1, BLOCK_THREADS, [&] {
        to_bf16(out.data(), rounded.data(), out.size());
    });
    for (size_t i = 0; i < half.size(); i++)
        if (half[i] != rounded[i]) return fail("attention's bf16 outputs", i, half[i], rounded[i]);
    // With rules, the reference without them must differ somewhere, so a kernel that
    // ignored the window, the cap or the scale would fail this case.
    bool rules_matter = false;
    for (int r = 0; r < rows; r++) {
        int i = r / c.q_heads, h = r % c.q_heads, g = h / (c.q_heads / c.kv_heads);
        const float* qr = &q[(size_t)r * c.head_dim];
        std::vector<double> want;
        double want_lse = reference_row(c, true, qr, q_pos[i], kv_pos, kl, vl, g, want);
        if (c.ruled()) {
            std::vector<double> plain;
            double plain_lse = reference_row(c, false, qr, q_pos[i], kv_pos, kl, vl, g, plain);
            if ((plain_lse == -INFINITY) != (want_lse == -INFINITY) ||
                (want_lse != -INFINITY && !near(plain_lse, want_lse, 1e-3)))
                rules_matter = true;
            for (int d = 0; d < c.head_dim; d++)
                if (!near(plain[d], want[d], 1e-3)) rules_matter = true;
        }
        bool lse_ok = (want_lse == -INFINITY && lse[r] == -INFINITY) ||
                      std::fabs(lse[r] - want_lse) <= 1e-4 * std::max(1.0, std::fabs(want_lse));
        if (!lse_ok) {
            std::printf("case keys=%d head_dim=%d splits=%d: row %d lse %.7g, want %.7g\n",
                        c.keys, c.head_dim, splits, r, lse[r], want_lse);
            return 1;
        }
        for (int d = 0; d < c.head_dim; d++) {
            float got = out[(size_t)r * c.head_dim + d];
            if (std::fabs(got - want[d]) > 1e-4 * std::max(1.0, std::fabs(want[d]))) {
                std::printf("case keys=%d head_dim=%d splits=%d: row %d col %d: %.7g, want %.7g\n",
                            c.keys, c.head_dim, splits, r, d, got, want[d]);
                return 1;
            }
        }
    }
    if (c.ruled() && !rules_matter) {
        std::printf("case keys=%d head_dim=%d: the score rules change nothing, so the case "
                    "cannot tell whether the kernel applies them\n", c.keys, c.head_dim);
        return 1;
    }
    std::printf("ok: %d queries x %d heads over %d keys (%d kv heads, head_dim %d), %d range(s)%s%s%s",
                c.queries, c.q_heads, c.keys, c.kv_heads, c.head_dim, splits,
                c.block_size > 0 ? ", paged" : "", c.scattered ? ", scattered" : "",
                c.bf16 ? ", bf16 keys and values" : "");
    if (c.ruled())
        std::printf(", query scale %g, soft-cap %g, window %llu", c.qscale, c.cap, c.window);
    std::printf("\n");
    return 0;
}

// A step's decode rows in one launch (`seqs`): three sequences of 5, 130 and 300 keys in one
// paged pool (blocks of 16, scattered), one query each at its last position, key ranges of
// 128 (so the shorter ones have empty ranges). Each row against the double-precision
// reference, and bit for bit against its sequence launched alone over the same ranges.
// edit_rows: two rows of 6 columns holding tokens 4..10 (a shard), edits in order against the
// host sampler's operations (bit for bit: token 5's penalty before its subtraction, which the
// other order would not give), tokens outside the shard skipped, a row without edits
// untouched.
static int check_edit_rows() {
    const int cols = 6;
    const u64 first = 4;
    float x[2 * cols] = {0.5f, 3.0f, -2.0f, 1.0f, 7.0f, 0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f};
    auto bits = [](float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; };
    // Token 5: repetition 1.5 then minus 0.25; token 6: repetition; token 7: + 1e-8 then + 2;
    // tokens 3 and 10 are outside.
    unsigned int edits[] = {5, 0, bits(1.5f), 6, 0, bits(1.5f), 5, 1, bits(0.25f),
                            7, 2, bits(1e-8f), 7, 2, bits(2.0f), 3, 2, bits(9.0f),
                            10, 2, bits(9.0f)};
    unsigned int offsets[] = {0, 7, 7};
    float want[2 * cols];
    std::memcpy(want, x, sizeof x);
    want[1] = 3.0f / 1.5f - 0.25f;
    want[2] = -2.0f * 1.5f;
    want[3] = (1.0f + 1e-8f) + 2.0f;
    tpctl_launch(2, 1, 32, [&] { edit_rows(x, cols, offsets, edits, first); });
    if (std::memcmp(x, want, sizeof x) != 0) {
        for (int i = 0; i < 2 * cols; i++)
            if (std::memcmp(&x[i], &want[i], 4) != 0) return fail("edit_rows", i, x[i], want[i]);
    }
    std::printf("ok: edit_rows (in order, a shard's columns, the host's operations)\n");
    return 0;
}

// qmatvec: every packing, 1 and 11 rows of x (two blocks of rows), a row of W longer than a block's groups (so
// threads take three) and one shorter, against the products of the weights `dequantize`
// gives in double precision; a second launch gives the same bits; reading the 4-bit nibbles
// in the other order (a deliberate fault) is caught.
static int check_qmatvec() {
    u64 seed = 515;
    const int QMV = 64;  // QMV_BLOCK
    for (int k : {32 * 130, 96}) {
        const int n = 2;
        u64 elems = (u64)n * k;
        std::vector<float> scales(elems / 16), mins(elems / 16);
        for (auto& v : scales) v = 0.05f * next_value(seed);
        for (auto& v : mins) v = 0.05f * next_value(seed);
        std::vector<unsigned char> qs(elems);
        for (auto& q : qs) q = (unsigned char)(next_value(seed) * 1e6);
        for (int kind = 0; kind < 4; kind++) {
            std::vector<float> dense(elems);
            tpctl_launch(elementwise(elems), 1, BLOCK_THREADS, [&] {
                dequantize(scales.data(), mins.data(), qs.data(), dense.data(), elems, kind);
            });
            for (int m : {1, 11}) {
                std::vector<float> x((size_t)m * k);
                for (auto& v : x) v = next_value(seed);
                std::vector<float> out((size_t)m * n, -7.0f), again(out);
                for (auto* o : {&out, &again}) {
                    if (o == &again && m == 1) continue;
                    tpctl_launch(n, (m + 7) / 8, QMV, [&] {
                        qmatvec(scales.data(), mins.data(), qs.data(), x.data(), o->data(), n, k, m,
                                kind);
                    });
                }
                for (int i = 0; i < m; i++) {
                    for (int r = 0; r < n; r++) {
                        double want = 0.0, scale = 0.0;
                        for (int c = 0; c < k; c++) {
                            double p = (double)x[(size_t)i * k + c] * dense[(size_t)r * k + c];
                            want += p;
                            scale += std::fabs(p);
                        }
                        float got = out[(size_t)i * n + r];
                        if (std::fabs(got - want) > 1e-5 * scale + 1e-6)
                            return fail("qmatvec", i * n + r, got, want);
                        if (m > 1 && std::memcmp(&got, &again[(size_t)i * n + r], 4) != 0)
                            return fail("qmatvec again", i * n + r, again[(size_t)i * n + r], got);
                    }
                }
            }
        }
        // The fault: the 4-bit block's nibbles swapped gives other weights, which must show.
        std::vector<unsigned char> swapped(qs);
        for (auto& q : swapped) q = (unsigned char)((q << 4) | (q >> 4));
        std::vector<float> x(k), good(n), bad(n);
        for (auto& v : x) v = next_value(seed);
        tpctl_launch(n, 1, QMV, [&] {
            qmatvec(scales.data(), mins.data(), qs.data(), x.data(), good.data(), n, k, 1, 1);
        });
        tpctl_launch(n, 1, QMV, [&] {
            qmatvec(scales.data(), mins.data(), swapped.data(), x.data(), bad.data(), n, k, 1, 1);
        });
        if (good == bad) {
            std::fprintf(stderr, "qmatvec: swapped nibbles went unnoticed\n");
            return 1;
        }
    }
    std::printf("ok: qmatvec (4 packings; 1 and 11 rows; the same bits again)\n");
    return 0;
}

static int check_batched() {
    u64 seed = 4242;
    const int q_heads = 6, kv_heads = 2, head_dim = 32, bs = 16, n = 3, chunk = 128;
    const int lens[n] = {5, 130, 300};
    const u64 stride = (u64)kv_heads * head_dim, block_stride = (u64)bs * stride;
    int total_blocks = 0;
    for (int len : lens) total_blocks += (len + bs - 1) / bs;
    std::vector<float> ks((size_t)total_blocks * block_stride), vs(ks.size());
    for (auto& x : ks) x = next_value(seed);
    for (auto& x : vs) x = next_value(seed);
    std::vector<unsigned int> table;
    std::vector<u64> kv_pos, seqs, q_pos;
    int handed = 0;
    for (int s = 0; s < n; s++) {
        seqs.push_back(kv_pos.size());
        seqs.push_back(table.size());
        seqs.push_back((u64)lens[s]);
        for (int b = 0; b < (lens[s] + bs - 1) / bs; b++)
            table.push_back((unsigned int)((handed++ * 7) % total_blocks));
        for (int j = 0; j < lens[s]; j++) kv_pos.push_back((u64)j);
        q_pos.push_back((u64)lens[s] - 1);
    }
    std::vector<float> q((size_t)n * q_heads * head_dim);
    for (auto& x : q) x = next_value(seed);
    float scale = 1.0f / std::sqrt((float)head_dim);
    int rows = n * q_heads, splits = (300 + chunk - 1) / chunk;
    // Runs attention and its merge over `tokens` query tokens: rows of `out` and `lse`.
    auto run = [&](const float* qp, const u64* qpos, const u64* kpos, const unsigned int* tab,
                   int n_kv, int tokens, int ranges, int range_keys, const u64* sq,
                   std::vector<float>& out, std::vector<float>& lse) {
        int r = tokens * q_heads;
        std::vector<float> part((size_t)ranges * r * head_dim), part_lse((size_t)ranges * r);
        tpctl_launch((unsigned int)(tokens * kv_heads), ranges, THREADS, [&] {
            attention(qp, qpos, ks.data(), vs.data(), kpos, tab, bs, block_stride, n_kv, q_heads,
                      kv_heads, head_dim, scale, 0.0f, ~0ull, range_keys, 0, sq, part.data(),
                      part_lse.data(), nullptr);
        });
        out = part;
        lse = part_lse;
        if (ranges > 1) {
            out.assign((size_t)r * head_dim, 0.0f);
            lse.assign(r, 0.0f);
            tpctl_launch(r, 1, THREADS, [&] {
                attention_merge(part.data(), part_lse.data(), ranges, r, head_dim, out.data(),
                                lse.data(), nullptr);
            });
        }
    };
    // Ranges of 128 keys, as many as the longest needs; then grids of 2 and 8 ranges whatever
    // the keys (chunk 0: each token's keys split evenly over them, in whole tiles: 2 ranges
    // of 256 keys for 300, 8 ranges of 128 with the last five empty).
    for (int fixed : {0, 2, 8}) {
    int ranges = fixed ? fixed : splits, chunk_arg = fixed ? 0 : chunk;
    std::vector<float> out, lse;
    // The backend passes no key count with `seqs` (0): each token reads its own.
    run(q.data(), q_pos.data(), kv_pos.data(), table.data(), fixed ? 0 : 300, n, ranges,
        chunk_arg, seqs.data(), out, lse);
    for (int s = 0; s < n; s++) {
        const float* qs = &q[(size_t)s * q_heads * head_dim];
        const u64* kpos = &kv_pos[seqs[3 * s]];
        const unsigned int* tab = &table[seqs[3 * s + 1]];
        std::vector<float> alone, alone_lse;
        int alone_ranges = fixed ? fixed : (lens[s] + chunk - 1) / chunk;
        run(qs, &q_pos[s], kpos, tab, lens[s], 1, alone_ranges, chunk_arg, nullptr, alone,
            alone_lse);
        Case c = {q_heads, kv_heads, head_dim, 1, lens[s], 1, bs, false};
        std::vector<float> kl((size_t)lens[s] * stride), vl(kl.size());
        for (int j = 0; j < lens[s]; j++) {
            u64 at = tab[j / bs] * block_stride + (u64)(j % bs) * stride;
            std::copy_n(&ks[at], stride, &kl[(size_t)j * stride]);
            std::copy_n(&vs[at], stride, &vl[(size_t)j * stride]);
        }
        std::vector<u64> pos(kpos, kpos + lens[s]);
        for (int h = 0; h < q_heads; h++) {
            size_t r = (size_t)s * q_heads + h;
            std::vector<double> want;
            double want_lse =
                reference_row(c, false, qs + (size_t)h * head_dim, q_pos[s], pos, kl, vl,
                              h / (q_heads / kv_heads), want);
            if (!near(lse[r], want_lse, 1e-4)) return fail("batched attention lse", r, lse[r], want_lse);
            if (__float_as_uint(lse[r]) != __float_as_uint(alone_lse[h]))
                return fail("batched attention lse vs alone", r, lse[r], alone_lse[h]);
            for (int d = 0; d < head_dim; d++) {
                float got = out[r * head_dim + d];
                if (!near(got, want[d], 1e-4)) return fail("batched attention", r, got, want[d]);
                if (__float_as_uint(got) != __float_as_uint(alone[(size_t)h * head_dim + d]))
                    return fail("batched attention vs alone", r, got, alone[(size_t)h * head_dim + d]);
            }
        }
    }
    }
    std::printf("ok: a step's decode rows of 3 sequences (5, 130, 300 keys) in one launch, over "
                "ranges of 128 keys and over fixed grids of 2 and 8 ranges, each the bits of its "
                "sequence alone\n");
    return 0;
}

int main() {
    const Case cases[] = {
        {6, 2, 16, 9, 9, 1, 0, false},      // GQA prefill, one range
        {9, 3, 64, 1, 700, 3, 0, false},    // decode over three key ranges
        {9, 3, 64, 1, 700, 3, 16, false},   // the same through a block table
        {4, 2, 160, 3, 300, 2, 0, true},    // head_dim over two chunks, queries that see no key
        {2, 2, 80, 2, 260, 1, 32, true},    // a partial chunk, paged, one range
        {12, 2, 32, 2, 400, 2, 0, false},   // six heads per KV head: two slices (4 and 2)
        {8, 1, 64, 1, 300, 2, 8, true},     // eight heads on one KV head, paged, scattered
        {9, 3, 64, 1, 700, 3, 16, false, true},  // decode over a paged bf16 cache
        {6, 2, 80, 4, 200, 1, 0, true, true},    // bf16, a partial chunk, scattered
        // Gemma 2's and 3's score rules, each alone and together.
        {6, 2, 16, 9, 9, 1, 0, false, false, 0.0f, 0.0f, 4},    // a window of 4, prefill
        {2, 1, 16, 6, 6, 1, 0, false, false, 0.0f, 0.0f, 1},    // a window of 1: itself only
        {6, 2, 32, 5, 40, 1, 0, false, false, 0.0f, 0.3f, 0},   // a soft-cap alone
        {6, 2, 16, 9, 9, 1, 0, false, false, 0.5f, 0.0f, 0},    // a query scale alone
        {6, 2, 16, 9, 9, 1, 0, false, false, 1.0f, 0.5f, 4},    // all three, prefill
        {9, 3, 64, 1, 700, 3, 16, false, false, 0.0f, 2.0f, 100},  // decode, paged: two ranges out
        {4, 2, 160, 3, 300, 2, 0, true, false, 0.0f, 1.0f, 50},  // scattered, two chunks
        {9, 3, 64, 1, 700, 3, 16, false, true, 0.125f, 1.5f, 300},  // bf16 paged decode
    };
    for (const Case& c : cases) {
        if (check(c) != 0) return 1;
    }
    return check_rows() != 0 || check_formats() != 0 || check_batched() != 0 ||
           check_qmatvec() != 0 || check_edit_rows() != 0;
}
