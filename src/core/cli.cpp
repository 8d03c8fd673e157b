#include "tessera/core/cli.h"

#include "tessera/config.h"

#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <limits>
#include <map>
#include <memory>

namespace tessera {
namespace cli {
namespace {

using Json = nlohmann::json;

// Options every command has, answered by parse() itself.
const std::vector<std::string>& builtin_names() {
  static const std::vector<std::string> names = {"config", "help", "version", "help-markdown"};
  return names;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

std::string strip_dashes(std::string s) {
  while (!s.empty() && s.front() == '-') s.erase(0, 1);
  return s;
}

std::string flag_of(const Option& o) { return o.positional ? o.name : "--" + o.name; }

// "--name TYPE" as --help and the docs show it.
std::string synopsis(const Option& o) {
  if (o.positional) return o.name;
  return o.is_switch ? flag_of(o) : flag_of(o) + " " + o.type;
}

int64_t to_int(const std::string& option, const std::string& text, int64_t lo, int64_t hi) {
  size_t used = 0;
  int64_t v = 0;
  bool ok = !text.empty();
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    ok = false;
  }
  TORCH_CHECK(ok && used == text.size(), "option --", option, " takes an integer, got '", text, "'");
  TORCH_CHECK(v >= lo && v <= hi, "option --", option, " is out of range: ", text);
  return v;
}

// The same names with '_' as with '-': JSON keys are often written that way.
std::string dashed(std::string key) {
  std::replace(key.begin(), key.end(), '_', '-');
  return key;
}

}  // namespace

void refuse_choice(const std::string& option, const std::string& value, const std::vector<std::string>& names) {
  std::string list;
  for (size_t i = 0; i < names.size(); ++i) list += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i];
  TORCH_CHECK(false, "option --", option, " must be ", list, "; got '", value, "' (did you mean '",
              closest(value, names), "'?)");
}

std::string closest(const std::string& word, const std::vector<std::string>& names) {
  std::string best;
  size_t best_distance = std::numeric_limits<size_t>::max();
  for (const auto& n : names) {
    const size_t d = edit_distance(word, n);
    if (d < best_distance) {
      best_distance = d;
      best = n;
    }
  }
  return best;
}

Command::Command(std::string name, std::string summary, std::string usage)
    : name_(std::move(name)), summary_(std::move(summary)), usage_(std::move(usage)) {}

Command& Command::group(std::string title) {
  group_ = std::move(title);
  return *this;
}

Command& Command::epilog(std::string text) {
  epilog_ = std::move(text);
  return *this;
}

Command& Command::add_option(Option option) {
  TORCH_INTERNAL_ASSERT(option.set, "cli: option ", option.name, " has no setter");
  const auto& builtin = builtin_names();
  TORCH_INTERNAL_ASSERT(std::find(builtin.begin(), builtin.end(), option.name) == builtin.end(),
                        "cli: --", option.name, " is built into every command");
  for (const auto& o : options_)
    TORCH_INTERNAL_ASSERT(o.name != option.name, "cli: ", name_, " registers --", option.name, " twice");
  option.group = group_;
  options_.push_back(std::move(option));
  return *this;
}

Command& Command::on_parsed(std::function<void(const Command&)> hook) {
  hooks_.push_back(std::move(hook));
  return *this;
}

Command& Command::default_text(const std::string& name, std::string text) {
  for (auto& o : options_)
    if (o.name == name) {
      o.default_text = std::move(text);
      return *this;
    }
  TORCH_INTERNAL_ASSERT(false, "cli: no option --", name);
}

Command& Command::add(const std::string& name, int* target, std::string help) {
  return add(name, target, std::move(help), "INT",
             [name](const std::string& t) {
               return static_cast<int>(to_int(name, t, std::numeric_limits<int>::min(), std::numeric_limits<int>::max()));
             },
             [](int v) { return std::to_string(v); });
}

Command& Command::add(const std::string& name, int64_t* target, std::string help) {
  return add(name, target, std::move(help), "INT",
             [name](const std::string& t) {
               return to_int(name, t, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max());
             },
             [](int64_t v) { return std::to_string(v); });
}

Command& Command::add(const std::string& name, uint64_t* target, std::string help) {
  return add(name, target, std::move(help), "INT",
             [name](const std::string& t) {
               return static_cast<uint64_t>(to_int(name, t, 0, std::numeric_limits<int64_t>::max()));
             },
             [](uint64_t v) { return std::to_string(v); });
}

Command& Command::add(const std::string& name, double* target, std::string help) {
  return add(name, target, std::move(help), "FLOAT",
             [name](const std::string& t) {
               size_t used = 0;
               double v = 0;
               bool ok = !t.empty();
               try {
                 v = std::stod(t, &used);
               } catch (const std::exception&) {
                 ok = false;
               }
               TORCH_CHECK(ok && used == t.size(), "option --", name, " takes a number, got '", t, "'");
               return v;
             },
             [](double v) { return fmt::format("{}", v); });
}

Command& Command::add(const std::string& name, bool* target, std::string help) {
  Option o;
  o.name = name;
  o.type = "BOOL";
  o.help = std::move(help);
  o.default_text = *target ? "true" : "false";
  o.is_switch = true;
  o.set = [name, target](const std::string& t) {
    if (t == "true" || t == "1" || t == "yes" || t == "on") {
      *target = true;
    } else if (t == "false" || t == "0" || t == "no" || t == "off") {
      *target = false;
    } else {
      TORCH_CHECK(false, "option --", name, " takes true or false, got '", t, "'");
    }
  };
  return add_option(std::move(o));
}

Command& Command::add(const std::string& name, std::string* target, std::string help,
                      std::vector<std::string> choices) {
  Option o;
  o.name = name;
  o.help = std::move(help);
  o.default_text = *target;
  if (choices.empty()) {
    o.type = "TEXT";
    o.set = [target](const std::string& t) { *target = t; };
  } else {
    for (size_t i = 0; i < choices.size(); ++i) o.type += (i ? "|" : "") + choices[i];
    o.set = [name, target, choices](const std::string& t) {
      if (std::find(choices.begin(), choices.end(), t) == choices.end()) refuse_choice(name, t, choices);
      *target = t;
    };
  }
  return add_option(std::move(o));
}

Command& Command::positional(const std::string& placeholder, std::string* target, std::string help, bool required) {
  Option o;
  o.name = placeholder;
  o.type = "TEXT";
  o.help = std::move(help);
  o.default_text = *target;
  o.positional = true;
  o.required = required;
  o.set = [target](const std::string& t) { *target = t; };
  return add_option(std::move(o));
}

const Option& Command::option(const std::string& name) const {
  for (const auto& o : options_)
    if (o.name == name) return o;
  TORCH_INTERNAL_ASSERT(false, "cli: ", name_, " has no option --", name);
}

bool Command::given(const std::string& name) const {
  option(name);  // a typo in the caller's name is a bug, not "not given"
  return std::find(given_.begin(), given_.end(), name) != given_.end();
}

void Command::set_value(const Option& o, const std::string& value, const std::string& source) {
  std::string error;
  try {
    o.set(value);
  } catch (const c10::Error& e) {
    error = e.msg();
  }
  TORCH_CHECK(error.empty(), error, source);
  if (std::find(given_.begin(), given_.end(), o.name) == given_.end()) given_.push_back(o.name);
}

void Command::apply_config(const std::string& path, const std::vector<std::string>& from_flags) {
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "--config ", path, " cannot be read");
  Json file;
  try {
    file = Json::parse(in);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "--config ", path, " is not valid JSON: ", e.what());
  }
  TORCH_CHECK(file.is_object(), "--config ", path, " must hold a JSON object of option names and values");
  std::vector<std::string> names;
  for (const auto& o : options_)
    if (!o.positional) names.push_back(o.name);
  for (auto it = file.begin(); it != file.end(); ++it) {
    const std::string key = dashed(it.key());
    auto o = std::find_if(options_.begin(), options_.end(),
                          [&](const Option& x) { return !x.positional && x.name == key; });
    TORCH_CHECK(o != options_.end(), "unknown option '", it.key(), "' in --config ", path,
                "; the closest valid one is '", closest(key, names), "' (", name_, " --help lists them)");
    if (std::find(from_flags.begin(), from_flags.end(), key) != from_flags.end()) continue;  // the flag wins
    const Json& v = it.value();
    TORCH_CHECK(v.is_string() || v.is_number() || v.is_boolean(), "option '", it.key(), "' in --config ",
                path, " must be a string, a number or a boolean, got ", v.dump());
    set_value(*o, v.is_string() ? v.get<std::string>() : v.dump(), fmt::format(" (in --config {})", path));
  }
}

