// Extend (prefill) attention, FlashAttention-2 style, over a batch of variable-length sequences:
// each query attends its sequence's cached prefix (no mask) and the new keys up to itself
// (causal). Two phases in one parallel region:
//   1. pack: every block of bn keys of every (sequence, head) is packed once into a contiguous
//      tile (K and V in the layout the GEMMs read), so the strided rows of one head are read
//      once, not once per query block;
//   2. attend: tasks = (sequence, head, block of bm queries), longest sequences first. A task
//      walks its key tiles: S = Q K^T (fp32), online softmax (running max m, sum l, rescale
//      alpha), O = O * alpha + P V, and finally O / l.
//
// Paths, picked by the active ISA and dtype:
//   Bf16Path     bf16 in, vdpbf16ps for both GEMMs (K and V packed in VNNI pairs), bf16 P;
//   F32Path<T>   fp32 FMA GEMMs (K packed transposed), T = float, or bf16 converted on packing
//                (AVX-512 without BF16);
//   PortablePath scalar C++, the same tiles and masking.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention_common.h"
#include "common.h"
#include "cpu_features.h"
#include "extend_attention_paths.h"

namespace py = pybind11;

namespace duet {
namespace {

using namespace attn;    // NOLINT(build/namespaces)
using namespace extend;  // NOLINT(build/namespaces)

constexpr size_t kKeptTileBytes = size_t{256} << 20;

// A [tokens, heads, dim] tensor with a contiguous last dimension; strides in elements.
struct View3 {
  const char* data;
  int64_t token_stride;
  int64_t head_stride;
};

struct Problem {
  int64_t num_heads, dqk, dv;
  float sm_scale;
  View3 q, k, v, k_prefix, v_prefix, out;
  std::vector<int64_t> new_lens, prefix_lens, new_start, prefix_start;
};

// ---- driver ------------------------------------------------------------------------------------

template <typename T>
const T* row_ptr(const View3& t, int64_t token, int64_t head) {
  return reinterpret_cast<const T*>(t.data) + token * t.token_stride + head * t.head_stride;
}

// Where the packed tiles of each sequence live: tile (b, h, j) is number
// first_tile[b] + h * tiles_per_head[b] + j; j < prefix_tiles[b] are the prefix, then the new keys.
struct TileIndex {
  std::vector<int64_t> first_tile, tiles_per_head, prefix_tiles;
  int64_t num_tiles = 0;

  TileIndex(const Problem& pb, int64_t bn) {
    for (size_t b = 0; b < pb.new_lens.size(); ++b) {
      first_tile.push_back(num_tiles);
      prefix_tiles.push_back(pb.new_lens[b] > 0 ? ceil_div(pb.prefix_lens[b], bn) : 0);
      tiles_per_head.push_back(
          pb.new_lens[b] > 0 ? prefix_tiles.back() + ceil_div(pb.new_lens[b], bn) : 0);
      num_tiles += tiles_per_head.back() * pb.num_heads;
    }
  }
};

// One key tile to pack: its rows and how many.
template <typename T>
struct PackItem {
  const T* k;
  const T* v;
  int64_t k_stride, v_stride, n_len;
};

template <typename T>
std::vector<PackItem<T>> make_pack_items(const Problem& pb, const TileIndex& ti, int64_t bn) {
  std::vector<PackItem<T>> items(ti.num_tiles);
  for (size_t b = 0; b < pb.new_lens.size(); ++b) {
    for (int64_t h = 0; h < pb.num_heads; ++h) {
      PackItem<T>* it = &items[ti.first_tile[b] + h * ti.tiles_per_head[b]];
      for (int64_t j = 0; j < ti.prefix_tiles[b]; ++j) {
        const int64_t n0 = pb.prefix_start[b] + j * bn;
        *it++ = {row_ptr<T>(pb.k_prefix, n0, h), row_ptr<T>(pb.v_prefix, n0, h),
                 pb.k_prefix.token_stride, pb.v_prefix.token_stride,
                 std::min(bn, pb.prefix_lens[b] - j * bn)};
      }
      for (int64_t j = 0; j < ti.tiles_per_head[b] - ti.prefix_tiles[b]; ++j) {
        const int64_t n0 = pb.new_start[b] + j * bn;
        *it++ = {row_ptr<T>(pb.k, n0, h), row_ptr<T>(pb.v, n0, h), pb.k.token_stride,
                 pb.v.token_stride, std::min(bn, pb.new_lens[b] - j * bn)};
      }
    }
  }
  return items;
}

struct Task {
  int64_t seq, head, m0, m_len;
};

// Tasks of one (sequence, head) are consecutive, so the query blocks working on it share its
// tiles through the caches; sequences go longest first and, inside one, the query blocks with
// the most keys first, so the short tasks come last under dynamic scheduling.
std::vector<Task> make_tasks(const Problem& pb, int64_t bm) {
  std::vector<int64_t> order(pb.new_lens.size());
  for (size_t b = 0; b < order.size(); ++b) order[b] = static_cast<int64_t>(b);
  auto seq_cost = [&](int64_t b) { return pb.new_lens[b] * (pb.prefix_lens[b] + pb.new_lens[b]); };
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return seq_cost(x) > seq_cost(y); });
  std::vector<Task> tasks;
  for (const int64_t b : order) {
    const int64_t num_blocks = ceil_div(pb.new_lens[b], bm);
    for (int64_t h = 0; h < pb.num_heads; ++h) {
      for (int64_t i = num_blocks - 1; i >= 0; --i) {
        tasks.push_back({b, h, i * bm, std::min(bm, pb.new_lens[b] - i * bm)});
      }
    }
  }
  return tasks;
}

