// Shared-memory collectives (all-reduce, all-gather, all-to-all) for the tensor-parallel ranks
// of one node on one host (issue 14).
//
// One segment per node (a file under /dev/shm that rank 0 creates and unlinks once every rank
// has mapped it): a header with an arrival counter, then two buffers of `world` slots of
// `capacity` floats, used by turns. A call copies the rank's fp32 partial into its slot of the
// turn's buffer, meets the others at the barrier, then sums every slot in rank order, so every
// rank gets the same bits. Two buffers make one barrier a call enough: a rank writes buffer b
// again two calls later, after the next barrier, which no rank passes before every rank has
// finished reading b. Longer tensors go through in pieces of `capacity`.
//
// The barrier spins a little (a peer usually arrives within microseconds), then sleeps on a
// futex on the counter: a slow peer costs no core the kernels need. A peer that does not come
// within timeout_s is an error (the caller's node fails; its requests move). `abort` (rank 0's
// watchdog, when it sees a rank die) ends every rank's wait at once, with an error: the sleep
// is cut in slices of kSliceNs, so an abort that lands between a waiter's check and its sleep
// is seen within one slice.
#include <fcntl.h>
#include <linux/futex.h>
#include <pybind11/pybind11.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <stdexcept>
#include <string>

#include "common.h"

namespace py = pybind11;

namespace duet {
namespace {

constexpr int64_t kHeaderBytes = 64;  // the counter, alone on its cache line
constexpr int kSpins = 4000;          // ~ a few microseconds of pause before sleeping
constexpr int64_t kSliceNs = 50000000;  // the longest sleep between two looks at `aborted`

struct Header {
  std::atomic<uint32_t> arrived;  // rank arrivals, all calls together (wraps; compared mod 2^32)
  std::atomic<uint32_t> aborted;  // set once by `abort`: a rank left waiting, now or later, fails
};

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

class ShmAllReduce {
 public:
  ShmAllReduce(const std::string& path, int rank, int world, int64_t capacity, bool create,
               double timeout_s)
      : rank_(rank),
        world_(world),
        capacity_(capacity),
        slot_bytes_(capacity * static_cast<int64_t>(sizeof(float))),
        timeout_s_(timeout_s) {
    if (world < 1 || rank < 0 || rank >= world || capacity < 1) {
      throw std::invalid_argument("shm all-reduce: bad rank, world or capacity");
    }
    bytes_ = kHeaderBytes + 2 * world * capacity * static_cast<int64_t>(sizeof(float));
    int fd = open(path.c_str(), create ? (O_RDWR | O_CREAT | O_EXCL) : O_RDWR, 0600);
    if (fd < 0) {
      throw std::runtime_error("shm all-reduce: cannot open " + path + ": " + strerror(errno));
    }
    if (create && ftruncate(fd, bytes_) != 0) {
      close(fd);
      throw std::runtime_error("shm all-reduce: cannot size " + path + ": " + strerror(errno));
    }
    void* base = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED) {
      throw std::runtime_error(std::string("shm all-reduce: mmap failed: ") + strerror(errno));
    }
    base_ = static_cast<char*>(base);
    header_ = reinterpret_cast<Header*>(base_);
    slots_ = reinterpret_cast<float*>(base_ + kHeaderBytes);
  }

  ~ShmAllReduce() {
    if (base_ != nullptr) munmap(base_, bytes_);
  }

  // data: `n` contiguous floats, summed over the ranks in place.
  void all_reduce(uintptr_t data, int64_t n) {
    float* x = reinterpret_cast<float*>(data);
    for (int64_t start = 0; start < n; start += capacity_) {
      const int64_t len = std::min(capacity_, n - start);
      float* buffer = turn_buffer();
      std::memcpy(buffer + rank_ * capacity_, x + start, len * sizeof(float));
      barrier();
      float* out = x + start;
      const auto sum_slots = [&](int64_t begin, int64_t end) {  // rank order: the same bits
        for (int64_t i = begin; i < end; ++i) out[i] = buffer[i];
        for (int r = 1; r < world_; ++r) {
          const float* slot = buffer + r * capacity_;
          for (int64_t i = begin; i < end; ++i) out[i] += slot[i];
        }
      };
      parallel_for(len, sum_slots, 1 << 14);
      ++calls_;
    }
  }

  // src: this rank's `nbytes`; dst: every rank's, in rank order (world * nbytes). Pieces of a
  // slot's size, through the same buffers by turns as all_reduce.
  void all_gather(uintptr_t src, int64_t nbytes, uintptr_t dst) {
    const char* in = reinterpret_cast<const char*>(src);
    char* out = reinterpret_cast<char*>(dst);
    for (int64_t start = 0; start < nbytes; start += slot_bytes_) {
      const int64_t len = std::min(slot_bytes_, nbytes - start);
      char* buffer = reinterpret_cast<char*>(turn_buffer());
      std::memcpy(buffer + rank_ * slot_bytes_, in + start, len);
      barrier();
      for (int r = 0; r < world_; ++r) {
        std::memcpy(out + r * nbytes + start, buffer + r * slot_bytes_, len);
      }
      ++calls_;
    }
  }

