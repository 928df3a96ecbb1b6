// Entry points of the kernels that absorbed MLA decode chains in one call (mla_absorbed.cpp):
// the latent row's RMSNorm, the rotary embedding, the per-head matmul with a prepacked right
// operand, and flash decoding over the paged cache. Each is also bound on its own (norm.cpp,
// rope.cpp, bmm.cpp, mla_decode.cpp); the chained call writes every intermediate straight into
// the strided place the next step reads, so the results are the same bits as the separate calls.
#pragma once

#include <cstdint>
#include <vector>

#include "common.h"

namespace duet {

// out[t * out_stride + i] = w[i] * x[t * x_stride + i] / sqrt(mean_i(x[t]^2) + eps), bf16.
void rms_norm_rows_bf16(const bf16_t* x, int64_t x_stride, const bf16_t* w, bf16_t* out,
                        int64_t out_stride, int64_t rows, int64_t d, float eps);

// Interleaved rotary embedding of q [T, H, R] (strides q_tok, q_head, 1) and k [T, R] (k_tok)
// at positions [T] into q_out (strides qo_tok, qo_head, 1) and k_out (ko_tok), bf16.
struct RopeArgs {
  const bf16_t* q;
  int64_t q_tok, q_head;
  const bf16_t* k;
  int64_t k_tok;
  const int64_t* positions;
  const float* cos_sin;  // [max_pos, R]
  int64_t max_pos;
  bf16_t* q_out;
  int64_t qo_tok, qo_head;
  bf16_t* k_out;
  int64_t ko_tok;
  int64_t tokens, heads, r;
};
void apply_rope_bf16(const RopeArgs& a);

// out[n][m] = a[n][m] @ b[n] per batch entry n, b prepacked once (the model's absorbed W_UK /
// W_UV): per n, ceil(P/32) blocks of the VNNI-2 layout of gemm_kernels.h over all of K, as
// PackedLinear packs a [N, P, K] weight.
struct PackedBmmArgs {
  const bf16_t* a;  // [N, M, 2 * k_pairs] with strides (sa0, sa1, 1)
  int64_t batch, m, k_pairs, sa0, sa1;
  const bf16_t* b;  // [N][ceil(P/32)][k_pairs][32][2]
  int64_t p;
  bf16_t* out;  // [N, M, P] with strides (so0, so1, 1)
  int64_t so0, so1;
};
void bmm_packed_bf16(const PackedBmmArgs& p);

// Absorbed MLA decode over one layer's paged latent cache; see mla_decode.cpp.
struct MlaDecodeProblem {
  int64_t batch, num_heads, width, rank, page_size, num_pages;
  const char* q;
  int64_t q_batch_stride, q_head_stride;  // elements; the last dimension is contiguous
  char* cache;                            // [num_pages * page_size][width]
  const int32_t* page_table;
  int64_t page_table_stride;
  std::vector<int64_t> seq_lens;
  const char* new_rows;  // [batch][width] or null
  char* out;             // [batch][num_heads][rank], q's dtype
  float sm_scale;
};
// Throws std::invalid_argument (naming `op`) for what would read or write out of bounds: a
// length past the table, a page id outside the cache, a dtype or size the kernel lacks.
void check_mla_decode(const char* op, const MlaDecodeProblem& pb, int64_t max_pages, DType dtype);
void mla_decode_run(const MlaDecodeProblem& pb, DType dtype);

}  // namespace duet
