/* kernels.cu: Tessera's CUDA kernels and the host functions that launch
 * them (kernels.cuh).
 *
 * Embedding gather, RMSNorm (fused with the residual add before it), RoPE
 * with the KV write into the paged pool, attention over the pool (one
 * kernel for prompt chunks and decodes: tiles of 16 query rows share each
 * 16-position K/V tile in shared memory, with an online softmax; the
 * tensor-core kernel for head sizes 64 and 128), SwiGLU, a GEMV for small
 * batches, and sampling with the CPU engine's (seed, position) draw.  The
 * per-element math is worker/kmath.h's. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cub/cub.cuh>

#include <algorithm>
#include <math.h>
#include <stdint.h>

extern "C" {
#include "common/dtype.h"
#include "worker/kmath.h"
}
#include "worker/cuda/kernels.cuh"

/* ---- kernels ------------------------------------------------------------------- */

__device__ __forceinline__ float ld_bf16(const bf16_t *p) { return tsr_k_bf16_to_f32(*p); }

__global__ void k_convert(bf16_t *dst, const void *src, size_t n, int dtype)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float f = dtype == TSR_DT_F32 ? ((const float *)src)[i]
                                      : tsr_k_f16_to_f32(((const uint16_t *)src)[i]);
        dst[i] = tsr_k_f32_to_bf16(f);
    }
}

/* Benchmark weights from a seed: uniform in [-scale, scale), or 1 for norms. */
__global__ void k_fill(bf16_t *dst, size_t n, unsigned long long seed, float scale)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float v = scale ? (float)(tsr_draw(seed, i) * 2.0 - 1.0) * scale : 1.0f;
        dst[i] = tsr_k_f32_to_bf16(v);
    }
}

/* Vocabulary-parallel lookup: rows this rank does not hold stay zero. */
__global__ void k_embed(float *x, const bf16_t *embed, const int32_t *tokens, int H, int v_begin,
                        int v_end)
{
    int t = blockIdx.x, id = tokens[t];
    bool mine = id >= v_begin && id < v_end;
    for (int j = threadIdx.x; j < H; j += blockDim.x)
        x[(size_t)t * H + j] = mine ? ld_bf16(embed + (size_t)(id - v_begin) * H + j) : 0.0f;
}

/* x += add (when add is given), then out = RMSNorm(x) * w in BF16.  Row
 * blockIdx.x of out reads row rows[blockIdx.x] of x (rows NULL: the same).
 * A row of up to 16 * THREADS elements (a multiple of 4) is held in
 * registers, four elements a thread at a time, with the weights' loads
 * issued before the sum's reduction; longer or odd rows go element by
 * element through memory. */
template <int THREADS>
__global__ void __launch_bounds__(THREADS)
k_add_rmsnorm(bf16_t *__restrict__ out, float *__restrict__ x, const float *__restrict__ add,
              const bf16_t *__restrict__ w, const int32_t *__restrict__ rows, int H, float eps)
{
    typedef cub::BlockReduce<double, THREADS> reduce_t;
    constexpr int PER = 4;   /* float4s a thread holds */
    __shared__ typename reduce_t::TempStorage tmp;
    __shared__ float scale;
    const int r = rows ? rows[blockIdx.x] : (int)blockIdx.x;
    float *xr = x + (size_t)r * H;
    const float *ar = add ? add + (size_t)r * H : NULL;
    bf16_t *orow = out + (size_t)blockIdx.x * H;
    float ss = 0;
    if (H % 4 == 0 && H <= 4 * PER * THREADS) {
        float4 *x4 = (float4 *)xr;
        const float4 *a4 = (const float4 *)ar;
        const uint2 *w4 = (const uint2 *)w;
        float4 v[PER];
        uint2 wv[PER];
        const int n4 = H / 4;
#pragma unroll
        for (int k = 0; k < PER; k++) {
            const int j = threadIdx.x + k * THREADS;
            if (j < n4) {
                v[k] = x4[j];
                wv[k] = w4[j];
                if (a4) {
                    const float4 a = a4[j];
                    v[k].x += a.x, v[k].y += a.y, v[k].z += a.z, v[k].w += a.w;
                    x4[j] = v[k];
                }
                ss += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
            }
        }
        const double total = reduce_t(tmp).Sum((double)ss);
        if (threadIdx.x == 0) scale = tsr_k_rms_scale(total, H, eps);
        __syncthreads();
        const float sc = scale;
        uint2 *o4 = (uint2 *)orow;
#pragma unroll
        for (int k = 0; k < PER; k++) {
            const int j = threadIdx.x + k * THREADS;
            if (j < n4) {
                const float w0 = tsr_k_bf16_to_f32((uint16_t)wv[k].x),
                            w1 = tsr_k_bf16_to_f32(wv[k].x >> 16),
                            w2 = tsr_k_bf16_to_f32((uint16_t)wv[k].y),
                            w3 = tsr_k_bf16_to_f32(wv[k].y >> 16);
                o4[j] = make_uint2(tsr_k_f32_to_bf16(w0 * (v[k].x * sc)) |
                                       (uint32_t)tsr_k_f32_to_bf16(w1 * (v[k].y * sc)) << 16,
                                   tsr_k_f32_to_bf16(w2 * (v[k].z * sc)) |
                                       (uint32_t)tsr_k_f32_to_bf16(w3 * (v[k].w * sc)) << 16);
            }
        }
        return;
    }
    for (int j = threadIdx.x; j < H; j += THREADS) {
        float v = xr[j];
        if (ar) xr[j] = v = v + ar[j];
        ss += v * v;
    }
    const double total = reduce_t(tmp).Sum((double)ss);
    if (threadIdx.x == 0) scale = tsr_k_rms_scale(total, H, eps);
    __syncthreads();
    const float sc = scale;
    for (int j = threadIdx.x; j < H; j += THREADS)
        orow[j] = tsr_k_f32_to_bf16(ld_bf16(w + j) * (xr[j] * sc));
}

