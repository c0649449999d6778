// MBGMV (decode LoRA) in CUDA C++, compiled at run time by NVRTC through cupy
// (slora/kernels/cuda.py). Same semantics as the Triton kernels and the torch twins in
// slora/kernels/reference.py, whose docstring gives the page layout:
//
//   an adapter's rows live in its pages; virtual element v of adapter s is at
//   pool_l[pages[s][v / P] * P + v % P]. Row starts and strides are multiples of 64 elements
//   and P is too, so every 16-byte vector a thread loads (8 bf16/fp16 or 4 fp32 elements,
//   starting at a multiple of its width) lies inside one page: one page lookup per vector.
//
// shrink: xa[t, g, j] = sum_k x[t, k] * A_g[j, k]            (fp32 out, zero past the rank)
// expand: out[t, col_g + n] += sum_j xa[t, g, j] * B_g^T[j, n]
// Rows whose slot is -1 (base model) exit at once.
//
// Tiling. shrink: one warp per (token, module, rank row); the warp streams the row in
// 16-byte vectors (32 lanes x 16 B = 512 B per step) and reduces with shuffles.
// expand: one thread per 16-byte vector of output columns; it walks the rank rows of B^T
// (coalesced across the warp) with the token's xa in shared memory.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

template <typename T> struct Vec;
template <> struct Vec<float> { static constexpr int N = 4; };
template <> struct Vec<__half> { static constexpr int N = 8; };
template <> struct Vec<__nv_bfloat16> { static constexpr int N = 8; };

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);
}

template <typename T>
__device__ __forceinline__ void load_vec(const T* p, float* out) {
  constexpr int N = Vec<T>::N;
  union { uint4 u; T e[N]; } v;
  v.u = *reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_f(v.e[i]);
}

// Address of virtual element v of an adapter (page list `pages`) in one layer's pool slice.
template <typename T>
__device__ __forceinline__ const T* page_ptr(const T* pool, const int* pages, long long v,
                                             long long P) {
  return pool + (long long)pages[v / P] * P + v % P;
}

template <typename T>
__device__ void shrink(const T* __restrict__ x, const T* __restrict__ pool,
                       const int* __restrict__ pages, const long long* __restrict__ offsets_a,
                       const int* __restrict__ ranks, const int* __restrict__ token_slot,
                       float* __restrict__ xa, int G, int max_rank, int d_in, long long stride,
                       long long P, int pages_stride, int x_stride) {
  constexpr int N = Vec<T>::N;
  const int t = blockIdx.x, g = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int j = blockIdx.z * (blockDim.x / 32) + warp;
  if (j >= max_rank) return;
  float* dst = xa + ((long long)t * G + g) * max_rank + j;
  const int s = token_slot[t];
  const int r = s < 0 ? 0 : ranks[s * G + g];
  if (j >= r) {  // base-only row or past this adapter's rank: zero (xa is not pre-zeroed)
    if (lane == 0) *dst = 0.f;
    return;
  }
  const int* pg = pages + (long long)s * pages_stride;
  const long long row = offsets_a[s * G + g] + (long long)j * stride;
  const T* xr = x + (long long)t * x_stride;
  float acc = 0.f;
  for (int k = lane * N; k < d_in; k += 32 * N) {
    float a[N], xv[N];
    load_vec(page_ptr(pool, pg, row + k, P), a);  // inside the padded row: in bounds
    if (k + N <= d_in) {
      load_vec(xr + k, xv);
    } else {  // the row's tail: padding is not ours to trust (it may hold anything)
#pragma unroll
      for (int i = 0; i < N; ++i) {
        xv[i] = k + i < d_in ? to_f(xr[k + i]) : 0.f;
        a[i] = k + i < d_in ? a[i] : 0.f;
      }
    }
#pragma unroll
    for (int i = 0; i < N; ++i) acc += a[i] * xv[i];
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffff, acc, o);
  if (lane == 0) *dst = acc;
}

template <typename T>
__device__ void expand(const float* __restrict__ xa, T* __restrict__ out, const T* __restrict__ pool,
                       const int* __restrict__ pages, const long long* __restrict__ offsets_b,
                       const int* __restrict__ ranks, const int* __restrict__ token_slot,
                       const long long* __restrict__ col_start, const int* __restrict__ out_dims,
                       const long long* __restrict__ strides, int G, int max_rank, long long P,
                       int pages_stride, int out_stride) {
  constexpr int N = Vec<T>::N;
  extern __shared__ float sxa[];
  const int t = blockIdx.x, g = blockIdx.y;
  const int s = token_slot[t];
  if (s < 0) return;
  const int r = ranks[s * G + g];
  if (r == 0) return;
  for (int j = threadIdx.x; j < r; j += blockDim.x) sxa[j] = xa[((long long)t * G + g) * max_rank + j];
  __syncthreads();
  const int n = (blockIdx.z * blockDim.x + threadIdx.x) * N;
  const int d_out = out_dims[g];
  if (n >= d_out) return;
  const int* pg = pages + (long long)s * pages_stride;
  const long long base = offsets_b[s * G + g] + n;
  const long long stride = strides[g];
  float acc[N] = {0.f};
  for (int j = 0; j < r; ++j) {
    float b[N];
    load_vec(page_ptr(pool, pg, base + (long long)j * stride, P), b);
    const float w = sxa[j];
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i] += w * b[i];
  }
  T* o = out + (long long)t * out_stride + col_start[g] + n;
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (n + i < d_out) o[i] = from_f<T>(to_f(o[i]) + acc[i]);
}

#define SLORA_INSTANTIATE(T, SUFFIX)                                                               \
  extern "C" __global__ void mbgmv_shrink_##SUFFIX(                                               \
      const T* x, const T* pool, const int* pages, const long long* offsets_a, const int* ranks,   \
      const int* token_slot, float* xa, int G, int max_rank, int d_in, long long stride,           \
      long long P, int pages_stride, int x_stride) {                                               \
    shrink<T>(x, pool, pages, offsets_a, ranks, token_slot, xa, G, max_rank, d_in, stride, P,      \
              pages_stride, x_stride);                                                             \
  }                                                                                                \
  extern "C" __global__ void mbgmv_expand_##SUFFIX(                                               \
      const float* xa, T* out, const T* pool, const int* pages, const long long* offsets_b,        \
      const int* ranks, const int* token_slot, const long long* col_start, const int* out_dims,    \
      const long long* strides, int G, int max_rank, long long P, int pages_stride,                \
      int out_stride) {                                                                            \
    expand<T>(xa, out, pool, pages, offsets_b, ranks, token_slot, col_start, out_dims, strides, G, \
              max_rank, P, pages_stride, out_stride);                                              \
  }

SLORA_INSTANTIATE(float, f32)
SLORA_INSTANTIATE(__half, f16)
SLORA_INSTANTIATE(__nv_bfloat16, bf16)
