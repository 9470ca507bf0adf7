// The threads of one decode step (`decode_layers.cpp`) held together for the whole step. A step is ~5 split loops a
// layer (the products, the attention); each `at::parallel_for` opens an OpenMP region of its own, which costs ~1.5-2
// µs to start and join on a 2-core machine (`docs/benchmarks/fused-decode.md`): 150 regions, a tenth of a small
// model's step. Here the step opens one region: its thread 0 runs the step, the others wait for loops to share
// (spinning, then yielding the core), and each loop costs one write to post it and one count to join it.
//
// The kernels split their loops with `tserve::parallel_for`, which is `at::parallel_for` outside a step, and the same
// contiguous chunks (a chunk a thread) inside one. A loop's results never depend on how it is split (each kernel's
// comment says why), so a step gives the same bits on the team as on PyTorch's regions.
//
// A thread that waits (for a loop's other chunks, or for the next loop while thread 0 norms, rotates or adds a row)
// asks the memory for the first lines of its own chunk of the next product's weights (`Upcoming`, which the step names
// with `expect_next`): the memory would otherwise idle between products, and the next product starts from L2.
// SmolLM2-135M's Q4_0 step: 4-8% faster at ~40-60 GB/s, Q8_0 2-5% (docs/benchmarks/step-overhead.md). A thread
// splits no chunk for it: the static split stays (a shared count that balanced the chunks cost more than it saved,
// and a split learnt from each product's timings, moving items to the thread that read faster, changed nothing).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/FunctionRef.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <thread>
#include <utility>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace tserve {

// The chunks the team splits a loop of n items into: at most one a thread, fewer where `grain` asks for more items a
// chunk.
inline int64_t chunk_count(int64_t n, int64_t grain, int threads) {
  grain = std::max<int64_t>(grain, 1);
  return std::max<int64_t>(1, std::min<int64_t>(threads, (n + grain - 1) / grain));
}

// Chunk `thread` of that split: contiguous, in thread order; [first, last), empty past the last chunk.
inline std::pair<int64_t, int64_t> chunk_of(int64_t n, int64_t grain, int threads, int thread) {
  const int64_t chunks = chunk_count(n, grain, threads);
  const int64_t size = (n + chunks - 1) / chunks, first = std::min(n, thread * size);
  return {first, std::min(n, first + size)};
}

// The weights a step's next product reads, as its loop splits them: `items` items of `item_bytes` each, one after the
// other from `data` (a kernel's panels or blocks of rows), and where the weights have them, their scales (`scale_bytes`
// an item) from `scales`. Split one item a chunk at least (`grain` 1), as the kernels' loops are.
struct Upcoming {
  const char* data = nullptr;
  int64_t item_bytes = 0, items = 0;
  const char* scales = nullptr;
  int64_t scale_bytes = 0;
};

// The lines a waiting thread asks for, one a call (`next`): its chunk of an `Upcoming` product from the start, at most
// `kBytes` of weights, and the scales of the same items as the weights' lines go by.
class UpcomingLines {
 public:
  static constexpr int64_t kBytes = 64 * 1024;  // of L2's 1-2 MB; 32 KB gained less, 128 KB no more

  UpcomingLines() = default;
  UpcomingLines(const Upcoming& u, int threads, int thread) {
    if (u.data == nullptr || u.items <= 0 || u.item_bytes <= 0) return;
    const auto [first, last] = chunk_of(u.items, 1, threads, thread);
    at_ = reinterpret_cast<uintptr_t>(u.data) + first * u.item_bytes;
    end_ = at_ + std::min((last - first) * u.item_bytes, kBytes);
    if (u.scales != nullptr) {
      scales_at_ = reinterpret_cast<uintptr_t>(u.scales) + first * u.scale_bytes;
      scales_end_ = scales_at_ + (end_ - at_) * u.scale_bytes / u.item_bytes + 64;
      scale_bytes_ = u.scale_bytes;
      item_bytes_ = u.item_bytes;
    }
  }

  // Asks for the next line (and the scales' lines its items reach) with fetch(address); false once every line is
  // asked for.
  template <typename Fetch>
  bool next(const Fetch& fetch) {
    if (at_ >= end_) return false;
    fetch(at_);
    at_ += 64;
    // The scales' lines keep pace with the weights': the scale bytes of the weight bytes asked for so far.
    for (scale_debt_ += 64 * scale_bytes_; scales_at_ < scales_end_ && scale_debt_ > 0;
         scale_debt_ -= 64 * item_bytes_) {
      fetch(scales_at_);
      scales_at_ += 64;
    }
    return true;
  }

  bool next() { return next(prefetch); }

  // A prefetch is a hint, never a fault: a line past the weights' end (the last item's rest) is harmless.
  static void prefetch(uintptr_t address) {
#if defined(__x86_64__) || defined(_M_X64)
    _mm_prefetch(reinterpret_cast<const char*>(address), _MM_HINT_T0);
#endif
  }

 private:
  uintptr_t at_ = 0, end_ = 0, scales_at_ = 0, scales_end_ = 0;
  int64_t scale_bytes_ = 0, item_bytes_ = 1, scale_debt_ = 0;
};

class StepTeam {
 public:
  using Loop = c10::function_ref<void(int64_t, int64_t)>;

  // The team that thread 0 of a step is running on, or nullptr (outside a step, and on the other threads).
  static StepTeam*& current() {
    thread_local StepTeam* team = nullptr;
    return team;
  }

  int size() const { return size_; }

