// A std::vector whose data starts on a 64-byte cache line. The kernels' reused row buffers
// feed AMX tile loads, which read a row's 64 bytes at a time: glibc puts a large block 16
// bytes past a page, and there every such row straddled two lines, twice the lines to load.
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace deepinfer {

template <typename T>
struct LineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kLine{64};

  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U> &) {}

  T *allocate(size_t n) { return static_cast<T *>(::operator new(n * sizeof(T), kLine)); }
  void deallocate(T *p, size_t) { ::operator delete(p, kLine); }
  bool operator==(const LineAllocator &) const { return true; }
  bool operator!=(const LineAllocator &) const { return false; }
};

template <typename T>
using LineVector = std::vector<T, LineAllocator<T>>;

}  // namespace deepinfer
