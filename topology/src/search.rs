//! Ring and tree search.
//!
//! Rings: orderings of a host's GPUs that maximise the bottleneck bandwidth. The search first
//! finds the largest bandwidth threshold for which a Hamiltonian cycle exists using only hops at
//! least that fast, then, among such cycles, the one with the fewest socket crossings and the
//! highest bandwidth (exact dynamic programming up to 16 GPUs, bounded backtracking above).
//! Several rings ("channels") are found by consuming the resources a ring uses — each NVLink
//! bundle per direction, each GPU's NVLink and PCIe port per direction, the inter-socket link per
//! direction — and searching again, while a new ring keeps at least half the first one's
//! bandwidth.
//!
//! Trees: a double binary tree across hosts (two complementary trees, each carrying half the
//! data: every host is interior in at most one of them) and a chain through the GPUs of a host.

use crate::graph::nvswitch_links;
use crate::model::{LinkSpeeds, PathClass, Topology};
use serde::{Deserialize, Serialize};

/// One ring (channel) through the GPUs of a host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ring {
    /// GPU indices (into `Topology::gpus`) in ring order; the last sends to the first.
    pub order: Vec<usize>,
    /// Path class of every hop `order[k] → order[k+1 mod n]`.
    pub hops: Vec<PathClass>,
    /// The slowest hop's bandwidth available to this ring, GB/s.
    pub bottleneck_gbps: f64,
}

impl Ring {
    /// Number of hops that cross sockets (`SYS`). A ring over two sockets has 2: it crosses the
    /// socket link once in each direction.
    pub fn socket_crossings(&self) -> usize {
        self.hops.iter().filter(|c| **c == PathClass::Sys).count()
    }

    /// True when every hop is a direct NVLink.
    pub fn all_nvlink(&self) -> bool {
        !self.hops.is_empty() && self.hops.iter().all(|c| c.is_nvlink())
    }
}

/// The rings chosen for a host.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct RingPlan {
    /// Rings, best first.
    pub rings: Vec<Ring>,
}

impl RingPlan {
    /// Sum of the rings' bottleneck bandwidths, GB/s: what a ring collective can move per GPU
    /// and direction.
    pub fn total_gbps(&self) -> f64 {
        self.rings.iter().map(|r| r.bottleneck_gbps).sum()
    }

    /// Bandwidth of the slowest hop of the first ring (0 without rings).
    pub fn bottleneck_gbps(&self) -> f64 {
        self.rings.first().map_or(0.0, |r| r.bottleneck_gbps)
    }
}

/// Resources a ring consumes.
struct Capacity {
    n: usize,
    classes: Vec<Vec<PathClass>>,
    /// Directed NVLink bundle capacity (direct NVLink only).
    edge: Vec<Vec<f64>>,
    nv_tx: Vec<f64>,
    nv_rx: Vec<f64>,
    pci_tx: Vec<f64>,
    pci_rx: Vec<f64>,
    socket: Vec<usize>,
    /// Directed inter-socket capacity, indexed [from socket][to socket].
    xsock: Vec<Vec<f64>>,
    nvswitch: bool,
    speeds: LinkSpeeds,
}

impl Capacity {
    fn new(topo: &Topology, speeds: &LinkSpeeds) -> Self {
        let n = topo.gpus.len();
        let classes: Vec<Vec<PathClass>> = (0..n)
            .map(|i| (0..n).map(|j| topo.gpu_path(i, j)).collect())
            .collect();
        let nvs = nvswitch_links(topo);
        let mut edge = vec![vec![0.0; n]; n];
        let mut nv_port = vec![0.0; n];
        for i in 0..n {
            for j in 0..n {
                if let PathClass::NvLink(_) = classes[i][j] {
                    edge[i][j] = speeds.bandwidth(classes[i][j]);
                    if nvs.is_none() {
                        nv_port[i] += edge[i][j];
                    }
                }
            }
            if let Some(k) = nvs {
                nv_port[i] = speeds.bandwidth(PathClass::NvLink(k));
            }
        }
        let groups = topo.socket_groups();
        let socket: Vec<usize> = groups[..n].to_vec();
        let ns = socket.iter().copied().max().map_or(1, |m| m + 1);
        Capacity {
            n,
            classes,
            edge,
            nv_tx: nv_port.clone(),
            nv_rx: nv_port,
            pci_tx: vec![speeds.pcie_gbps; n],
            pci_rx: vec![speeds.pcie_gbps; n],
            socket,
            xsock: vec![vec![speeds.inter_socket_gbps; ns]; ns],
            nvswitch: nvs.is_some(),
            speeds: *speeds,
        }
    }