__global__ void k_add(float *x, const float *add, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] += add[i];
}

/* RoPE on head blockIdx.y of row blockIdx.x (the query heads, then the KV
 * heads); a KV head's rotated k and its v go into the pool. */
__global__ void k_rope_kv(float *__restrict__ qkv, bf16_t *__restrict__ kpool,
                          bf16_t *__restrict__ vpool, const float *__restrict__ cosv,
                          const float *__restrict__ sinv, tsr_cuda_meta_t md, int l, int n_blocks,
                          int qh, int kvh, int hd)
{
    const int t = blockIdx.x, head = blockIdx.y, pos = md.row_pos[t], half = hd / 2;
    if (pos < 0) return;
    float *base = qkv + (size_t)t * (qh + 2 * kvh) * hd + (size_t)head * hd;
    const float *c = cosv + (size_t)pos * half, *s = sinv + (size_t)pos * half;
    if (head < qh) {
        for (int j = threadIdx.x; j < half; j += blockDim.x)
            tsr_k_rope_pair(&base[j], &base[j + half], c[j], s[j]);
        return;
    }
    const int kh = head - qh;
    const float *v = base + (size_t)kvh * hd;
    const size_t off = tsr_k_kv_offset(md.tables + md.row_tbl[t], n_blocks, kvh, hd, l, pos, kh);
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        float a = base[j], b = base[j + half];
        tsr_k_rope_pair(&a, &b, c[j], s[j]);
        kpool[off + j] = tsr_k_f32_to_bf16(a);
        kpool[off + j + half] = tsr_k_f32_to_bf16(b);
        vpool[off + j] = tsr_k_f32_to_bf16(v[j]);
        vpool[off + j + half] = tsr_k_f32_to_bf16(v[j + half]);
    }
}

/* Causal attention of one tile (up to TSR_ATT_TILE query rows of one
 * entry) for one query head: 4 warps, each with up to 4 rows; a lane holds
 * head_dim / 32 dimensions of its rows' queries and accumulators.  Every
 * 16-position K/V tile is loaded once into shared memory for all rows. */
