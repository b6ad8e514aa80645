// Work items [0, count) of one custom call, shared by the calling thread and tasks on XLA's
// intra-op thread pool: whoever is free takes the next item (an atomic counter), so a thread
// that the OS delays does not hold the others up. Included by the CPU kernels beside it.

#ifndef DSPARK_JAX_CPU_PARALLEL_H_
#define DSPARK_JAX_CPU_PARALLEL_H_

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace dspark {

// Calls item(i) for every i in [0, count), on at most `workers` threads (the caller and up to
// workers - 1 pool tasks; 0: as many as the pool has), and returns when all are done. `item`
// is copied into state that late tasks keep alive; they find no item left and return.
template <typename Item>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t count, int64_t workers, Item item) {
  struct Job {
    Item item;
    int64_t count;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};

    explicit Job(Item f, int64_t n) : item(std::move(f)), count(n) {}

    void Work() {
      for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) {
        item(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  if (count <= 0) return;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t tasks = std::min(count, workers > 0 ? std::min(workers, threads) : threads);
  auto job = std::make_shared<Job>(std::move(item), count);
  for (int64_t t = 1; t < tasks; ++t) pool.Schedule([job] { job->Work(); });
  job->Work();
  while (job->done.load(std::memory_order_acquire) < count) _mm_pause();
}

}  // namespace dspark

#endif  // DSPARK_JAX_CPU_PARALLEL_H_