    /// What a ring could still get on hop i → j.
    fn hop(&self, i: usize, j: usize) -> f64 {
        let c = self.classes[i][j];
        match c {
            PathClass::NvLink(_) => {
                let port = self.nv_tx[i].min(self.nv_rx[j]);
                if self.nvswitch {
                    port
                } else {
                    port.min(self.edge[i][j])
                }
            }
            PathClass::Loc | PathClass::Na => 0.0,
            _ => {
                let mut b = self
                    .speeds
                    .bandwidth(c)
                    .min(self.pci_tx[i])
                    .min(self.pci_rx[j]);
                let (si, sj) = (self.socket[i], self.socket[j]);
                if si != sj {
                    b = b.min(self.xsock[si][sj]);
                }
                b
            }
        }
    }

    fn consume(&mut self, order: &[usize], b: f64) {
        let n = order.len();
        for k in 0..n {
            let (i, j) = (order[k], order[(k + 1) % n]);
            match self.classes[i][j] {
                PathClass::NvLink(_) => {
                    self.edge[i][j] = (self.edge[i][j] - b).max(0.0);
                    self.nv_tx[i] = (self.nv_tx[i] - b).max(0.0);
                    self.nv_rx[j] = (self.nv_rx[j] - b).max(0.0);
                }
                _ => {
                    self.pci_tx[i] = (self.pci_tx[i] - b).max(0.0);
                    self.pci_rx[j] = (self.pci_rx[j] - b).max(0.0);
                    let (si, sj) = (self.socket[i], self.socket[j]);
                    if si != sj {
                        self.xsock[si][sj] = (self.xsock[si][sj] - b).max(0.0);
                    }
                }
            }
        }
    }

    /// Tie-break cost of a hop: socket crossings dominate, then 1/bandwidth.
    fn cost(&self, i: usize, j: usize, cap: f64) -> f64 {
        let cross = if self.socket[i] != self.socket[j] {
            1.0e6
        } else {
            0.0
        };
        let slow = match self.classes[i][j] {
            PathClass::NvLink(_) => 0.0,
            PathClass::Pix | PathClass::Pxb => 1.0e3,
            _ => 2.0e3,
        };
        // Among equal rings, prefer the natural order (0 > 1 > 2 ...): a negligible cost on the
        // forward index distance, whose sum over a cycle is smallest for the identity.
        let forward = ((j + self.n - i) % self.n) as f64;
        cross + slow + 1.0 / cap.max(1e-9) + 1e-9 * forward
    }
}

/// Minimum-cost Hamiltonian cycle over allowed hops (exact for n ≤ 16).
fn cycle_dp(n: usize, allowed: &dyn Fn(usize, usize) -> Option<f64>) -> Option<Vec<usize>> {
    let full = 1usize << n;
    let mut dp = vec![f64::INFINITY; full * n];
    let mut par = vec![u8::MAX; full * n];
    dp[n] = 0.0; // mask 1 (only node 0), at node 0
    for mask in 1..full {
        if mask & 1 == 0 {
            continue;
        }
        for v in 0..n {
            let cur = dp[mask * n + v];
            if !cur.is_finite() || mask & (1 << v) == 0 {
                continue;
            }
            for w in 0..n {
                if mask & (1 << w) != 0 {
                    continue;
                }
                if let Some(c) = allowed(v, w) {
                    let nm = mask | (1 << w);
                    let nc = cur + c;
                    if nc < dp[nm * n + w] {
                        dp[nm * n + w] = nc;
                        par[nm * n + w] = v as u8;
                    }
                }
            }
        }
    }
    let last = full - 1;
    let mut best: Option<(f64, usize)> = None;
    for v in 1..n {
        let c = dp[last * n + v];
        if let (true, Some(close)) = (c.is_finite(), allowed(v, 0)) {
            let t = c + close;
            if best.is_none_or(|(b, _)| t < b) {
                best = Some((t, v));
            }
        }
    }
    let (_, mut v) = best?;
    let mut mask = last;
    let mut rev = vec![v];
    while v != 0 {
        let p = par[mask * n + v] as usize;
        if p >= n {
            return None;
        }
        mask &= !(1 << v);
        v = p;
        rev.push(v);
    }
    rev.reverse();
    // rev starts with 0 and ends with the last node.
    Some(rev)
}