#define ATT_WARPS 4
#define ATT_DPL 8           /* dimensions per lane: head_dim <= 256 */
__global__ void __launch_bounds__(ATT_WARPS * 32)
k_attention(bf16_t *att, const float *qkv, const bf16_t *kpool, const bf16_t *vpool,
            tsr_cuda_meta_t md, int l, int n_blocks, int qh, int kvh, int hd, float scale)
{
    __shared__ float ks[TSR_KV_BLOCK][256], vs[TSR_KV_BLOCK][256];
    const int tile = blockIdx.x, h = blockIdx.y, n = md.tile_n[tile];
    if (n <= 0) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, kh = h / (qh / kvh);
    const int row0 = md.tile_row0[tile], pos0 = md.tile_pos0[tile];
    const int32_t *table = md.tables + md.tile_tbl[tile];
    const size_t qkvw = (size_t)(qh + 2 * kvh) * hd;
    const int rows_per_warp = (TSR_ATT_TILE + ATT_WARPS - 1) / ATT_WARPS;
    float q[rows_per_warp][ATT_DPL], acc[rows_per_warp][ATT_DPL];
    tsr_osm_t sm[rows_per_warp];
    for (int i = 0; i < rows_per_warp; i++) {
        int r = warp + i * ATT_WARPS;
        sm[i] = tsr_k_osm_init();
        for (int j = 0; j < ATT_DPL; j++) {
            int d = lane + 32 * j;
            q[i][j] = r < n && d < hd ? qkv[(size_t)(row0 + r) * qkvw + (size_t)h * hd + d] : 0.0f;
            acc[i][j] = 0.0f;
        }
    }
    const int visible_max = pos0 + n;     /* the last row sees this many positions */
    for (int b0 = 0; b0 < visible_max; b0 += TSR_KV_BLOCK) {
        const int np = min(TSR_KV_BLOCK, visible_max - b0);
        size_t base = tsr_k_kv_offset(table, n_blocks, kvh, hd, l, b0, kh);
        __syncthreads();
        for (int i = threadIdx.x; i < np * hd; i += blockDim.x) {
            ks[i / hd][i % hd] = ld_bf16(kpool + base + i);
            vs[i / hd][i % hd] = ld_bf16(vpool + base + i);
        }
        __syncthreads();
        for (int i = 0; i < rows_per_warp; i++) {
            int r = warp + i * ATT_WARPS;
            if (r >= n) break;
            int visible = pos0 + r + 1;
            for (int p = 0; p < np && b0 + p < visible; p++) {
                float part = 0;
                for (int j = 0; j < ATT_DPL; j++) {
                    int d = lane + 32 * j;
                    if (d < hd) part += q[i][j] * ks[p][d];
                }
                for (int o = 16; o; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
                float w, c = tsr_k_osm_push(&sm[i], part * scale, &w);
                for (int j = 0; j < ATT_DPL; j++) {
                    int d = lane + 32 * j;
                    if (d < hd) acc[i][j] = acc[i][j] * c + w * vs[p][d];
                }
            }
        }
    }
    for (int i = 0; i < rows_per_warp; i++) {
        int r = warp + i * ATT_WARPS;
        if (r >= n) break;
        for (int j = 0; j < ATT_DPL; j++) {
            int d = lane + 32 * j;
            if (d < hd)
                att[(size_t)(row0 + r) * qh * hd + (size_t)h * hd + d] =
                    tsr_k_f32_to_bf16(acc[i][j] / sm[i].l);
        }
    }
}

/* Causal attention on the tensor cores (mma.sync m16n8k16, BF16 in, f32
 * accumulate), flash-style: one block takes a tile of up to TSR_ATT_TILE
 * positions of an entry for the query heads that share KV head kh (up to
 * TSR_ATT_ROWS (position, head) rows, tsr_k_gqa_row), so each K/V tile is
 * read once for the whole group.  Per tile of ATT_KEYS keys, loaded into
 * shared memory (K as rows, V transposed), each warp computes its 16 rows'
 * scores S = Q K^T, updates the online softmax, and adds P V, with P taken
 * straight from S's registers.  Q and P are rounded to BF16 for the
 * products; scores, softmax and sums stay f32. */
#define ATT_KEYS 64

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&v;
}

__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int HD, bool SPLIT>
__global__ void __launch_bounds__(128)
k_attention_mma(bf16_t *att, const float *__restrict__ qkv, const bf16_t *__restrict__ kpool,
                const bf16_t *__restrict__ vpool, tsr_cuda_meta_t md, int l, int n_blocks, int qh,
                int kvh, float scale, int chunks)
{
    /* SPLIT (a step of decodes, a tile's rows fit one warp): the four warps
     * share the same 16 rows and each takes a quarter of every key tile;
     * their partial softmax states are merged at the end */
    constexpr int KP = HD + 8, VP = ATT_KEYS + 8, VEC = HD / 8, NT = SPLIT ? 2 : ATT_KEYS / 8;
    static_assert(128 % ATT_KEYS == 0 && VEC % (128 / ATT_KEYS) == 0, "the K/V tile's loads");
    static_assert(!SPLIT || ATT_KEYS == 4 * 16, "a split warp takes 16 keys of a tile");
    static_assert(!SPLIT || 4 * 16 * (HD + 2) * 4 <= (ATT_KEYS * KP + HD * VP) * 2,
                  "the warps' partial states fit in the tiles' memory");
    __shared__ __align__(16) bf16_t smem[ATT_KEYS * KP + HD * VP];
    bf16_t *const ks = smem;                     /* [key][dim], rows padded */
    bf16_t *const vt = smem + ATT_KEYS * KP;     /* [dim][key], rows padded */
    const int tile = blockIdx.x, n = md.tile_n[tile];
    if (n <= 0) return;
    const int g = qh / kvh, kh = blockIdx.y / chunks, rows = n * g;
    const int r_begin = (blockIdx.y % chunks) * TSR_ATT_ROWS;
    if (r_begin >= rows) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row0 = md.tile_row0[tile], pos0 = md.tile_pos0[tile];
    const int32_t *table = md.tables + md.tile_tbl[tile];
    const size_t qkvw = (size_t)(qh + 2 * kvh) * HD;
    const int wr = r_begin + (SPLIT ? 0 : warp * 16);   /* the warp's first row */
    const int t0 = SPLIT ? 2 * warp : 0;                 /* its first key tile of 8 */
    const bool active = wr < rows;
    /* this lane's two rows (C elements 0-1 and 2-3): validity, the row of
     * the step it belongs to, its position and its query head */
    bool rv[2];
    int rrow[2], rpos[2], rhead[2];
    for (int i = 0; i < 2; i++) {
        int r, c, po, ho;
        tsr_k_mma_c(lane, 2 * i, &r, &c);
        rv[i] = wr + r < rows;
        tsr_k_gqa_row(rv[i] ? wr + r : 0, g, &po, &ho);
        rrow[i] = row0 + po;
        rpos[i] = pos0 + po;
        rhead[i] = kh * g + ho;
    }
    /* Q as A operands, one per 16 dimensions: elements (2j, 2j+1) are the
     * row of C pair j / 2 (A's rows are C's rows) at adjacent dims */
    uint32_t qa[HD / 16][4];
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int r, c;
            tsr_k_mma_a(lane, 2 * j, &r, &c);
            const int i = r >= 8;
            float2 v = make_float2(0.0f, 0.0f);
            if (rv[i])
                v = *(const float2 *)(qkv + (size_t)rrow[i] * qkvw + (size_t)rhead[i] * HD +
                                      kk * 16 + c);
            qa[kk][j] = pack_bf16x2(v.x, v.y);
        }
    float o[HD / 8][4];
