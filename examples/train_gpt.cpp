// train_gpt: a GPT trained with every kind of parallelism tessera has, on a
// text corpus (bytes) or token ids (docs/train-gpt.md). Every option and its
// default: train_gpt --help (docs/cli.md).
//
//   mpirun -np 8 train_gpt --dp 2 --pp 2 --tp 2 --spec zero2 --steps 200
//   mpirun -np 4 train_gpt --config run.json      (option names as keys)
//
// The program is the training loop. The library holds the rest:
// train::RunOptions (the options and their rules), train::TokenData (the
// windows a step trains on), train::GPTRun (the GPT on the run's layout, a
// Trainer or an ElasticTrainer, resuming, the final weights) and
// train::MetricsLog (progress lines and JSON lines).
#include <tessera/comm/factory.h>
#include <tessera/comm/flight_recorder.h>
#include <tessera/comm/tracing_communicator.h>
#include <tessera/context/hosts.h>
#include <tessera/train/gpt_run.h>
#include <tessera/train/link_probe.h>
#include <tessera/train/metrics.h>
#include <tessera/train/run_plan.h>
#include <tessera/train/token_data.h>

#include "example_main.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace {

using namespace tessera;

std::string human_bytes(double b) {
  if (b >= 1e9) return fmt::format("{:.2f} GB", b / 1e9);
  if (b >= 1e6) return fmt::format("{:.2f} MB", b / 1e6);
  return fmt::format("{:.1f} kB", b / 1e3);
}

// Bytes as text (a vocabulary of 256), token ids as <id> otherwise.
std::string as_text(const std::vector<int64_t>& tokens, int64_t vocab) {
  std::string text;
  for (int64_t t : tokens) {
    if (vocab != 256) {
      text += fmt::format("<{}>", t);
    } else {
      text += (t == '\n' || t == '\t' || (t >= 32 && t < 127)) ? static_cast<char>(t) : '?';
    }
  }
  return text;
}