/// Hamiltonian cycle by bounded backtracking, cheapest hops first (for n > 16).
fn cycle_dfs(n: usize, allowed: &dyn Fn(usize, usize) -> Option<f64>) -> Option<Vec<usize>> {
    let mut path = vec![0usize];
    let mut used = vec![false; n];
    used[0] = true;
    let mut budget: u64 = 200_000;
    fn go(
        n: usize,
        allowed: &dyn Fn(usize, usize) -> Option<f64>,
        path: &mut Vec<usize>,
        used: &mut [bool],
        budget: &mut u64,
    ) -> bool {
        if *budget == 0 {
            return false;
        }
        *budget -= 1;
        let v = *path.last().unwrap_or(&0);
        if path.len() == n {
            return allowed(v, 0).is_some();
        }
        let mut next: Vec<(f64, usize)> = (0..n)
            .filter(|&w| !used[w])
            .filter_map(|w| allowed(v, w).map(|c| (c, w)))
            .collect();
        next.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        for (_, w) in next {
            used[w] = true;
            path.push(w);
            if go(n, allowed, path, used, budget) {
                return true;
            }
            path.pop();
            used[w] = false;
        }
        false
    }
    go(n, allowed, &mut path, &mut used, &mut budget).then_some(path)
}

/// The ring with the largest bottleneck, or with `fixed`: the cheapest ring whose every hop
/// can still carry `fixed` GB/s (its bottleneck is then reported as `fixed`).
fn best_ring(cap: &Capacity, fixed: Option<f64>) -> Option<Ring> {
    let n = cap.n;
    if n == 0 {
        return None;
    }
    if n == 1 {
        return Some(Ring {
            order: vec![0],
            hops: Vec::new(),
            bottleneck_gbps: 0.0,
        });
    }
    let mut thresholds: Vec<f64> = Vec::new();
    for i in 0..n {
        for j in 0..n {
            let h = cap.hop(i, j);
            if i != j && h > 1e-9 && !thresholds.iter().any(|t| (t - h).abs() < 1e-9) {
                thresholds.push(h);
            }
        }
    }
    thresholds.sort_by(|a, b| b.total_cmp(a));
    if let Some(f) = fixed {
        thresholds = vec![f];
    }
    for t in thresholds {
        let allowed = |i: usize, j: usize| -> Option<f64> {
            if i == j {
                return None;
            }
            let h = cap.hop(i, j);
            (h + 1e-9 >= t).then(|| cap.cost(i, j, h))
        };
        let found = if n <= 16 {
            cycle_dp(n, &allowed)
        } else {
            cycle_dfs(n, &allowed)
        };
        if let Some(order) = found {
            let hops: Vec<PathClass> = (0..n)
                .map(|k| cap.classes[order[k]][order[(k + 1) % n]])
                .collect();
            let b = (0..n)
                .map(|k| cap.hop(order[k], order[(k + 1) % n]))
                .fold(f64::INFINITY, f64::min);
            return Some(Ring {
                order,
                hops,
                bottleneck_gbps: b,
            });
        }
    }
    None
}

/// Most rings (channels) searched for.
pub const MAX_CHANNELS: usize = 16;

