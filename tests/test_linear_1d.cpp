// ColumnParallelLinear and RowParallelLinear against the serial computation:
// the same full weights loaded into a serial torch::nn::functional::linear
// and into the parallel layers (the tensor group is the whole world), then
// forward outputs, input gradients and gathered weight gradients compared
// (Note [Global loss for gradient checks] in test_functional.cpp: the loss
// each rank computes on what it holds sums to the serial loss).
// Runs on TESSERA_TEST_DEVICE (test::device()).
#include "test_util.h"

#include "tessera/nn/column_parallel_linear.h"
#include "tessera/nn/row_parallel_linear.h"
#include "tessera/nn/shard.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace tessera {
namespace {

// fp32, relative to the norm of the expected tensor.
constexpr double kRelTolerance = 1e-5;

using test::rel_error;

#define EXPECT_CLOSE(actual, expected) EXPECT_REL_CLOSE(actual, expected, kRelTolerance)

constexpr int64_t kBatch = 2, kSeq = 12, kHidden = 12, kFfn = 24;  // divisible by 1, 2, 3, 4

struct Serial {
  at::Tensor x, w, b, y, x_grad, w_grad, b_grad;
};

// y = x wᵀ + b and its gradients for the loss sum(dy * y).
Serial serial_linear(const at::Tensor& x0, const at::Tensor& w0, const at::Tensor& b0, const at::Tensor& dy) {
  Serial s;
  s.x = x0.clone().requires_grad_(true);
  s.w = w0.clone().requires_grad_(true);
  s.b = b0.clone().requires_grad_(true);
  s.y = torch::nn::functional::linear(s.x, s.w, s.b);
  (s.y * dy).sum().backward();
  s.x_grad = s.x.grad();
  s.w_grad = s.w.grad();
  s.b_grad = s.b.grad();
  return s;
}

TEST(ColumnParallelLinear, MatchesSerialWithShardedOutput) {
  auto tp = test::world();
  const int r = tp->rank(), n = tp->size();
  at::Tensor x = test::device_randn({kBatch, kSeq, kHidden}, 1), w = test::device_randn({kFfn, kHidden}, 2),
             b = test::device_randn({kFfn}, 3);
  at::Tensor dy = test::device_randn({kBatch, kSeq, kFfn}, 4);
  Serial s = serial_linear(x, w, b, dy);

  nn::ColumnParallelLinear layer(nn::ColumnParallelLinearOptions(kHidden, kFfn), tp);
  layer->to(test::device());
  layer->load_full(w, b);
  at::Tensor xp = x.clone().requires_grad_(true);
  at::Tensor y = layer->forward(xp);
  EXPECT_CLOSE(y, s.y.detach().chunk(n, -1)[r]);
  (y * dy.chunk(n, -1)[r]).sum().backward();
  EXPECT_CLOSE(xp.grad(), s.x_grad);  // copy_to_group summed every rank's part
  EXPECT_CLOSE(nn::unshard(layer->weight.grad(), 0, *tp), s.w_grad);
  EXPECT_CLOSE(nn::unshard(layer->bias.grad(), 0, *tp), s.b_grad);
}

TEST(ColumnParallelLinear, GatheredOutputIsTheFullOutput) {
  auto tp = test::world();
  at::Tensor x = test::device_randn({kBatch, kSeq, kHidden}, 5), w = test::device_randn({kFfn, kHidden}, 6),
             b = test::device_randn({kFfn}, 7);
  at::Tensor dy = test::device_randn({kBatch, kSeq, kFfn}, 8);
  Serial s = serial_linear(x, w, b, dy);
  nn::ColumnParallelLinear layer(nn::ColumnParallelLinearOptions(kHidden, kFfn).gather_output(true), tp);
  layer->to(test::device());
  layer->load_full(w, b);
  at::Tensor xp = x.clone().requires_grad_(true);
  at::Tensor y = layer->forward(xp);
  EXPECT_CLOSE(y, s.y.detach());
  // Replicated output, replicated loss: counted once, as in the serial model.
  (y * dy).sum().backward();
  EXPECT_CLOSE(xp.grad(), s.x_grad);
  EXPECT_CLOSE(nn::unshard(layer->weight.grad(), 0, *tp), s.w_grad);
}

TEST(RowParallelLinear, MatchesSerialFromParallelAndFullInput) {
  auto tp = test::world();
  const int r = tp->rank(), n = tp->size();
  at::Tensor x = test::device_randn({kBatch, kSeq, kFfn}, 9), w = test::device_randn({kHidden, kFfn}, 10),
             b = test::device_randn({kHidden}, 11);
  at::Tensor dy = test::device_randn({kBatch, kSeq, kHidden}, 12);
  Serial s = serial_linear(x, w, b, dy);
  for (bool input_is_parallel : {true, false}) {
    SCOPED_TRACE(input_is_parallel ? "input_is_parallel" : "full input");
    nn::RowParallelLinear layer(nn::RowParallelLinearOptions(kFfn, kHidden).input_is_parallel(input_is_parallel), tp);
    layer->to(test::device());
    layer->load_full(w, b);
    at::Tensor xp = (input_is_parallel ? x.chunk(n, -1)[r].contiguous() : x.clone()).requires_grad_(true);
    at::Tensor y = layer->forward(xp);
    EXPECT_CLOSE(y, s.y.detach());
    (y * dy).sum().backward();
    EXPECT_CLOSE(xp.grad(), input_is_parallel ? s.x_grad.chunk(n, -1)[r] : s.x_grad);
    EXPECT_CLOSE(nn::unshard(layer->weight.grad(), 1, *tp), s.w_grad);
    EXPECT_CLOSE(layer->bias.grad(), s.b_grad);
    EXPECT_CLOSE(layer->full_weight(), w);
  }
}

// The Megatron MLP, Column -> GELU -> Row, in both variants.
TEST(ParallelMlp, MatchesSerialWithAndWithoutSequenceParallelism) {
  auto tp = test::world();
  const int r = tp->rank(), n = tp->size();
  at::Tensor x = test::device_randn({kBatch, kSeq, kHidden}, 13);
  at::Tensor w1 = test::device_randn({kFfn, kHidden}, 14), b1 = test::device_randn({kFfn}, 15);
  at::Tensor w2 = test::device_randn({kHidden, kFfn}, 16), b2 = test::device_randn({kHidden}, 17);
  at::Tensor dy = test::device_randn({kBatch, kSeq, kHidden}, 18);

  at::Tensor sx = x.clone().requires_grad_(true);
  at::Tensor sw1 = w1.clone().requires_grad_(true), sb1 = b1.clone().requires_grad_(true);
  at::Tensor sw2 = w2.clone().requires_grad_(true), sb2 = b2.clone().requires_grad_(true);
  at::Tensor sy = torch::nn::functional::linear(at::gelu(torch::nn::functional::linear(sx, sw1, sb1)), sw2, sb2);
  (sy * dy).sum().backward();

  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "sequence parallel" : "1d");
    nn::ColumnParallelLinear fc1(nn::ColumnParallelLinearOptions(kHidden, kFfn).sequence_parallel(sp), tp);
    nn::RowParallelLinear fc2(nn::RowParallelLinearOptions(kFfn, kHidden).sequence_parallel(sp), tp);
    fc1->to(test::device());
    fc2->to(test::device());
    fc1->load_full(w1, b1);
    fc2->load_full(w2, b2);
    // Sequence parallel: each rank holds (and gets the loss of) its sequence shard.
    at::Tensor xp = (sp ? x.chunk(n, 1)[r].contiguous() : x.clone()).requires_grad_(true);
    at::Tensor y = fc2->forward(at::gelu(fc1->forward(xp)));
    EXPECT_CLOSE(y, sp ? sy.detach().chunk(n, 1)[r] : sy.detach());
    (y * (sp ? dy.chunk(n, 1)[r] : dy)).sum().backward();
    fc2->reduce_partial_gradients();
    EXPECT_CLOSE(xp.grad(), sp ? sx.grad().chunk(n, 1)[r] : sx.grad());
    EXPECT_CLOSE(nn::unshard(fc1->weight.grad(), 0, *tp), sw1.grad());
    EXPECT_CLOSE(nn::unshard(fc1->bias.grad(), 0, *tp), sb1.grad());
    EXPECT_CLOSE(nn::unshard(fc2->weight.grad(), 1, *tp), sw2.grad());
    EXPECT_CLOSE(fc2->bias.grad(), sb2.grad());
  }
}

