// Declarations of the CUDA built-ins that crates/tensor/src/kernels/cuda/kernels.cu uses, so
// that a host C++ compiler can check the kernels' syntax and types where there is no NVRTC
// (`cargo xtask ci`'s tidy test, before a GPU bundle is built). Nothing is run.
#include <math.h>
#define __global__
#define __device__
#define __shared__ static
struct tpctl_dim3 { unsigned int x, y, z; };
extern tpctl_dim3 threadIdx, blockIdx, blockDim, gridDim;
void __syncthreads();
float __int_as_float(int);
unsigned int __float_as_uint(float);
float __uint_as_float(unsigned int);
int min(int, int);
int max(int, int);
unsigned int atomicAdd(unsigned int*, unsigned int);
double __longlong_as_double(long long);