#pragma unroll
    for (int t = 0; t < HD / 8; t++) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, lsum[2] = {0.0f, 0.0f};
    const int visible_max = pos0 + n;
    for (int k0 = 0; k0 < visible_max; k0 += ATT_KEYS) {
        __syncthreads();   /* the last tile's readers are done */
        /* 16-byte vectors.  A thread keeps one key (consecutive threads,
         * consecutive keys, so a warp's transposed V stores fall in
         * different banks) and takes every other (128 / ATT_KEYS) vector
         * of it: one block-table lookup, then all its loads in flight. */
        {
            constexpr int STRIDE = 128 / ATT_KEYS, PER = VEC / STRIDE;
            const int key = threadIdx.x % ATT_KEYS, c0 = threadIdx.x / ATT_KEYS, pos = k0 + key;
            uint4 kv4[PER], vv4[PER];
            if (pos < visible_max) {   /* past it: zeros, never a stale NaN times 0 */
                const size_t off = tsr_k_kv_offset(table, n_blocks, kvh, HD, l, pos, kh);
#pragma unroll
                for (int j = 0; j < PER; j++) {
                    kv4[j] = *(const uint4 *)(kpool + off + (c0 + STRIDE * j) * 8);
                    vv4[j] = *(const uint4 *)(vpool + off + (c0 + STRIDE * j) * 8);
                }
            } else {
#pragma unroll
                for (int j = 0; j < PER; j++) kv4[j] = vv4[j] = make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int j = 0; j < PER; j++) {
                const int c = c0 + STRIDE * j;
                *(uint4 *)(ks + key * KP + c * 8) = kv4[j];
                const bf16_t *vh = (const bf16_t *)&vv4[j];
#pragma unroll
                for (int d = 0; d < 8; d++) vt[(c * 8 + d) * VP + key] = vh[d];
            }
        }
        __syncthreads();
        if (!active) continue;
        float sc[NT][4];
#pragma unroll
        for (int t = 0; t < NT; t++) {
            sc[t][0] = sc[t][1] = sc[t][2] = sc[t][3] = 0.0f;
            int kb, nb;
            tsr_k_mma_b(lane, 0, &kb, &nb);   /* (k, n): dim kb, key (t0 + t) * 8 + nb */
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                const bf16_t *kr = ks + ((t0 + t) * 8 + nb) * KP + kk * 16 + kb;
                mma_bf16(sc[t], qa[kk], *(const uint32_t *)kr, *(const uint32_t *)(kr + 8));
            }
        }
        /* scale and mask: a key after the row's position, or a padding row */
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int t = 0; t < NT; t++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int r, c;
                tsr_k_mma_c(lane, e, &r, &c);
                const int i = e >> 1, key = k0 + (t0 + t) * 8 + c;
                sc[t][e] = rv[i] && key <= rpos[i] ? sc[t][e] * scale : -INFINITY;
                mx[i] = fmaxf(mx[i], sc[t][e]);
            }
        /* the online softmax, per row over the 4 lanes that hold it */
#pragma unroll
        for (int i = 0; i < 2; i++) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
            const float mnew = fmaxf(m[i], mx[i]), base = mnew == -INFINITY ? 0.0f : mnew;
            const float c = expf(m[i] - base);
            m[i] = mnew;
            lsum[i] *= c;
#pragma unroll
            for (int t = 0; t < HD / 8; t++) o[t][2 * i] *= c, o[t][2 * i + 1] *= c;
#pragma unroll
            for (int t = 0; t < NT; t++)
#pragma unroll
                for (int e = 2 * i; e < 2 * i + 2; e++) {
                    sc[t][e] = expf(sc[t][e] - base);
                    lsum[i] += sc[t][e];
                }
        }
        /* O += P V: the C registers of key tiles 2kk and 2kk + 1 are the A
         * operand of keys [16kk, 16kk + 16) */