/// The rings through this host's GPUs (empty without GPUs).
pub fn rings(topo: &Topology, speeds: &LinkSpeeds) -> RingPlan {
    let mut cap = Capacity::new(topo, speeds);
    let greedy = plan_rings(&mut cap, None);
    // With direct NVLinks left unused, rings at a fraction of the best bandwidth may fit more
    // channels (4 GPUs in an NV4 mesh: 6 rings at 40 GB/s beat 2 at 80).
    let nvlink_left = !cap.nvswitch && cap.nv_tx.iter().any(|&x| x > 1e-6);
    let Some(b) = greedy.rings.first().map(|r| r.bottleneck_gbps) else {
        return greedy;
    };
    if !nvlink_left || b <= 1e-9 || !greedy.rings[0].all_nvlink() {
        return greedy;
    }
    let mut best = greedy;
    for div in 1..=4 {
        let mut c = Capacity::new(topo, speeds);
        let p = plan_rings(&mut c, Some(b / f64::from(div)));
        if p.total_gbps() > best.total_gbps() + 1e-6 {
            best = p;
        }
    }
    best
}

fn plan_rings(cap: &mut Capacity, fixed: Option<f64>) -> RingPlan {
    let mut plan = RingPlan::default();
    while plan.rings.len() < MAX_CHANNELS {
        let Some(mut r) = best_ring(cap, fixed) else {
            break;
        };
        if let Some(f) = fixed {
            r.bottleneck_gbps = r.bottleneck_gbps.min(f);
        }
        if let Some(first) = plan.rings.first() {
            if r.bottleneck_gbps + 1e-9 < 0.5 * first.bottleneck_gbps {
                break;
            }
            // Once NVLink-only rings are exhausted, do not fall back to PCIe channels.
            if first.all_nvlink() && !r.all_nvlink() {
                break;
            }
        }
        if r.order.len() < 2 || r.bottleneck_gbps <= 1e-9 {
            if plan.rings.is_empty() {
                plan.rings.push(r);
            }
            break;
        }
        cap.consume(&r.order, r.bottleneck_gbps);
        plan.rings.push(r);
    }
    plan
}

/// A tree over `n` ranks (hosts).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tree {
    /// The root.
    pub root: usize,
    /// Parent of each rank (`None` for the root).
    pub parent: Vec<Option<usize>>,
    /// Children of each rank (at most 2).
    pub children: Vec<Vec<usize>>,
}

impl Tree {
    /// Ranks with at least one child.
    pub fn interior(&self) -> Vec<usize> {
        (0..self.children.len())
            .filter(|&r| !self.children[r].is_empty())
            .collect()
    }

    /// Depth (edges on the longest root-to-leaf path).
    pub fn depth(&self) -> usize {
        (0..self.parent.len())
            .map(|mut r| {
                let mut d = 0;
                while let Some(p) = self.parent.get(r).copied().flatten() {
                    r = p;
                    d += 1;
                    if d > self.parent.len() {
                        break;
                    }
                }
                d
            })
            .max()
            .unwrap_or(0)
    }
}

/// In-order binary tree over 1-based positions 1..=n: a position whose lowest set bit is `b` has
/// children at `p ± b/2` (descending further when `p + b/2` is beyond n). Odd positions are leaves.
fn inorder_tree(n: usize, rank_of: impl Fn(usize) -> usize) -> Tree {
    let mut parent = vec![None; n];
    let mut children = vec![Vec::new(); n];
    let root_pos = if n == 0 {
        0
    } else {
        1usize << (usize::BITS - 1 - n.leading_zeros())
    };
    for p in 1..=n {
        let low = p & p.wrapping_neg();
        let mut half = low / 2;
        if half == 0 {
            continue;
        }
        let left = p - half;
        let me = rank_of(p);
        children[me].push(rank_of(left));
        parent[rank_of(left)] = Some(me);
        while half > 0 && p + half > n {
            half /= 2;
        }
        if half > 0 {
            let right = p + half;
            children[me].push(rank_of(right));
            parent[rank_of(right)] = Some(me);
        }
    }
    Tree {
        root: if n == 0 { 0 } else { rank_of(root_pos) },
        parent,
        children,
    }
}

