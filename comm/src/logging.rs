//! `WEFT_DEBUG=INFO|DEBUG|TRACE|WARN` turns on logging to stderr, like NCCL_DEBUG;
//! `WEFT_DEBUG_SUBSYS=INIT,NET,TUNING,...` limits it to those subsystems (tracing targets
//! `weftcc::init`, `weftcc::net`, ...). A program that installed its own `tracing` subscriber
//! keeps it: this only installs one when none is set.

/// The subsystems `WEFT_DEBUG_SUBSYS` may name (each the tracing target `weftcc::<name>`), and
/// `ALL`.
pub const SUBSYSTEMS: [&str; 10] = [
    "INIT",
    "NET",
    "SHM",
    "BOOTSTRAP",
    "OP",
    "TUNING",
    "ERROR",
    "CUDA",
    "TRACE",
    "ALL",
];

/// Checks a `WEFT_DEBUG_SUBSYS` value: subsystems separated by commas, each one of
/// [`SUBSYSTEMS`] (any case).
pub fn check_subsystems(value: &str) -> std::result::Result<(), String> {
    match value
        .split(',')
        .map(str::trim)
        .find(|s| !SUBSYSTEMS.iter().any(|k| k.eq_ignore_ascii_case(s)))
    {
        Some(bad) => Err(format!(
            "subsystems separated by commas, each one of {} ({bad:?} is none)",
            SUBSYSTEMS.join(", ")
        )),
        None => Ok(()),
    }
}

/// Installs the stderr logger once per process if `WEFT_DEBUG` asks for it.
pub fn init() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // A value that is not one of the levels is refused by `CommConfig::from_env` (and by
        // `weft run` before it starts a rank); here it leaves logging off.
        let Ok(Some(level)) = weftcc_settings::DEBUG.choice() else {
            return;
        };
        let level = match level {
            "WARN" => "warn",
            "INFO" => "info",
            "DEBUG" => "debug",
            "TRACE" => "trace",
            _ => return,
        };
        let filter = match weftcc_settings::DEBUG_SUBSYS.value() {
            Some(subsys) if !subsys.eq_ignore_ascii_case("ALL") => subsys
                .split(',')
                .map(|s| format!("weftcc::{}={level}", s.trim().to_ascii_lowercase()))
                .collect::<Vec<_>>()
                .join(","),
            _ => format!("weftcc={level},weftcc_transports={level},weftcc_collectives={level}"),
        };
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_target(true)
            .try_init();
    });
}

#[cfg(test)]
mod tests {
    #[test]
    fn subsystems_are_checked_one_by_one() {
        assert!(super::check_subsystems("INIT,net, Tuning").is_ok());
        assert!(super::check_subsystems("ALL").is_ok());
        let e = super::check_subsystems("INIT,NETT").unwrap_err();
        assert!(e.contains("\"NETT\" is none"), "{e}");
    }
}
