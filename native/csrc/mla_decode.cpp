// MLA decode (flash decoding) over the paged latent cache, absorbed form: per sequence b and
// head h, out[b][h] = softmax(scale * q[b][h] . rows^T) rows[:, :L] over the sequence's cached
// rows (W = L + R wide: c_kv | k_pe). Keys are whole rows, values their first L columns.
//
// Work is split into tasks = (sequence, KV split); a task walks its rows in chunks of kChunk
// tokens with all heads folded into the GEMM M dimension, so each row is loaded from memory
// once and used by every head for both products. Splits of one sequence are merged at the end
// by their log-sum-exp. The new token's row (new_rows) is stored into the cache first, in the
// same call. The rows of the next chunk (or of the next task) are prefetched during the GEMMs.
//
// Paths, picked by the active ISA and dtype:
//   AmxPath      AMX-BF16 tiles for both products (mla_decode_amx.h), W and L multiples of 32;
//   Bf16Path     vdpbf16ps; per chunk each row pair is loaded once and packed into VNNI pairs
//                (values); QK^T reads the keys in place when 16 divides the page size, else
//                from a contiguous copy made in the same pass;
//   F32Path<T>   fp32 FMA; rows copied (bf16 converted) once, used as keys and values;
//   PortablePath scalar C++.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_common.h"
#include "common.h"
#include "cpu_features.h"
#include "decode_parts.h"
#include "mla_decode_amx.h"
#include "mla_decode_paths.h"

namespace py = pybind11;