#pragma unroll
        for (int kk = 0; kk < NT / 2; kk++) {
            const uint32_t pa[4] = {pack_bf16x2(sc[2 * kk][0], sc[2 * kk][1]),
                                    pack_bf16x2(sc[2 * kk][2], sc[2 * kk][3]),
                                    pack_bf16x2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                                    pack_bf16x2(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
            int kb, nb;
            tsr_k_mma_b(lane, 0, &kb, &nb);   /* (k, n): key 16kk + kb, dim t * 8 + nb */
#pragma unroll
            for (int t = 0; t < HD / 8; t++) {
                const bf16_t *vr = vt + (t * 8 + nb) * VP + (t0 / 2 + kk) * 16 + kb;
                mma_bf16(o[t], pa, *(const uint32_t *)vr, *(const uint32_t *)(vr + 8));
            }
        }
    }
    if (!active) return;
    if constexpr (SPLIT) {   /* merge the four warps' states of the same 16 rows */
        float *po = (float *)smem, *pm = po + 4 * 16 * HD, *pl = pm + 4 * 16;
        __syncthreads();   /* every warp is done with the tiles */
#pragma unroll
        for (int i = 0; i < 2; i++) {
            float sum = lsum[i];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            int r, c;
            tsr_k_mma_c(lane, 2 * i, &r, &c);
            if (c == 0) pm[warp * 16 + r] = m[i], pl[warp * 16 + r] = sum;
#pragma unroll
            for (int t = 0; t < HD / 8; t++) {
                po[(warp * 16 + r) * HD + t * 8 + c] = o[t][2 * i];
                po[(warp * 16 + r) * HD + t * 8 + c + 1] = o[t][2 * i + 1];
            }
        }
        __syncthreads();
        for (int x = threadIdx.x; x < 16 * HD; x += blockDim.x) {
            const int r = x / HD, d = x % HD;
            if (wr + r >= rows) continue;
            tsr_osm_t st = tsr_k_osm_init();
            float acc = 0.0f;
            for (int w = 0; w < 4; w++) {
                const tsr_osm_t part = {pm[w * 16 + r], pl[w * 16 + r]};
                float ca, cb;
                tsr_k_osm_merge(&st, part, &ca, &cb);
                acc = acc * ca + po[(w * 16 + r) * HD + d] * cb;
            }
            int pof, hof;
            tsr_k_gqa_row(wr + r, g, &pof, &hof);
            att[(size_t)(row0 + pof) * qh * HD + (size_t)(kh * g + hof) * HD + d] =
                tsr_k_f32_to_bf16(acc / st.l);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            float sum = lsum[i];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            if (!rv[i]) continue;
            int r, c;
            tsr_k_mma_c(lane, 2 * i, &r, &c);
            bf16_t *out = att + (size_t)rrow[i] * qh * HD + (size_t)rhead[i] * HD + c;
#pragma unroll
            for (int t = 0; t < HD / 8; t++)
                *(uint32_t *)(out + t * 8) =
                    pack_bf16x2(o[t][2 * i] / sum, o[t][2 * i + 1] / sum);
        }
    }
}

__global__ void k_swiglu(bf16_t *act, const float *gu, int I, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t t = i / I, k = i % I;
        const float *g = gu + t * 2 * I;
        act[i] = tsr_k_f32_to_bf16(tsr_k_swiglu(g[k], g[I + k]));
    }
}

#ifdef TSR_TESTING
/* The injected fault: a write to an address no allocation has (test builds only). */
__global__ void k_fault(void) { *(volatile int *)(uintptr_t)16 = 1; }
#endif

/* Pads each row of logits past this rank's vocabulary with -inf. */
__global__ void k_pad(float *lg, int C, int vs, int rows)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < rows * (C - vs); i += gridDim.x * blockDim.x)
        lg[(size_t)(i / (C - vs)) * C + vs + i % (C - vs)] = -INFINITY;
}

/* The logit of token i of sampled row s in the gathered [tp][S][C] layout. */
__device__ __forceinline__ float logit_at(const float *g, int S, int C, int s, int i)
{
    return g[((size_t)(i / C) * S + s) * C + i % C];
}

/* Per sampled row: the first maximum; for a sampled (not greedy) row also
 * the weights, their sum in id order, and the segment to sort when top_p
 * cuts (an empty one otherwise). */