int train_loop(train::RunOptions options, const std::shared_ptr<comm::TracingCommunicator>& world,
               const std::shared_ptr<comm::CommTrace>& trace, std::chrono::steady_clock::time_point started) {
  options.check(world->size());
  train::MetricsLog log(world->rank() == 0, options.metrics());
  const train::TokenData data = train::TokenData::load(options.data(), options.data_format());
  data.check_window(options.seq());
  // The model: the flags' (its vocabulary the data's), or --init-from's
  // config.json; its context stays the run's sequence (--seq).
  if (options.init_from().empty())
    options.model().vocab(data.vocab());
  else
    options.model(train::run_model(options).context(options.seq()));

  // --plan: the planner chooses the layout (auto) or predicts the options' one (flags).
  std::optional<planner::Estimate> predicted;
  if (options.plan() != train::PlanMode::kNone) predicted = train::plan_run(options, world, log);

  train::GPTRun run(world, options, options.init_from().empty() ? data.vocab() : data.needed_vocab());
  if (!options.resume().empty())
    log.print(fmt::format("resumed from {} at step {}", options.resume(), run.start_step()));
  const double flops_per_token = train::gpt_flops_per_token(run.config(), options.seq());
  // Every rank at once: each one's share of the cores (or of a shared GPU).
  const c10::Device device = options.resolved_device();
  const double peak_flops = train::measured_matmul_flops(device.is_cuda() ? 4096 : 512, 5, device,
                                                         options.bf16() ? at::kBFloat16 : at::kFloat);
  const auto& cfg = run.config();
  const context::HostMap host_map = context::map_hosts(*world);
  const std::string hosts = host_map.describe();
  log.print(fmt::format(
      "train_gpt: {} | {} | data {} ({} tokens, vocab {}) | GPT {} layers, hidden {}, {} heads, "
      "{:.2f} M parameters | {} | {} steps of {} x {} tokens",
      run.describe(), hosts, data.source(), data.size(), data.vocab(), cfg.layers(), cfg.hidden(), cfg.heads(),
      static_cast<double>(run.parameters()) / 1e6, options.optimizer(), options.steps(),
      options.elastic() ? "(" + options.batch_schedule() + ")" : std::to_string(options.batch()), options.seq()));

  const uint64_t seed = options.grid().seed();
  std::vector<double> step_seconds;  // for --plan's measured step time
  double last_loss = 0;
  for (int64_t step = run.start_step(); step < options.steps(); ++step) {
    const std::string before = run.layout_name();
    if (const auto moved = run.adapt(step)) {
      log.record("migration", {{"step", static_cast<double>(step)}, {"data_size", run.data_size()},
                               {"bytes_moved", static_cast<double>(moved->bytes_moved)},
                               {"bytes_kept", static_cast<double>(moved->bytes_kept)}, {"seconds", moved->seconds}});
      log.print(fmt::format("step {:4d}/{} | elastic: batch {}, {} -> {} | moved {}, kept {} in place | {:.2f} s "
                            "(build {:.2f}, exchange {:.2f})",
                            step, options.steps(), run.batch(step), before, run.layout_name(),
                            human_bytes(static_cast<double>(moved->bytes_moved)),
                            human_bytes(static_cast<double>(moved->bytes_kept)), moved->seconds,
                            moved->build_seconds, moved->exchange_seconds));
    }
    train::Trainer* trainer = run.trainer();
    if (trainer == nullptr) continue;  // idle in this layout: the next move wakes it
    const int64_t batch = run.batch(step);
    const auto rows = run.rows(batch);
    auto local = [&rows](const at::Tensor& t) { return t.narrow(0, rows.first, rows.count); };
    const auto w = data.windows(train::Split::kTrain, batch, options.seq(),
                                train::window_seed(seed, step, train::Split::kTrain));
    const double bytes_before = static_cast<double>(trace->total().bytes);
    const auto st = trainer->train_step(local(w.inputs), local(w.targets));
    last_loss = st.loss;
    step_seconds.push_back(st.seconds);
    const double tokens_per_s = static_cast<double>(batch * options.seq()) / st.seconds;
    const double mfu = flops_per_token * tokens_per_s / (peak_flops * trainer->context()->world()->size());
    const double state = static_cast<double>(trainer->memory().total());
    const double comm_bytes = static_cast<double>(trace->total().bytes) - bytes_before;
    const models::MoEBalance moe = run.model()->moe_balance(*trainer->context()->world());
    log.record("train", {{"step", st.step}, {"loss", st.loss}, {"lr", st.lr}, {"grad_norm", st.grad_norm},
                         {"tokens_per_s", tokens_per_s}, {"mfu", mfu}, {"model_state_bytes", state},
                         {"comm_bytes", comm_bytes}, {"seconds", st.seconds}, {"moe_aux_loss", moe.aux_loss},
                         {"moe_max_over_mean", moe.max_over_mean}, {"moe_dropped", moe.dropped},
                         {"wait_s", st.wait_seconds}, {"slowest_rank", static_cast<double>(st.slowest_rank)},
                         {"straggler_lag_s", st.straggler_lag}});
    if (options.rank_times())
      log.record("ranks", {{"step", static_cast<double>(st.step)}},
                 {{"compute_s", st.rank_compute_seconds}, {"wait_s", st.rank_wait_seconds}});
    // Note [Slow links]: between steps, every rank at once.
    std::string slow_link;
    const int64_t probe_every = options.link_probe_every();
    if (probe_every > 0 && host_map.hosts() >= 2 && (st.step % probe_every == 0 || st.step == 1)) {
      const train::LinkProbe probe = train::probe_links(*world, host_map);
      log.record("links",
                 {{"step", static_cast<double>(st.step)},
                  {"slow_host", static_cast<double>(probe.slow_host)},
                  {"slowdown", probe.slowdown}},
                 {{"host_seconds", probe.host_seconds}});
      if (probe.slow_host >= 0)
        slow_link = fmt::format(" | slow link: host {} ({:.0f} ms per 1 MiB exchange, {:.1f}x the median host)",
                                host_map.names[static_cast<size_t>(probe.slow_host)],
                                1000 * probe.host_seconds[static_cast<size_t>(probe.slow_host)], probe.slowdown);
    }
    // Note [Stragglers]: named when its lag is a large enough part of the step.
    const bool straggling = st.slowest_rank >= 0 && options.straggler_threshold() > 0 &&
                            st.straggler_lag > options.straggler_threshold() * st.seconds;
    if (st.step % options.log_every() == 0 || st.step == options.steps())
      log.print(fmt::format(
          "step {:4d}/{}{} | loss {:.4f} | lr {:.2e} | {:7.0f} tok/s | MFU {:4.1f}% | state {}/rank | "
          "comm {}/step/rank | {:.0f} ms{}{}{}{}",
          st.step, options.steps(), options.elastic() ? fmt::format(" | {} | batch {}", run.layout_name(), batch) : "",
          st.loss, st.lr, tokens_per_s, 100 * mfu, human_bytes(state), human_bytes(comm_bytes), 1000 * st.seconds,
          cfg.experts() > 0 ? fmt::format(" | experts max/mean {:.2f}, aux {:.4f}, dropped {:.0f}", moe.max_over_mean,
                                          moe.aux_loss, moe.dropped)
                            : "",
          st.skipped ? " | skipped (overflow)" : "",
          straggling ? fmt::format(" | slowest rank {} +{:.0f} ms", st.slowest_rank, 1000 * st.straggler_lag) : "",
          slow_link));
    const int64_t every = options.eval_every();
    if (every > 0 && (st.step % every == 0 || st.step == options.steps())) {
      const auto v = data.windows(train::Split::kValidation, batch, options.seq(),
                                  train::window_seed(seed, st.step, train::Split::kValidation));
      const double val = trainer->evaluate(local(v.inputs), local(v.targets));
      log.record("eval", {{"step", st.step}, {"val_loss", val}});
      log.print(fmt::format("step {:4d}/{} | validation loss {:.4f}", st.step, options.steps(), val));
    }
    if (options.save_every() > 0 && st.step % options.save_every() == 0)
      trainer->save(fmt::format("{}/step-{:06d}", options.save(), st.step), run.metadata(st.step));
  }
  run.finish();
  if (predicted) {
    const double measured = train::median_step(step_seconds);
    log.record("plan", {{"predicted_s", predicted->step_s}, {"measured_s", measured},
                        {"predicted_peak_bytes", predicted->memory.peak()}});
    log.print(fmt::format("planner: {} | step predicted {:.4g} s, measured {:.4g} s (median after warm-up), "
                          "measured/predicted {:.2f}",
                          predicted->plan.to_string(), predicted->step_s, measured, measured / predicted->step_s));
  }

  // The final weights: --save's DIR/final, or a temporary directory for --consolidate and --sample.
  const std::string final_dir = run.save_final();
  const auto sample = run.consolidate_and_sample(final_dir, data.vocab() == 256 ? int64_t{'\n'} : 0);
  if (!options.consolidate().empty()) log.print(fmt::format("consolidated weights: {}", options.consolidate()));
  run.export_hf(final_dir);
  if (!options.export_hf().empty()) log.print(fmt::format("Hugging Face model: {}", options.export_hf()));
  if (!sample.empty())
    log.print(fmt::format("final loss {:.4f}; sampled text (temperature 0.8):\n{}", last_loss,
                          as_text(sample, data.vocab())));
  log.print(fmt::format("train_gpt: done in {:.0f} s",
                        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count()));
  return 0;
}

