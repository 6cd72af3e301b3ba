// The attention kernels of kernels.cu, run on the CPU emulator (emulator.h), against a plain
// double-precision attention: one key range and several (attention_merge), contiguous and
// paged keys, head sizes that are and are not multiples of the staged chunk, queries that see
// no key. Exits non-zero with the first difference. Built and run by xtask's tidy tests.
#include <cstdio>
#include <cstdlib>

typedef unsigned long long u64;
extern "C" void attention(const float* q, const u64* q_pos, const float* k, const float* v,
                          const u64* kv_pos, const unsigned int* table, int block_size,
                          u64 block_stride, int n_kv, int q_heads, int kv_heads, int head_dim,
                          float scale, int chunk, float* out, float* lse);
extern "C" void attention_merge(const float* part, const float* part_lse, int splits, int rows,
                                int head_dim, float* out, float* lse);

static const unsigned int THREADS = 128;  // ATTN_BLOCK

static float next_value(u64& state) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(state >> 40) / (double)(1ull << 24) * 2.0 - 1.0);
}

struct Case {
    int q_heads, kv_heads, head_dim, queries, keys, splits, block_size;
    bool scattered;
};

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
    float scale = 1.0f / std::sqrt((float)c.head_dim);
    int chunk = (c.keys + c.splits - 1) / c.splits;
    chunk = (chunk + 127) / 128 * 128;
    int splits = (c.keys + chunk - 1) / chunk;
    std::vector<float> part((size_t)splits * rows * c.head_dim), part_lse((size_t)splits * rows);
    const unsigned int* tp = table.empty() ? nullptr : table.data();
    // One block per query token, KV head and slice of up to ATTN_GROUP (4) of its query heads.
    int per_group = c.q_heads / c.kv_heads;
    unsigned int blocks = (unsigned int)(c.queries * c.kv_heads * ((per_group + 3) / 4));
    tpctl_launch(blocks, splits, THREADS, [&] {
        attention(q.data(), q_pos.data(), ks.data(), vs.data(), kv_pos.data(), tp,
                  c.block_size > 0 ? c.block_size : 1, block_stride, c.keys, c.q_heads,
                  c.kv_heads, c.head_dim, scale, chunk, part.data(), part_lse.data());
    });
    std::vector<float> out = part, lse = part_lse;
    if (splits > 1) {
        out.assign((size_t)rows * c.head_dim, 0.0f);
        lse.assign(rows, 0.0f);
        tpctl_launch(rows, 1, THREADS, [&] {
            attention_merge(part.data(), part_lse.data(), splits, rows, c.head_dim, out.data(),
                            lse.data());
        });
    }
    for (int r = 0; r < rows; r++) {
        int i = r / c.q_heads, h = r % c.q_heads, g = h / (c.q_heads / c.kv_heads);
        std::vector<double> s;
        double mx = -INFINITY;
        for (int j = 0; j < c.keys; j++) {
            double dot = -INFINITY;
            if (kv_pos[j] <= q_pos[i]) {
                dot = 0.0;
                for (int d = 0; d < c.head_dim; d++)
                    dot += (double)q[(size_t)r * c.head_dim + d] *
                           kl[(size_t)j * stride + (size_t)g * c.head_dim + d];
                dot *= scale;
            }
            s.push_back(dot);
            mx = std::max(mx, dot);
        }
        double sum = 0.0;
        for (double x : s) sum += x == -INFINITY ? 0.0 : std::exp(x - mx);
        double want_lse = mx == -INFINITY ? -INFINITY : mx + std::log(sum);
        bool lse_ok = (want_lse == -INFINITY && lse[r] == -INFINITY) ||
                      std::fabs(lse[r] - want_lse) <= 1e-4 * std::max(1.0, std::fabs(want_lse));
        if (!lse_ok) {
            std::printf("case keys=%d head_dim=%d splits=%d: row %d lse %.7g, want %.7g\n",
                        c.keys, c.head_dim, splits, r, lse[r], want_lse);
            return 1;
        }
        for (int d = 0; d < c.head_dim; d++) {
            double want = 0.0;
            if (mx != -INFINITY) {
                for (int j = 0; j < c.keys; j++)
                    if (s[j] != -INFINITY)
                        want += std::exp(s[j] - mx) / sum *
                                vl[(size_t)j * stride + (size_t)g * c.head_dim + d];
            }
            float got = out[(size_t)r * c.head_dim + d];
            if (std::fabs(got - want) > 1e-4 * std::max(1.0, std::fabs(want))) {
                std::printf("case keys=%d head_dim=%d splits=%d: row %d col %d: %.7g, want %.7g\n",
                            c.keys, c.head_dim, splits, r, d, got, want);
                return 1;
            }
        }
    }
    std::printf("ok: %d queries x %d heads over %d keys (%d kv heads, head_dim %d), %d range(s)%s%s\n",
                c.queries, c.q_heads, c.keys, c.kv_heads, c.head_dim, splits,
                c.block_size > 0 ? ", paged" : "", c.scattered ? ", scattered" : "");
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
    };
    for (const Case& c : cases) {
        if (check(c) != 0) return 1;
    }
    return 0;
}
