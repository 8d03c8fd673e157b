#pragma once
// Command-line options of tessera's commands: one table per command, read
// from flags and from a JSON file (--config), printed as --help and as
// Markdown for docs/cli.md. Parsing is CLI11's; the table is tessera's.
//
// Note [One option table]
// A command registers each option once, bound to the field it sets:
//
//   RunOptions run;                       // defaults live in the struct
//   cli::Command cmd("train_gpt", "Trains a GPT on every kind of parallelism.");
//   cmd.group("Grid").add("dp", &run.grid().data(), "data-parallel size; 0: the rest of the world");
//
// The default shown by --help is the field's value when it is registered,
// so a default is written in one place. parse() reads `--config FILE` (a
// JSON object whose keys are option names, with '-' or '_'), then the flags
// over it: a flag always wins over the file. A bad value, an unknown option
// (named with the closest valid one) or a value missing is a c10::Error that
// every rank raises alike, since every rank parses the same argv.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace tessera {
namespace cli {

// Throws: `value` of --`option` is none of `names` (the closest named).
[[noreturn]] void refuse_choice(const std::string& option, const std::string& value,
                                const std::vector<std::string>& names);

// The name in `names` closest to `word` (edit distance), for "did you mean".
std::string closest(const std::string& word, const std::vector<std::string>& names);

struct Option {
  std::string name;           // the flag without "--": "tp-mode"; a positional's placeholder: "CHECKPOINT"
  std::string type;           // "INT", "FLOAT", "TEXT", "BOOL", or the choices "1d|2d|2.5d|3d"
  std::string help;           // one line
  std::string default_text;   // as --help shows it; empty: none
  std::string group;          // the section of --help
  bool is_switch = false;     // a bool: "--name" alone sets true, "--name=false" false
  bool positional = false;
  bool required = false;
  // Sets the bound field from text; throws c10::Error naming the option on a bad value.
  std::function<void(const std::string&)> set;
};

// What parse() found: run the command, or print `text` (help, version) and exit 0.
struct Parsed {
  bool run = true;
  std::string text;
};

class Command {
 public:
  // `summary`: one line; `usage`: the synopsis after the name (default "[OPTIONS]").
  Command(std::string name, std::string summary, std::string usage = "[OPTIONS]");

  const std::string& name() const { return name_; }
  // Following options go into this section of --help ("Options" until called).
  Command& group(std::string title);
  // A paragraph printed after the options in --help (examples, notes).
  Command& epilog(std::string text);

  Command& add(const std::string& name, int* target, std::string help);
  Command& add(const std::string& name, int64_t* target, std::string help);
  Command& add(const std::string& name, uint64_t* target, std::string help);
  Command& add(const std::string& name, double* target, std::string help);
  Command& add(const std::string& name, bool* target, std::string help);
  // `choices` non-empty: the value must be one of them.
  Command& add(const std::string& name, std::string* target, std::string help, std::vector<std::string> choices = {});
  // Any other type: `parse` from text (throwing c10::Error with its rule), `show` for the default.
  template <class T, class Parse, class Show>
  Command& add(const std::string& name, T* target, std::string help, std::string type, Parse parse, Show show) {
    Option o;
    o.name = name;
    o.type = std::move(type);
    o.help = std::move(help);
    o.default_text = show(*target);
    o.set = [target, parse](const std::string& text) { *target = parse(text); };
    return add_option(std::move(o));
  }
  // An enum (or any type) with a fixed list of names: `names[i]` is `values[i]`.
  template <class T>
  Command& add_enum(const std::string& name, T* target, std::string help, std::vector<std::string> names,
                    std::vector<T> values) {
    std::string type, shown;
    for (size_t i = 0; i < names.size(); ++i) {
      type += (i ? "|" : "") + names[i];
      if (values[i] == *target) shown = names[i];
    }
    Option o;
    o.name = name;
    o.type = type;
    o.help = std::move(help);
    o.default_text = shown;
    o.set = [name, target, names, values](const std::string& text) {
      for (size_t i = 0; i < names.size(); ++i)
        if (names[i] == text) {
          *target = values[i];
          return;
        }
      refuse_choice(name, text, names);
    };
    return add_option(std::move(o));
  }
  // A positional argument, in the order added.
  Command& positional(const std::string& placeholder, std::string* target, std::string help, bool required = true);
  // The general form: every add() above ends here.
  Command& add_option(Option option);
  // Called at the end of every parse() that returns run = true.
  Command& on_parsed(std::function<void(const Command&)> hook);
  // Shows `text` as the default in --help instead of the bound value
  // (a default computed at run time: "10% of --steps").
  Command& default_text(const std::string& name, std::string text);

  // Reads argv (argv[0] is the program). Collective in effect: every rank
  // must see the same argv and files, and throws alike.
  Parsed parse(int argc, const char* const* argv);
  // Whether the option was set by a flag or by the --config file.
  bool given(const std::string& name) const;
  // Every option set by a flag or the --config file, in the order set.
  const std::vector<std::string>& given() const { return given_; }
  // Throws unless the option is known: for checks that name options.
  const Option& option(const std::string& name) const;
  const std::vector<Option>& options() const { return options_; }

  std::string help() const;
  // A section of docs/cli.md: the command, its synopsis and one table per group.
  std::string markdown() const;
  // "tessera 0.1.0 (LibTorch 1.13.0, NCCL backend: no)".
  static std::string version();

 private:
  void apply_config(const std::string& path, const std::vector<std::string>& from_flags);
  void set_value(const Option& o, const std::string& value, const std::string& source);

  std::string name_, summary_, usage_, epilog_;
  std::string group_ = "Options";
  std::vector<Option> options_;
  std::vector<std::string> given_;
  std::vector<std::function<void(const Command&)>> hooks_;
};

}  // namespace cli
}  // namespace tessera
