//! The store as an etcd v3 cluster ([`EtcdBackend`]), spoken to through etcd's JSON gateway
//! (`/v3/…` over HTTP/1.1, keys and values in base64), so that the job's meeting point survives
//! the loss of any host.
//!
//! - Every key of a job lives under `/weftcc/<token>/`: jobs sharing a cluster never meet. Data
//!   keys are `…/k/<key>`, sessions `…/s/<key>` (attached to the client's lease) and
//!   `…/r/<key>` (the session's record, which outlives the lease).
//! - Waits (GET, WAIT, GET_ALL) poll with a back-off (first at once, then after 25 ms doubling to
//!   250 ms, and once more at the deadline) rather than use the gateway's watch: a watch is a
//!   long-lived streamed answer that a blocking HTTP client cannot bound by a deadline, while a
//!   poll is one short request that is, and it fails over between endpoints like any other. The
//!   cost is latency (at most the back-off) and a few requests a second per waiting client.
//! - ADD is a compare-and-swap loop: read the counter and its revision, then a transaction that
//!   writes the sum only if the revision is unchanged (or the key still absent).
//! - A request that cannot reach an endpoint (refused, reset, timed out, no leader) is sent to the
//!   next one, round the list, until the request's deadline; then it is
//!   [`StoreError::Etcd`] naming the endpoints.
//! - A session is a lease of [`ETCD_LEASE_TTL`] granted to the client that names one, kept alive
//!   by a thread of that client every [`ETCD_KEEPALIVE_EVERY`] (which also stamps the record
//!   with the time). A client that is dropped revokes its lease at once; a process that dies
//!   stops renewing it and etcd expires it within the TTL: the session then reads as closed.
//!   etcd runs no code of ours, so it runs no session-closed hook
//!   ([`StoreBackend::runs_session_hooks`] is false).

use crate::backend::{SessionInfo, StoreBackend};
use crate::error::{Result, StoreError};
use crate::{ETCD_KEEPALIVE_EVERY, ETCD_LEASE_TTL, MAX_STORE_TOKEN};
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use weftcc_base::Deadline;

/// How a store address names an etcd cluster.
pub(crate) const ETCD_SCHEME: &str = "etcd://";
/// etcd's default limit on the operations of one transaction (`--max-txn-ops`).
const MAX_TXN_OPS: usize = 128;
/// Largest answer read from etcd.
const MAX_ANSWER: u64 = 256 << 20;
/// Extra time a request may take beyond its own wait (as the built-in store's client).
const CLIENT_MARGIN: Duration = Duration::from_secs(10);
/// First pause of a polling wait; it doubles up to [`POLL_MAX`].
const POLL_FIRST: Duration = Duration::from_millis(25);
const POLL_MAX: Duration = Duration::from_millis(250);

/// The cluster's endpoints and an HTTP agent (connections kept open between requests).
#[derive(Clone)]
struct Http {
    agent: ureq::Agent,
    endpoints: Arc<Vec<String>>,
    /// The endpoint that answered last, tried first.
    current: Arc<Mutex<usize>>,
}

/// What one attempt at one endpoint came to.
enum Attempt {
    Answer(Value),
    /// The endpoint could not serve it: try the next.
    Unreachable(String),
    /// The cluster refused the request itself.
    Refused(String),
}

impl Http {
    fn new(endpoints: Vec<String>) -> Http {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .proxy(None)
            .build()
            .into();
        Http {
            agent,
            endpoints: Arc::new(endpoints),
            current: Arc::new(Mutex::new(0)),
        }
    }

    fn all(&self) -> String {
        self.endpoints.join(",")
    }

