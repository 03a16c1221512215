#include "thread_pool.h"

#include <algorithm>
#include <chrono>
#include <memory>

#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define DEEPINFER_PAUSE() _mm_pause()
#else
#define DEEPINFER_PAUSE() std::this_thread::yield()
#endif

namespace deepinfer {

namespace {
// How long a worker stays awake after a job: the gap between two kernel calls in a decode
// step (a few small torch ops) is tens of microseconds.
constexpr auto kSpin = std::chrono::microseconds(200);
constexpr int kMaxWorkers = 255;  // the job word keeps the worker count in 8 bits
}  // namespace

ThreadPool::ThreadPool(int workers) {
  for (int i = 0; i < workers; ++i) threads_.emplace_back(&ThreadPool::worker_loop, this, i);
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_.store(true);
  }
  wake_.notify_all();
  for (auto &t : threads_) t.join();
}

void ThreadPool::take_parts() {
  for (int p = next_part_.fetch_add(1); p < parts_; p = next_part_.fetch_add(1)) {
    (*fn_)(p);
    parts_done_.fetch_add(1, std::memory_order_release);
  }
}

void ThreadPool::run(int parts, int threads, const std::function<void(int)> &fn) {
  if (parts <= 0) return;
  const int helpers = std::min(threads - 1, std::min(workers(), parts - 1));
  std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
  if (helpers <= 0 || !busy.owns_lock()) {
    for (int p = 0; p < parts; ++p) fn(p);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fn_ = &fn;
    parts_ = parts;
    next_part_.store(0);
    parts_done_.store(0);
    pending_.store(helpers);
    const uint64_t number = (job_.load() >> 8) + 1;
    job_.store(number << 8 | static_cast<uint64_t>(helpers), std::memory_order_release);
  }
  wake_.notify_all();
  take_parts();
  while (parts_done_.load(std::memory_order_acquire) < parts || pending_.load(std::memory_order_acquire) > 0)
    DEEPINFER_PAUSE();
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  while (true) {
    const auto spin_until = std::chrono::steady_clock::now() + kSpin;
    int n = 0;
    while (job_.load(std::memory_order_acquire) == seen && !stop_.load()) {
      DEEPINFER_PAUSE();
      if (++n % 64 == 0 && std::chrono::steady_clock::now() > spin_until) {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return job_.load() != seen || stop_.load(); });
      }
    }
    if (stop_.load()) return;
    seen = job_.load(std::memory_order_acquire);
    if (index < static_cast<int>(seen & 0xff)) {
      take_parts();
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }
}

ThreadPool &shared_pool(int threads) {
  static std::mutex guard;
  static std::unique_ptr<ThreadPool> pool;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(guard);
  const int want = std::min(threads - 1, kMaxWorkers);
  // A pool that is replaced is left alive, its workers asleep: another thread may still be
  // inside its run(), and after a fork its workers exist only in the parent.
  if (pool && (owner != getpid() || pool->workers() < want)) pool.release();
  if (!pool) {
    pool = std::make_unique<ThreadPool>(want);
    owner = getpid();
  }
  return *pool;
}

void split_rows(int rows, int threads, const std::function<void(int, int)> &fn) {
  constexpr int kMinRowsPerThread = 16;
  const int parts = std::max(1, std::min(threads, rows / kMinRowsPerThread));
  if (parts == 1) return fn(0, rows);
  const int step = (rows + parts - 1) / parts;
  shared_pool(parts).run(parts, parts, [&](int p) { fn(std::min(rows, p * step), std::min(rows, (p + 1) * step)); });
}

}  // namespace deepinfer