// bm: up to 120 queries (a multiple of the row tile), smaller when that leaves threads idle;
// bn: up to 256 keys, a multiple of the K panel width. The per-thread working set (~320 KB at
// 192/128) stays in L2.
Dims choose_dims(const Problem& pb, int rows) {
  int64_t max_new = 0, max_keys = 0, total_new = 0;
  for (size_t b = 0; b < pb.new_lens.size(); ++b) {
    max_new = std::max(max_new, pb.new_lens[b]);
    max_keys = std::max(max_keys, pb.new_lens[b] + pb.prefix_lens[b]);
    total_new += pb.new_lens[b];
  }
  Dims d{pb.dqk, pb.dv, 0, 0};
  d.bm = std::min<int64_t>(round_up(120, rows), round_up(std::max<int64_t>(max_new, 1), rows));
  const int64_t want_tasks = 4 * num_threads();
  while (d.bm > 4 * rows && ceil_div(total_new, d.bm) * pb.num_heads < want_tasks) {
    d.bm = round_up(d.bm / 2, rows);
  }
  d.bn = std::min<int64_t>(256, round_up(std::max<int64_t>(max_keys, 1), kPanel));
  return d;
}

template <typename Path, typename T>
void run_task(const Problem& pb, const Dims& d, const TileIndex& ti, const char* tiles,
              int64_t tile_bytes, int64_t v_offset, const Task& t, typename Path::Work& w) {
  using Packed = typename Path::Packed;
  const int64_t new_start = pb.new_start[t.seq];
  Path::load_q(w, d, row_ptr<T>(pb.q, new_start + t.m0, t.head), pb.q.token_stride, t.m_len);
  Path::begin(w, d, t.m_len);
  const char* tile =
      tiles + (ti.first_tile[t.seq] + t.head * ti.tiles_per_head[t.seq]) * tile_bytes;
  auto attend = [&](int64_t n_len, int64_t offset) {
    Path::block(w, d, t.m_len, reinterpret_cast<const Packed*>(tile),
                reinterpret_cast<const Packed*>(tile + v_offset), n_len, offset, pb.sm_scale);
    tile += tile_bytes;
  };
  const int64_t prefix_len = pb.prefix_lens[t.seq];
  for (int64_t n0 = 0; n0 < prefix_len; n0 += d.bn) {
    const int64_t n_len = std::min(d.bn, prefix_len - n0);
    attend(n_len, n_len);
  }
  // New keys: key n0 + j is visible to query m0 + r iff n0 + j <= m0 + r.
  const int64_t key_end = t.m0 + t.m_len;
  for (int64_t n0 = 0; n0 < key_end; n0 += d.bn) attend(std::min(d.bn, key_end - n0), t.m0 - n0);
  T* out = const_cast<T*>(row_ptr<T>(pb.out, new_start + t.m0, t.head));
  Path::store(w, d, out, pb.out.token_stride, t.m_len);
}

template <typename Path, typename T>
void run(const Problem& pb) {
  using Packed = typename Path::Packed;
  const Dims d = choose_dims(pb, Path::kRows);
  const TileIndex ti(pb, d.bn);
  const std::vector<PackItem<T>> items = make_pack_items<T>(pb, ti, d.bn);
  const std::vector<Task> tasks = make_tasks(pb, d.bm);
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  if (num_tasks == 0) return;
  const int64_t v_offset = arena_bytes<Packed>(Path::k_tile_elems(d));
  const int64_t tile_bytes = v_offset + arena_bytes<Packed>(Path::v_tile_elems(d));
  // The tiles are about as large as k, v, k_prefix and v_prefix. Up to kKeptTileBytes they live
  // in the calling thread's scratch (no page faults on the next call); beyond, per call.
  const size_t tiles_bytes = static_cast<size_t>(ti.num_tiles * tile_bytes);
  std::unique_ptr<char, decltype(&std::free)> owned(nullptr, &std::free);
  char* tiles = nullptr;
  if (tiles_bytes <= kKeptTileBytes) {
    tiles = thread_scratch(1, tiles_bytes);
  } else {
    owned.reset(static_cast<char*>(std::aligned_alloc(64, round_up(tiles_bytes, 64))));
    if (!owned) throw std::bad_alloc();
    tiles = owned.get();
  }
  Arena layout(nullptr);
  Path::carve(layout, d);
  const int64_t work_bytes = layout.used();
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(num_threads(), num_tasks)))
  {
#pragma omp for schedule(dynamic, 4)
    for (int64_t i = 0; i < ti.num_tiles; ++i) {
      char* tile = tiles + i * tile_bytes;
      const PackItem<T>& it = items[i];
      Path::pack_k(reinterpret_cast<Packed*>(tile), d, it.k, it.k_stride, it.n_len);
      Path::pack_v(reinterpret_cast<Packed*>(tile + v_offset), d, it.v, it.v_stride, it.n_len);
    }
    Arena arena(thread_scratch(0, work_bytes));
    typename Path::Work w = Path::carve(arena, d);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_tasks; ++i) {
      run_task<Path, T>(pb, d, ti, tiles, tile_bytes, v_offset, tasks[i], w);
    }
  }
}

