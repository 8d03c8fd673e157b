// VocabParallelEmbedding and vocab_parallel_cross_entropy against serial
// LibTorch (torch::nn::functional::embedding / cross_entropy on the full
// tensors; the tensor group is the whole world). Vocabularies of 12 divide
// every tested group size (1 to 4); vocabularies of 10 are padded to 12 at 3
// and 4 ranks (Note [Vocabulary padding] in vocab_parallel_embedding.h).
// Gradients follow Note [Global loss for gradient checks] in
// test_functional.cpp: a replicated output gets the same loss on every rank,
// a sharded one gets each rank's part, and either way the shards' gradients
// gathered are the serial gradient.
// Runs on TESSERA_TEST_DEVICE (test::device()).
#include "test_util.h"

#include "tessera/comm/functional.h"
#include "tessera/nn/shard.h"
#include "tessera/nn/vocab_parallel_cross_entropy.h"
#include "tessera/nn/vocab_parallel_embedding.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sstream>

namespace tessera {
namespace {

namespace F = torch::nn::functional;

// fp32, relative to the norm of the expected tensor.
constexpr double kRelTolerance = 1e-5;
constexpr int64_t kBatch = 2, kSeq = 12, kDim = 8;  // kSeq divisible by 1, 2, 3, 4
constexpr int64_t kDivisibleVocab = 12, kPaddedVocab = 10;
constexpr int64_t kIgnore = -100;

using test::rel_error;

#define EXPECT_CLOSE(actual, expected) EXPECT_REL_CLOSE(actual, expected, kRelTolerance)

// Identical on every rank: every rank seeds its own generator alike.
at::Generator generator(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

// Ids in [0, vocab), with both ends of the vocabulary present, on the test device.
at::Tensor seeded_ids(int64_t vocab, uint64_t seed) {
  at::Tensor ids = at::randint(0, vocab, {kBatch, kSeq}, generator(seed), at::TensorOptions().dtype(at::kLong));
  ids[0][0] = 0;
  ids[0][1] = vocab - 1;
  return ids.to(test::device());
}

// ---------------------------------------------------------------------------
// VocabParallelEmbedding

void check_embedding(int64_t vocab, bool sequence_parallel) {
  auto tp = test::world();
  const int r = tp->rank(), n = tp->size();
  const at::Tensor w = test::device_randn({vocab, kDim}, 1);
  const at::Tensor ids = seeded_ids(vocab, 2);
  const at::Tensor dy = test::device_randn({kBatch, kSeq, kDim}, 3);

  at::Tensor ws = w.clone().requires_grad_(true);
  at::Tensor ys = F::embedding(ids, ws);
  (ys * dy).sum().backward();

  nn::VocabParallelEmbedding emb(nn::VocabParallelEmbeddingOptions(vocab, kDim).sequence_parallel(sequence_parallel),
                                 tp);
  emb->to(test::device());
  emb->load_full(w);
  at::Tensor y = emb->forward(ids);
  if (sequence_parallel) {
    // Each rank's loss is its sequence shard's part of the serial loss.
    EXPECT_CLOSE(y, ys.detach().chunk(n, 1)[r]);
    (y * dy.chunk(n, 1)[r]).sum().backward();
  } else {
    // Replicated output and loss.
    EXPECT_CLOSE(y, ys.detach());
    (y * dy).sum().backward();
  }
  const at::Tensor grad = nn::unshard(emb->weight.grad(), 0, *tp);
  EXPECT_CLOSE(grad.narrow(0, 0, vocab), ws.grad());
  EXPECT_EQ(grad.narrow(0, vocab, emb->padded_vocab() - vocab).abs().sum().item<double>(), 0.0)
      << "padded rows must get no gradient";
}

TEST(VocabParallelEmbedding, ShardsThePaddedVocabulary) {
  auto tp = test::world();
  const int r = tp->rank(), n = tp->size();
  nn::VocabParallelEmbedding emb(nn::VocabParallelEmbeddingOptions(kPaddedVocab, kDim), tp);
  emb->to(test::device());
  const int64_t padded = (kPaddedVocab + n - 1) / n * n;
  EXPECT_EQ(emb->padded_vocab(), padded);
  EXPECT_EQ(emb->vocab_start(), r * padded / n);
  EXPECT_EQ(emb->vocab_end(), (r + 1) * padded / n);
  EXPECT_EQ(emb->weight.sizes(), (std::vector<int64_t>{padded / n, kDim}));

  const at::Tensor w = test::device_randn({kPaddedVocab, kDim}, 4);
  emb->load_full(w);
  EXPECT_TRUE(torch::equal(emb->full_weight(), w));
  const at::Tensor padded_table = nn::unshard(emb->weight, 0, *tp);
  EXPECT_EQ(padded_table.narrow(0, kPaddedVocab, padded - kPaddedVocab).abs().sum().item<double>(), 0.0);

  std::ostringstream printed;
  emb->pretty_print(printed);
  EXPECT_NE(printed.str().find("padded_vocab=" + std::to_string(padded)), std::string::npos) << printed.str();
}

TEST(VocabParallelEmbedding, InitEqualsSerialEmbedding) {
  auto tp = test::world();
  torch::manual_seed(1234);
  torch::nn::Embedding serial(kPaddedVocab, kDim);
  serial->to(test::device());
  torch::manual_seed(1234);
  nn::VocabParallelEmbedding emb(nn::VocabParallelEmbeddingOptions(kPaddedVocab, kDim), tp);
  emb->to(test::device());
  EXPECT_TRUE(torch::equal(emb->full_weight(), serial->weight.detach()));
}

TEST(VocabParallelEmbedding, CloneKeepsTheShard) {
  auto tp = test::world();
  nn::VocabParallelEmbedding emb(nn::VocabParallelEmbeddingOptions(kPaddedVocab, kDim), tp);
  emb->to(test::device());
  emb->load_full(test::device_randn({kPaddedVocab, kDim}, 5));
  auto copy = std::dynamic_pointer_cast<nn::VocabParallelEmbeddingImpl>(emb->clone());
  ASSERT_NE(copy, nullptr);
  EXPECT_TRUE(torch::equal(copy->weight, emb->weight));
  EXPECT_NE(copy->weight.data_ptr(), emb->weight.data_ptr());
  EXPECT_EQ(copy->vocab_start(), emb->vocab_start());
}

TEST(VocabParallelEmbedding, MatchesSerialDivisibleVocab) { check_embedding(kDivisibleVocab, false); }
TEST(VocabParallelEmbedding, MatchesSerialPaddedVocab) { check_embedding(kPaddedVocab, false); }
TEST(VocabParallelEmbedding, SequenceParallelMatchesSerialDivisibleVocab) { check_embedding(kDivisibleVocab, true); }
TEST(VocabParallelEmbedding, SequenceParallelMatchesSerialPaddedVocab) { check_embedding(kPaddedVocab, true); }

TEST(VocabParallelEmbedding, RejectsBadIdsAndShapes) {
  auto tp = test::world();
  nn::VocabParallelEmbedding emb(nn::VocabParallelEmbeddingOptions(kPaddedVocab, kDim), tp);
  emb->to(test::device());
  at::Tensor ids = seeded_ids(kPaddedVocab, 6);
  ids[1][3] = kPaddedVocab;
  EXPECT_ERROR_CONTAINS(emb->forward(ids), "token id 10 is out of range", "[0, num_embeddings = 10)");
  ids[1][3] = -3;
  EXPECT_ERROR_CONTAINS(emb->forward(ids), "token id -3 is out of range");
  EXPECT_ERROR_CONTAINS(emb->forward(ids.to(at::kFloat)), "ids must be int64 or int32");
  EXPECT_ERROR_CONTAINS(emb->load_full(test::device_randn({12, kDim}, 7)), "[12, 8] given", "[10, 8] expected");
}

// ---------------------------------------------------------------------------
// vocab_parallel_cross_entropy

F::CrossEntropyFuncOptions serial_options(nn::Reduction reduction, int64_t ignore_index) {
  F::CrossEntropyFuncOptions options;
  options.ignore_index(ignore_index);
  switch (reduction) {
    case nn::Reduction::kMean:
      options.reduction(torch::kMean);
      break;
    case nn::Reduction::kSum:
      options.reduction(torch::kSum);
      break;
    case nn::Reduction::kNone:
      options.reduction(torch::kNone);
      break;
  }
  return options;
}

struct CrossEntropyCase {
  int64_t vocab = kDivisibleVocab;
  nn::Reduction reduction = nn::Reduction::kMean;
  int64_t ignore_index = kIgnore;
  double scale = 1.0;         // of the logits
  double padding_fill = 0.0;  // value of the padded logit columns
  at::ScalarType dtype = at::kFloat;
};

// Loss and logits gradient against torch's cross_entropy on the full logits.
void check_cross_entropy(const CrossEntropyCase& c) {
  auto tp = test::world();
  const int r = tp->rank(), n = tp->size();
  const at::Tensor logits = test::device_randn({kBatch, kSeq, c.vocab}, 11, c.dtype) * c.scale;
  at::Tensor target = seeded_ids(c.vocab, 12);
  target[0][2] = c.ignore_index;
  target[1][5] = c.ignore_index;
  const at::Tensor dl = test::device_randn({kBatch, kSeq}, 13, c.dtype);  // upstream gradient for kNone

  at::Tensor ls = logits.clone().requires_grad_(true);
  at::Tensor loss_s =
      F::cross_entropy(ls.reshape({-1, c.vocab}), target.reshape(-1), serial_options(c.reduction, c.ignore_index));
  if (c.reduction == nn::Reduction::kNone) {
    loss_s = loss_s.reshape({kBatch, kSeq});
    (loss_s * dl).sum().backward();
  } else {
    loss_s.backward();
  }

  const int64_t padded = nn::pad_to_multiple(c.vocab, n);
  const at::Tensor padding = at::full({kBatch, kSeq, padded - c.vocab}, c.padding_fill, logits.options());
  at::Tensor shard = at::cat({logits, padding}, -1).chunk(n, -1)[r].clone().requires_grad_(true);
  auto options =
      nn::VocabParallelCrossEntropyOptions().vocab_size(c.vocab).ignore_index(c.ignore_index).reduction(c.reduction);
  at::Tensor loss = nn::vocab_parallel_cross_entropy(shard, target, tp, options);
  EXPECT_EQ(loss.scalar_type(), c.dtype);
  EXPECT_TRUE(loss.isfinite().all().item<bool>());
  EXPECT_CLOSE(loss, loss_s.detach());
  // Replicated loss: every rank back-propagates the same upstream gradient.
  if (c.reduction == nn::Reduction::kNone) {
    (loss * dl).sum().backward();
  } else {
    loss.backward();
  }
  const at::Tensor grad_padding = at::zeros({kBatch, kSeq, padded - c.vocab}, logits.options());
  EXPECT_CLOSE(shard.grad(), at::cat({ls.grad(), grad_padding}, -1).chunk(n, -1)[r]);
  EXPECT_TRUE(shard.grad().isfinite().all().item<bool>());
  // Padded columns get exactly zero.
  const int64_t real_here = std::min(std::max<int64_t>(c.vocab - r * (padded / n), 0), padded / n);
  EXPECT_EQ(shard.grad().narrow(-1, real_here, padded / n - real_here).abs().sum().item<double>(), 0.0);
}

TEST(VocabParallelCrossEntropy, MeanMatchesSerial) { check_cross_entropy({}); }

TEST(VocabParallelCrossEntropy, SumMatchesSerial) {
  CrossEntropyCase c;
  c.reduction = nn::Reduction::kSum;
  check_cross_entropy(c);
}

TEST(VocabParallelCrossEntropy, NoneMatchesSerial) {
  CrossEntropyCase c;
  c.reduction = nn::Reduction::kNone;
  check_cross_entropy(c);
}

TEST(VocabParallelCrossEntropy, Float64MatchesSerial) {
  CrossEntropyCase c;
  c.dtype = at::kDouble;
  c.vocab = kPaddedVocab;
  check_cross_entropy(c);
}

TEST(VocabParallelCrossEntropy, IgnoreIndexMayBeAClass) {
  for (nn::Reduction reduction : {nn::Reduction::kMean, nn::Reduction::kSum, nn::Reduction::kNone}) {
    CrossEntropyCase c;
    c.ignore_index = 3;
    c.reduction = reduction;
    check_cross_entropy(c);
  }
}

TEST(VocabParallelCrossEntropy, PaddedColumnsDoNotCount) {
  // Large padded logits would dominate the softmax if they counted.
  for (double fill : {0.0, 1e4, -1e4}) {
    for (nn::Reduction reduction : {nn::Reduction::kMean, nn::Reduction::kNone}) {
      CrossEntropyCase c;
      c.vocab = kPaddedVocab;
      c.padding_fill = fill;
      c.reduction = reduction;
      check_cross_entropy(c);
    }
  }
}

TEST(VocabParallelCrossEntropy, ExtremeLogitsStayFinite) {
  for (int64_t vocab : {kDivisibleVocab, kPaddedVocab}) {
    CrossEntropyCase c;
    c.vocab = vocab;
    c.scale = 1e4;  // logits of order ±1e4: exp() would overflow without the max
    c.padding_fill = 1e4;
    check_cross_entropy(c);
  }
}

// A tied LM head on the padded table: the padded rows make zero logit
// columns, which the loss ignores, and they get no gradient.
TEST(VocabParallelCrossEntropy, TiedHeadOnPaddedEmbedding) {
  auto tp = test::world();
  const at::Tensor w = test::device_randn({kPaddedVocab, kDim}, 21);
  const at::Tensor hidden = test::device_randn({kBatch, kSeq, kDim}, 22);
  const at::Tensor target = seeded_ids(kPaddedVocab, 23);

  at::Tensor ws = w.clone().requires_grad_(true);
  at::Tensor hs = hidden.clone().requires_grad_(true);
  at::Tensor loss_s = F::cross_entropy(at::matmul(hs, ws.t()).reshape({-1, kPaddedVocab}), target.reshape(-1));
  loss_s.backward();

  nn::VocabParallelEmbedding emb(nn::VocabParallelEmbeddingOptions(kPaddedVocab, kDim), tp);
  emb->to(test::device());
  emb->load_full(w);
  at::Tensor h = hidden.clone().requires_grad_(true);
  // copy_to_group: each rank's vocabulary columns contribute to h's gradient.
  at::Tensor logits_shard = at::matmul(comm::copy_to_group(h, tp), emb->weight.t());
  at::Tensor loss = nn::vocab_parallel_cross_entropy(logits_shard, target, tp,
                                                     nn::VocabParallelCrossEntropyOptions().vocab_size(kPaddedVocab));
  EXPECT_CLOSE(loss, loss_s.detach());
  loss.backward();
  EXPECT_CLOSE(h.grad(), hs.grad());
  const at::Tensor grad = nn::unshard(emb->weight.grad(), 0, *tp);
  EXPECT_CLOSE(grad.narrow(0, 0, kPaddedVocab), ws.grad());
  EXPECT_EQ(grad.narrow(0, kPaddedVocab, emb->padded_vocab() - kPaddedVocab).abs().sum().item<double>(), 0.0);
}

TEST(VocabParallelCrossEntropy, RejectsBadTargetsAndShapes) {
  auto tp = test::world();
  const int n = tp->size();
  const int64_t padded = nn::pad_to_multiple(kPaddedVocab, n);
  const at::Tensor shard = test::device_randn({kBatch, kSeq, padded / n}, 31);
  auto options = nn::VocabParallelCrossEntropyOptions().vocab_size(kPaddedVocab);
  at::Tensor target = seeded_ids(kPaddedVocab, 32);
  target[1][4] = kPaddedVocab;
  EXPECT_ERROR_CONTAINS(nn::vocab_parallel_cross_entropy(shard, target, tp, options), "target 10 is out of range",
                        "[0, vocab_size = 10)");
  target[1][4] = -7;
  EXPECT_ERROR_CONTAINS(nn::vocab_parallel_cross_entropy(shard, target, tp, options), "target -7 is out of range");
  EXPECT_ERROR_CONTAINS(nn::vocab_parallel_cross_entropy(shard, target.narrow(1, 0, 3), tp, options),
                        "the target must have the logits' shape without the last");
  const std::string too_large =
      "vocab_size " + std::to_string(padded + 1) + " is not in [1, " + std::to_string(padded) + "]";
  EXPECT_ERROR_CONTAINS(
      nn::vocab_parallel_cross_entropy(shard, seeded_ids(kPaddedVocab, 33), tp, options.vocab_size(padded + 1)),
      too_large.c_str());
}

}  // namespace
}  // namespace tessera