template <int THREADS>
__global__ void __launch_bounds__(THREADS) k_sample_prep(const float *g, int S, int C, int V, tsr_cuda_meta_t md, int32_t *best,
                              float *w, int32_t *ids, double *wsum, int32_t *seg_begin,
                              int32_t *seg_end)
{
    typedef cub::BlockReduce<cub::KeyValuePair<int, float>, THREADS> argmax_t;
    typedef cub::BlockReduce<double, THREADS> sum_t;
    __shared__ union {
        typename argmax_t::TempStorage a;
        typename sum_t::TempStorage s;
    } tmp;
    __shared__ int b;
    const int s = blockIdx.x;
    cub::KeyValuePair<int, float> m(0, -INFINITY);
    for (int i = threadIdx.x; i < V; i += THREADS) {
        float v = logit_at(g, S, C, s, i);
        if (v > m.value) m = cub::KeyValuePair<int, float>(i, v);  /* first max per thread */
    }
    /* The first maximum over threads: larger value, then smaller id. */
    struct first_max {
        __device__ cub::KeyValuePair<int, float> operator()(const cub::KeyValuePair<int, float> &x,
                                                            const cub::KeyValuePair<int, float> &y) const
        {
            if (x.value != y.value) return x.value > y.value ? x : y;
            return x.key < y.key ? x : y;
        }
    };
    cub::KeyValuePair<int, float> r = argmax_t(tmp.a).Reduce(m, first_max());
    /* worker/sample.c compares each logit with the best so far: a NaN
     * first logit wins, any other NaN never does */
    if (threadIdx.x == 0) best[s] = b = isnan(logit_at(g, S, C, s, 0)) ? 0 : r.key;
    __syncthreads();
    seg_begin[s] = seg_end[s] = s * V;
    if (tsr_k_greedy(md.samp_temp[s])) return;
    const float mx = logit_at(g, S, C, s, b), temp = md.samp_temp[s];
    double dpart = 0;
    for (int i = threadIdx.x; i < V; i += THREADS) {
        float p = tsr_k_sample_weight(logit_at(g, S, C, s, i), mx, temp);
        w[(size_t)s * V + i] = p;
        ids[(size_t)s * V + i] = i;
        dpart += p;
    }
    __syncthreads();
    double total = sum_t(tmp.s).Sum(dpart);
    if (threadIdx.x == 0) {
        wsum[s] = total;
        if (tsr_k_top_p_cuts(md.samp_top_p[s])) seg_end[s] = (s + 1) * V;
    }
}

/* The first of candidates [0, n) of p whose inclusive prefix sum passes
 * pass(prefix, weight), scanned THREADS at a time with a block scan; n
 * when none does.  Every thread of the block calls it and gets the answer;
 * tmp and found are the caller's shared memory. */
template <int THREADS, typename Pass>
__device__ int first_prefix(const float *p, int n, Pass pass,
                            typename cub::BlockScan<double, THREADS>::TempStorage &tmp, int &found)
{
    __syncthreads();   /* found's last readers are done */
    if (threadIdx.x == 0) found = n;
    double run = 0;
    for (int t0 = 0; t0 < n; t0 += THREADS) {
        int i = t0 + threadIdx.x;
        double v = i < n ? p[i] : 0.0, incl, total;
        __syncthreads();
        cub::BlockScan<double, THREADS>(tmp).InclusiveSum(v, incl, total);
        if (i < n && pass(incl + run, p[i])) atomicMin(&found, i);
        __syncthreads();
        if (found < n) break;
        run += total;
    }
    __syncthreads();
    int f = found;
    __syncthreads();   /* everyone has read it before it is written again */
    return f;
}

/* Walks a row's candidates (sorted when top_p cuts, else in id order) in
 * tiles of THREADS with a block scan: first the cut, then the draw. */
template <int THREADS>
__global__ void __launch_bounds__(THREADS) k_sample_pick(const float *w, const int32_t *ids, const float *w_sorted,
                              const int32_t *ids_sorted, const double *wsum, const int32_t *best,
                              int V, tsr_cuda_meta_t md, int32_t *out)
{
    typedef cub::BlockScan<double, THREADS> scan_t;
    __shared__ typename scan_t::TempStorage tmp;
    __shared__ int found;
    __shared__ double found_sum;
    const int s = blockIdx.x;
    if (tsr_k_greedy(md.samp_temp[s])) {
        if (threadIdx.x == 0) out[s] = best[s];
        return;
    }
    const bool cut = tsr_k_top_p_cuts(md.samp_top_p[s]);
    const float *p = (cut ? w_sorted : w) + (size_t)s * V;
    const int32_t *id = (cut ? ids_sorted : ids) + (size_t)s * V;
    int k = V;
    double keep = wsum[s];
    /* 1. the cut: the smallest k >= 1 whose prefix reaches top_p * sum */
    if (cut) {
        const double goal = md.samp_top_p[s] * wsum[s];
        int f = first_prefix<THREADS>(p, V, [=](double prefix, float) { return prefix >= goal; },
                                      tmp, found);
        k = f + 1 < V ? f + 1 : V;
        /* keep = prefix(k), summed sequentially like the CPU */
        if (threadIdx.x == 0) {
            double acc = 0;
            for (int i = 0; i < k; i++) acc += p[i];
            found_sum = acc;
        }
        __syncthreads();
        keep = found_sum;
    }
    /* 2. the draw: the first candidate whose prefix passes r */
    const double r = tsr_draw(md.samp_seed[s], md.samp_pos[s]) * keep;
    int f = first_prefix<THREADS>(p, k, [=](double prefix, float w) { return r < prefix && w > 0; },
                                  tmp, found);
    if (threadIdx.x == 0) out[s] = f < k ? id[f] : best[s];
}


