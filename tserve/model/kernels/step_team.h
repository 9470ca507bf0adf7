// The threads of one decode step (`decode_layers.cpp`) held together for the whole step. A step is ~5 split loops a
// layer (the products, the attention); each `at::parallel_for` opens an OpenMP region of its own, which costs ~1.5-2
// µs to start and join on a 2-core machine (`docs/benchmarks/fused-decode.md`): 150 regions, a tenth of a small
// model's step. Here the step opens one region: its thread 0 runs the step, the others wait for loops to share
// (spinning, then yielding the core), and each loop costs one write to post it and one count to join it.
//
// The kernels split their loops with `tserve::parallel_for`, which is `at::parallel_for` outside a step, and the same
// contiguous chunks (a chunk a thread) inside one. A loop's results never depend on how it is split (each kernel's
// comment says why), so a step gives the same bits on the team as on PyTorch's regions.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/FunctionRef.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <thread>

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace tserve {

class StepTeam {
 public:
  using Loop = c10::function_ref<void(int64_t, int64_t)>;

  // The team that thread 0 of a step is running on, or nullptr (outside a step, and on the other threads).
  static StepTeam*& current() {
    thread_local StepTeam* team = nullptr;
    return team;
  }

  int size() const { return size_; }

  // Thread 0: f over [begin, end) in at most one chunk a thread (fewer where `grain` asks for more per chunk), the
  // first chunk its own; returns when every chunk is done.
  void run(int64_t begin, int64_t end, int64_t grain, Loop f) {
    if (end <= begin) return;
    const int64_t n = end - begin, chunks = std::min<int64_t>(size_, (n + std::max<int64_t>(grain, 1) - 1) /
                                                                          std::max<int64_t>(grain, 1));
    if (chunks <= 1) {
      f(begin, end);
      return;
    }
    // The loop in the line that posts it: a thread that sees the post has what it needs without another miss.
    posted_.loop = f;
    posted_.begin = begin;
    posted_.end = end;
    posted_.chunk = (n + chunks - 1) / chunks;
    done_.value.store(0, std::memory_order_relaxed);
    posted_.generation.fetch_add(1, std::memory_order_release);
    std::exception_ptr own_error;
    try {
      f(begin, std::min(end, begin + posted_.chunk));
    } catch (...) {  // rethrown once the others are done with f (it lives on the caller's frame)
      own_error = std::current_exception();
    }
    for (int64_t spins = 0; done_.value.load(std::memory_order_acquire) < size_ - 1; ++spins) pause(spins);
    if (own_error) std::rethrow_exception(own_error);
    if (failed_.load(std::memory_order_acquire)) {
      failed_.store(false, std::memory_order_relaxed);
      std::rethrow_exception(error_);
    }
  }

  // Threads 1 .. size - 1: the chunks of the loops thread 0 posts, until it is done with the step.
  void serve(int thread) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t posted;
      for (int64_t spins = 0; (posted = posted_.generation.load(std::memory_order_acquire)) == seen; ++spins) {
        pause(spins);
      }
      seen = posted;
      if (posted == kFinished) return;
      const int64_t from = posted_.begin + thread * posted_.chunk;
      if (from < posted_.end) {
        try {
          posted_.loop(from, std::min(posted_.end, from + posted_.chunk));
        } catch (...) {
          if (!failed_.exchange(true)) error_ = std::current_exception();
        }
      }
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
    int64_t begin = 0, end = 0, chunk = 0;
  } posted_;
  struct alignas(64) Done {
    std::atomic<int64_t> value{0};
  } done_;
  int size_ = 1;
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