namespace duet {
namespace {

using namespace attn;  // NOLINT(build/namespaces)
using namespace mla;   // NOLINT(build/namespaces)

using Problem = MlaDecodeProblem;

// ---- driver ------------------------------------------------------------------------------------

struct Task {
  int64_t seq, split, begin, end;
};

// Splits: with fewer busy sequences than twice the threads, each sequence is cut into pieces
// of about total / (2 * threads) tokens so every thread gets about two tasks; otherwise one
// task per sequence (no merge). Splits start on multiples of 16 (see kChunk).
std::vector<Task> make_tasks(const Problem& pb, std::vector<int64_t>* num_splits) {
  int64_t total = 0, busy = 0;
  for (const int64_t len : pb.seq_lens) {
    total += len;
    busy += len > 0;
  }
  const int64_t threads = num_threads();
  const int64_t piece = busy < 2 * threads ? std::max<int64_t>(64, ceil_div(total, 2 * threads))
                                           : std::numeric_limits<int64_t>::max() / 2;
  std::vector<Task> tasks;
  num_splits->assign(pb.batch, 0);
  for (int64_t b = 0; b < pb.batch; ++b) {
    const int64_t len = pb.seq_lens[b];
    const int64_t n = ceil_div(len, piece);
    (*num_splits)[b] = n;
    for (int64_t s = 0; s < n; ++s) {
      const int64_t begin = len * s / n / 16 * 16;
      const int64_t end = s + 1 == n ? len : len * (s + 1) / n / 16 * 16;
      tasks.push_back({b, s, begin, end});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& x, const Task& y) { return x.end - x.begin > y.end - y.begin; });
  return tasks;
}

template <typename T>
T* cache_row(const Problem& pb, int64_t b, int64_t pos) {
  const int64_t page = pb.page_table[b * pb.page_table_stride + pos / pb.page_size];
  return reinterpret_cast<T*>(pb.cache) + (page * pb.page_size + pos % pb.page_size) * pb.width;
}

// Pointers to the rows at positions n0 .. n0 + n_len - 1 of sequence b (one division per call).
template <typename T>
void chunk_rows(const Problem& pb, int64_t b, int64_t n0, int64_t n_len, const T** rows) {
  const int32_t* table = pb.page_table + b * pb.page_table_stride;
  const T* cache = reinterpret_cast<const T*>(pb.cache);
  int64_t page = n0 / pb.page_size, offset = n0 % pb.page_size;
  for (int64_t j = 0; j < n_len; ++j) {
    rows[j] = cache + (table[page] * pb.page_size + offset) * pb.width;
    if (++offset == pb.page_size) {
      offset = 0;
      ++page;
    }
  }
}

// The cache lines of n_len rows of row_bytes each, as a prefetch list.
template <typename T>
LinePrefetch row_lines(const T* const* rows, int64_t n_len, int64_t row_bytes, const char** lines) {
  const char** line = lines;
  for (int64_t j = 0; j < n_len; ++j) {
    const char* row = reinterpret_cast<const char*>(rows[j]);
    for (int64_t i = 0; i < row_bytes; i += 64) *line++ = row + i;
  }
  return LinePrefetch{lines, line};
}

// One task. The next chunk's rows are prefetched while the current one computes, one cache line
// every few k steps of its GEMM tiles (pages are scattered, so the hardware prefetchers lose the
// stream at every page boundary); during the last chunk, the first chunk of `following` (the
// task this thread runs next). A first chunk nobody prefetched is requested in one burst.
// rows holds 2 * kChunk pointers: the current chunk's and the next one's.
template <typename Path, typename T, typename Work>
void run_task(const Problem& pb, const Dims& d, const Task& t, const Task* following,
              bool first_prefetched, int64_t num_splits, Work& w, const T** rows,
              const char** lines, float* partial, float* lse) {
  const int64_t row_bytes = pb.width * static_cast<int64_t>(sizeof(T));
  const T* q = reinterpret_cast<const T*>(pb.q) + t.seq * pb.q_batch_stride;
  Path::begin(w, d, q, pb.q_head_stride);
  const T** cur = rows;
  const T** next_rows = rows + kChunk;
  int64_t n_len = std::min(kChunk, t.end - t.begin);
  chunk_rows(pb, t.seq, t.begin, n_len, cur);
  if (!first_prefetched) {
    LinePrefetch first = row_lines(cur, n_len, row_bytes, lines);
    while (first.next != first.end) prefetch_one(&first);
  }
  for (int64_t n0 = t.begin; n0 < t.end; n0 += kChunk) {
    int64_t next_len = 0;
    LinePrefetch next;
    if (n0 + kChunk < t.end) {
      next_len = std::min(kChunk, t.end - n0 - kChunk);
      chunk_rows(pb, t.seq, n0 + kChunk, next_len, next_rows);
      next = row_lines(next_rows, next_len, row_bytes, lines);
    } else if (following != nullptr) {
      const int64_t len = std::min(kChunk, following->end - following->begin);
      chunk_rows(pb, following->seq, following->begin, len, next_rows);
      next = row_lines(next_rows, len, row_bytes, lines);
    }
    Path::chunk(w, d, cur, n_len, pb.sm_scale, &next);
    while (next.next != next.end) prefetch_one(&next);
    std::swap(cur, next_rows);
    n_len = next_len;
  }
  if (num_splits == 1) {
    Path::finish(w, d, reinterpret_cast<T*>(pb.out) + t.seq * d.heads * d.rank,
                 static_cast<float*>(nullptr));
  } else {
    Path::finish(w, d, partial, lse);
  }
}

template <typename Path, typename T>
void run(const Problem& pb) {
  if (pb.batch == 0) return;
  // Rows read in place need whole VNNI pairs (even width) and 16-row groups inside one page.
  constexpr bool kPairs = std::is_same_v<Path, Bf16Path> || std::is_same_v<Path, AmxPath>;
  const bool in_place = kPairs && pb.width % 2 == 0 && pb.page_size % 16 == 0;
  const bool lane_pairs = kPairs && pb.rank % 32 == 0;
  const Dims d{pb.width, pb.rank, pb.num_heads, round_up(pb.num_heads, 16), in_place, lane_pairs};
  std::vector<int64_t> num_splits;
  const std::vector<Task> tasks = make_tasks(pb, &num_splits);
  // Partial outputs and log-sum-exps of split sequences, indexed by (sequence, split).
  std::vector<int64_t> first_split(pb.batch + 1, 0);
  for (int64_t b = 0; b < pb.batch; ++b) {
    first_split[b + 1] = first_split[b] + (num_splits[b] > 1 ? num_splits[b] : 0);
  }
  const int64_t num_partials = first_split[pb.batch];
  char* merge_buf = thread_scratch(
      1, static_cast<size_t>(arena_bytes<float>(num_partials * d.heads * (d.rank + 1)) + 64));
  float* partials = reinterpret_cast<float*>(merge_buf);
  float* lses = partials + num_partials * d.heads * d.rank;
  Arena layout(nullptr);
  Path::carve(layout, d);
  layout.take<const T*>(2 * kChunk);
  layout.take<const char*>(kChunk * ceil_div(pb.width * static_cast<int64_t>(sizeof(T)), 64));
  const int64_t max_splits =
      std::max<int64_t>(1, *std::max_element(num_splits.begin(), num_splits.end()));
  layout.take<float>(max_splits);
  const int64_t work_bytes = layout.used();
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int threads =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads(), num_tasks)));
  std::atomic<int64_t> next_task{0};