    /// POSTs `body` to `path` on the current endpoint, failing over round the list until
    /// `deadline`.
    fn post(&self, path: &str, body: &Value, deadline: &Deadline) -> Result<Value> {
        let body = body.to_string();
        let n = self.endpoints.len();
        let mut last = String::new();
        let mut last_ep = self.all();
        loop {
            let start = *weftcc_base::lock(&self.current);
            for i in 0..n {
                let idx = (start + i) % n;
                let ep = &self.endpoints[idx];
                match self.attempt(ep, path, &body, deadline) {
                    Attempt::Answer(v) => {
                        *weftcc_base::lock(&self.current) = idx;
                        return Ok(v);
                    }
                    Attempt::Refused(detail) => {
                        return Err(StoreError::Etcd {
                            endpoint: ep.clone(),
                            detail,
                        })
                    }
                    Attempt::Unreachable(detail) => {
                        last = detail;
                        last_ep = ep.clone();
                    }
                }
                if deadline.expired() {
                    break;
                }
            }
            if deadline.expired() {
                let endpoint = if n == 1 { last_ep } else { self.all() };
                return Err(StoreError::Etcd {
                    endpoint,
                    detail: format!("no endpoint answered {path} in time (last error: {last})"),
                });
            }
            std::thread::sleep(Duration::from_millis(50).min(deadline.remaining()));
        }
    }

    fn attempt(&self, ep: &str, path: &str, body: &str, deadline: &Deadline) -> Attempt {
        let limit = deadline.remaining().max(Duration::from_millis(50));
        let sent = self
            .agent
            .post(format!("http://{ep}{path}"))
            .config()
            .timeout_global(Some(limit))
            .build()
            .header("content-type", "application/json")
            .send(body);
        let mut resp = match sent {
            Ok(r) => r,
            Err(e) => return Attempt::Unreachable(e.to_string()),
        };
        let status = resp.status().as_u16();
        let text = match resp
            .body_mut()
            .with_config()
            .limit(MAX_ANSWER)
            .read_to_string()
        {
            Ok(t) => t,
            Err(e) => return Attempt::Unreachable(format!("reading the answer: {e}")),
        };
        let value: Value = match serde_json::from_str(&text) {
            Ok(v) => v,
            Err(e) => {
                return Attempt::Unreachable(format!(
                    "HTTP {status}, an answer that is not JSON ({e})"
                ))
            }
        };
        if status == 200 && value.get("error").is_none() {
            return Attempt::Answer(value);
        }
        let message = value
            .get("message")
            .or_else(|| value.get("error"))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        // gRPC's UNAVAILABLE (no leader, shutting down) and gateway errors: another member may
        // serve it.
        let code = value.get("code").and_then(Value::as_i64).unwrap_or(0);
        if code == 14 || status == 503 || status == 502 {
            Attempt::Unreachable(format!("HTTP {status}: {message}"))
        } else {
            Attempt::Refused(format!("HTTP {status}: {message}"))
        }
    }
}

/// The end of the key range that holds every key starting with `prefix` (non-empty).
fn range_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

fn b64(bytes: &[u8]) -> String {
    B64.encode(bytes)
}

fn unb64(v: Option<&Value>) -> Result<Vec<u8>> {
    // The gateway leaves out empty fields: a missing value is an empty one.
    match v.and_then(Value::as_str) {
        None => Ok(Vec::new()),
        Some(s) => B64
            .decode(s)
            .map_err(|e| StoreError::Protocol(format!("etcd sent bad base64: {e}"))),
    }
}

