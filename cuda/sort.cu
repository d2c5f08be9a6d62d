// Argsort along the last dim of contiguous rows (src/backend/cuda/sort.rs): each row's
// indices in a stable order (ties in index order), NaN after every number ascending and
// before every number descending, the CPU's order (src/backend/cpu/sort.rs). A bitonic
// network over (key, index) pairs: no two pairs are equal, so the network's result is the
// one stable order. A row is padded to a power of two with pairs that go after every
// element. Rows of up to SORT_SHARED elements sort in shared memory, one block per row; longer
// rows sort in global memory, one launch per step of the network.

#define SORT_SHARED 2048

// Keys: f32, f16 and bf16 compare as float (exactly), i64 and u8 as i64.
__device__ __forceinline__ float sort_key(float x) { return x; }
__device__ __forceinline__ float sort_key(f16 x) { return to_f32(x); }
__device__ __forceinline__ float sort_key(bf16 x) { return to_f32(x); }
__device__ __forceinline__ i64 sort_key(i64 x) { return x; }
__device__ __forceinline__ i64 sort_key(u8 x) { return (i64)x; }

// Whether (a, ia) goes before (b, ib). Indices from n up are padding, after every element;
// a NaN is larger than every number; equal keys keep their index order.
template <typename K>
__device__ __forceinline__ bool sort_before(K a, i64 ia, K b, i64 ib, i64 n, int desc) {
    bool pa = ia >= n, pb = ib >= n;
    if (pa || pb) return pa && pb ? ia < ib : pb;
    bool na = a != a, nb = b != b;
    if (na || nb) return na && nb ? ia < ib : (desc ? na : nb);
    if (a < b) return !desc;
    if (b < a) return desc;
    return ia < ib;
}

// The lower place of compare-exchange pair q at distance j (the upper is that plus j).
__device__ __forceinline__ i64 pair_low(i64 q, i64 j) { return 2 * j * (q / j) + q % j; }

// One compare-exchange of the network's stage (k, j) on places i < i + j of a row.
template <typename K>
__device__ __forceinline__ void exchange(K* keys, i64* ids, i64 i, i64 j, i64 k, i64 n, int desc) {
    i64 u = i + j;
    bool up = (i & k) == 0;
    bool swap = up ? sort_before(keys[u], ids[u], keys[i], ids[i], n, desc)
                   : sort_before(keys[i], ids[i], keys[u], ids[u], n, desc);
    if (swap) {
        K t = keys[i];
        keys[i] = keys[u];
        keys[u] = t;
        i64 s = ids[i];
        ids[i] = ids[u];
        ids[u] = s;
    }
}

// Rows of n <= np2 <= SORT_SHARED elements: one block per row (blocks loop over rows).
template <typename T, typename K>
__device__ void argsort_rows(const T* __restrict__ x, i64* __restrict__ out, i64 rows, i64 n,
                             i64 np2, int desc) {
    __shared__ K keys[SORT_SHARED];
    __shared__ i64 ids[SORT_SHARED];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        for (i64 c = threadIdx.x; c < np2; c += blockDim.x) {
            keys[c] = c < n ? sort_key(x[r * n + c]) : (K)0;
            ids[c] = c;
        }
        __syncthreads();
        for (i64 k = 2; k <= np2; k <<= 1) {
            for (i64 j = k >> 1; j > 0; j >>= 1) {
                for (i64 q = threadIdx.x; q < np2 / 2; q += blockDim.x)
                    exchange(keys, ids, pair_low(q, j), j, k, n, desc);
                __syncthreads();
            }
        }
        for (i64 c = threadIdx.x; c < n; c += blockDim.x) out[r * n + c] = ids[c];
        __syncthreads(); // the next row overwrites keys and ids
    }
}

// Longer rows: the keys and indices of each row padded to np2 in global memory ...
template <typename T, typename K>
__device__ void argsort_init(const T* __restrict__ x, K* __restrict__ keys, i64* __restrict__ ids,
                             i64 rows, i64 n, i64 np2) {
    FOR_EACH(i, rows * np2) {
        i64 r = i / np2, c = i % np2;
        keys[i] = c < n ? sort_key(x[r * n + c]) : (K)0;
        ids[i] = c;
    }
}

// ... then one launch per stage (k, j) of the network, a thread per pair of every row.
template <typename K>
__device__ void argsort_step(K* __restrict__ keys, i64* __restrict__ ids, i64 rows, i64 n,
                             i64 np2, i64 j, i64 k, int desc) {
    i64 half = np2 / 2;
    FOR_EACH(p, rows * half) {
        i64 r = p / half;
        exchange(keys + r * np2, ids + r * np2, pair_low(p % half, j), j, k, n, desc);
    }
}

#define ARGSORT(T, K)                                                                          \
    extern "C" __global__ void argsort_rows_##T(const T* x, i64* out, i64 rows, i64 n, i64 np2, \
                                                int desc) {                                    \
        argsort_rows<T, K>(x, out, rows, n, np2, desc);                                        \
    }                                                                                          \
    extern "C" __global__ void argsort_init_##T(const T* x, K* keys, i64* ids, i64 rows, i64 n, \
                                                i64 np2) {                                     \
        argsort_init<T, K>(x, keys, ids, rows, n, np2);                                        \
    }
#define ARGSORT_STEP(K)                                                                        \
    extern "C" __global__ void argsort_step_##K(K* keys, i64* ids, i64 rows, i64 n, i64 np2,   \
                                                i64 j, i64 k, int desc) {                      \
        argsort_step<K>(keys, ids, rows, n, np2, j, k, desc);                                  \
    }

PART(float, ARGSORT(float, float))
PART(f16, ARGSORT(f16, float))
PART(bf16, ARGSORT(bf16, float))
PART(i64, ARGSORT(i64, i64))
PART(u8, ARGSORT(u8, i64))
PART(float, ARGSORT_STEP(float))
PART(i64, ARGSORT_STEP(i64))