#pragma omp parallel num_threads(threads)
  {
    if (pb.new_rows != nullptr) {
      // The new token's row goes in before any task reads the cache.
#pragma omp for schedule(static)
      for (int64_t b = 0; b < pb.batch; ++b) {
        if (pb.seq_lens[b] == 0) continue;
        std::memcpy(cache_row<T>(pb, b, pb.seq_lens[b] - 1),
                    reinterpret_cast<const T*>(pb.new_rows) + b * pb.width, pb.width * sizeof(T));
      }
    }
    Arena arena(thread_scratch(0, work_bytes));
    auto w = Path::carve(arena, d);
    const T** rows = arena.take<const T*>(2 * kChunk);
    const char** lines =
        arena.take<const char*>(kChunk * ceil_div(pb.width * static_cast<int64_t>(sizeof(T)), 64));
    // Dynamic scheduling by hand: a thread claims its next task before running the current
    // one, so that it can prefetch the next task's first rows.
    int64_t i = next_task.fetch_add(1);
    bool prefetched = false;
    while (i < num_tasks) {
      const int64_t following = next_task.fetch_add(1);
      const Task& t = tasks[i];
      const int64_t slot = first_split[t.seq] + t.split;
      run_task<Path, T>(pb, d, t, following < num_tasks ? &tasks[following] : nullptr, prefetched,
                        num_splits[t.seq], w, rows, lines, partials + slot * d.heads * d.rank,
                        lses + slot * d.heads);
      i = following;
      prefetched = true;
    }
#pragma omp barrier
    // Outputs of split sequences (merged) and of empty ones (zeros), one (sequence, head) each.
    float* weights = arena.take<float>(max_splits);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < pb.batch * d.heads; ++item) {
      const int64_t b = item / d.heads, h = item % d.heads;
      T* out = reinterpret_cast<T*>(pb.out) + item * d.rank;
      if (num_splits[b] == 0) {
        std::fill(out, out + d.rank, T(0));
      } else if (num_splits[b] > 1) {
        const int64_t slot = first_split[b];
        const float* partial = partials + (slot * d.heads + h) * d.rank;
        const float* lse = lses + slot * d.heads + h;
        if constexpr (Path::kAvx512) {
          merge_head_avx512(d, num_splits[b], partial, lse, weights, out);
        } else {
          merge_head_scalar(d, num_splits[b], partial, lse, weights, out);
        }
      }
    }
  }
}

