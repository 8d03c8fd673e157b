// Runs every file under the given directories (a fuzz target's corpus)
// through the target once, as libFuzzer would: what CI does with the
// committed corpus, built with the ordinary compiler. A finding aborts, as
// under the fuzzer; otherwise prints how many inputs ran.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  int64_t inputs = 0;
  for (int i = 1; i < argc; ++i) {
    if (!fs::is_directory(argv[i])) {
      std::fprintf(stderr, "%s: no corpus directory %s\n", argv[0], argv[i]);
      return 1;
    }
    std::vector<fs::path> files;
    for (const auto& e : fs::recursive_directory_iterator(argv[i]))
      if (e.is_regular_file()) files.push_back(e.path());
    for (const auto& f : files) {
      std::ifstream in(f, std::ios::binary);
      const std::vector<char> bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
      ++inputs;
    }
  }
  std::printf("%lld inputs replayed\n", static_cast<long long>(inputs));
  return inputs > 0 ? 0 : 1;
}
