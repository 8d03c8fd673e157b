#include "tessera/optim/by_name.h"

#include "tessera/optim/lamb.h"
#include "tessera/optim/lars.h"
#include "tessera/optim/param_groups.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

namespace tessera {
namespace optim {

const std::vector<std::string>& optimizer_names() {
  static const std::vector<std::string> names = {"adamw", "adam", "sgd", "lamb", "lars"};
  return names;
}

std::shared_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerByName& o,
                                                        const std::vector<std::pair<std::string, at::Tensor>>& named) {
  const std::string& name = o.name();
  if (name == "lamb") return std::make_shared<Lamb>(param_groups(named, LambOptions(o.lr()).weight_decay(o.weight_decay())));
  if (name == "lars") return std::make_shared<Lars>(param_groups(named, LarsOptions(o.lr()).weight_decay(o.weight_decay())));
  std::vector<at::Tensor> params;
  for (const auto& p : named) params.push_back(p.second);
  if (name == "adamw")
    return std::make_shared<torch::optim::AdamW>(params, torch::optim::AdamWOptions(o.lr()).weight_decay(o.weight_decay()));
  if (name == "adam")
    return std::make_shared<torch::optim::Adam>(params, torch::optim::AdamOptions(o.lr()).weight_decay(o.weight_decay()));
  if (name == "sgd") return std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(o.lr()).momentum(o.momentum()));
  TORCH_CHECK(false, "unknown optimizer '", name, "'; use adamw, adam, sgd, lamb or lars");
}

std::string optimizer_name(const torch::optim::Optimizer& o) {
  // AdamW before Adam: neither derives from the other, but keep the order of the table.
  if (dynamic_cast<const torch::optim::AdamW*>(&o)) return "adamw";
  if (dynamic_cast<const torch::optim::Adam*>(&o)) return "adam";
  if (dynamic_cast<const torch::optim::SGD*>(&o)) return "sgd";
  if (dynamic_cast<const Lamb*>(&o)) return "lamb";
  if (dynamic_cast<const Lars*>(&o)) return "lars";
  return "";
}

}  // namespace optim
}  // namespace tessera
