// train_gpt's command line (train::run_command: every option, their values,
// --config FILE) and the rules between options (RunOptions::check): the
// input is the arguments, separated by NUL bytes; a `--config` argument
// reads the file "config.json" made of the text after the first "\n\n".
#include "fuzz_input.h"

#include "tessera/train/run_options.h"

#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessera;
  std::string t = fuzz::text(data, size);
  std::string config;
  if (const size_t cut = t.find("\n\n"); cut != std::string::npos) {
    config = t.substr(cut + 2);
    t.resize(cut);
  }
  const std::string config_path =
      fuzz::write_file("config.json", reinterpret_cast<const uint8_t*>(config.data()), config.size());
  std::vector<std::string> args{"train_gpt"};
  size_t start = 0;
  for (size_t i = 0; i <= t.size(); ++i) {
    if (i < t.size() && t[i] != '\0') continue;
    std::string a = t.substr(start, i - start);
    if (a == "CONFIG") a = config_path;
    if (!a.empty()) args.push_back(a);
    start = i + 1;
  }
  if (args.size() > 64) return 0;
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  return fuzz::run([&] {
    train::RunOptions run;
    cli::Command cmd = train::run_command("train_gpt", "fuzzed", run);
    const auto parsed = cmd.parse(static_cast<int>(argv.size()), argv.data());
    if (parsed.run) run.check(8);
  });
}
