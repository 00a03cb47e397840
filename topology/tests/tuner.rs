//! α-β model and WEFT_ALGO / WEFT_PROTO override syntax.

mod common;
use weftcc_topology::search::rings;
use weftcc_topology::tuner::{
    Algorithm, Calibration, Collective, LinkFigure, Measurement, Model, ModelInput, Protocol,
    Selection,
};
use weftcc_topology::{LinkSpeeds, TopoError};

fn input(nranks: usize, nhosts: usize) -> ModelInput {
    ModelInput {
        nranks,
        nhosts,
        intra_gbps: 120.0,
        intra_lat_us: 0.6,
        net_gbps: 25.0,
        net_lat_us: 5.0,
        reduce_gbps: 0.0,
    }
}

#[test]
fn small_uses_latency_protocols_large_uses_simple_ring() {
    let m = Model::new(input(64, 8), None);
    let all_a = Selection::default();
    let all_p = Selection::default();
    let small = m.choose(Collective::AllReduce, 8, &all_a, &all_p).unwrap();
    assert_eq!(small.proto, Protocol::Ll);
    assert_ne!(
        small.algo,
        Algorithm::Ring,
        "many ranks, tiny message: not the ring"
    );
    let large = m
        .choose(Collective::AllReduce, 1 << 30, &all_a, &all_p)
        .unwrap();
    assert_eq!(large.algo, Algorithm::Ring);
    assert_eq!(large.proto, Protocol::Simple);
    // Large ring all-reduce across hosts: bus bandwidth close to the network's.
    assert!(
        large.busbw_gbps > 20.0 && large.busbw_gbps <= 25.0,
        "{large:?}"
    );
    // Time grows with size.
    let mut last = 0.0;
    for s in [8u64, 1 << 10, 1 << 20, 1 << 26] {
        let p = m.choose(Collective::AllReduce, s, &all_a, &all_p).unwrap();
        assert!(p.time_us >= last);
        last = p.time_us;
    }
}

#[test]
fn algorithms_only_where_implemented() {
    let m = Model::new(input(8, 1), None);
    assert!(m
        .predict(
            Collective::AllGather,
            Algorithm::Tree,
            Protocol::Simple,
            1024
        )
        .is_none());
    assert!(m
        .predict(Collective::Broadcast, Algorithm::Rd, Protocol::Simple, 1024)
        .is_none());
    for c in Collective::ALL {
        assert!(m
            .predict(c, Algorithm::Ring, Protocol::Simple, 1024)
            .is_some());
    }
    // One rank: base latency only.
    let one = Model::new(input(1, 1), None);
    let p = one
        .predict(
            Collective::AllReduce,
            Algorithm::Ring,
            Protocol::Ll,
            1 << 20,
        )
        .unwrap();
    assert!((p.time_us - 6.6).abs() < 1e-9);
}