TEST(ParallelLinear, InitialisationEqualsTorchLinearWithTheSameSeed) {
  auto tp = test::world();
  torch::manual_seed(123);
  torch::nn::Linear serial(kHidden, kFfn);
  serial->to(test::device());
  torch::manual_seed(123);
  nn::ColumnParallelLinear column(nn::ColumnParallelLinearOptions(kHidden, kFfn), tp);
  column->to(test::device());
  EXPECT_TRUE(at::equal(column->full_weight(), serial->weight.detach()));
  EXPECT_TRUE(at::equal(column->full_bias(), serial->bias.detach()));
  torch::manual_seed(123);
  nn::RowParallelLinear row(nn::RowParallelLinearOptions(kHidden, kFfn), tp);
  row->to(test::device());
  EXPECT_TRUE(at::equal(row->full_weight(), serial->weight.detach()));
  EXPECT_TRUE(at::equal(row->full_bias(), serial->bias.detach()));
}

TEST(ParallelLinear, IndivisibleHiddenSizeIsRejected) {
  auto tp = test::world();
  if (tp->size() == 1) GTEST_SKIP() << "every size divides by 1";
  const int64_t odd = tp->size() * 3 + 1;
  EXPECT_ERROR_CONTAINS(nn::ColumnParallelLinear(nn::ColumnParallelLinearOptions(8, odd), tp),
                        "ColumnParallelLinear out_features", "is not divisible by the tensor-parallel size");
  EXPECT_ERROR_CONTAINS(nn::RowParallelLinear(nn::RowParallelLinearOptions(odd, 8), tp),
                        "RowParallelLinear in_features", "not divisible");
  nn::ColumnParallelLinear ok(nn::ColumnParallelLinearOptions(8, tp->size() * 2), tp);
  ok->to(test::device());
  EXPECT_ERROR_CONTAINS(
      ok->load_full(at::zeros({3, 3}, test::device_options()), at::zeros({3}, test::device_options())), "load_full",
      "expected");
}

TEST(ParallelLinear, PrettyPrintAndClone) {
  auto tp = test::world();
  nn::ColumnParallelLinear layer(nn::ColumnParallelLinearOptions(kHidden, kFfn), tp);
  layer->to(test::device());
  std::ostringstream text;
  text << *layer;
  EXPECT_NE(text.str().find("ColumnParallelLinear(in_features=12"), std::string::npos) << text.str();
  auto copy = std::dynamic_pointer_cast<nn::ColumnParallelLinearImpl>(layer->clone());
  ASSERT_TRUE(copy != nullptr);
  EXPECT_TRUE(at::equal(copy->weight, layer->weight));
  EXPECT_NE(copy->weight.data_ptr(), layer->weight.data_ptr());
}

}  // namespace
}  // namespace tessera
