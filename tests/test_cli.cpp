// cli::Command: flags and --config into bound fields, defaults from the
// fields, the refusals and their messages, --help and the Markdown table.
#include "tessera/core/cli.h"

#include "test_util.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace tessera {
namespace cli {
namespace {

enum class Color { kRed, kBlue };

struct Fields {
  int64_t steps = 100;
  int dp = 0;
  double lr = 3e-3;
  bool stream = false;
  std::string data;
  std::string mode = "1d";
  Color color = Color::kRed;
};

Command command(Fields& f) {
  Command c("prog", "a test program");
  c.group("Run").add("steps", &f.steps, "optimizer steps").add("dp", &f.dp, "data-parallel size").add("lr", &f.lr,
                                                                                                         "peak rate");
  c.group("Data").add("stream", &f.stream, "stream the weights").add("data", &f.data, "the corpus");
  c.add("mode", &f.mode, "tensor mode", {"1d", "2d", "3d"});
  c.add_enum("color", &f.color, "a color", {"red", "blue"}, {Color::kRed, Color::kBlue});
  return c;
}

Parsed parse(Command& c, std::vector<const char*> args) {
  args.insert(args.begin(), "prog");
  return c.parse(static_cast<int>(args.size()), args.data());
}

std::string write_file(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + name;
  std::ofstream(path) << text;
  return path;
}

TEST(Cli, FlagsSetTheBoundFieldsAndDefaultsStay) {
  Fields f;
  Command c = command(f);
  EXPECT_TRUE(parse(c, {"--steps", "5", "--lr=0.5", "--stream", "--mode", "2d", "--color", "blue"}).run);
  EXPECT_EQ(f.steps, 5);
  EXPECT_DOUBLE_EQ(f.lr, 0.5);
  EXPECT_TRUE(f.stream);
  EXPECT_EQ(f.mode, "2d");
  EXPECT_EQ(f.color, Color::kBlue);
  EXPECT_EQ(f.dp, 0);  // not given: the field's default
  EXPECT_TRUE(c.given("steps"));
  EXPECT_TRUE(c.given("stream"));
  EXPECT_FALSE(c.given("dp"));
  Fields g;
  Command d = command(g);
  parse(d, {"--stream=false", "--dp", "-3"});
  EXPECT_FALSE(g.stream);
  EXPECT_EQ(g.dp, -3);
  EXPECT_TRUE(d.given("stream"));
}

TEST(Cli, RefusesUnknownAndMalformedOptionsNamingTheClosest) {
  Fields f;
  Command c = command(f);
  EXPECT_ERROR_CONTAINS(parse(c, {"--step", "5"}), "unknown flag --step", "closest valid one is --steps");
  EXPECT_ERROR_CONTAINS(parse(c, {"--steps", "five"}), "option --steps takes an integer, got 'five'");
  EXPECT_ERROR_CONTAINS(parse(c, {"--lr", "1e-3x"}), "option --lr takes a number, got '1e-3x'");
  EXPECT_ERROR_CONTAINS(parse(c, {"--steps"}), "--steps", "needs its value");
  EXPECT_ERROR_CONTAINS(parse(c, {"--steps", "--lr", "1"}), "flag --steps needs a value, got the flag --lr");
  EXPECT_ERROR_CONTAINS(parse(c, {"--mode", "2.5d"}), "option --mode must be 1d, 2d or 3d; got '2.5d'",
                        "did you mean '2d'");
  EXPECT_ERROR_CONTAINS(parse(c, {"--color", "bleu"}), "must be red or blue", "did you mean 'blue'");
  EXPECT_ERROR_CONTAINS(parse(c, {"--stream=maybe"}), "option --stream takes true or false");
  EXPECT_ERROR_CONTAINS(parse(c, {"stray"}), "unexpected argument 'stray'");
}

TEST(Cli, ConfigFileUnderTheFlags) {
  const std::string path =
      write_file("cli_config.json", R"({"steps": 7, "lr": 0.25, "stream": true, "data": "corpus.txt", "dp": 2})");
  Fields f;
  Command c = command(f);
  parse(c, {"--dp", "4", "--config", path.c_str()});
  EXPECT_EQ(f.steps, 7);
  EXPECT_DOUBLE_EQ(f.lr, 0.25);
  EXPECT_TRUE(f.stream);
  EXPECT_EQ(f.data, "corpus.txt");
  EXPECT_EQ(f.dp, 4);  // the flag wins, before or after --config
  EXPECT_TRUE(c.given("data"));
  const std::string underscores = write_file("cli_config_underscore.json", R"({"mode": "3d"})");
  Fields g;
  Command d = command(g);
  parse(d, {"--config", underscores.c_str()});
  EXPECT_EQ(g.mode, "3d");

  const std::string bad_key = write_file("cli_bad_key.json", R"({"setps": 7})");
  Fields h;
  Command e = command(h);
  EXPECT_ERROR_CONTAINS(parse(e, {"--config", bad_key.c_str()}), "unknown option 'setps' in --config",
                        "closest valid one is 'steps'");
  const std::string bad_value = write_file("cli_bad_value.json", R"({"steps": [1, 2]})");
  EXPECT_ERROR_CONTAINS(parse(e, {"--config", bad_value.c_str()}), "option 'steps' in --config",
                        "must be a string, a number or a boolean");
  const std::string bad_type = write_file("cli_bad_type.json", R"({"steps": 1.5})");
  EXPECT_ERROR_CONTAINS(parse(e, {"--config", bad_type.c_str()}), "option --steps takes an integer, got '1.5'",
                        "(in --config");
  const std::string not_json = write_file("cli_not_json.json", "{steps: 1");
  EXPECT_ERROR_CONTAINS(parse(e, {"--config", not_json.c_str()}), "is not valid JSON");
  EXPECT_ERROR_CONTAINS(parse(e, {"--config", "/nonexistent/run.json"}), "cannot be read");
}

TEST(Cli, HelpVersionAndMarkdownListEveryOption) {
  Fields f;
  Command c = command(f);
  const Parsed help = parse(c, {"--help"});
  EXPECT_FALSE(help.run);
  for (const auto& o : c.options()) EXPECT_NE(help.text.find("--" + o.name), std::string::npos) << o.name;
  EXPECT_NE(help.text.find("(default: 100)"), std::string::npos) << help.text;
  EXPECT_NE(help.text.find("--mode 1d|2d|3d"), std::string::npos) << help.text;
  EXPECT_NE(help.text.find("--config FILE"), std::string::npos);
  EXPECT_EQ(f.steps, 100);  // --help sets nothing
  const Parsed version = parse(c, {"--version"});
  EXPECT_FALSE(version.run);
  EXPECT_NE(version.text.find("tessera "), std::string::npos);
  const std::string md = c.markdown();
  for (const auto& o : c.options()) EXPECT_NE(md.find("`--" + o.name), std::string::npos) << o.name;
  EXPECT_NE(md.find("### Data"), std::string::npos);
  EXPECT_NE(md.find("--mode 1d\\|2d\\|3d"), std::string::npos) << md;
}

TEST(Cli, Positionals) {
  std::string in, out, prefix = "model/";
  Command c("tool", "converts", "IN OUT [PREFIX]");
  c.positional("IN", &in, "input").positional("OUT", &out, "output").positional("PREFIX", &prefix, "prefix", false);
  parse(c, {"a", "b"});
  EXPECT_EQ(in, "a");
  EXPECT_EQ(out, "b");
  EXPECT_EQ(prefix, "model/");
  std::string in2, out2;
  Command d("tool", "converts", "IN OUT");
  d.positional("IN", &in2, "input").positional("OUT", &out2, "output");
  EXPECT_ERROR_CONTAINS(parse(d, {"a"}), "missing OUT", "usage: tool IN OUT");
}

TEST(Cli, Closest) {
  EXPECT_EQ(closest("tp_mod", {"tp-mode", "tp", "sp-mode"}), "tp-mode");
  EXPECT_EQ(closest("sedd", {"seed", "steps", "seq"}), "seed");
}

}  // namespace
}  // namespace cli
}  // namespace tessera