void dispatch(const Problem& pb, DType dtype) {
  const Isa isa = active_isa();
  const bool avx512 = isa >= Isa::kAvx512;
  if (dtype == DType::kFloat32) {
    avx512 ? run<F32Path<float>, float>(pb) : run<PortablePath<float>, float>(pb);
  } else if (isa >= Isa::kAvx512Bf16) {
    run<Bf16Path, bf16_t>(pb);
  } else {
    avx512 ? run<F32Path<bf16_t>, bf16_t>(pb) : run<PortablePath<bf16_t>, bf16_t>(pb);
  }
}

std::vector<int64_t> exclusive_sum(const std::vector<int64_t>& lens, int64_t limit,
                                   const char* what) {
  std::vector<int64_t> start(lens.size());
  int64_t total = 0;
  for (size_t i = 0; i < lens.size(); ++i) {
    if (lens[i] < 0) throw std::invalid_argument(std::string(what) + " must be >= 0");
    start[i] = total;
    total += lens[i];
  }
  if (total > limit) {
    throw std::invalid_argument(std::string(what) + " sum to " + std::to_string(total) +
                                " but the tensor has " + std::to_string(limit) + " rows");
  }
  return start;
}

// Binding: raw pointers and element strides from native/_attention_ops.py, which checks
// devices, dtypes and shapes. strides = (token, head) for q, k, v, k_prefix, v_prefix, out.
void extend_attention_binding(uintptr_t out, uintptr_t q, uintptr_t k, uintptr_t v,
                              uintptr_t k_prefix, uintptr_t v_prefix,
                              const std::vector<int64_t>& strides, std::vector<int64_t> new_lens,
                              std::vector<int64_t> prefix_lens, int64_t num_tokens,
                              int64_t num_prefix_tokens, int64_t num_heads, int64_t head_dim_qk,
                              int64_t head_dim_v, int dtype, double sm_scale) {
  if (strides.size() != 12) throw std::invalid_argument("extend_attention: expected 12 strides");
  if (new_lens.size() != prefix_lens.size()) {
    throw std::invalid_argument("extend_attention: new_lens and prefix_lens differ in length");
  }
  if (num_heads < 1 || head_dim_qk < 1 || head_dim_v < 1 || head_dim_qk > 1024 ||
      head_dim_v > 1024) {
    throw std::invalid_argument("extend_attention: head dims must be in [1, 1024], heads >= 1");
  }
  const DType dt = static_cast<DType>(dtype);
  if (dt != DType::kFloat32 && dt != DType::kBFloat16) {
    throw std::invalid_argument("extend_attention: dtype must be float32 or bfloat16");
  }
  Problem pb;
  pb.num_heads = num_heads;
  pb.dqk = head_dim_qk;
  pb.dv = head_dim_v;
  pb.sm_scale = static_cast<float>(sm_scale);
  auto view = [&](uintptr_t p, int i) {
    return View3{reinterpret_cast<const char*>(p), strides[2 * i], strides[2 * i + 1]};
  };
  pb.q = view(q, 0);
  pb.k = view(k, 1);
  pb.v = view(v, 2);
  pb.k_prefix = view(k_prefix, 3);
  pb.v_prefix = view(v_prefix, 4);
  pb.out = view(out, 5);
  pb.new_start = exclusive_sum(new_lens, num_tokens, "new_lens");
  pb.prefix_start = exclusive_sum(prefix_lens, num_prefix_tokens, "prefix_lens");
  pb.new_lens = std::move(new_lens);
  pb.prefix_lens = std::move(prefix_lens);
  dispatch(pb, dt);
}

}  // namespace

void register_extend_attention(py::module_& m) {
  m.def("extend_attention", &extend_attention_binding, py::call_guard<py::gil_scoped_release>(),
        "FA2 extend attention (see native/_attention_ops.py for the contract).");
}

}  // namespace duet