/* ---- helpers ------------------------------------------------------------------- */

static int grid_for(size_t n, int threads)
{
    size_t g = (n + threads - 1) / threads;
    return g > 4096 ? 4096 : g < 1 ? 1 : (int)g;
}

/* The same product for a few rows of x (a small decode batch), where it is
 * a pass over the weights that cuBLAS's GEMM kernels read at well under
 * the memory's rate for the smaller matrices: a block of GEMV_WARPS warps
 * takes GEMV_ROWS rows of w, each warp one stretch of their columns, its
 * lanes 16-byte pieces of it in turn (a lane's loads of several pieces in
 * flight together); the x rows come through the caches; the sums are
 * reduced by shuffles within a warp, then through shared memory.  NT rows
 * of x. */
#define GEMV_ROWS 4
#define GEMV_WARPS 8
#define GEMV_MAX_T 4

__device__ __forceinline__ void bf16x8_to_f32(const uint4 v, float f[8])
{
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(u[i] << 16);
        f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
    }
}

template <int NT>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
k_gemv(float *__restrict__ y, int ldy, const bf16_t *__restrict__ x, const bf16_t *__restrict__ w,
       int in, int out)
{
    __shared__ float red[GEMV_WARPS][GEMV_ROWS * NT];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r0 = blockIdx.x * GEMV_ROWS;
    int vbeg, vend;
    tsr_k_gemv_span(in / 8, GEMV_WARPS, warp, &vbeg, &vend);
    float acc[GEMV_ROWS][NT] = {};
    const uint4 *wr[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++)
        wr[r] = (const uint4 *)(w + (size_t)(r0 + r < out ? r0 + r : r0) * in);
#pragma unroll 4
    for (int v = vbeg + lane; v < vend; v += 32) {
        uint4 wv[GEMV_ROWS], xv[NT];
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; r++) wv[r] = __ldg(wr[r] + v);
#pragma unroll
        for (int t = 0; t < NT; t++) xv[t] = __ldg((const uint4 *)(x + (size_t)t * in) + v);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float xf[8];
            bf16x8_to_f32(xv[t], xf);
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; r++) {
                float wf[8];
                bf16x8_to_f32(wv[r], wf);
#pragma unroll
                for (int k = 0; k < 8; k++) acc[r][t] = fmaf(wf[k], xf[k], acc[r][t]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float a = acc[r][t];
#pragma unroll
            for (int o = 16; o; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
            if (lane == 0) red[warp][r * NT + t] = a;
        }
    __syncthreads();
    if (threadIdx.x < GEMV_ROWS * NT) {
        const int r = threadIdx.x / NT, t = threadIdx.x % NT;
        float a = 0.0f;
#pragma unroll
        for (int k = 0; k < GEMV_WARPS; k++) a += red[k][threadIdx.x];
        if (r0 + r < out) y[(size_t)t * ldy + r0 + r] = a;
    }
}


/* ---- launches ------------------------------------------------------------------ */

static_assert(TSR_KERN_MAX_HEAD_DIM == 32 * ATT_DPL, "k_attention holds head_dim / 32 per lane");

void tsr_kern_convert(cudaStream_t st, bf16_t *dst, const void *src, size_t n, int dtype)
{
    k_convert<<<grid_for(n, 256), 256, 0, st>>>(dst, src, n, dtype);
}

void tsr_kern_fill(cudaStream_t st, bf16_t *dst, size_t n, unsigned long long seed, float scale)
{
    k_fill<<<grid_for(n, 256), 256, 0, st>>>(dst, n, seed, scale);
}

void tsr_kern_embed(cudaStream_t st, int rows, float *x, const bf16_t *embed,
                    const int32_t *tokens, int H, int v_begin, int v_end)
{
    k_embed<<<rows, 256, 0, st>>>(x, embed, tokens, H, v_begin, v_end);
}

void tsr_kern_add_rmsnorm(cudaStream_t st, int rows, bf16_t *out, float *x, const float *add,
                          const bf16_t *w, const int32_t *row_idx, int H, float eps)
{
    k_add_rmsnorm<512><<<rows, 512, 0, st>>>(out, x, add, w, row_idx, H, eps);
}

void tsr_kern_add(cudaStream_t st, float *x, const float *add, size_t n)
{
    k_add<<<grid_for(n, 256), 256, 0, st>>>(x, add, n);
}

void tsr_kern_rope_kv(cudaStream_t st, int T, float *qkv, bf16_t *kpool, bf16_t *vpool,
                      const float *cosv, const float *sinv, tsr_cuda_meta_t md, int l, int n_blocks,
                      int qh, int kvh, int hd)
{
    const int threads = std::min(128, (hd / 2 + 31) / 32 * 32);   /* a thread a pair */
    k_rope_kv<<<dim3(T, qh + kvh), threads, 0, st>>>(qkv, kpool, vpool, cosv, sinv, md, l,
                                                     n_blocks, qh, kvh, hd);
}

void tsr_kern_attention(cudaStream_t st, int tiles, bool decode, bf16_t *att, const float *qkv,
                        const bf16_t *kpool, const bf16_t *vpool, tsr_cuda_meta_t md, int l,
                        int n_blocks, int qh, int kvh, int hd)
{
    const int g = qh / kvh;
    const float scale = 1.0f / sqrtf((float)hd);
    const bool split = decode && g <= 16;
    const int chunks = split ? 1 : tsr_k_gqa_chunks(TSR_ATT_TILE, g);
    const dim3 grid(tiles, kvh * chunks);
#define ATT_MMA(HD, SPLIT)                                                                       \
    k_attention_mma<HD, SPLIT><<<grid, 128, 0, st>>>(att, qkv, kpool, vpool, md, l, n_blocks,    \
                                                     qh, kvh, scale, chunks)
    if (hd == 128 && split) ATT_MMA(128, true);
    else if (hd == 128) ATT_MMA(128, false);
    else if (hd == 64 && split) ATT_MMA(64, true);
    else if (hd == 64) ATT_MMA(64, false);
#undef ATT_MMA
    else
        k_attention<<<dim3(tiles, qh), ATT_WARPS * 32, 0, st>>>(att, qkv, kpool, vpool, md, l,
                                                                n_blocks, qh, kvh, hd, scale);
}

void tsr_kern_swiglu(cudaStream_t st, bf16_t *act, const float *gu, int I, size_t n)
{
    k_swiglu<<<grid_for(n, 256), 256, 0, st>>>(act, gu, I, n);
}

bool tsr_kern_gemv_fits(int T, int in)
{
    return T <= GEMV_MAX_T && in % 8 == 0;
}

void tsr_kern_gemv(cudaStream_t st, float *y, int ldy, const bf16_t *x, const bf16_t *w, int T,
                   int in, int out)
{
    const int blocks = (out + GEMV_ROWS - 1) / GEMV_ROWS, th = GEMV_WARPS * 32;
    switch (T) {
    case 1: k_gemv<1><<<blocks, th, 0, st>>>(y, ldy, x, w, in, out); break;
    case 2: k_gemv<2><<<blocks, th, 0, st>>>(y, ldy, x, w, in, out); break;
    case 3: k_gemv<3><<<blocks, th, 0, st>>>(y, ldy, x, w, in, out); break;
    default: k_gemv<4><<<blocks, th, 0, st>>>(y, ldy, x, w, in, out); break;
    }
}

void tsr_kern_pad(cudaStream_t st, float *lg, int C, int vs, int rows)
{
    k_pad<<<grid_for((size_t)rows * (C - vs), 256), 256, 0, st>>>(lg, C, vs, rows);
}

void tsr_kern_sample_prep(cudaStream_t st, int rows, const float *g, int C, int V,
                          tsr_cuda_meta_t md, int32_t *best, float *w, int32_t *ids, double *wsum,
                          int32_t *seg_begin, int32_t *seg_end)
{
    k_sample_prep<1024><<<rows, 1024, 0, st>>>(g, rows, C, V, md, best, w, ids, wsum, seg_begin,
                                               seg_end);
}

cudaError_t tsr_kern_sort_desc(cudaStream_t st, void *tmp, size_t *tmp_bytes, const float *w,
                               float *w_sorted, const int32_t *ids, int32_t *ids_sorted, int n,
                               int segments, int32_t *seg_begin, int32_t *seg_end)
{
    return cub::DeviceSegmentedRadixSort::SortPairsDescending(tmp, *tmp_bytes, w, w_sorted, ids,
                                                              ids_sorted, n, segments, seg_begin,
                                                              seg_end, 0, 32, st);
}

void tsr_kern_sample_pick(cudaStream_t st, int rows, const float *w, const int32_t *ids,
                          const float *w_sorted, const int32_t *ids_sorted, const double *wsum,
                          const int32_t *best, int V, tsr_cuda_meta_t md, int32_t *out)
{
    k_sample_pick<1024><<<rows, 1024, 0, st>>>(w, ids, w_sorted, ids_sorted, wsum, best, V, md,
                                               out);
}

#ifdef TSR_TESTING
void tsr_kern_fault(cudaStream_t st)
{
    k_fault<<<1, 1, 0, st>>>();
}
#endif
