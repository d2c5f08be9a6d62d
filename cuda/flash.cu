// Flash attention on tensor cores for f16 and bf16 with head sizes 64 and 128
// (src/backend/cuda/flash.rs launches it; other cases take cuda/attention.cu): the same
// contract as attention.cu (B L queries, B S keys and values of D, `causal` meaning query i
// sees keys 0..=i, a contiguous log-sum-exp per query row for backward), in the
// FlashAttention-2 arrangement, except that every tensor's rows are addressed through a
// FaRows (any [B, H, T, D] view whose rows start 16-byte aligned: the heads of a packed
// q/k/v product are read where they lie, the output is written [B, T, H, D]).
//
// Products run on `mma.sync.aligned.m16n8k16` (16-bit inputs, f32 accumulators): a warp owns
// 16 rows, a fragment's registers are the PTX ISA's layouts (g = lane / 4, t = lane % 4):
//   A 16x16 row-major: reg 0 = (g, 2t..2t+1), 1 = (g+8, 2t..), 2 = (g, 2t+8..), 3 = (g+8, 2t+8..)
//   B 16x8 "col":      reg 0 = rows 2t..2t+1 of column g, reg 1 = rows 2t+8..2t+9
//   C 16x8:            c0, c1 = (g, 2t..2t+1), c2, c3 = (g+8, 2t..2t+1)
// so an accumulator tile pair (columns 16k..16k+15) is, packed to 16 bits, the A fragment of
// the next product: the probabilities never leave registers. Tiles reach shared memory with
// 16-byte copies (`cp.async` for keys and values: the next tile is in flight while this one
// is computed on), rows padded by FA_PAD halves so that the fragments' `ldmatrix` loads
// (eight 16-byte rows a phase) do not collide in the banks.
//
// Forward: a block of FA_WARPS warps takes 64 queries, loops over tiles of BC keys (up to
// the diagonal when causal) with the online softmax in base 2, and writes the output and the
// natural log-sum-exp. Backward recomputes the probabilities from it in two kernels that need
// no atomics (every output row is one warp's, so results repeat bit for bit): per block of
// keys, dv = P^T do and dk = scale dS^T q over every query tile; per block of queries,
// dq = scale dS k over every key tile, where dS = P (do v^T - D) and D = rowsum(do o) comes
// from fa_prep. Arithmetic outside the products is f32; P and dS are rounded to the input
// type for their products, as FlashAttention does.

