// A copy of large contiguous byte spans with non-temporal stores, for KV hand-offs into another
// process's pool (kv_transfer/blocks.py, the shm backend).
//
// A plain copy reads every destination line before writing it (read for ownership) and leaves
// the lines in this core's cache, where the copying process never reads them again: three bytes
// of memory traffic per byte moved. Streaming stores write whole lines straight to memory: two.
// Spans are split over ATen's threads in 64-byte-aligned pieces; an sfence makes the stores
// visible before the call returns (the hand-off's completion notice goes out after it).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "vec.h"

namespace {

constexpr int64_t kPiece = 1 << 20;  // bytes per parallel work item

void stream(uint8_t* dst, const uint8_t* src, int64_t n) {
#if defined(KVBRIDGE_VEC)
  const int64_t head = std::min<int64_t>(n, (64 - reinterpret_cast<uintptr_t>(dst) % 64) % 64);
  std::memcpy(dst, src, head);
  int64_t i = head;
  for (; i + 256 <= n; i += 256) {  // four lines' loads in flight, then their stores
    kvbridge_vec::Line lines[4];
    for (int j = 0; j < 4; ++j) lines[j] = kvbridge_vec::load_line(src + i + 64 * j);
    for (int j = 0; j < 4; ++j) kvbridge_vec::stream_line(dst + i + 64 * j, lines[j]);
  }
  for (; i + 64 <= n; i += 64) kvbridge_vec::stream_line(dst + i, kvbridge_vec::load_line(src + i));
  std::memcpy(dst + i, src + i, n - i);
  _mm_sfence();
#else
  std::memcpy(dst, src, n);
#endif
}

// dst.copy_(src) for contiguous CPU tensors of the same byte size (any dtypes: bytes are copied)
void stream_copy(at::Tensor dst, const at::Tensor& src) {
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu(), "stream_copy copies CPU tensors");
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "stream_copy needs contiguous tensors");
  const int64_t n = dst.numel() * dst.element_size();
  TORCH_CHECK(src.numel() * src.element_size() == n, "stream_copy: ", src.numel() * src.element_size(),
              " source bytes for ", n, " destination bytes");
  uint8_t* d = static_cast<uint8_t*>(dst.data_ptr());
  const uint8_t* s = static_cast<const uint8_t*>(src.data_ptr());
  at::parallel_for(0, (n + kPiece - 1) / kPiece, 1, [&](int64_t begin, int64_t end) {
    const int64_t lo = begin * kPiece, hi = std::min(n, end * kPiece);
    stream(d + lo, s + lo, hi - lo);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvbridge, m) { m.def("stream_copy(Tensor(a!) dst, Tensor src) -> ()"); }

TORCH_LIBRARY_IMPL(kvbridge, CPU, m) { m.impl("stream_copy", stream_copy); }