  // src: `world` pieces of `piece_bytes`, piece r for rank r; dst: the piece each rank has for
  // this one, in rank order. Each turn moves a slot's share of every piece.
  void all_to_all(uintptr_t src, int64_t piece_bytes, uintptr_t dst) {
    const char* in = reinterpret_cast<const char*>(src);
    char* out = reinterpret_cast<char*>(dst);
    const int64_t step = slot_bytes_ / world_;
    for (int64_t start = 0; start < piece_bytes; start += step) {
      const int64_t len = std::min(step, piece_bytes - start);
      char* buffer = reinterpret_cast<char*>(turn_buffer());
      char* mine = buffer + rank_ * slot_bytes_;
      for (int r = 0; r < world_; ++r) {
        std::memcpy(mine + r * step, in + r * piece_bytes + start, len);
      }
      barrier();
      for (int r = 0; r < world_; ++r) {
        std::memcpy(out + r * piece_bytes + start, buffer + r * slot_bytes_ + rank_ * step, len);
      }
      ++calls_;
    }
  }

  // Returns once every rank has made as many meetings (barriers, all_reduce pieces) as this one.
  void barrier() {
    if (header_->aborted.load(std::memory_order_acquire) != 0) throw_aborted();
    const uint32_t target = static_cast<uint32_t>((meetings_ + 1) * world_);
    const uint32_t seen = header_->arrived.fetch_add(1, std::memory_order_acq_rel) + 1;
    if (seen == target) {
      futex(&header_->arrived, FUTEX_WAKE, INT32_MAX, nullptr);
    } else {
      wait_for(target);
    }
    ++meetings_;
  }

  // Fails every rank's current and later waits (a peer died: none of them would ever end).
  void abort() {
    header_->aborted.store(1, std::memory_order_release);
    futex(&header_->arrived, FUTEX_WAKE, INT32_MAX, nullptr);
  }

 private:
  // This call's buffer (the two alternate by call: see the file's comment).
  float* turn_buffer() const { return slots_ + (calls_ & 1) * world_ * capacity_; }

  static bool passed(uint32_t now, uint32_t target) {
    return static_cast<int32_t>(now - target) >= 0;  // the counter wraps: compare mod 2^32
  }

  void wait_for(uint32_t target) {
    for (int spin = 0; spin < kSpins; ++spin) {
      if (passed(header_->arrived.load(std::memory_order_acquire), target)) return;
      cpu_relax();
    }
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
    for (;;) {
      const uint32_t now = header_->arrived.load(std::memory_order_acquire);
      if (passed(now, target)) return;
      if (header_->aborted.load(std::memory_order_acquire) != 0) throw_aborted();
      const auto left = deadline - std::chrono::steady_clock::now();
      if (left <= std::chrono::steady_clock::duration::zero()) {
        throw std::runtime_error("shm all-reduce: rank " + std::to_string(rank_) + " waited " +
                                 std::to_string(timeout_s_) + " s for its peers");
      }
      const int64_t ns = std::min<int64_t>(
          kSliceNs, std::chrono::duration_cast<std::chrono::nanoseconds>(left).count());
      timespec wait{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
      futex(&header_->arrived, FUTEX_WAIT, now, &wait);  // woken, timed out or moved: re-check
    }
  }

  [[noreturn]] void throw_aborted() const {
    throw std::runtime_error("shm all-reduce: rank " + std::to_string(rank_) +
                             ": the group was aborted (a peer rank died)");
  }

  static void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  int rank_, world_;
  int64_t capacity_;
  int64_t slot_bytes_;  // capacity_ floats
  double timeout_s_;
  int64_t bytes_ = 0;
  char* base_ = nullptr;
  Header* header_ = nullptr;
  float* slots_ = nullptr;
  int64_t calls_ = 0;     // collective pieces so far (their parity picks the buffer)
  int64_t meetings_ = 0;  // barriers passed, the pieces' included
};

}  // namespace

void register_shm_allreduce(py::module_& m) {
  py::class_<ShmAllReduce>(m, "ShmAllReduce")
      .def(py::init<const std::string&, int, int, int64_t, bool, double>(), py::arg("path"),
           py::arg("rank"), py::arg("world"), py::arg("capacity"), py::arg("create"),
           py::arg("timeout_s"))
      .def("all_reduce", &ShmAllReduce::all_reduce, py::arg("data"), py::arg("n"),
           py::call_guard<py::gil_scoped_release>())
      .def("all_gather", &ShmAllReduce::all_gather, py::arg("src"), py::arg("nbytes"),
           py::arg("dst"), py::call_guard<py::gil_scoped_release>())
      .def("all_to_all", &ShmAllReduce::all_to_all, py::arg("src"), py::arg("piece_bytes"),
           py::arg("dst"), py::call_guard<py::gil_scoped_release>())
      .def("barrier", &ShmAllReduce::barrier, py::call_guard<py::gil_scoped_release>())
      .def("abort", &ShmAllReduce::abort);
}

}  // namespace duet