Parsed Command::parse(int argc, const char* const* argv) {
  CLI::App app(summary_, name_);
  app.set_help_flag();
  app.allow_extras(true);
  app.positionals_at_end(false);
  bool help = false, version = false, markdown = false;
  std::string config;
  app.add_flag("-h,--help", help);
  app.add_flag("--version", version);
  app.add_flag("--help-markdown", markdown);
  app.add_option("--config", config)->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  std::vector<std::string> raw(options_.size());
  std::vector<CLI::Option*> bound(options_.size());
  for (size_t i = 0; i < options_.size(); ++i) {
    const Option& o = options_[i];
    bound[i] = o.is_switch ? app.add_flag(flag_of(o), raw[i]) : app.add_option(flag_of(o), raw[i]);
    bound[i]->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ArgumentMismatch& e) {
    TORCH_CHECK(false, e.what(), " (a flag needs its value: --name VALUE or --name=VALUE)");
  } catch (const CLI::ParseError& e) {
    TORCH_CHECK(false, e.what(), " (", name_, " --help lists the options)");
  }
  if (help) return {false, this->help()};
  if (version) return {false, name_ + ": " + Command::version() + "\n"};
  if (markdown) return {false, this->markdown()};

  std::vector<std::string> names;
  for (const auto& o : options_)
    if (!o.positional) names.push_back(o.name);
  for (const auto& n : builtin_names()) names.push_back(n);
  // CLI11 takes the token after a flag as its value even when it is a flag itself.
  std::vector<std::string> from_flags;
  for (size_t i = 0; i < options_.size(); ++i) {
    if (bound[i]->count() == 0) continue;
    const std::string& v = raw[i];
    if (!options_[i].positional && v.rfind("--", 0) == 0) {
      const std::string word = strip_dashes(v.substr(0, v.find('=')));
      TORCH_CHECK(std::find(names.begin(), names.end(), word) == names.end(), "flag --", options_[i].name,
                  " needs a value, got the flag ", v);
    }
    from_flags.push_back(options_[i].name);
  }
  for (const auto& extra : app.remaining()) {
    if (extra.rfind("-", 0) == 0) {
      const std::string word = strip_dashes(extra.substr(0, extra.find('=')));
      TORCH_CHECK(false, "unknown flag ", extra.substr(0, extra.find('=')), "; the closest valid one is --",
                  closest(word, names), " (", name_, " --help lists them)");
    }
    TORCH_CHECK(false, "unexpected argument '", extra, "' (usage: ", name_, " ", usage_, ")");
  }
  if (!config.empty()) apply_config(config, from_flags);
  for (size_t i = 0; i < options_.size(); ++i)
    if (bound[i]->count() > 0) set_value(options_[i], raw[i], "");
  for (const auto& o : options_)
    TORCH_CHECK(!o.required || given(o.name), "missing ", o.name, " (usage: ", name_, " ", usage_, ")");
  for (const auto& hook : hooks_) hook(*this);
  return {};
}

