// Sharing a kernel call's work items among XLA:CPU's intra-op threads (the FFI ThreadPool),
// for paged_attention.cc and dense.cc.
//
// Items are handed out through an atomic counter.  The calling thread takes items too and
// returns only when every item is done, so a pool that runs nothing (or runs a task late)
// costs speed, never correctness.  The shared state is heap-held: a task the pool starts
// after the call returned finds no item left and touches nothing but that state.
#ifndef PHOTON_JAX_CSRC_PARALLEL_H_
#define PHOTON_JAX_CSRC_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace photon {

// How long the calling thread spins for the helpers' last items before it sleeps: longer
// than an item takes (a block of the small config's widest int8 layer streams in ~50 us).
constexpr int64_t kSpinUs = 200;

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

struct ParallelWork {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<bool> failed{false};
  int64_t total = 0;
  std::mutex mu;
  std::condition_variable cv;
};

// Each participating thread runs its own copy of `worker`: `bool worker(int64_t item)`,
// false if the item failed.  A worker keeps its scratch as members, sized at first use
// (copies are made before any item runs, so they copy nothing large).
template <typename Worker>
void TakeItems(const std::shared_ptr<ParallelWork>& w, Worker worker) {
  int64_t finished = 0;
  for (int64_t i = w->next.fetch_add(1); i < w->total; i = w->next.fetch_add(1)) {
    if (!worker(i)) w->failed = true;
    ++finished;
  }
  if (finished && w->done.fetch_add(finished) + finished == w->total) {
    std::lock_guard<std::mutex> lock(w->mu);
    w->cv.notify_all();
  }
}

// Runs worker(0 .. total-1) over the calling thread and up to `max_threads - 1` pool tasks;
// true if every item succeeded.
template <typename Worker>
bool ParallelFor(xla::ffi::ThreadPool& pool, int64_t total, int64_t max_threads,
                 const Worker& worker) {
  auto w = std::make_shared<ParallelWork>();
  w->total = total;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t helpers = std::min(threads, max_threads) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([w, worker]() { TakeItems(w, worker); });
  }
  TakeItems(w, worker);
  // What is left is at most one item per helper, already running.  Wait for it spinning,
  // not asleep: a decode step makes dozens of calls of 20-200 us each, and being woken from
  // the condition variable cost about 16 us a call on the 2-core machine (a chain of the
  // small config's 16 int8 layers: 0.96 ms sleeping, 0.61 ms spinning).  The spin is
  // bounded, so a helper the OS has set aside costs this thread a sleep, never a core.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinUs);
  while (w->done.load(std::memory_order_acquire) != w->total &&
         std::chrono::steady_clock::now() < give_up) {
    CpuRelax();
  }
  std::unique_lock<std::mutex> lock(w->mu);
  w->cv.wait(lock, [&] { return w->done.load() == w->total; });
  return !w->failed;
}

}  // namespace photon

#endif  // PHOTON_JAX_CSRC_PARALLEL_H_
