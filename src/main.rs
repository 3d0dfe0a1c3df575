//! The `warren` binary: command-line parsing and wiring. Everything else lives in the crates.

mod admin;
mod config;
mod join;
mod rabbitmq_conf;
mod resources;
mod server;
mod tls;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Warren: a message broker that speaks AMQP 0-9-1.
#[derive(Debug, Parser)]
#[command(name = "warren", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run the broker.
    Server(Box<config::ServerArgs>),
    /// Manage a running broker (rabbitmqctl-style subcommands).
    Ctl {
        /// The broker's data directory (its admin socket lives there).
        #[arg(long, default_value = "./warren-data")]
        data_dir: std::path::PathBuf,
        #[command(subcommand)]
        command: admin::CtlCommand,
    },
}

/// Replace this process with a fresh run of the same binary and arguments (returns only on
/// failure). Sockets are close-on-exec, so the new image binds its ports anew.
fn restart_in_place() -> std::io::Error {
    use std::os::unix::process::CommandExt;
    let mut args = std::env::args_os();
    let program = std::env::current_exe()
        .ok()
        .or_else(|| args.next().map(std::path::PathBuf::from))
        .unwrap_or_default();
    let mut args = std::env::args_os();
    args.next();
    std::process::Command::new(program).args(args).exec()
}

/// mimalloc rather than glibc's malloc: glibc's malloc and free were 18% of a busy leader's CPU,
/// their arena locks contended between the runtime's workers, the WAL writer and the link
/// thread; ten quorum queues carry 31% more with mimalloc for 17% less CPU per message
/// (docs/benchmarks.md, "The allocator").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Cmd::Ctl { data_dir, command } => match admin::ctl(&data_dir, command) {
            Ok(code) => ExitCode::from(code),
            Err(e) => {
                eprintln!("warren ctl: {e:#}");
                ExitCode::FAILURE
            }
        },
        Cmd::Server(args) => {
            let cfg = match config::ServerConfig::load(*args) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("warren: {e:#}");
                    return ExitCode::from(2);
                }
            };
            if let Err(e) = init_logging(&cfg.log_level, cfg.log_format) {
                eprintln!("warren: {e}");
                return ExitCode::from(2);
            }
            let runtime = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("warren: cannot start the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match runtime.block_on(server::run(cfg)) {
                Ok(server::Exit::Stopped) => ExitCode::SUCCESS,
                Ok(server::Exit::Rejoin) => {
                    // Everything is closed and durable: start again, same arguments, as the
                    // cluster node the recorded seeds make it.
                    drop(runtime);
                    let e = restart_in_place();
                    eprintln!("warren: cannot restart to join the cluster: {e}");
                    ExitCode::FAILURE
                }
                Err(e) => {
                    tracing::error!("{e:#}");
                    eprintln!("warren: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// Logs go to stderr: text by default, one JSON object per line with `--log-format json`.
/// The level is a tracing filter, so levels per module work: `info,warren_store=debug`.
/// A filter that does not parse is refused (exit 2) rather than replaced: an operator who asked
/// for `warren_store=debug` must not silently get `info`.
fn init_logging(level: &str, format: config::LogFormat) -> Result<(), String> {
    let mut filter = tracing_subscriber::EnvFilter::try_new(level)
        .map_err(|e| format!("invalid --log-level '{level}': {e}"))?;
    if !level.contains("openraft") {
        // openraft narrates every election and replication step at info: its warnings are
        // what an operator needs, unless asked for more (`--log-level info,openraft=info`).
        filter = filter.add_directive(
            "openraft=warn"
                .parse()
                .map_err(|e| format!("openraft filter: {e}"))?,
        );
    }
    // Colour only on a terminal: a file, a pipe or journald gets plain text (NO_COLOR too).
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    match format {
        config::LogFormat::Text => builder.init(),
        config::LogFormat::Json => builder.json().init(),
    }
    Ok(())
}