// The flight records (Note [Flight recorder]) go beside the metrics unless
// TESSERA_TRACE_DIR says where; an error other than a timeout (which has
// written them already) writes this rank's record before it ends the job.
int run_training(const train::RunOptions& options) {
  const auto started = std::chrono::steady_clock::now();
  comm::WorldOptions world_options;
  world_options.device = options.resolved_device();
  world_options.backend = options.backend();
  if (world_options.flight_recorder.dir.empty() && !options.metrics().empty())
    world_options.flight_recorder.dir = options.metrics() + ".flight";
  auto trace = std::make_shared<comm::CommTrace>();
  auto world = std::make_shared<comm::TracingCommunicator>(comm::make_world_communicator(world_options), trace);
  try {
    return train_loop(options, world, trace, started);
  } catch (const comm::TimeoutError&) {
    throw;
  } catch (const std::exception& e) {
    const auto* error = dynamic_cast<const c10::Error*>(&e);
    if (const auto recorder = comm::flight_recorder_of(world))
      recorder->dump(std::string("error: ") + (error ? error->what_without_backtrace() : e.what()));
    throw;
  }
}

}  // namespace

int main(int argc, char** argv) {
  train::RunOptions options;
  cli::Command command = train::run_command(
      "train_gpt", "trains a GPT on text or token ids with data, pipeline, tensor, sequence and expert parallelism",
      options);
  return tessera_examples::run_command(argc, argv, command, [&] { return run_training(options); });
}