/// An int64 field of a gateway answer (sent as a string; left out when zero).
fn int(v: &Value, field: &str) -> i64 {
    match v.get(field) {
        Some(Value::String(s)) => s.parse().unwrap_or(0),
        Some(Value::Number(n)) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A session record's value: when its client was last heard from, then what it said.
fn record(value: &[u8]) -> Vec<u8> {
    let mut v = now_ms().to_le_bytes().to_vec();
    v.extend_from_slice(value);
    v
}

/// A session as its client holds it: its etcd keys and what it says.
#[derive(Clone)]
struct Named {
    /// `…/s/<key>`, attached to the lease.
    session: Vec<u8>,
    /// `…/r/<key>`, the record that outlives it.
    record: Vec<u8>,
    value: Vec<u8>,
}

/// The session this client holds and its lease, shared with the keepalive thread.
struct Lease {
    id: i64,
    /// The session, once named.
    named: Mutex<Option<Named>>,
    stop: AtomicBool,
}

/// A client of an etcd cluster (see the module docs).
pub(crate) struct EtcdBackend {
    http: Http,
    /// `/weftcc/<token>/`.
    prefix: String,
    timeout: Duration,
    lease: Option<Arc<Lease>>,
    keepalive: Option<std::thread::JoinHandle<()>>,
}

impl EtcdBackend {
    /// A client of the cluster at `endpoints` (`host:port[,host:port…]`), checked to answer
    /// (retried until `timeout` while it does not).
    pub(crate) fn connect(endpoints: &str, token: &str, timeout: Duration) -> Result<EtcdBackend> {
        let list: Vec<String> = endpoints
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(str::to_string)
            .collect();
        if list.is_empty() || list.iter().any(|e| !e.contains(':') || e.contains('/')) {
            return Err(StoreError::Config(format!(
                "etcd store address {ETCD_SCHEME}{endpoints:?} must list host:port endpoints, \
                 separated by commas"
            )));
        }
        if token.is_empty() || token.len() > MAX_STORE_TOKEN || token.contains('/') {
            return Err(StoreError::Config(format!(
                "an etcd store's job token must be 1 to {MAX_STORE_TOKEN} bytes without '/'"
            )));
        }
        let backend = EtcdBackend {
            http: Http::new(list),
            prefix: format!("/weftcc/{token}/"),
            timeout,
            lease: None,
            keepalive: None,
        };
        let deadline = Deadline::after(timeout);
        match backend.http.post(
            "/v3/kv/range",
            &json!({"key": b64(backend.prefix.as_bytes()), "count_only": true}),
            &deadline,
        ) {
            Ok(_) => Ok(backend),
            Err(StoreError::Etcd { endpoint, detail }) if deadline.expired() => {
                Err(StoreError::Timeout {
                    what: format!("connecting to etcd at {endpoint} (last error: {detail})"),
                    after: timeout,
                })
            }
            Err(e) => Err(e),
        }
    }

    fn data_key(&self, key: &str) -> Vec<u8> {
        format!("{}k/{key}", self.prefix).into_bytes()
    }

    /// The deadline of a request without a wait of its own (the client's margin).
    fn margin(&self, wait: Duration) -> Deadline {
        Deadline::after(
            wait.saturating_add(CLIENT_MARGIN.min(self.timeout))
                .saturating_add(Duration::from_millis(500)),
        )
    }

    fn post(&self, path: &str, body: Value) -> Result<Value> {
        self.http.post(path, &body, &self.margin(Duration::ZERO))
    }

    /// The value and modification revision of one etcd key, if set.
    fn range(&self, key: &[u8]) -> Result<Option<(Vec<u8>, i64)>> {
        let v = self.post("/v3/kv/range", json!({"key": b64(key)}))?;
        match v
            .get("kvs")
            .and_then(Value::as_array)
            .and_then(|k| k.first())
        {
            None => Ok(None),
            Some(kv) => Ok(Some((unb64(kv.get("value"))?, int(kv, "mod_revision")))),
        }
    }

    /// Every value of `keys` (etcd keys) in one transaction; `None` for a key not set.
    fn range_many(&self, keys: &[Vec<u8>]) -> Result<Vec<Option<Vec<u8>>>> {
        let ops: Vec<Value> = keys
            .iter()
            .map(|k| json!({"request_range": {"key": b64(k)}}))
            .collect();
        let v = self.post("/v3/kv/txn", json!({"success": ops}))?;
        let answers = v
            .get("responses")
            .and_then(Value::as_array)
            .map_or(&[][..], Vec::as_slice);
        if answers.len() != keys.len() {
            return Err(StoreError::Protocol(format!(
                "etcd answered {} of {} reads",
                answers.len(),
                keys.len()
            )));
        }
        answers
            .iter()
            .map(|a| {
                match a
                    .get("response_range")
                    .and_then(|r| r.get("kvs"))
                    .and_then(Value::as_array)
                    .and_then(|k| k.first())
                {
                    None => Ok(None),
                    Some(kv) => unb64(kv.get("value")).map(Some),
                }
            })
            .collect()
    }

    /// Polls `ready` until it gives an answer or `wait` passes (see the module docs).
    fn poll<T>(
        &self,
        wait: Duration,
        mut ready: impl FnMut(&Self) -> Result<Option<T>>,
    ) -> Result<T> {
        let deadline = Deadline::after(wait);
        let mut pause = POLL_FIRST;
        loop {
            if let Some(t) = ready(self)? {
                return Ok(t);
            }
            if deadline.expired() {
                return Err(StoreError::Timeout {
                    what: format!("waiting in etcd at {}", self.http.all()),
                    after: wait,
                });
            }
            std::thread::sleep(pause.min(deadline.remaining()));
            pause = (pause * 2).min(POLL_MAX);
        }
    }

    /// Grants this client's lease and starts its keepalive thread, once.
    fn lease(&mut self) -> Result<Arc<Lease>> {
        if let Some(l) = &self.lease {
            return Ok(l.clone());
        }
        let v = self.post("/v3/lease/grant", json!({"TTL": ETCD_LEASE_TTL.as_secs()}))?;
        let id = int(&v, "ID");
        if id == 0 {
            return Err(StoreError::Protocol("etcd granted no lease".into()));
        }
        let lease = Arc::new(Lease {
            id,
            named: Mutex::new(None),
            stop: AtomicBool::new(false),
        });
        let http = self.http.clone();
        let shared = lease.clone();
        let thread = std::thread::Builder::new()
            .name("weft-etcd-lease".into())
            .spawn(move || keep_alive(&http, &shared))
            .map_err(|e| StoreError::io("starting the etcd lease keepalive thread", e))?;
        self.keepalive = Some(thread);
        self.lease = Some(lease.clone());
        Ok(lease)
    }
}

/// Renews `lease` every [`ETCD_KEEPALIVE_EVERY`] and stamps its session's record, until stopped.
fn keep_alive(http: &Http, lease: &Lease) {
    let step = Duration::from_millis(50);
    let mut since = Duration::ZERO;
    while !lease.stop.load(Ordering::SeqCst) {
        std::thread::sleep(step);
        since += step;
        if since < ETCD_KEEPALIVE_EVERY {
            continue;
        }
        since = Duration::ZERO;
        // Within the TTL: a renewal that cannot get through by then is too late anyway.
        let deadline = Deadline::after(ETCD_LEASE_TTL);
        match http.post(
            "/v3/lease/keepalive",
            &json!({"ID": lease.id.to_string()}),
            &deadline,
        ) {
            Ok(v) if int(v.get("result").unwrap_or(&v), "TTL") > 0 => {}
            Ok(_) => {
                tracing::warn!(target: "weftcc::store", lease = lease.id, "etcd lease expired: this client's session reads as closed");
                return;
            }
            Err(e) => {
                tracing::warn!(target: "weftcc::store", lease = lease.id, "etcd lease keepalive failed: {e}");
                continue;
            }
        }
        let named = weftcc_base::lock(&lease.named).clone();
        if let Some(named) = named {
            let _ = http.post("/v3/kv/txn", &stamp(lease.id, &named), &deadline);
        }
    }
}

/// A transaction that stamps a session's record, if the session is still this lease's.
fn stamp(lease: i64, named: &Named) -> Value {
    json!({
        "compare": [{"key": b64(&named.session), "target": "LEASE", "result": "EQUAL", "lease": lease.to_string()}],
        "success": [{"request_put": {"key": b64(&named.record), "value": b64(&record(&named.value))}}],
    })
}

impl Drop for EtcdBackend {
    /// Revokes the lease: the session reads as closed at once, as a closed connection does.
    fn drop(&mut self) {
        let Some(lease) = self.lease.take() else {
            return;
        };
        lease.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.keepalive.take() {
            let _ = t.join();
        }
        let deadline = Deadline::after(Duration::from_secs(1).min(self.timeout));
        let named = weftcc_base::lock(&lease.named).clone();
        if let Some(named) = named {
            let _ = self
                .http
                .post("/v3/kv/txn", &stamp(lease.id, &named), &deadline);
        }
        let _ = self.http.post(
            "/v3/lease/revoke",
            &json!({"ID": lease.id.to_string()}),
            &deadline,
        );
    }
}

impl StoreBackend for EtcdBackend {
    fn set(&mut self, key: &str, value: &[u8], wait: Duration) -> Result<()> {
        let body = json!({"key": b64(&self.data_key(key)), "value": b64(value)});
        self.http
            .post("/v3/kv/put", &body, &self.margin(wait))
            .map(|_| ())
    }

    fn get(&mut self, key: &str, wait: Duration) -> Result<Vec<u8>> {
        let k = self.data_key(key);
        self.poll(wait, |this| Ok(this.range(&k)?.map(|(v, _)| v)))
    }

    fn wait(&mut self, keys: &[&str], wait: Duration) -> Result<()> {
        let keys: Vec<Vec<u8>> = keys.iter().map(|k| self.data_key(k)).collect();
        let mut done = 0;
        self.poll(wait, |this| {
            while done < keys.len() {
                let part = &keys[done..keys.len().min(done + MAX_TXN_OPS)];
                if this.range_many(part)?.iter().any(Option::is_none) {
                    return Ok(None);
                }
                done += part.len();
            }
            Ok(Some(()))
        })
    }

    fn get_all(
        &mut self,
        keys: &[String],
        unless: Option<&str>,
        wait: Duration,
    ) -> Result<Vec<Vec<u8>>> {
        let mut keys: Vec<Vec<u8>> = keys.iter().map(|k| self.data_key(k)).collect();
        // The interrupting key is read in the same transaction, last.
        if let Some(u) = unless {
            keys.push(self.data_key(u));
        }
        self.poll(wait, |this| {
            let mut values = this.range_many(&keys)?;
            if unless.is_some() {
                if let Some(value) = values.pop().flatten() {
                    return Err(StoreError::Interrupted {
                        key: String::new(),
                        value,
                    });
                }
            }
            Ok(values.into_iter().collect::<Option<Vec<_>>>())
        })
    }

    fn max_keys_per_request(&self) -> usize {
        // One operation stays free for GET_ALL_UNLESS's interrupting key.
        MAX_TXN_OPS - 1
    }

    fn add(&mut self, key: &str, delta: i64, wait: Duration) -> Result<i64> {
        let k = self.data_key(key);
        let deadline = self.margin(wait);
        loop {
            let found = self.range(&k)?;
            let (old, compare) = match &found {
                None => (
                    0,
                    json!({"key": b64(&k), "target": "VERSION", "result": "EQUAL", "version": "0"}),
                ),
                Some((v, rev)) => {
                    let old = std::str::from_utf8(v)
                        .ok()
                        .and_then(|s| s.trim().parse::<i64>().ok())
                        .ok_or_else(|| {
                            StoreError::Rejected("value is not an integer counter".into())
                        })?;
                    (
                        old,
                        json!({"key": b64(&k), "target": "MOD", "result": "EQUAL", "mod_revision": rev.to_string()}),
                    )
                }
            };
            let new = old.wrapping_add(delta);
            let txn = json!({
                "compare": [compare],
                "success": [{"request_put": {"key": b64(&k), "value": b64(new.to_string().as_bytes())}}],
            });
            let answer = self.http.post("/v3/kv/txn", &txn, &deadline)?;
            if answer.get("succeeded").and_then(Value::as_bool) == Some(true) {
                return Ok(new);
            }
            if deadline.expired() {
                return Err(StoreError::Timeout {
                    what: format!("adding to store key {key:?} in etcd at {}", self.http.all()),
                    after: wait,
                });
            }
        }
    }

    fn set_if_absent(&mut self, key: &str, value: &[u8], wait: Duration) -> Result<Vec<u8>> {
        let k = self.data_key(key);
        // One transaction: put only where the key has no version yet, then read what it holds.
        let txn = json!({
            "compare": [{"key": b64(&k), "target": "VERSION", "result": "EQUAL", "version": "0"}],
            "success": [
                {"request_put": {"key": b64(&k), "value": b64(value)}},
                {"request_range": {"key": b64(&k)}},
            ],
            "failure": [{"request_range": {"key": b64(&k)}}],
        });
        let answer = self.http.post("/v3/kv/txn", &txn, &self.margin(wait))?;
        let kv = answer
            .get("responses")
            .and_then(Value::as_array)
            .and_then(|r| r.last())
            .and_then(|r| r.get("response_range"))
            .and_then(|r| r.get("kvs"))
            .and_then(Value::as_array)
            .and_then(|k| k.first())
            .ok_or_else(|| {
                StoreError::Protocol(format!(
                    "etcd's answer to a set-if-absent of {key:?} holds no value"
                ))
            })?;
        unb64(kv.get("value"))
    }

    fn check(&mut self, key: &str) -> Result<bool> {
        let v = self.post(
            "/v3/kv/range",
            json!({"key": b64(&self.data_key(key)), "count_only": true}),
        )?;
        Ok(int(&v, "count") > 0)
    }

    fn delete(&mut self, key: &str) -> Result<bool> {
        let v = self.post(
            "/v3/kv/deleterange",
            json!({"key": b64(&self.data_key(key))}),
        )?;
        Ok(int(&v, "deleted") > 0)
    }

    fn name_session(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let lease = self.lease()?;
        let named = Named {
            session: format!("{}s/{key}", self.prefix).into_bytes(),
            record: format!("{}r/{key}", self.prefix).into_bytes(),
            value: value.to_vec(),
        };
        let old = weftcc_base::lock(&lease.named).clone();
        // A client holds one name: taking another closes the old one (if still ours).
        if let Some(old) = old.filter(|o| o.session != named.session) {
            let mut close = stamp(lease.id, &old);
            if let Some(ops) = close["success"].as_array_mut() {
                ops.push(json!({"request_delete_range": {"key": b64(&old.session)}}));
            }
            let _ = self.post("/v3/kv/txn", close);
        }
        let ops = json!({"success": [
            {"request_put": {"key": b64(&named.session), "value": b64(value), "lease": lease.id.to_string()}},
            {"request_put": {"key": b64(&named.record), "value": b64(&record(value))}},
        ]});
        self.post("/v3/kv/txn", ops)?;
        *weftcc_base::lock(&lease.named) = Some(named);
        Ok(())
    }

    fn sessions(&mut self, prefix: &str) -> Result<Vec<SessionInfo>> {
        let records = format!("{}r/{prefix}", self.prefix).into_bytes();
        let live = format!("{}s/{prefix}", self.prefix).into_bytes();
        let txn = json!({"success": [
            {"request_range": {"key": b64(&records), "range_end": b64(&range_end(&records))}},
            {"request_range": {"key": b64(&live), "range_end": b64(&range_end(&live)), "keys_only": true}},
        ]});
        let v = self.post("/v3/kv/txn", txn)?;
        let kvs = |i: usize| -> Vec<Value> {
            v.get("responses")
                .and_then(|r| r.get(i))
                .and_then(|r| r.get("response_range"))
                .and_then(|r| r.get("kvs"))
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default()
        };
        let strip = |full: &[u8], kind: &str| -> Option<String> {
            let head = format!("{}{kind}/", self.prefix);
            full.strip_prefix(head.as_bytes())
                .map(|k| String::from_utf8_lossy(k).into_owned())
        };
        let mut open = std::collections::HashSet::new();
        for kv in kvs(1) {
            if let Some(k) = strip(&unb64(kv.get("key"))?, "s") {
                open.insert(k);
            }
        }
        let now = now_ms();
        let mut out = Vec::new();
        for kv in kvs(0) {
            let Some(key) = strip(&unb64(kv.get("key"))?, "r") else {
                continue;
            };
            let raw = unb64(kv.get("value"))?;
            let Some((stamp, value)) = raw.split_first_chunk::<8>() else {
                return Err(StoreError::Protocol(format!(
                    "etcd holds a bad session record for {key:?}"
                )));
            };
            out.push(SessionInfo {
                open: open.contains(&key),
                idle: Duration::from_millis(now.saturating_sub(u64::from_le_bytes(*stamp))),
                value: value.to_vec(),
                key,
            });
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    fn describe(&self) -> String {
        format!("etcd at {}", self.http.all())
    }

    fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    fn runs_session_hooks(&self) -> bool {
        false
    }
}
