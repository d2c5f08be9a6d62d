// Flash attention on tensor cores for f16 and bf16 with head sizes 64 and 128
// (src/backend/cuda/attention.rs picks it; other cases take cuda/attention.cu): the same
// contract as attention.cu (contiguous [B, L, D] queries, [B, S, D] keys and values, `causal`
// meaning query i sees keys 0..=i, a log-sum-exp per query row for backward), in the
// FlashAttention-2 arrangement.
//
// Products run on `mma.sync.aligned.m16n8k16` (16-bit inputs, f32 accumulators): a warp owns
// 16 rows, a fragment's registers are the PTX ISA's layouts (g = lane / 4, t = lane % 4):
//   A 16x16 row-major: reg 0 = (g, 2t..2t+1), 1 = (g+8, 2t..), 2 = (g, 2t+8..), 3 = (g+8, 2t+8..)
//   B 16x8 "col":      reg 0 = rows 2t..2t+1 of column g, reg 1 = rows 2t+8..2t+9
//   C 16x8:            c0, c1 = (g, 2t..2t+1), c2, c3 = (g+8, 2t..2t+1)
// so an accumulator tile pair (columns 16k..16k+15) is, packed to 16 bits, the A fragment of
// the next product: the probabilities never leave registers. Tiles reach shared memory with
// 16-byte loads, rows padded by FA_PAD halves so that a warp's fragment loads do not collide.
//
// Forward: a block of FA_WARPS warps takes 64 queries, loops over tiles of FA_BC keys (up to
// the diagonal when causal) with the online softmax in base 2, and writes the output and the
// natural log-sum-exp. Backward recomputes the probabilities from it in two kernels that need
// no atomics (every output row is one warp's, so results repeat bit for bit): per block of
// keys, dv = P^T do and dk = scale dS^T q over every query tile; per block of queries,
// dq = scale dS k over every key tile, where dS = P (do v^T - D) and D = rowsum(do o) comes
// from fa_prep. Arithmetic outside the products is f32; P and dS are rounded to the input
// type for their products, as FlashAttention does.

#define FA_WARPS 4
#define FA_PAD 8
// A 16-byte aligned shared array of n halves (rounded up), as u16 `name`.
#define FA_SHARED(name, n)                                  \
    __shared__ uint4 name##_vec[((n) * 2 + 15) / 16];       \
    u16* name = (u16*)name##_vec