std::string Command::help() const {
  std::string out = fmt::format("{}: {}\n\nUsage: {} {}\n", name_, summary_, name_, usage_);
  size_t width = 0;
  for (const auto& o : options_) width = std::max(width, synopsis(o).size());
  width = std::min<size_t>(width, 34);
  auto line = [&](const std::string& left, const std::string& text) {
    std::string s = "  " + left;
    if (left.size() > width) {
      s += "\n" + std::string(width + 2, ' ');
    } else {
      s += std::string(width - left.size(), ' ');
    }
    return s + "  " + text + "\n";
  };
  std::vector<std::string> groups;
  for (const auto& o : options_)
    if (std::find(groups.begin(), groups.end(), o.group) == groups.end()) groups.push_back(o.group);
  for (const auto& g : groups) {
    out += "\n" + g + ":\n";
    for (const auto& o : options_) {
      if (o.group != g) continue;
      std::string text = o.help;
      if (o.required) {
        text += " (required)";
      } else if (!o.default_text.empty() || o.type == "TEXT") {
        text += " (default: " + (o.default_text.empty() ? std::string("none") : o.default_text) + ")";
      }
      out += line(synopsis(o), text);
    }
  }
  out += "\nEvery command:\n";
  out += line("--config FILE", "read options from a JSON object {\"name\": value}; flags win over it");
  out += line("-h, --help", "print this help and exit");
  out += line("--version", "print the version and exit");
  if (!epilog_.empty()) out += "\n" + epilog_ + "\n";
  return out;
}

std::string Command::markdown() const {
  std::string out = fmt::format("## {}\n\n{}\n\n```\n{} {}\n```\n", name_, summary_, name_, usage_);
  std::vector<std::string> groups;
  for (const auto& o : options_)
    if (std::find(groups.begin(), groups.end(), o.group) == groups.end()) groups.push_back(o.group);
  for (const auto& g : groups) {
    out += fmt::format("\n### {}\n\n| option | default | meaning |\n| --- | --- | --- |\n", g);
    for (const auto& o : options_) {
      if (o.group != g) continue;
      std::string type = synopsis(o);
      size_t bar = 0;
      while ((bar = type.find('|', bar)) != std::string::npos) {
        type.replace(bar, 1, "\\|");
        bar += 2;
      }
      const std::string def = o.required ? "required" : (o.default_text.empty() ? "" : "`" + o.default_text + "`");
      out += fmt::format("| `{}` | {} | {} |\n", type, def, o.help);
    }
  }
  if (!epilog_.empty()) out += "\n" + epilog_ + "\n";
  return out;
}

std::string Command::version() {
#ifdef TESSERA_HAVE_NCCL
  const char* nccl = "yes";
#else
  const char* nccl = "no";
#endif
  return fmt::format("tessera {} (LibTorch {}, NCCL backend: {})", TESSERA_VERSION, TESSERA_BUILT_WITH_TORCH, nccl);
}

}  // namespace cli
}  // namespace tessera