/// The double binary tree over `n` ranks: two trees, each carrying half the data, such that a
/// rank is interior in at most one of them (so its send bandwidth is used once).
/// Tree 0 has the odd ranks interior; tree 1 is tree 0 mirrored (n even) or shifted by one (n odd).
pub fn double_binary_tree(n: usize) -> [Tree; 2] {
    let t0 = inorder_tree(n, |p| p - 1);
    let t1 = if n.is_multiple_of(2) {
        inorder_tree(n, |p| n - p)
    } else {
        inorder_tree(n, |p| p % n)
    };
    [t0, t1]
}

/// The chain through a host's GPUs used inside a tree step: the first ring's order.
pub fn host_chain(plan: &RingPlan, ngpus: usize) -> Vec<usize> {
    plan.rings
        .first()
        .map(|r| r.order.clone())
        .unwrap_or_else(|| (0..ngpus).collect())
}

/// Where a host's ring is opened when the ring runs through several hosts: the order of the
/// host's GPUs from the one that receives from the previous host to the one that sends to the
/// next. The cut is placed so that both ends are as close to a NIC as possible, then on the
/// slowest hop of the ring (which the network hop replaces), so the order inside is unchanged.
pub fn network_order(topo: &Topology, ring: &Ring) -> Vec<usize> {
    let n = ring.order.len();
    if n < 2 {
        return ring.order.clone();
    }
    let nic_rank = |g: usize| {
        topo.closest_nic(g)
            .map_or(0, |(_, c)| crate::model::class_rank(c))
    };
    let k = (0..n)
        .min_by_key(|&k| {
            let (last, first) = (ring.order[k], ring.order[(k + 1) % n]);
            let hop = ring.hops.get(k).copied().unwrap_or(PathClass::Na);
            (
                nic_rank(first).max(nic_rank(last)),
                std::cmp::Reverse(crate::model::class_rank(hop)),
                k,
            )
        })
        .unwrap_or(n - 1);
    (0..n).map(|i| ring.order[(k + 1 + i) % n]).collect()
}

/// One ring through several hosts: the hosts in order, each visited once with its own
/// host-local order inside. Returns (host, local GPU) pairs.
pub fn global_ring(host_orders: &[Vec<usize>]) -> Vec<(usize, usize)> {
    host_orders
        .iter()
        .enumerate()
        .flat_map(|(h, order)| order.iter().map(move |&g| (h, g)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_tree(t: &Tree, n: usize) {
        assert_eq!(t.parent.len(), n);
        assert!(t.parent[t.root].is_none());
        let roots = t.parent.iter().filter(|p| p.is_none()).count();
        assert_eq!(roots, 1, "one root");
        for r in 0..n {
            assert!(t.children[r].len() <= 2);
            for &c in &t.children[r] {
                assert_eq!(t.parent[c], Some(r));
            }
        }
        // Everyone reaches the root.
        for mut r in 0..n {
            let mut steps = 0;
            while let Some(p) = t.parent[r] {
                r = p;
                steps += 1;
                assert!(steps <= n);
            }
            assert_eq!(r, t.root);
        }
    }

    #[test]
    fn double_binary_tree_is_complementary() {
        for n in 1..=70 {
            let [a, b] = double_binary_tree(n);
            check_tree(&a, n);
            check_tree(&b, n);
            for r in 0..n {
                let both = !a.children[r].is_empty() && !b.children[r].is_empty();
                assert!(!both, "rank {r} interior in both trees for n={n}");
            }
            // Depth is logarithmic.
            let lg = (usize::BITS - n.leading_zeros()) as usize;
            assert!(a.depth() <= lg + 1 && b.depth() <= lg + 1, "n={n}");
        }
    }

    #[test]
    fn global_ring_keeps_host_order() {
        let r = global_ring(&[vec![1, 0], vec![2, 0, 1]]);
        assert_eq!(r, vec![(0, 1), (0, 0), (1, 2), (1, 0), (1, 1)]);
    }
}
