// A small persistent thread pool for the CPU kernels. A decode step calls the kernels a few
// hundred times, each for well under a millisecond, so starting threads per call (tens of
// microseconds each) or waking sleeping ones for every call would eat much of the gain. The
// workers spin for a short while after each job, so back-to-back calls find them awake, then
// sleep on a condition variable so an idle engine costs nothing.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace deepinfer {

class ThreadPool {
 public:
  explicit ThreadPool(int workers);
  ~ThreadPool();
  ThreadPool(const ThreadPool &) = delete;
  ThreadPool &operator=(const ThreadPool &) = delete;

  // Runs fn(part) for every part in [0, parts) on the calling thread and up to `threads - 1`
  // workers; returns when all parts are done. While another caller's job holds the pool,
  // the parts run on the calling thread alone.
  void run(int parts, int threads, const std::function<void(int)> &fn);
  int workers() const { return static_cast<int>(threads_.size()); }

 private:
  void worker_loop(int index);
  void take_parts();

  std::vector<std::thread> threads_;
  std::mutex busy_;  // held by the caller whose job the workers are on
  std::mutex mutex_;
  std::condition_variable wake_;
  // (job number << 8) | number of workers taking part: one word, so a worker reads both at
  // once. A job ends only when every worker taking part has checked out (pending_ == 0), so
  // no worker can still be inside it when the next one begins.
  std::atomic<uint64_t> job_{0};
  std::atomic<int> next_part_{0};
  std::atomic<int> parts_done_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  int parts_ = 0;
  const std::function<void(int)> *fn_ = nullptr;
};

// The process-wide pool, grown on first use to at least `threads - 1` workers. A child
// forked after the pool started gets a pool of its own (the parent's workers are not there).
ThreadPool &shared_pool(int threads);

// Rows [0, rows) in up to `threads` contiguous ranges fn(begin, end) on the shared pool (one
// range under 16 rows a thread: waking a worker costs more). For kernels that compute each
// row alone, so that their floats do not depend on the split.
void split_rows(int rows, int threads, const std::function<void(int, int)> &fn);

}  // namespace deepinfer