// mma.sync m16n8k16 and cp.async need compute capability 8.0: an older device's build of
// this file is empty (the launcher never picks these kernels there).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800

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
// ldmatrix.sync.aligned.m8n8.x4 (.trans): four 8 x 8 matrices of 16-bit values from shared
// memory, lanes 8j..8j+7 giving the addresses of matrix j's rows (16-byte aligned). Lane l
// gets, in register j, matrix j's row l/4 at columns 2(l%4), 2(l%4)+1; with .trans, column
// l/4 at rows 2(l%4), 2(l%4)+1. The host build exchanges the addresses through memory.
#ifdef __CUDACC_RTC__
__device__ __forceinline__ u32 fa_smem(const u16* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void fa_ldm(u32* r, const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(fa_smem(p)));
}
__device__ __forceinline__ void fa_ldm_t(u32* r, const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(fa_smem(p)));
}
#else
inline void fa_ldm(u32* r, const u16* p) { host_ldmatrix_x4(r, p, false); }
inline void fa_ldm_t(u32* r, const u16* p) { host_ldmatrix_x4(r, p, true); }
#endif
// The A fragment of the 16 x 16 block at `p` (row stride `stride`): matrices (rows 0-7,
// columns 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15).
__device__ __forceinline__ void fa_frag_a(u32* a, const u16* p, int stride) {
    int l = threadIdx.x & 31;
    fa_ldm(a, p + (l % 8 + 8 * ((l / 8) % 2)) * stride + 8 * (l / 16));
}
// The B fragments of two column tiles whose columns are rows 0-7 and 8-15 of the 16 x 16
// block at `p` (k along the rows): a product with a row-major matrix's transpose, such as
// q k^T. b[0..2] is the first tile's, b[2..4] the second's.
__device__ __forceinline__ void fa_frag_bt2(u32* b, const u16* p, int stride) {
    int l = threadIdx.x & 31;
    fa_ldm(b, p + (l % 8 + 8 * (l / 16)) * stride + 8 * ((l / 8) % 2));
}
// The B fragments of the column tiles 0-7 and 8-15 of the 16 x 16 block at `p` of a
// row-major matrix (k down the rows), such as the values in P v: transposed loads.
__device__ __forceinline__ void fa_frag_b2(u32* b, const u16* p, int stride) {
    int l = threadIdx.x & 31;
    fa_ldm_t(b, p + (l % 8 + 8 * ((l / 8) % 2)) * stride + 8 * (l / 16));
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

// Rows [r0, r0 + R) of a matrix of `rows` rows of D (`st` apart) into shared `dst` (row
// stride D + FA_PAD), zeros past `rows`, by every thread of the block.
template <typename T, int D, int R>
__device__ __forceinline__ void fa_load(u16* dst, const T* src, i64 st, i64 r0, i64 rows) {
    constexpr int V = D / 8;
    for (int c = threadIdx.x; c < R * V; c += blockDim.x) {
        int r = c / V, e = (c % V) * 8;
        Vec16<T> x = {};
        if (r0 + r < rows) x = *(const Vec16<T>*)(src + (r0 + r) * st + e);
        *(Vec16<T>*)(dst + r * (D + FA_PAD) + e) = x;
    }
}

// 16 bytes from global `src` to shared `dst` without passing through registers
// (cp.async.cg, Ampere and later), zeros when `live` is false (src is then not read); a
// group of them is committed, and waited for until at most N groups are in flight. The
// host build's copies land at the wait (tests/emulator/host_shim.h).
#ifdef __CUDACC_RTC__
__device__ __forceinline__ void fa_cp16(u16* dst, const void* src, bool live) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(fa_smem(dst)), "l"(src),
                 "r"(live ? 16 : 0));
}
__device__ __forceinline__ void fa_cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void fa_cp_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}
#else
inline void fa_cp16(u16* dst, const void* src, bool live) { host_cp_async16(dst, src, live); }
inline void fa_cp_commit() { host_cp_commit(); }
template <int N> inline void fa_cp_wait() { host_cp_wait(N); }
#endif

// fa_load through cp.async: the copies are in flight until a wait.
template <typename T, int D, int R>
__device__ __forceinline__ void fa_load_async(u16* dst, const T* src, i64 st, i64 r0, i64 rows) {
    constexpr int V = D / 8;
    for (int c = threadIdx.x; c < R * V; c += blockDim.x) {
        int r = c / V, e = (c % V) * 8;
        bool live = r0 + r < rows;
        fa_cp16(dst + r * (D + FA_PAD) + e, src + (live ? (r0 + r) * st + e : 0), live);
    }
}

// Key and value tile j0 (rows `ks` and `vs` apart) into `stage` (keys, then values at TILE
// halves), as one committed group.
template <typename T, int D, int BC>
__device__ __forceinline__ void fa_issue_kv(u16* stage, const T* k, i64 ks, const T* v, i64 vs,
                                            i64 j0, i64 S) {
    fa_load_async<T, D, BC>(stage, k, ks, j0, S);
    fa_load_async<T, D, BC>(stage + BC * (D + FA_PAD), v, vs, j0, S);
    fa_cp_commit();
}

// Waits for the tile issued before the one just issued (or, with `more` false, for the last
// one), then for the whole block: the current stage is readable.
__device__ __forceinline__ void fa_await(bool more) {
    if (more) fa_cp_wait<1>();
    else fa_cp_wait<0>();
    __syncthreads();
}

// Where the rows of one (batch, head) pair start, and the distance between rows, in
// elements: pair bh = b h_count + h starts at b sb + h sh (a [B, H, T, D] view with any
// strides whose last is 1, such as the heads of a packed q/k/v product; contiguous
// [B H, T, D] rows are h = 1, sb = T D, st = D). Every offset is a multiple of 8 elements
// (the launcher checks), so rows start 16-byte aligned.
struct FaRows {
    i64 h, sb, sh, st;
};
__device__ __forceinline__ i64 fa_base(const FaRows& r, i64 bh) {
    return idiv(bh, r.h) * r.sb + imod(bh, r.h) * r.sh;
}
// The rows of every tensor a kernel reads or writes (the forward's output is `o`).
struct FaAll {
    FaRows q, k, v, o, dout, dq, dk, dv;
};

