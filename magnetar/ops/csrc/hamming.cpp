// Bit-packed hash codes and Hamming-similarity top-k (CPU), for Spotlight/LSH sparse decoding.
//
// Built by magnetar.ops.op_builder.HammingBuilder (DeepSpeed OpBuilder, JIT). The torch references are in
// magnetar/sparse/codes.py; the results must be identical to them bit for bit:
//
//   pack_bits(bits (R, nbits) bool/uint8, nbits % 32 == 0) -> int32 (R, nbits / 32)
//       bit b of a code goes to word b / 32, bit position b % 32 (least significant first); any non-zero
//       byte is a 1. The words are uint32 bit patterns stored in int32 tensors.
//   hamming_scores(q (H, M, G, W) int32, k (H, N, W) int32) -> int32 (H, M, N)
//       score[h, m, n] = sum over g of (32 W - popcount(q[h, m, g] XOR k[h, n]))  -- the number of agreeing
//       bits (XNOR popcount), summed over the G query heads sharing KV head h (GQA).
//   hamming_topk(q, k, kk) -> (scores int32 (H, M, kk), indices int64 (H, M, kk))
//       the kk best keys per (h, m), ordered by score descending, ties by index ascending (so the result is
//       deterministic and equals a stable sort of the scores).
//
// Top-k is a counting selection: scores are small integers in [0, 32 W G], so one histogram per row finds the
// threshold score in O(N) and the selected keys are collected in index order, then sorted (kk log kk).
// Parallelised with at::parallel_for over rows, or over key chunks when there are few rows (one query over
// 512K keys).

#include "torch_op.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <tuple>
#include <vector>

namespace {

inline int popcount32(uint32_t x) { return __builtin_popcount(x); }

void check_codes(const at::Tensor& q, const at::Tensor& k) {
  TORCH_CHECK(q.dim() == 4, "magnetar hamming: query codes must be (H, M, G, W), got shape ", q.sizes());
  TORCH_CHECK(k.dim() == 3, "magnetar hamming: key codes must be (H, N, W), got shape ", k.sizes());
  TORCH_CHECK(q.scalar_type() == at::kInt && k.scalar_type() == at::kInt,
              "magnetar hamming: codes must be int32 (packed by pack_bits), got ", q.scalar_type(), " and ",
              k.scalar_type());
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(2), "magnetar hamming: query codes ", q.sizes(),
              " and key codes ", k.sizes(), " disagree on H or W");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu(), "magnetar hamming (CPU op): codes must be on the CPU");
}

// scores of one (h, m) row over keys [n0, n1); W known at compile time for the common code lengths (32-256
// bits) so the word loop unrolls into straight popcnt instructions
template <int64_t W>
inline void row_scores_fixed(const uint32_t* qrow, int64_t G, const uint32_t* kh, int64_t n0, int64_t n1,
                             int32_t* out) {
  const int32_t full = static_cast<int32_t>(32 * W * G);
  for (int64_t n = n0; n < n1; ++n) {
    const uint32_t* kv = kh + n * W;
    int32_t diff = 0;
    for (int64_t g = 0; g < G; ++g) {
      const uint32_t* qv = qrow + g * W;
#pragma GCC unroll 8
      for (int64_t w = 0; w < W; ++w) diff += popcount32(qv[w] ^ kv[w]);
    }
    out[n] = full - diff;
  }
}

inline void row_scores(const uint32_t* qrow, int64_t G, int64_t W, const uint32_t* kh, int64_t n0, int64_t n1,
                       int32_t* out) {
  switch (W) {
    case 1: return row_scores_fixed<1>(qrow, G, kh, n0, n1, out);
    case 2: return row_scores_fixed<2>(qrow, G, kh, n0, n1, out);
    case 4: return row_scores_fixed<4>(qrow, G, kh, n0, n1, out);
    case 8: return row_scores_fixed<8>(qrow, G, kh, n0, n1, out);
    default: break;
  }
  const int32_t full = static_cast<int32_t>(32 * W * G);
  for (int64_t n = n0; n < n1; ++n) {
    const uint32_t* kv = kh + n * W;
    int32_t diff = 0;
    for (int64_t g = 0; g < G; ++g) {
      const uint32_t* qv = qrow + g * W;
      for (int64_t w = 0; w < W; ++w) diff += popcount32(qv[w] ^ kv[w]);
    }
    out[n] = full - diff;
  }
}

void all_scores(const at::Tensor& q, const at::Tensor& k, at::Tensor& scores) {
  const int64_t H = q.size(0), M = q.size(1), G = q.size(2), W = q.size(3), N = k.size(1);
  const auto* qp = reinterpret_cast<const uint32_t*>(q.data_ptr<int32_t>());
  const auto* kp = reinterpret_cast<const uint32_t*>(k.data_ptr<int32_t>());
  int32_t* sp = scores.data_ptr<int32_t>();
  const int64_t rows = H * M;
  if (rows >= at::get_num_threads()) {
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t h = r / M;
        row_scores(qp + r * G * W, G, W, kp + h * N * W, 0, N, sp + r * N);
      }
    });
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t h = r / M;
      at::parallel_for(0, N, 4096, [&](int64_t n0, int64_t n1) {
        row_scores(qp + r * G * W, G, W, kp + h * N * W, n0, n1, sp + r * N);
      });
    }
  }
}

