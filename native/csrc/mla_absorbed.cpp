// One layer's absorbed MLA decode in one call, from the projections to the heads' values:
//   rows[t]      = [rmsnorm(kv_a[t, :L]) | rope(kv_a[t, L:])]      (stored into the cache)
//   q_full[t, h] = [q_nope[t, h] @ W_UK[h] | rope(q_pe[t, h])]
//   o[t, h]      = flash decoding of q_full[t, h] over the sequence's cached rows
//   out[t, h]    = o[t, h] @ W_UV[h]
// It chains the kernels of the separate ops (decode_parts.h), each writing straight into the
// strided place the next one reads: the same bits as the separate calls, in one Python call a
// layer instead of a dozen (the splits, copies, concatenations and transposes between them cost
// more than the norm and the rope themselves at batch 1).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "decode_parts.h"

namespace py = pybind11;

namespace duet {
namespace {

// The call's intermediates (new rows, absorbed queries, latent outputs), in a buffer of the
// calling thread that only grows: no allocation or zero fill per call. The kernels it chains
// keep their own scratch (attention_common.h's slots, gemm's accumulators).
bf16_t* scratch_bf16(int64_t count) {
  struct Buffer {
    bf16_t* data = nullptr;
    int64_t size = 0;
    ~Buffer() { std::free(data); }
  };
  thread_local Buffer buffer;
  if (buffer.size < count) {
    std::free(buffer.data);
    const int64_t bytes = (count * static_cast<int64_t>(sizeof(bf16_t)) + 4095) / 4096 * 4096;
    buffer.data = static_cast<bf16_t*>(std::aligned_alloc(64, bytes));
    if (buffer.data == nullptr) throw std::bad_alloc();
    buffer.size = bytes / static_cast<int64_t>(sizeof(bf16_t));
  }
  return buffer.data;
}

struct Sizes {
  int64_t heads, nope, rope, rank, v;  // H, Dn, R, L, Dv
};

void check_sizes(const Sizes& s, int64_t width, int64_t uk_k_pairs, int64_t uv_k_pairs,
                 int64_t q_tok, int64_t q_head, uintptr_t q) {
  const std::string op = "mla_decode_absorbed";
  if (s.heads < 1 || s.nope < 2 || s.rope < 2 || s.rank < 2 || s.v < 1) {
    throw std::invalid_argument(op + ": heads, nope, rope, rank and v dims must be positive");
  }
  if (s.nope % 2 || s.rope % 2 || s.rank % 2) {
    throw std::invalid_argument(op + ": nope, rope and rank dims must be even");
  }
  if (width != s.rank + s.rope) {
    throw std::invalid_argument(op + ": the cache's width must be rank + rope");
  }
  if (2 * uk_k_pairs != s.nope || 2 * uv_k_pairs != s.rank) {
    throw std::invalid_argument(op + ": W_UK must be packed over K = nope, W_UV over K = rank");
  }
  // The bmm tiles read q_nope as rows of bf16 pairs: 4-byte aligned starts.
  if (q % 4 || q_tok % 2 || q_head % 2 || q_head < s.nope + s.rope ||
      q_tok < s.heads * q_head) {
    throw std::invalid_argument(op + ": q must be [T, H, nope + rope] with even strides");
  }
}

void mla_decode_absorbed(uintptr_t out, uintptr_t q, int64_t q_tok, int64_t q_head,
                         uintptr_t kv_a, int64_t kv_a_stride, uintptr_t norm_w, double eps,
                         uintptr_t positions, uintptr_t cos_sin, int64_t max_pos, uintptr_t w_uk,
                         int64_t uk_k_pairs, uintptr_t w_uv, int64_t uv_k_pairs,
                         const std::vector<int64_t>& dims, uintptr_t kv_cache, int64_t num_pages,
                         int64_t page_size, uintptr_t page_table, int64_t page_table_stride,
                         int64_t max_pages, std::vector<int64_t> seq_lens, double sm_scale,
                         const std::vector<int>& dtypes) {
  check_dtypes("mla_decode_absorbed", dtypes,
               {{"out", DType::kBFloat16},
                {"q", DType::kBFloat16},
                {"kv_a", DType::kBFloat16},
                {"norm_w", DType::kBFloat16},
                {"positions", DType::kInt64},
                {"cos_sin", DType::kFloat32},
                {"w_uk", DType::kBFloat16},
                {"w_uv", DType::kBFloat16},
                {"kv_cache", DType::kBFloat16},
                {"page_table", DType::kInt32}});
  if (dims.size() != 5) throw std::invalid_argument("mla_decode_absorbed: dims is [H, Dn, R, L, Dv]");
  const Sizes s{dims[0], dims[1], dims[2], dims[3], dims[4]};
  const int64_t width = s.rank + s.rope;
  check_sizes(s, width, uk_k_pairs, uv_k_pairs, q_tok, q_head, q);
  const int64_t tokens = static_cast<int64_t>(seq_lens.size());
  bf16_t* rows = scratch_bf16(tokens * (width + s.heads * width + s.heads * s.rank));
  bf16_t* q_full = rows + tokens * width;
  bf16_t* latent = q_full + tokens * s.heads * width;

  MlaDecodeProblem pb;
  pb.batch = tokens;
  pb.num_heads = s.heads;
  pb.width = width;
  pb.rank = s.rank;
  pb.page_size = page_size;
  pb.num_pages = num_pages;
  pb.q = reinterpret_cast<const char*>(q_full);
  pb.q_batch_stride = s.heads * width;
  pb.q_head_stride = width;
  pb.cache = reinterpret_cast<char*>(kv_cache);
  pb.page_table = reinterpret_cast<const int32_t*>(page_table);
  pb.page_table_stride = page_table_stride;
  pb.seq_lens = std::move(seq_lens);
  pb.new_rows = reinterpret_cast<const char*>(rows);
  pb.out = reinterpret_cast<char*>(latent);
  pb.sm_scale = static_cast<float>(sm_scale);
  // Every check before the first write into the cache: a refused call leaves it as it was.
  check_mla_decode("mla_decode_absorbed", pb, max_pages, DType::kBFloat16);

  const auto* qp = reinterpret_cast<const bf16_t*>(q);
  const auto* kv = reinterpret_cast<const bf16_t*>(kv_a);
  rms_norm_rows_bf16(kv, kv_a_stride, reinterpret_cast<const bf16_t*>(norm_w), rows, width,
                     tokens, s.rank, static_cast<float>(eps));
  // Throws on a position outside the table before it writes anything.
  apply_rope_bf16(RopeArgs{qp + s.nope, q_tok, q_head, kv + s.rank, kv_a_stride,
                           reinterpret_cast<const int64_t*>(positions),
                           reinterpret_cast<const float*>(cos_sin), max_pos, q_full + s.rank,
                           s.heads * width, width, rows + s.rank, width, tokens, s.heads,
                           s.rope});
  bmm_packed_bf16(PackedBmmArgs{qp, s.heads, tokens, uk_k_pairs, q_head, q_tok,
                                reinterpret_cast<const bf16_t*>(w_uk), s.rank, q_full, width,
                                s.heads * width});
  mla_decode_run(pb, DType::kBFloat16);
  bmm_packed_bf16(PackedBmmArgs{latent, s.heads, tokens, uv_k_pairs, s.rank,
                                s.heads * s.rank, reinterpret_cast<const bf16_t*>(w_uv), s.v,
                                reinterpret_cast<bf16_t*>(out), s.v, s.heads * s.v});
}

}  // namespace

void register_mla_absorbed(py::module_& m) {
  m.def("mla_decode_absorbed", &mla_decode_absorbed, py::call_guard<py::gil_scoped_release>(),
        "One layer's absorbed MLA decode: norm and rope of the new latent rows, W_UK absorption, "
        "flash decoding over the paged cache (the new rows stored first), W_UV (see "
        "native/_mla_ops.py).");
}

}  // namespace duet