  // Thread 0: the product the loops posted from now on are followed by (nothing: an empty `Upcoming`).
  void expect(const Upcoming& next) { next_ = next; }

  // Thread 0: f over [begin, end) in at most one chunk a thread (fewer where `grain` asks for more per chunk), the
  // first chunk its own; returns when every chunk is done.
  void run(int64_t begin, int64_t end, int64_t grain, Loop f) {
    if (end <= begin) return;
    const int64_t n = end - begin;
    if (chunk_count(n, grain, size_) <= 1) {
      f(begin, end);
      return;
    }
    // The loop in the line that posts it: a thread that sees the post has what it needs without another miss.
    posted_.loop = f;
    posted_.begin = begin;
    posted_.n = n;
    posted_.grain = grain;
    posted_.next = next_;
    done_.value.store(0, std::memory_order_relaxed);
    posted_.generation.fetch_add(1, std::memory_order_release);
    std::exception_ptr own_error;
    try {
      const auto [first, last] = chunk_of(n, grain, size_, 0);
      f(begin + first, begin + last);
    } catch (...) {  // rethrown once the others are done with f (it lives on the caller's frame)
      own_error = std::current_exception();
    }
    UpcomingLines lines(next_, size_, 0);
    for (int64_t spins = 0; done_.value.load(std::memory_order_acquire) < size_ - 1; ++spins) {
      if (!lines.next()) pause(spins);
    }
    if (own_error) std::rethrow_exception(own_error);
    if (failed_.load(std::memory_order_acquire)) {
      failed_.store(false, std::memory_order_relaxed);
      std::rethrow_exception(error_);
    }
  }

  // Threads 1 .. size - 1: the chunks of the loops thread 0 posts, until it is done with the step.
  void serve(int thread) {
    uint64_t seen = 0;
    UpcomingLines lines;
    for (;;) {
      uint64_t posted;
      for (int64_t spins = 0; (posted = posted_.generation.load(std::memory_order_acquire)) == seen; ++spins) {
        if (!lines.next()) pause(spins);
      }
      seen = posted;
      if (posted == kFinished) return;
      const auto [first, last] = chunk_of(posted_.n, posted_.grain, size_, thread);
      if (first < last) {
        try {
          posted_.loop(posted_.begin + first, posted_.begin + last);
        } catch (...) {
          if (!failed_.exchange(true)) error_ = std::current_exception();
        }
      }
      lines = UpcomingLines(posted_.next, size_, thread);  // read before the count: thread 0 may post again after it
      done_.value.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  void form(int size) { size_ = size; }  // thread 0, before the others look at the team
  void finish() { posted_.generation.store(kFinished, std::memory_order_release); }

  // Spin a while (a loop is posted every few µs), then give the core up between looks: a machine with more threads
  // than cores (other processes' threads) must not spin a core away from the thread that would post or finish.
  static void pause(int64_t spins) {
    if (spins < 20000) {
#if defined(__x86_64__) || defined(_M_X64)
      _mm_pause();
#endif
    } else {
      std::this_thread::yield();
    }
  }

 private:
  static constexpr uint64_t kFinished = ~uint64_t{0};

  // Each on a cache line of its own: thread 0 writes the first, the others the second.
  struct alignas(64) Posted {
    std::atomic<uint64_t> generation{0};
    Loop loop;
    int64_t begin = 0, n = 0, grain = 1;
    Upcoming next;  // what the loop after this one reads
  } posted_;
  struct alignas(64) Done {
    std::atomic<int64_t> value{0};
  } done_;
  int size_ = 1;
  Upcoming next_;
  std::atomic<bool> failed_{false};
  std::exception_ptr error_;
};

// A kernel's split loop: on the step's team inside a step, else `at::parallel_for` (PyTorch's own OpenMP threads,
// `torch.set_num_threads`).
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (StepTeam* team = StepTeam::current()) {
    team->run(begin, end, grain, StepTeam::Loop(f));
  } else {
    at::parallel_for(begin, end, grain, f);
  }
}

// Inside a step: the product the step's next loops are followed by (`StepTeam::expect`); outside one, nothing.
inline void expect_next(const Upcoming& next) {
  if (StepTeam* team = StepTeam::current()) team->expect(next);
}

// The threads a kernel's loop is split over.
inline int thread_count() {
  const StepTeam* team = StepTeam::current();
  return team != nullptr ? team->size() : at::get_num_threads();
}

// body() on thread 0 of one OpenMP region of PyTorch's threads, the others serving its loops. Where there is one
// thread, or this is already inside a region, body() runs alone (its loops then as `at::parallel_for` runs them).
template <typename F>
void on_step_team(const F& body) {
#if defined(_OPENMP)
  const int threads = at::get_num_threads();
  if (threads < 2 || at::in_parallel_region() || StepTeam::current() != nullptr) {
    body();
    return;
  }
  StepTeam team;  // outlives the region (its end waits for every thread to leave `serve`)
  std::atomic<bool> formed{false};
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    if (omp_get_thread_num() == 0) {
      team.form(omp_get_num_threads());
      formed.store(true, std::memory_order_release);
      StepTeam::current() = &team;
      try {
        body();
      } catch (...) {
        error = std::current_exception();
      }
      StepTeam::current() = nullptr;
      team.finish();
    } else {
      for (int64_t spins = 0; !formed.load(std::memory_order_acquire); ++spins) StepTeam::pause(spins);
      team.serve(omp_get_thread_num());
    }
  }
  if (error) std::rethrow_exception(error);
#else
  body();
#endif
}

}  // namespace tserve