// the kk best of one row of scores (length N, values in [0, maxv]); writes kk (score, index) pairs
void select_row(const int32_t* s, int64_t N, int32_t maxv, int64_t kk, int32_t* out_s, int64_t* out_i) {
  std::vector<int64_t> hist(static_cast<size_t>(maxv) + 1, 0);
  for (int64_t n = 0; n < N; ++n) hist[s[n]]++;
  int64_t above = 0;  // keys with a score > thr
  int32_t thr = maxv;
  for (; thr >= 0; --thr) {
    if (above + hist[thr] >= kk) break;
    above += hist[thr];
  }
  int64_t ties = kk - above;  // keys with score == thr to take, lowest indices first
  std::vector<std::pair<int32_t, int64_t>> chosen;
  chosen.reserve(kk);
  for (int64_t n = 0; n < N && static_cast<int64_t>(chosen.size()) < kk; ++n) {
    if (s[n] > thr) {
      chosen.emplace_back(s[n], n);
    } else if (s[n] == thr && ties > 0) {
      chosen.emplace_back(s[n], n);
      --ties;
    }
  }
  std::sort(chosen.begin(), chosen.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  for (int64_t i = 0; i < kk; ++i) {
    out_s[i] = chosen[i].first;
    out_i[i] = chosen[i].second;
  }
}

}  // namespace

at::Tensor pack_bits(at::Tensor bits) {
  TORCH_CHECK(bits.dim() == 2, "magnetar pack_bits: bits must be (R, nbits), got shape ", bits.sizes());
  TORCH_CHECK(bits.scalar_type() == at::kBool || bits.scalar_type() == at::kByte,
              "magnetar pack_bits: bits must be bool or uint8, got ", bits.scalar_type());
  TORCH_CHECK(bits.size(1) % 32 == 0, "magnetar pack_bits: the number of bits (", bits.size(1),
              ") must be a multiple of 32");
  TORCH_CHECK(bits.device().is_cpu(), "magnetar pack_bits (CPU op): bits must be on the CPU");
  bits = bits.contiguous();
  const int64_t R = bits.size(0), W = bits.size(1) / 32;
  auto out = at::empty({R, W}, bits.options().dtype(at::kInt));
  const auto* bp = reinterpret_cast<const uint8_t*>(bits.data_ptr());
  auto* op = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  at::parallel_for(0, R, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t w = 0; w < W; ++w) {
        const uint8_t* src = bp + r * W * 32 + w * 32;
        uint32_t word = 0;
        for (int b = 0; b < 32; ++b) word |= static_cast<uint32_t>(src[b] != 0) << b;
        op[r * W + w] = word;
      }
    }
  });
  return out;
}

at::Tensor hamming_scores(at::Tensor q, at::Tensor k) {
  check_codes(q, k);
  q = q.contiguous();
  k = k.contiguous();
  auto scores = at::empty({q.size(0), q.size(1), k.size(1)}, q.options());
  all_scores(q, k, scores);
  return scores;
}

std::tuple<at::Tensor, at::Tensor> hamming_topk(at::Tensor q, at::Tensor k, int64_t kk) {
  check_codes(q, k);
  const int64_t H = q.size(0), M = q.size(1), G = q.size(2), W = q.size(3), N = k.size(1);
  TORCH_CHECK(kk >= 1 && kk <= N, "magnetar hamming_topk: k must be in [1, ", N, "] (the number of keys), got ", kk);
  q = q.contiguous();
  k = k.contiguous();
  auto scores = at::empty({H, M, N}, q.options());
  all_scores(q, k, scores);
  auto top_s = at::empty({H, M, kk}, q.options());
  auto top_i = at::empty({H, M, kk}, q.options().dtype(at::kLong));
  const int32_t maxv = static_cast<int32_t>(32 * W * G);
  const int32_t* sp = scores.data_ptr<int32_t>();
  int32_t* ts = top_s.data_ptr<int32_t>();
  int64_t* ti = top_i.data_ptr<int64_t>();
  at::parallel_for(0, H * M, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) select_row(sp + r * N, N, maxv, kk, ts + r * kk, ti + r * kk);
  });
  return {top_s, top_i};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Magnetar bit-packed Hamming similarity and top-k (CPU)";
  m.def("pack_bits", &pack_bits, "pack (R, nbits) bits into (R, nbits/32) int32 words, LSB first");
  m.def("hamming_scores", &hamming_scores, "XNOR-popcount similarity of packed codes, summed over GQA groups");
  m.def("hamming_topk", &hamming_topk, "the k most similar keys (score desc, index asc)");
}
