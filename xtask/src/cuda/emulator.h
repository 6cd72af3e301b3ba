// Runs the CUDA kernels of crates/tensor/src/kernels/cuda/kernels.cu on the CPU, so their
// arithmetic can be tested where there is no GPU (`cargo xtask ci`'s tidy tests, with
// emulate_attention.cpp). A launch runs its blocks one after another; a block's threads are
// real threads meeting at a barrier for each __syncthreads, and __shared__ arrays are
// function statics, which every thread of the running block sees. Slow, and only for
// kernels without warp-level built-ins.
#include <barrier>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>
#include <algorithm>
#include <atomic>

#define __global__
#define __device__
#define __shared__ static
struct tpctl_dim3 {
    unsigned int x, y, z;
};
inline thread_local tpctl_dim3 threadIdx;
inline tpctl_dim3 blockIdx, blockDim, gridDim;
inline std::barrier<>* tpctl_block_barrier = nullptr;

inline void __syncthreads() { tpctl_block_barrier->arrive_and_wait(); }
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, sizeof f);
    return f;
}
inline float __uint_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}
inline double __longlong_as_double(long long i) {
    double d;
    std::memcpy(&d, &i, sizeof d);
    return d;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}
using std::max;
using std::min;
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) {
    return std::atomic_ref<unsigned int>(*p).fetch_add(v);
}
// Inline PTX (the f16 rounding) has no CPU meaning: it compiles to nothing here, and the
// kernels that use it are not emulated.
#define asm(...)

// Runs `kernel` (a callable that calls the kernel with its arguments) over a grid of
// grid_x x grid_y blocks of `threads` threads.
template <class Kernel>
void tpctl_launch(unsigned int grid_x, unsigned int grid_y, unsigned int threads, Kernel kernel) {
    gridDim = {grid_x, grid_y, 1};
    blockDim = {threads, 1, 1};
    for (unsigned int y = 0; y < grid_y; y++) {
        for (unsigned int x = 0; x < grid_x; x++) {
            blockIdx = {x, y, 0};
            std::barrier<> barrier((std::ptrdiff_t)threads);
            tpctl_block_barrier = &barrier;
            std::vector<std::thread> block;
            for (unsigned int t = 0; t < threads; t++) {
                block.emplace_back([t, &kernel] {
                    threadIdx = {t, 0, 0};
                    kernel();
                });
            }
            for (auto& th : block) th.join();
        }
    }
}