#[test]
fn overrides_follow_nccl_syntax() {
    let s: Selection<Algorithm> = Selection::parse("ring").unwrap();
    assert!(s.allows(Collective::AllReduce, Algorithm::Ring));
    assert!(!s.allows(Collective::AllReduce, Algorithm::Tree));
    let s: Selection<Algorithm> = Selection::parse("^tree").unwrap();
    assert!(s.allows(Collective::AllReduce, Algorithm::Ring));
    assert!(!s.allows(Collective::AllReduce, Algorithm::Tree));
    let s: Selection<Algorithm> = Selection::parse("ring,rd;allreduce:tree").unwrap();
    assert!(s.allows(Collective::AllReduce, Algorithm::Tree));
    assert!(!s.allows(Collective::AllReduce, Algorithm::Ring));
    assert!(s.allows(Collective::Broadcast, Algorithm::Ring));
    assert!(!s.allows(Collective::Broadcast, Algorithm::Tree));
    let s: Selection<Algorithm> = Selection::parse(" AllReduce : ^ring ; ").unwrap();
    assert!(!s.allows(Collective::AllReduce, Algorithm::Ring));
    assert!(s.allows(Collective::AllGather, Algorithm::Ring));
    let s: Selection<Algorithm> = Selection::parse("auto").unwrap();
    assert!(s.is_unrestricted());
    let s: Selection<Protocol> = Selection::parse("LL,ll128;all_reduce:simple").unwrap();
    assert!(s.allows(Collective::Broadcast, Protocol::Ll128));
    assert!(!s.allows(Collective::Broadcast, Protocol::Simple));
    assert!(s.allows(Collective::AllReduce, Protocol::Simple));
    assert!(Selection::<Algorithm>::parse("").unwrap().is_unrestricted());

    for bad in [
        "ring,",
        "foo",
        "allreduce:",
        "bogus:ring",
        "ring;tree",
        "allreduce:ring;allreduce:tree",
        "^",
    ] {
        match Selection::<Algorithm>::parse(bad) {
            Err(TopoError::Tuner(msg)) => assert!(!msg.is_empty()),
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    assert!(Selection::<Protocol>::parse("LL256").is_err());
}

#[test]
fn overrides_steer_the_choice() {
    let m = Model::new(input(64, 8), None);
    let only_ring = Selection::parse("ring").unwrap();
    let all = Selection::default();
    let all_a = Selection::default();
    let p = m
        .choose(Collective::AllReduce, 8, &only_ring, &all)
        .unwrap();
    assert_eq!(p.algo, Algorithm::Ring);
    let simple = Selection::parse("simple").unwrap();
    let p = m.choose(Collective::AllReduce, 8, &all_a, &simple).unwrap();
    assert_eq!(p.proto, Protocol::Simple);
    // Nothing left that implements all-gather.
    let tree = Selection::parse("tree").unwrap();
    assert!(m.choose(Collective::AllGather, 8, &tree, &all).is_none());
}

#[test]
fn calibration_fits_and_round_trips() {
    // time = 3 µs + bytes / 10 GB/s.
    let samples: Vec<(f64, f64)> = [1e3, 1e5, 1e6, 1e7]
        .iter()
        .map(|&b| (b, 3.0 + b / 1e4))
        .collect();
    let f = LinkFigure::fit(&samples).unwrap();
    assert!((f.alpha_us - 3.0).abs() < 1e-6, "{f:?}");
    assert!((f.gbps - 10.0).abs() < 1e-6, "{f:?}");
    assert!(LinkFigure::fit(&[(1.0, 1.0)]).is_err());
    assert!(LinkFigure::fit(&[(1.0, 1.0), (1.0, 2.0)]).is_err());
    assert!(LinkFigure::fit(&[(1.0, 2.0), (2.0, 1.0)]).is_err());
    assert!(LinkFigure::fit(&[(f64::NAN, 2.0), (2.0, 1.0)]).is_err());

    let cal = Calibration {
        intra: Some(f),
        net: None,
        protocols: vec![],
    };
    let back = Calibration::from_json(&cal.to_json()).unwrap();
    assert_eq!(back, cal);
    assert!(Calibration::from_json("{").is_err());
    assert!(Calibration::from_json(r#"{"intra":{"alpha_us":1,"gbps":-2},"net":null}"#).is_err());

    let m = Model::new(input(8, 1), Some(&cal));
    assert_eq!(m.input.intra_gbps, 10.0);
}

#[test]
fn model_from_a_fixture() {
    let t = common::topology("dgx_h100.txt");
    let sp = LinkSpeeds::default();
    let plan = rings(&t, &sp);
    let mi = ModelInput::from_topology(&t, &plan, &sp, 1, None);
    assert_eq!(mi.nranks, 8);
    assert!((mi.intra_gbps - 360.0).abs() < 1e-6);
    let m = Model::new(mi, None);
    let big = m
        .predict(
            Collective::AllReduce,
            Algorithm::Ring,
            Protocol::Simple,
            1 << 30,
        )
        .unwrap();
    assert!(big.busbw_gbps > 300.0 && big.busbw_gbps <= 360.0, "{big:?}");
}

#[test]
fn calibration_from_perf_rows_reproduces_them() {
    // 4 ranks, all-reduce: 6 steps of 2 µs, bus bandwidth 5 GB/s.
    let rows: Vec<String> = [8u64, 1024, 1 << 20, 16 << 20]
        .iter()
        .map(|&b| {
            let t = 12.0 + b as f64 * 1.5 / 5e3;
            format!(
                r#"{{"collective":"all-reduce","size":{b},"count":1,"type":"float","redop":"sum","root":-1,"nranks":4,"oop":{{"time_us":{t},"algbw":0,"busbw":0,"wrong":0}},"ip":{{"time_us":{t},"algbw":0,"busbw":0,"wrong":null}}}}"#
            )
        })
        .chain(std::iter::once(
            r#"{"collective":"all-to-all","size":8,"nranks":4,"oop":{"time_us":1}}"#.to_string(),
        ))
        .collect();
    let json = format!("[{}]", rows.join(","));
    let m = Calibration::perf_rows(&json).unwrap();
    assert_eq!(m.len(), 4);
    assert_eq!(m[0].collective, Collective::AllReduce);
    let cal = Calibration::fit_intra(&m).unwrap();
    let f = cal.intra.unwrap();
    assert!(
        (f.gbps - 5.0).abs() < 1e-6 && (f.alpha_us - 2.0).abs() < 1e-6,
        "{f:?}"
    );
    let model = Model::new(input(4, 1), Some(&cal));
    for s in &m {
        let p = model
            .predict(s.collective, Algorithm::Ring, Protocol::Simple, s.bytes)
            .unwrap();
        assert!(
            (p.time_us - s.time_us).abs() < 1e-6 * s.time_us.max(1.0),
            "{p:?} vs {s:?}"
        );
    }
    assert!(Calibration::perf_rows("[{").is_err());
    assert!(Calibration::fit_intra(&[Measurement {
        collective: Collective::AllReduce,
        nranks: 1,
        bytes: 8,
        time_us: 1.0
    }])
    .is_err());
}

#[test]
fn setting_errors_name_the_variable() {
    // Settings no other test uses (a test may declare its own).
    static ALGO: weftcc_settings::Setting = weftcc_settings::Setting {
        name: "WEFT_TOPO_TEST_ALGO",
        kind: weftcc_settings::Kind::Text,
        agreement: weftcc_settings::Agreement::Own,
        default: "all",
        doc: "test",
    };
    static UNSET: weftcc_settings::Setting = weftcc_settings::Setting {
        name: "WEFT_TOPO_TEST_UNSET",
        kind: weftcc_settings::Kind::Text,
        agreement: weftcc_settings::Agreement::Own,
        default: "all",
        doc: "test",
    };
    std::env::set_var(ALGO.name, "ring,bogus");
    let e = Selection::<Algorithm>::from_setting(&ALGO).unwrap_err();
    assert_eq!(
        e.to_string(),
        "tuner: WEFT_TOPO_TEST_ALGO=\"ring,bogus\": unknown algorithm \"bogus\" (ring, tree, rd, hier)"
    );
    assert!(Selection::<Algorithm>::from_setting(&UNSET)
        .unwrap()
        .is_unrestricted());
}
