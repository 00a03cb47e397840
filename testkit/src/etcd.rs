//! A real `etcd` for the tests of the etcd store: started on free loopback ports in a temporary
//! directory, killed and its directory removed when dropped (also when the test fails).
//! Without an `etcd` on PATH the caller skips, saying so, except where `WEFT_REQUIRE_ETCD=1`
//! (CI): there it fails.

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running single-member etcd.
pub struct Etcd {
    child: Child,
    dir: PathBuf,
    /// `127.0.0.1:PORT` of its client endpoint.
    pub endpoint: String,
}

impl Etcd {
    /// The store address of this etcd (`etcd://127.0.0.1:PORT`).
    pub fn store_addr(&self) -> String {
        format!("etcd://{}", self.endpoint)
    }

    /// Starts one, or `None` (after saying why on stderr) when `etcd` is not installed and
    /// `WEFT_REQUIRE_ETCD` is not set. Panics when it is set, or when an installed etcd does
    /// not start.
    pub fn start(test: &str) -> Option<Etcd> {
        match Command::new("etcd")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
        {
            Ok(_) => {}
            Err(e) => {
                let why = format!("no etcd binary to run ({e}); install Debian's etcd-server");
                if weftcc_settings::REQUIRE_ETCD.flag().unwrap_or(true) {
                    panic!("WEFT_REQUIRE_ETCD=1 and {why}");
                }
                eprintln!("SKIPPED {test}: {why}");
                return None;
            }
        }
        let mut last = String::new();
        for _ in 0..3 {
            match Etcd::try_start() {
                Ok(e) => return Some(e),
                Err(e) => last = e,
            }
        }
        panic!("etcd did not start: {last}");
    }

    fn try_start() -> Result<Etcd, String> {
        let free = || -> Result<u16, String> {
            let l = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
            Ok(l.local_addr().map_err(|e| e.to_string())?.port())
        };
        let (client, peer) = (free()?, free()?);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir =
            std::env::temp_dir().join(format!("weft-etcd-{}-{client}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let log = std::fs::File::create(dir.join("etcd.log")).map_err(|e| e.to_string())?;
        let log2 = log.try_clone().map_err(|e| e.to_string())?;
        let client_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let child = Command::new("etcd")
            .arg("--name=weft")
            .arg(format!("--data-dir={}", dir.join("data").display()))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=weft={peer_url}"))
            // The store's values may be a few MiB (base64 makes them larger).
            .arg("--max-request-bytes=33554432")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .map_err(|e| e.to_string());
        let child = match child {
            Ok(c) => c,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        let mut etcd = Etcd {
            child,
            dir,
            endpoint: format!("127.0.0.1:{client}"),
        };
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(15) {
            if let Ok(Some(status)) = etcd.child.try_wait() {
                let log = std::fs::read_to_string(etcd.dir.join("etcd.log")).unwrap_or_default();
                let tail: String = log.lines().rev().take(5).collect::<Vec<_>>().join(" | ");
                return Err(format!("etcd exited with {status}: {tail}"));
            }
            if TcpStream::connect(&etcd.endpoint).is_ok() {
                return Ok(etcd);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err("etcd did not listen within 15 s".into())
    }

    /// Stops it as a crash would (SIGKILL), leaving its directory until drop.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