void mla_decode_binding(uintptr_t out, uintptr_t q, int64_t q_batch_stride, int64_t q_head_stride,
                        uintptr_t kv_cache, int64_t num_pages, int64_t page_size, int64_t width,
                        uintptr_t page_table, int64_t page_table_stride, int64_t max_pages,
                        std::vector<int64_t> seq_lens, uintptr_t new_rows, int64_t num_heads,
                        int64_t kv_lora_rank, int dtype, double sm_scale) {
  Problem pb;
  pb.batch = static_cast<int64_t>(seq_lens.size());
  pb.num_heads = num_heads;
  pb.width = width;
  pb.rank = kv_lora_rank;
  pb.page_size = page_size;
  pb.num_pages = num_pages;
  pb.q = reinterpret_cast<const char*>(q);
  pb.q_batch_stride = q_batch_stride;
  pb.q_head_stride = q_head_stride;
  pb.cache = reinterpret_cast<char*>(kv_cache);
  pb.page_table = reinterpret_cast<const int32_t*>(page_table);
  pb.page_table_stride = page_table_stride;
  pb.seq_lens = std::move(seq_lens);
  pb.new_rows = reinterpret_cast<const char*>(new_rows);
  pb.out = reinterpret_cast<char*>(out);
  pb.sm_scale = static_cast<float>(sm_scale);
  const DType dt = static_cast<DType>(dtype);
  check_mla_decode("mla_decode", pb, max_pages, dt);
  mla_decode_run(pb, dt);
}

}  // namespace

void mla_decode_run(const MlaDecodeProblem& pb, DType dtype) {
  const Isa isa = active_isa();
  const bool avx512 = isa >= Isa::kAvx512;
  if (dtype == DType::kFloat32) {
    avx512 ? run<F32Path<float>, float>(pb) : run<PortablePath<float>, float>(pb);
  } else if (isa >= Isa::kAmx && pb.width % 32 == 0 && pb.rank % 32 == 0) {
    run<AmxPath, bf16_t>(pb);
  } else if (isa >= Isa::kAvx512Bf16) {
    run<Bf16Path, bf16_t>(pb);
  } else {
    avx512 ? run<F32Path<bf16_t>, bf16_t>(pb) : run<PortablePath<bf16_t>, bf16_t>(pb);
  }
}

// Raw pointers come from native/_attention_ops.py and native/_mla_ops.py, which check devices,
// dtypes and shapes; checked here is what would otherwise read or write out of bounds.
void check_mla_decode(const char* op, const MlaDecodeProblem& pb, int64_t max_pages, DType dtype) {
  const std::string name(op);
  if (dtype != DType::kFloat32 && dtype != DType::kBFloat16) {
    throw std::invalid_argument(name + ": dtype must be float32 or bfloat16");
  }
  if (pb.num_heads < 1 || pb.page_size < 1 || pb.width < 1 || pb.rank < 1 ||
      pb.rank > pb.width) {
    throw std::invalid_argument(name +
                                ": need heads, page_size >= 1 and 1 <= kv_lora_rank <= W");
  }
  for (size_t b = 0; b < pb.seq_lens.size(); ++b) {
    const int64_t len = pb.seq_lens[b];
    if (len < 0 || len > max_pages * pb.page_size) {
      throw std::invalid_argument(name + ": seq_lens[" + std::to_string(b) + "] = " +
                                  std::to_string(len) + " is outside [0, max_pages * page_size]");
    }
    for (int64_t i = 0; i < ceil_div(len, pb.page_size); ++i) {
      const int64_t page = pb.page_table[b * pb.page_table_stride + i];
      if (page < 0 || page >= pb.num_pages) {
        throw std::invalid_argument(name + ": page_table[" + std::to_string(b) + ", " +
                                    std::to_string(i) + "] = " + std::to_string(page) +
                                    " is not a page of the cache");
      }
    }
  }
}

void register_mla_decode(py::module_& m) {
  m.def("mla_decode", &mla_decode_binding, py::call_guard<py::gil_scoped_release>(),
        "Absorbed MLA decode over the paged latent cache (see native/_attention_ops.py).");
}

}  // namespace duet