// d += a b on the tensor cores (one warp, every lane). The host build (tests/emulator)
// exchanges the warp's fragments through memory instead (host_shim.h).
#ifdef __CUDACC_RTC__
__device__ __forceinline__ void fa_mma(bf16, float* d, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void fa_mma(f16, float* d, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#else
inline void fa_mma(bf16, float* d, const u32* a, const u32* b) { host_mma_m16n8k16(d, a, b, true); }
inline void fa_mma(f16, float* d, const u32* a, const u32* b) { host_mma_m16n8k16(d, a, b, false); }
#endif

// Two floats rounded to T, packed low then high: a fragment register.
template <typename T> __device__ __forceinline__ u32 fa_pack(float lo, float hi) {
    return (u32)from_f32<T>(lo).bits | ((u32)from_f32<T>(hi).bits << 16);
}
// Two adjacent halves of shared memory (p 4-byte aligned: an even column of an even stride).
__device__ __forceinline__ u32 fa_ld2(const u16* p) { return *(const u32*)p; }
// p[0] and p[stride]: two rows of one column.
__device__ __forceinline__ u32 fa_ld2s(const u16* p, int stride) {
    return (u32)p[0] | ((u32)p[stride] << 16);
}
// The A fragment of the 16 x 16 block at `p` (row stride `stride`).
__device__ __forceinline__ void fa_frag_a(u32* a, const u16* p, int stride) {
    int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    a[0] = fa_ld2(p + g * stride + 2 * t);
    a[1] = fa_ld2(p + (g + 8) * stride + 2 * t);
    a[2] = fa_ld2(p + g * stride + 2 * t + 8);
    a[3] = fa_ld2(p + (g + 8) * stride + 2 * t + 8);
}
// The B fragment whose column n is row n of the 8 x 16 block at `p` (k along the row): a
// product with a row-major matrix's transpose, such as q k^T.
__device__ __forceinline__ void fa_frag_bt(u32* b, const u16* p, int stride) {
    int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    b[0] = fa_ld2(p + g * stride + 2 * t);
    b[1] = fa_ld2(p + g * stride + 2 * t + 8);
}
// The B fragment of the 16 x 8 block at `p` of a row-major matrix (k down the rows), such as
// the values in P v.
__device__ __forceinline__ void fa_frag_b(u32* b, const u16* p, int stride) {
    int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    b[0] = fa_ld2s(p + 2 * t * stride + g, stride);
    b[1] = fa_ld2s(p + (2 * t + 8) * stride + g, stride);
}
// Accumulator tiles n and n + 1 (16 columns) as an A fragment.
template <typename T> __device__ __forceinline__ void fa_acc_a(u32* a, const float* c0,
                                                               const float* c1) {
    a[0] = fa_pack<T>(c0[0], c0[1]);
    a[1] = fa_pack<T>(c0[2], c0[3]);
    a[2] = fa_pack<T>(c1[0], c1[1]);
    a[3] = fa_pack<T>(c1[2], c1[3]);
}
// The largest and the sum over the lanes of a quad (the four that hold a row's columns).
__device__ __forceinline__ float fa_quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float fa_quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Rows [r0, r0 + R) of a [rows, D] matrix into shared `dst` (row stride D + FA_PAD), zeros
// past `rows`, by every thread of the block.
template <typename T, int D, int R>
__device__ __forceinline__ void fa_load(u16* dst, const T* src, i64 r0, i64 rows) {
    constexpr int V = D / 8;
    for (int c = threadIdx.x; c < R * V; c += blockDim.x) {
        int r = c / V, e = (c % V) * 8;
        Vec16<T> x = {};
        if (r0 + r < rows) x = *(const Vec16<T>*)(src + (r0 + r) * D + e);
        *(Vec16<T>*)(dst + r * (D + FA_PAD) + e) = x;
    }
}

// Whether query i and key j meet: both exist, and with `causal` j is not past i.
__device__ __forceinline__ bool fa_live(i64 i, i64 j, i64 L, i64 S, int causal) {
    return i < L && j < S && !(causal && j > i);
}

#define FA_LOG2E 1.4426950408889634f
#define FA_LN2 0.6931471805599453f

template <typename T, int D, int BC>
__device__ void fa_forward(const T* __restrict__ q, const T* __restrict__ k,
                           const T* __restrict__ v, T* __restrict__ out, float* __restrict__ lse,
                           i64 B, i64 L, i64 S, float scale, int causal) {
    constexpr int BR = 16 * FA_WARPS, P = D + FA_PAD;
    FA_SHARED(qs, BR * P);
    FA_SHARED(ks, BC * P);
    FA_SHARED(vs, BC * P);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const float sl2 = scale * FA_LOG2E;
    i64 tiles = (L + BR - 1) / BR;
    for (i64 blk = blockIdx.x; blk < B * tiles; blk += gridDim.x) {
        i64 b = blk / tiles, i0 = (blk % tiles) * BR;
        const T* kb = k + b * S * D;
        const T* vb = v + b * S * D;
        __syncthreads(); // the previous tile's reads are done
        fa_load<T, D, BR>(qs, q + b * L * D, i0, L);
        __syncthreads();
        u32 qa[D / 16][4];
        for (int kk = 0; kk < D / 16; kk++) fa_frag_a(qa[kk], qs + warp * 16 * P + kk * 16, P);
        float o[D / 8][4] = {};
        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
        const i64 rows[2] = {i0 + warp * 16 + g, i0 + warp * 16 + g + 8};
        i64 end = causal && i0 + BR < S ? i0 + BR : S;
        for (i64 j0 = 0; j0 < end; j0 += BC) {
            __syncthreads();
            fa_load<T, D, BC>(ks, kb, j0, S);
            fa_load<T, D, BC>(vs, vb, j0, S);
            __syncthreads();
            float s[BC / 8][4] = {};
            for (int kk = 0; kk < D / 16; kk++) {
                for (int n = 0; n < BC / 8; n++) {
                    u32 bk[2];
                    fa_frag_bt(bk, ks + n * 8 * P + kk * 16, P);
                    fa_mma(T{}, s[n], qa[kk], bk);
                }
            }
            float mx[2] = {m[0], m[1]};
            for (int n = 0; n < BC / 8; n++) {
                for (int e = 0; e < 4; e++) {
                    i64 j = j0 + n * 8 + 2 * t + (e & 1);
                    // Rows past L compute on zeros and are not written.
                    bool live = j < S && !(causal && j > rows[e >> 1]);
                    float x = live ? s[n][e] * sl2 : -INFINITY;
                    s[n][e] = x;
                    mx[e >> 1] = fmaxf(mx[e >> 1], x);
                }
            }
            float base[2], alpha[2], sum[2] = {0.0f, 0.0f};
            for (int h = 0; h < 2; h++) {
                mx[h] = fa_quad_max(mx[h]);
                base[h] = mx[h] == -INFINITY ? 0.0f : mx[h]; // no row sees a key yet
                alpha[h] = exp2f(m[h] - base[h]);
                m[h] = mx[h];
            }
            for (int n = 0; n < BC / 8; n++) {
                for (int e = 0; e < 4; e++) {
                    float p = exp2f(s[n][e] - base[e >> 1]);
                    s[n][e] = p;
                    sum[e >> 1] += p;
                }
            }
            for (int h = 0; h < 2; h++) l[h] = l[h] * alpha[h] + sum[h];
            for (int n = 0; n < D / 8; n++)
                for (int e = 0; e < 4; e++) o[n][e] *= alpha[e >> 1];
            for (int kk = 0; kk < BC / 16; kk++) {
                u32 pa[4];
                fa_acc_a<T>(pa, s[2 * kk], s[2 * kk + 1]);
                for (int n = 0; n < D / 8; n++) {
                    u32 bv[2];
                    fa_frag_b(bv, vs + kk * 16 * P + n * 8, P);
                    fa_mma(T{}, o[n], pa, bv);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            float total = fa_quad_sum(l[h]);
            if (rows[h] >= L) continue;
            float inv = 1.0f / total;
            T* orow = out + (b * L + rows[h]) * D + 2 * t;
            for (int n = 0; n < D / 8; n++) {
                orow[n * 8] = from_f32<T>(o[n][2 * h] * inv);
                orow[n * 8 + 1] = from_f32<T>(o[n][2 * h + 1] * inv);
            }
            if (t == 0) lse[b * L + rows[h]] = (m[h] + log2f(total)) * FA_LN2;
        }
    }
}

// D_i = do_i . o_i per row (f32), for both backward kernels.
template <typename T, int D>
__device__ void fa_prep(const T* __restrict__ o, const T* __restrict__ dout,
                        float* __restrict__ dsum, i64 rows) {
    FOR_EACH(r, rows) {
        float s = 0.0f;
        for (int e = 0; e < D; e += 8) {
            Vec16<T> x = *(const Vec16<T>*)(o + r * D + e);
            Vec16<T> y = *(const Vec16<T>*)(dout + r * D + e);
            for (int u = 0; u < 8; u++) s += to_f32(x.v[u]) * to_f32(y.v[u]);
        }
        dsum[r] = s;
    }
}

// dk and dv: a block of W warps owns 16 W keys (16 a warp), the query tiles of BQ rows pass
// through shared memory. The products: S^T = k q^T, dP^T = v do^T (keys down the rows), then
// dv += P^T do and dk += dS^T q from the accumulators as A fragments.
template <typename T, int D, int W, int BQ>
__device__ void fa_backward_kv(const T* __restrict__ q, const T* __restrict__ k,
                               const T* __restrict__ v, const T* __restrict__ dout,
                               const float* __restrict__ lse, const float* __restrict__ dsum,
                               T* __restrict__ dk, T* __restrict__ dv, i64 B, i64 L, i64 S,
                               float scale, int causal) {
    constexpr int N = 16 * W, P = D + FA_PAD;
    FA_SHARED(ks, N * P);
    FA_SHARED(vs, N * P);
    FA_SHARED(qs, BQ * P);
    FA_SHARED(dos, BQ * P);
    __shared__ float ls[BQ], dd[BQ];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const float sl2 = scale * FA_LOG2E;
    i64 tiles = (S + N - 1) / N;
    for (i64 blk = blockIdx.x; blk < B * tiles; blk += gridDim.x) {
        i64 b = blk / tiles, j0 = (blk % tiles) * N;
        __syncthreads();
        fa_load<T, D, N>(ks, k + b * S * D, j0, S);
        fa_load<T, D, N>(vs, v + b * S * D, j0, S);
        float gk[D / 8][4] = {}, gv[D / 8][4] = {};
        const i64 keys[2] = {j0 + warp * 16 + g, j0 + warp * 16 + g + 8};
        // Causal: the queries before this block's first key see none of its keys.
        for (i64 i0 = causal ? j0 / BQ * BQ : 0; i0 < L; i0 += BQ) {
            __syncthreads();
            fa_load<T, D, BQ>(qs, q + b * L * D, i0, L);
            fa_load<T, D, BQ>(dos, dout + b * L * D, i0, L);
            for (int c = threadIdx.x; c < BQ; c += blockDim.x) {
                ls[c] = i0 + c < L ? lse[b * L + i0 + c] * FA_LOG2E : 0.0f;
                dd[c] = i0 + c < L ? dsum[b * L + i0 + c] : 0.0f;
            }
            __syncthreads();
            float st[BQ / 8][4] = {}, dpt[BQ / 8][4] = {};
            for (int kk = 0; kk < D / 16; kk++) {
                u32 ka[4], va[4];
                fa_frag_a(ka, ks + warp * 16 * P + kk * 16, P);
                fa_frag_a(va, vs + warp * 16 * P + kk * 16, P);
                for (int n = 0; n < BQ / 8; n++) {
                    u32 bq[2], bd[2];
                    fa_frag_bt(bq, qs + n * 8 * P + kk * 16, P);
                    fa_frag_bt(bd, dos + n * 8 * P + kk * 16, P);
                    fa_mma(T{}, st[n], ka, bq);
                    fa_mma(T{}, dpt[n], va, bd);
                }
            }
            for (int n = 0; n < BQ / 8; n++) {
                for (int e = 0; e < 4; e++) {
                    int c = n * 8 + 2 * t + (e & 1);
                    bool live = fa_live(i0 + c, keys[e >> 1], L, S, causal);
                    float p = live ? exp2f(st[n][e] * sl2 - ls[c]) : 0.0f;
                    st[n][e] = p;
                    dpt[n][e] = p * (dpt[n][e] - dd[c]);
                }
            }
            for (int kk = 0; kk < BQ / 16; kk++) {
                u32 pa[4], sa[4];
                fa_acc_a<T>(pa, st[2 * kk], st[2 * kk + 1]);
                fa_acc_a<T>(sa, dpt[2 * kk], dpt[2 * kk + 1]);
                for (int n = 0; n < D / 8; n++) {
                    u32 bd[2], bq[2];
                    fa_frag_b(bd, dos + kk * 16 * P + n * 8, P);
                    fa_frag_b(bq, qs + kk * 16 * P + n * 8, P);
                    fa_mma(T{}, gv[n], pa, bd);
                    fa_mma(T{}, gk[n], sa, bq);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            if (keys[h] >= S) continue;
            T* krow = dk + (b * S + keys[h]) * D + 2 * t;
            T* vrow = dv + (b * S + keys[h]) * D + 2 * t;
            for (int n = 0; n < D / 8; n++) {
                krow[n * 8] = from_f32<T>(gk[n][2 * h] * scale);
                krow[n * 8 + 1] = from_f32<T>(gk[n][2 * h + 1] * scale);
                vrow[n * 8] = from_f32<T>(gv[n][2 * h]);
                vrow[n * 8 + 1] = from_f32<T>(gv[n][2 * h + 1]);
            }
        }
    }
}

// dq: a block of FA_WARPS warps owns 64 queries (16 a warp), the key tiles of BC rows pass
// through shared memory: S = q k^T and dP = do v^T (queries down the rows), dq += dS k.
template <typename T, int D, int BC>
__device__ void fa_backward_q(const T* __restrict__ q, const T* __restrict__ k,
                              const T* __restrict__ v, const T* __restrict__ dout,
                              const float* __restrict__ lse, const float* __restrict__ dsum,
                              T* __restrict__ dq, i64 B, i64 L, i64 S, float scale, int causal) {
    constexpr int BR = 16 * FA_WARPS, P = D + FA_PAD;
    FA_SHARED(qs, BR * P);
    FA_SHARED(ks, BC * P);
    FA_SHARED(vs, BC * P);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const float sl2 = scale * FA_LOG2E;
    i64 tiles = (L + BR - 1) / BR;
    for (i64 blk = blockIdx.x; blk < B * tiles; blk += gridDim.x) {
        i64 b = blk / tiles, i0 = (blk % tiles) * BR;
        const i64 rows[2] = {i0 + warp * 16 + g, i0 + warp * 16 + g + 8};
        float li[2], di[2];
        for (int h = 0; h < 2; h++) {
            li[h] = rows[h] < L ? lse[b * L + rows[h]] * FA_LOG2E : 0.0f;
            di[h] = rows[h] < L ? dsum[b * L + rows[h]] : 0.0f;
        }
        // The queries' and then the output gradient's fragments, through one buffer.
        u32 qa[D / 16][4], da[D / 16][4];
        __syncthreads();
        fa_load<T, D, BR>(qs, q + b * L * D, i0, L);
        __syncthreads();
        for (int kk = 0; kk < D / 16; kk++) fa_frag_a(qa[kk], qs + warp * 16 * P + kk * 16, P);
        __syncthreads();
        fa_load<T, D, BR>(qs, dout + b * L * D, i0, L);
        __syncthreads();
        for (int kk = 0; kk < D / 16; kk++) fa_frag_a(da[kk], qs + warp * 16 * P + kk * 16, P);
        float gq[D / 8][4] = {};
        i64 end = causal && i0 + BR < S ? i0 + BR : S;
        for (i64 j0 = 0; j0 < end; j0 += BC) {
            __syncthreads();
            fa_load<T, D, BC>(ks, k + b * S * D, j0, S);
            fa_load<T, D, BC>(vs, v + b * S * D, j0, S);
            __syncthreads();
            float s[BC / 8][4] = {}, dp[BC / 8][4] = {};
            for (int kk = 0; kk < D / 16; kk++) {
                for (int n = 0; n < BC / 8; n++) {
                    u32 bk[2], bv[2];
                    fa_frag_bt(bk, ks + n * 8 * P + kk * 16, P);
                    fa_frag_bt(bv, vs + n * 8 * P + kk * 16, P);
                    fa_mma(T{}, s[n], qa[kk], bk);
                    fa_mma(T{}, dp[n], da[kk], bv);
                }
            }
            for (int n = 0; n < BC / 8; n++) {
                for (int e = 0; e < 4; e++) {
                    i64 j = j0 + n * 8 + 2 * t + (e & 1);
                    int h = e >> 1;
                    float p = fa_live(rows[h], j, L, S, causal) ? exp2f(s[n][e] * sl2 - li[h]) : 0.0f;
                    dp[n][e] = p * (dp[n][e] - di[h]);
                }
            }
            for (int kk = 0; kk < BC / 16; kk++) {
                u32 sa[4];
                fa_acc_a<T>(sa, dp[2 * kk], dp[2 * kk + 1]);
                for (int n = 0; n < D / 8; n++) {
                    u32 bk[2];
                    fa_frag_b(bk, ks + kk * 16 * P + n * 8, P);
                    fa_mma(T{}, gq[n], sa, bk);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            if (rows[h] >= L) continue;
            T* qrow = dq + (b * L + rows[h]) * D + 2 * t;
            for (int n = 0; n < D / 8; n++) {
                qrow[n * 8] = from_f32<T>(gq[n][2 * h] * scale);
                qrow[n * 8 + 1] = from_f32<T>(gq[n][2 * h + 1] * scale);
            }
        }
    }
}

// Entry points per dtype and head size: forward with FA_BC keys a tile (64 for head 64, 32
// for head 128, so that a block's tiles fit 48 KiB of static shared memory), dk/dv with W
// warps and BQ queries a tile.
#define FLASH(T, D, BC, W, BQ)                                                                 \
    extern "C" __global__ void flash_forward_##T##_##D(const T* q, const T* k, const T* v,      \
                                                       T* out, float* lse, i64 B, i64 L,        \
                                                       i64 S, float scale, int causal) {        \
        fa_forward<T, D, BC>(q, k, v, out, lse, B, L, S, scale, causal);                        \
    }                                                                                          \
    extern "C" __global__ void flash_prep_##T##_##D(const T* o, const T* dout, float* dsum,     \
                                                    i64 rows) {                                \
        fa_prep<T, D>(o, dout, dsum, rows);                                                     \
    }                                                                                          \
    extern "C" __global__ void flash_backward_kv_##T##_##D(                                    \
        const T* q, const T* k, const T* v, const T* dout, const float* lse,                   \
        const float* dsum, T* dk, T* dv, i64 B, i64 L, i64 S, float scale, int causal) {        \
        fa_backward_kv<T, D, W, BQ>(q, k, v, dout, lse, dsum, dk, dv, B, L, S, scale, causal);  \
    }                                                                                          \
    extern "C" __global__ void flash_backward_q_##T##_##D(                                     \
        const T* q, const T* k, const T* v, const T* dout, const float* lse,                   \
        const float* dsum, T* dq, i64 B, i64 L, i64 S, float scale, int causal) {               \
        fa_backward_q<T, D, BC>(q, k, v, dout, lse, dsum, dq, B, L, S, scale, causal);          \
    }

PART(f16, FLASH(f16, 64, 64, 4, 64))
PART(f16, FLASH(f16, 128, 32, 2, 32))
PART(bf16, FLASH(bf16, 64, 64, 4, 64))
PART(bf16, FLASH(bf16, 128, 32, 2, 32))