// The head of the loop over key tiles (the forward's and dq's): once every thread is done
// with the stage the next copies go to, issues tile it + 1 (when the loop has one), waits for
// tile it and returns its stage (keys, then values TILE halves on).
template <typename T, int D, int BC>
__device__ __forceinline__ const u16* fa_next_tile(u16* sm, i64 it, i64 j0, i64 end, const T* kb,
                                                   const T* vb, const FaAll& r, i64 S) {
    constexpr int TILE = BC * (D + FA_PAD);
    __syncthreads();
    bool more = j0 + BC < end;
    if (more)
        fa_issue_kv<T, D, BC>(sm + ((it + 1) & 1) * 2 * TILE, kb, r.k.st, vb, r.v.st, j0 + BC, S);
    fa_await(more);
    return sm + (it & 1) * 2 * TILE;
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
                           i64 B, i64 L, i64 S, float scale, int causal, const FaAll& r) {
    constexpr int BR = 16 * FA_WARPS, P = D + FA_PAD, TILE = BC * P;
    static_assert(BR <= 2 * BC, "the queries pass through one stage of keys and values");
    // Two stages of a key and a value tile, so that the next tile's copies (cp.async) run
    // while this one's products do; the queries pass through stage 1 first.
    FA_SHARED(sm, 4 * TILE);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const float sl2 = scale * FA_LOG2E;
    i64 tiles = (L + BR - 1) / BR;
    for (i64 blk = blockIdx.x; blk < B * tiles; blk += gridDim.x) {
        i64 b = blk / tiles, i0 = (blk % tiles) * BR;
        const T* kb = k + fa_base(r.k, b);
        const T* vb = v + fa_base(r.v, b);
        i64 end = causal && i0 + BR < S ? i0 + BR : S;
        __syncthreads(); // the previous block's reads are done
        fa_load<T, D, BR>(sm + 2 * TILE, q + fa_base(r.q, b), r.q.st, i0, L);
        fa_issue_kv<T, D, BC>(sm, kb, r.k.st, vb, r.v.st, 0, S);
        __syncthreads();
        u32 qa[D / 16][4];
        for (int kk = 0; kk < D / 16; kk++)
            fa_frag_a(qa[kk], sm + 2 * TILE + warp * 16 * P + kk * 16, P);
        float o[D / 8][4] = {};
        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
        const i64 rows[2] = {i0 + warp * 16 + g, i0 + warp * 16 + g + 8};
        for (i64 j0 = 0, it = 0; j0 < end; j0 += BC, it++) {
            const u16* ks = fa_next_tile<T, D, BC>(sm, it, j0, end, kb, vb, r, S);
            const u16* vs = ks + TILE;
            float s[BC / 8][4] = {};
            for (int kk = 0; kk < D / 16; kk++) {
                for (int n = 0; n < BC / 8; n += 2) {
                    u32 bk[4];
                    fa_frag_bt2(bk, ks + n * 8 * P + kk * 16, P);
                    fa_mma(T{}, s[n], qa[kk], bk);
                    fa_mma(T{}, s[n + 1], qa[kk], bk + 2);
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
                for (int n = 0; n < D / 8; n += 2) {
                    u32 bv[4];
                    fa_frag_b2(bv, vs + kk * 16 * P + n * 8, P);
                    fa_mma(T{}, o[n], pa, bv);
                    fa_mma(T{}, o[n + 1], pa, bv + 2);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            float total = fa_quad_sum(l[h]);
            if (rows[h] >= L) continue;
            float inv = 1.0f / total;
            T* orow = out + fa_base(r.o, b) + rows[h] * r.o.st + 2 * t;
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
                        float* __restrict__ dsum, i64 rows, i64 L, const FaAll& r) {
    FOR_EACH(row, rows) {
        i64 bh = idiv(row, L), i = imod(row, L);
        const T* orow = o + fa_base(r.o, bh) + i * r.o.st;
        const T* grow = dout + fa_base(r.dout, bh) + i * r.dout.st;
        float s = 0.0f;
        for (int e = 0; e < D; e += 8) {
            Vec16<T> x = *(const Vec16<T>*)(orow + e);
            Vec16<T> y = *(const Vec16<T>*)(grow + e);
            for (int u = 0; u < 8; u++) s += to_f32(x.v[u]) * to_f32(y.v[u]);
        }
        dsum[row] = s;
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
                               float scale, int causal, const FaAll& r) {
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
        fa_load<T, D, N>(ks, k + fa_base(r.k, b), r.k.st, j0, S);
        fa_load<T, D, N>(vs, v + fa_base(r.v, b), r.v.st, j0, S);
        float gk[D / 8][4] = {}, gv[D / 8][4] = {};
        const i64 keys[2] = {j0 + warp * 16 + g, j0 + warp * 16 + g + 8};
        // Causal: the queries before this block's first key see none of its keys.
        for (i64 i0 = causal ? j0 / BQ * BQ : 0; i0 < L; i0 += BQ) {
            __syncthreads();
            fa_load<T, D, BQ>(qs, q + fa_base(r.q, b), r.q.st, i0, L);
            fa_load<T, D, BQ>(dos, dout + fa_base(r.dout, b), r.dout.st, i0, L);
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
                for (int n = 0; n < BQ / 8; n += 2) {
                    u32 bq[4], bd[4];
                    fa_frag_bt2(bq, qs + n * 8 * P + kk * 16, P);
                    fa_frag_bt2(bd, dos + n * 8 * P + kk * 16, P);
                    fa_mma(T{}, st[n], ka, bq);
                    fa_mma(T{}, st[n + 1], ka, bq + 2);
                    fa_mma(T{}, dpt[n], va, bd);
                    fa_mma(T{}, dpt[n + 1], va, bd + 2);
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
                for (int n = 0; n < D / 8; n += 2) {
                    u32 bd[4], bq[4];
                    fa_frag_b2(bd, dos + kk * 16 * P + n * 8, P);
                    fa_frag_b2(bq, qs + kk * 16 * P + n * 8, P);
                    fa_mma(T{}, gv[n], pa, bd);
                    fa_mma(T{}, gv[n + 1], pa, bd + 2);
                    fa_mma(T{}, gk[n], sa, bq);
                    fa_mma(T{}, gk[n + 1], sa, bq + 2);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            if (keys[h] >= S) continue;
            T* krow = dk + fa_base(r.dk, b) + keys[h] * r.dk.st + 2 * t;
            T* vrow = dv + fa_base(r.dv, b) + keys[h] * r.dv.st + 2 * t;
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
                              T* __restrict__ dq, i64 B, i64 L, i64 S, float scale, int causal,
                              const FaAll& r) {
    constexpr int BR = 16 * FA_WARPS, P = D + FA_PAD, TILE = BC * P;
    static_assert(BR <= 2 * BC, "the queries pass through one stage of keys and values");
    // As fa_forward: two stages of key and value tiles; the queries and the output
    // gradient pass through stage 1 first.
    FA_SHARED(sm, 4 * TILE);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const float sl2 = scale * FA_LOG2E;
    i64 tiles = (L + BR - 1) / BR;
    for (i64 blk = blockIdx.x; blk < B * tiles; blk += gridDim.x) {
        i64 b = blk / tiles, i0 = (blk % tiles) * BR;
        const T* kb = k + fa_base(r.k, b);
        const T* vb = v + fa_base(r.v, b);
        const i64 rows[2] = {i0 + warp * 16 + g, i0 + warp * 16 + g + 8};
        float li[2], di[2];
        for (int h = 0; h < 2; h++) {
            li[h] = rows[h] < L ? lse[b * L + rows[h]] * FA_LOG2E : 0.0f;
            di[h] = rows[h] < L ? dsum[b * L + rows[h]] : 0.0f;
        }
        i64 end = causal && i0 + BR < S ? i0 + BR : S;
        u32 qa[D / 16][4], da[D / 16][4];
        __syncthreads(); // the previous block's reads are done
        fa_load<T, D, BR>(sm + 2 * TILE, q + fa_base(r.q, b), r.q.st, i0, L);
        fa_issue_kv<T, D, BC>(sm, kb, r.k.st, vb, r.v.st, 0, S);
        __syncthreads();
        for (int kk = 0; kk < D / 16; kk++)
            fa_frag_a(qa[kk], sm + 2 * TILE + warp * 16 * P + kk * 16, P);
        __syncthreads();
        fa_load<T, D, BR>(sm + 2 * TILE, dout + fa_base(r.dout, b), r.dout.st, i0, L);
        __syncthreads();
        for (int kk = 0; kk < D / 16; kk++)
            fa_frag_a(da[kk], sm + 2 * TILE + warp * 16 * P + kk * 16, P);
        float gq[D / 8][4] = {};
        for (i64 j0 = 0, it = 0; j0 < end; j0 += BC, it++) {
            const u16* ks = fa_next_tile<T, D, BC>(sm, it, j0, end, kb, vb, r, S);
            const u16* vs = ks + TILE;
            float s[BC / 8][4] = {}, dp[BC / 8][4] = {};
            for (int kk = 0; kk < D / 16; kk++) {
                for (int n = 0; n < BC / 8; n += 2) {
                    u32 bk[4], bv[4];
                    fa_frag_bt2(bk, ks + n * 8 * P + kk * 16, P);
                    fa_frag_bt2(bv, vs + n * 8 * P + kk * 16, P);
                    fa_mma(T{}, s[n], qa[kk], bk);
                    fa_mma(T{}, s[n + 1], qa[kk], bk + 2);
                    fa_mma(T{}, dp[n], da[kk], bv);
                    fa_mma(T{}, dp[n + 1], da[kk], bv + 2);
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
                for (int n = 0; n < D / 8; n += 2) {
                    u32 bk[4];
                    fa_frag_b2(bk, ks + kk * 16 * P + n * 8, P);
                    fa_mma(T{}, gq[n], sa, bk);
                    fa_mma(T{}, gq[n + 1], sa, bk + 2);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            if (rows[h] >= L) continue;
            T* qrow = dq + fa_base(r.dq, b) + rows[h] * r.dq.st + 2 * t;
            for (int n = 0; n < D / 8; n++) {
                qrow[n * 8] = from_f32<T>(gq[n][2 * h] * scale);
                qrow[n * 8 + 1] = from_f32<T>(gq[n][2 * h + 1] * scale);
            }
        }
    }
}

// Entry points per dtype and head size: forward and dq with BC keys a tile (64 for head 64,
// 32 for head 128, so that two stages of key and value tiles fit 48 KiB of static shared
// memory), dk/dv with W warps and BQ queries a tile.
#define FLASH(T, D, BC, W, BQ)                                                                 \
    extern "C" __global__ void flash_forward_##T##_##D(const T* q, const T* k, const T* v,      \
                                                       T* out, float* lse, i64 B, i64 L,        \
                                                       i64 S, float scale, int causal,          \
                                                       FaAll r) {                               \
        fa_forward<T, D, BC>(q, k, v, out, lse, B, L, S, scale, causal, r);                     \
    }                                                                                          \
    extern "C" __global__ void flash_prep_##T##_##D(const T* o, const T* dout, float* dsum,     \
                                                    i64 rows, i64 L, FaAll r) {                \
        fa_prep<T, D>(o, dout, dsum, rows, L, r);                                               \
    }                                                                                          \
    extern "C" __global__ void flash_backward_kv_##T##_##D(                                    \
        const T* q, const T* k, const T* v, const T* dout, const float* lse,                   \
        const float* dsum, T* dk, T* dv, i64 B, i64 L, i64 S, float scale, int causal,          \
        FaAll r) {                                                                             \
        fa_backward_kv<T, D, W, BQ>(q, k, v, dout, lse, dsum, dk, dv, B, L, S, scale, causal,   \
                                    r);                                                        \
    }                                                                                          \
    extern "C" __global__ void flash_backward_q_##T##_##D(                                     \
        const T* q, const T* k, const T* v, const T* dout, const float* lse,                   \
        const float* dsum, T* dq, i64 B, i64 L, i64 S, float scale, int causal, FaAll r) {      \
        fa_backward_q<T, D, BC>(q, k, v, dout, lse, dsum, dq, B, L, S, scale, causal, r);       \
    }

PART(f16, FLASH(f16, 64, 64, 4, 64))
PART(f16, FLASH(f16, 128, 32, 2, 32))
PART(bf16, FLASH(bf16, 64, 64, 4, 64))
PART(bf16, FLASH(bf16, 128, 32, 2, 32))

#endif // __CUDA_ARCH__ >= 800
