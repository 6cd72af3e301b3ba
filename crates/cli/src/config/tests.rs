//! The config file: defaults, full files, and the errors people will actually hit.

use super::*;
use mesh::CommBackend::{Mpi, Nccl, Shm, Tcp};

/// A build without the optional backends, and one with CUDA.
const NONE: Built = Built { cuda: false, mpi: false };
const CUDA: Built = Built { cuda: true, mpi: false };

fn axes(tp: CommBackend, cp: CommBackend, control: CommBackend) -> AxisBackends {
    AxisBackends { tp, cp, control }
}

#[test]
fn an_empty_file_is_all_defaults() {
    let c = Config::parse("", "empty.toml").unwrap();
    assert_eq!(c, Config::default());
    assert_eq!(c.model.name, "smollm2-135m-instruct");
    assert_eq!(c.sampling.max_tokens, 64);
    assert_eq!(c.server.listen, "127.0.0.1:8000");
}

#[test]
fn a_full_file_parses() {
    let text = r#"
[model]
name = "/models/tiny.gguf"
weights = "f32"

[layout]
tp = 2
cp = 2
backends = { tp = "tcp", cp = "shm", control = "tcp" }

[runtime]
threads = 1
kv_cache_tokens = 1024
timeout_s = 5

[sampling]
temperature = 0.7
top_p = 0.9
top_k = 40
seed = 7
max_tokens = 16

[sleep.kv_cache]
restore = "discard"

[sleep.weights]
restore = "backup"
spill_dir = "/tmp/spill"

[server]
listen = "127.0.0.1:9000"
"#;
    let c = Config::parse(text, "full.toml").unwrap();
    assert_eq!((c.layout.tp, c.layout.cp), (Some(2), Some(2)));
    assert_eq!(c.layout.backends.tp, mesh::CommBackend::Tcp);
    assert_eq!(c.model.weights, WeightsForm::F32);
    assert_eq!(c.sleep["weights"].restore, RestoreMode::Backup);
    assert_eq!(c.sleep["kv_cache"].spill_dir, None);
    assert_eq!(c.runtime.timeout_s, 5.0);
}

#[test]
fn errors_name_the_key_line_and_column() {
    for (text, needles) in [
        ("[layout]\ntp = 2\ntpp = 3\n", &["cfg.toml", "line 3", "unknown field `tpp`"][..]),
        ("[modle]\nname = \"x\"\n", &["line 1", "unknown field `modle`"]),
        ("[layout]\ntp = \"two\"\n", &["line 2", "invalid type"]),
        ("[layout.backends]\ntp = \"gloo\"\n", &["line 2", "local, shm, tcp, nccl or mpi"]),
        ("[sleep.kv_cache]\nrestore = \"later\"\n", &["line 2", "unknown variant `later`"]),
        ("[sampling]\ntop_p = 1.5\n", &["`sampling.top_p` must be in (0, 1]"]),
        ("[layout]\ncp = 0\n", &["`layout.cp` must be at least 1"]),
        ("[runtime]\ntimeout_s = -1\n", &["`runtime.timeout_s`"]),
        ("[sleep.\"kv cache\"]\nrestore = \"zero\"\n", &["`sleep.kv cache` is not a tag name"]),
        ("[layout\n", &["line 1"]),
    ] {
        let err = format!("{:#}", Config::parse(text, "cfg.toml").unwrap_err());
        for needle in needles {
            assert!(err.contains(needle), "{text:?}: `{err}` lacks `{needle}`");
        }
    }
}

#[test]
fn the_example_config_parses_with_every_key_it_shows() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/smollm2.toml");
    let config = Config::load(&path).unwrap();
    assert_eq!(config.server.asleep_wait_timeout, 60.0);
    assert!(!config.server.refuse_while_asleep);
    let text = "[server]\nasleep_wait_timeout = 2.5\n";
    assert_eq!(Config::parse(text, "t.toml").unwrap().server.asleep_wait_timeout, 2.5);
    assert_eq!(Config::default().server.asleep_wait_timeout, 60.0);
    assert_eq!(config.server.drain_timeout, 5.0);
    let text = "[server]\ndrain_timeout = 0.5\n";
    assert_eq!(Config::parse(text, "t.toml").unwrap().server.drain_timeout, 0.5);
    assert_eq!(Config::default().server.drain_timeout, 5.0);
}

/// One node's flags with the given layout.
fn flags(tp: Option<usize>, cp: Option<usize>) -> LaunchFlags {
    LaunchFlags { tp, cp, nnodes: 1, ..LaunchFlags::default() }
}

#[test]
fn launch_settings_take_flags_over_the_file_over_the_defaults() {
    let none = Config::default().launch(&flags(None, None), 8, NONE).unwrap();
    assert_eq!((none.tp, none.cp, none.nproc, none.threads), (1, 1, 1, 8));
    assert_eq!(none.model, Config::default().model.name);
    assert_eq!(none.kv_cache_tokens, 4096);
    assert_eq!(none.backends, axes(Shm, Shm, Shm));
    let file = Config::parse(
        "[layout]\ntp = 2\ncp = 2\n[runtime]\nthreads = 3\nkv_cache_tokens = 512\n[model]\nname = \"m.gguf\"\n",
        "launch.toml",
    )
    .unwrap();
    let from_file = file.launch(&flags(None, None), 8, NONE).unwrap();
    assert_eq!((from_file.tp, from_file.cp, from_file.nproc), (2, 2, 4));
    assert_eq!((from_file.threads, from_file.kv_cache_tokens), (3, 512));
    assert_eq!(from_file.model, "m.gguf");
    let over = LaunchFlags {
        tp: Some(4),
        model: Some("x.gguf".into()),
        threads: Some(1),
        max_model_len: Some(64),
        backend: Some(mesh::CommBackend::Tcp),
        ..flags(None, Some(1))
    };
    let flagged = file.launch(&over, 8, NONE).unwrap();
    assert_eq!((flagged.tp, flagged.cp, flagged.threads, flagged.kv_cache_tokens), (4, 1, 1, 64));
    assert_eq!(flagged.model, "x.gguf");
    assert_eq!(flagged.backends, axes(Tcp, Tcp, Tcp));
    // Threads default to the cores over this node's ranks.
    let split = Config::default().launch(&flags(Some(2), Some(2)), 8, NONE).unwrap();
    assert_eq!(split.threads, 2);
    // Two nodes: half the ranks each, TCP on every axis unless told.
    let two = LaunchFlags { nnodes: 2, node_rank: 1, ..flags(Some(4), None) };
    let two = Config::default().launch(&two, 8, NONE).unwrap();
    assert_eq!((two.nproc, two.backends), (2, axes(Tcp, Tcp, Tcp)));
    // NCCL keeps the control axis on the host.
    let nccl = LaunchFlags { backend: Some(mesh::CommBackend::Nccl), ..flags(Some(2), None) };
    let nccl = Config::default().launch(&nccl, 8, CUDA).unwrap();
    assert_eq!(nccl.backends, axes(Nccl, Nccl, Shm));
}

#[test]
fn launch_settings_refuse_what_cannot_run() {
    let cfg = Config::default();
    let err = |f: LaunchFlags, cuda: bool| {
        cfg.launch(&f, 8, Built { cuda, mpi: false }).unwrap_err().to_string()
    };
    assert_eq!(err(flags(Some(0), None), false), "--tp and --cp must be at least 1");
    let outside = LaunchFlags { nnodes: 2, node_rank: 2, ..flags(Some(2), None) };
    assert_eq!(err(outside, false), "--node-rank 2 is not below --nnodes 2");
    let uneven = LaunchFlags { nnodes: 2, ..flags(Some(3), None) };
    assert!(err(uneven, false).contains("3 ranks do not split evenly over --nnodes 2"));
    let nccl = LaunchFlags { backend: Some(mesh::CommBackend::Nccl), ..flags(None, None) };
    assert!(err(nccl, false).contains("built without CUDA"));
    let mpi = LaunchFlags { backend: Some(Mpi), ..flags(Some(2), None) };
    assert_eq!(
        err(mpi, false),
        "the mpi backend: this tpctl was built without MPI; build it with \
         `cargo build --release -p tpctl --features mpi` (needs OpenMPI)"
    );
    let gpu = LaunchFlags { device: Some(ComputeDevice::Cuda), ..flags(None, None) };
    assert!(err(gpu, false).contains("--device cuda"));
    let half = LaunchFlags { dtype: Some(ComputeDtype::Bf16), ..flags(None, None) };
    assert!(err(half, true).contains("half precision needs --device cuda"));
}

/// The mpi backend, by flag or on one axis of the file, in a build with MPI: one host only.
#[test]
fn the_mpi_backend_runs_on_one_host_in_a_build_with_mpi() {
    let with_mpi = Built { cuda: false, mpi: true };
    let flag = LaunchFlags { backend: Some(Mpi), ..flags(Some(2), Some(2)) };
    let s = Config::default().launch(&flag, 8, with_mpi).unwrap();
    assert_eq!(s.backends, axes(Mpi, Mpi, Mpi));
    let file = Config::parse("[layout.backends]\ncp = \"mpi\"\n", "mpi.toml").unwrap();
    assert_eq!(file.launch(&flags(None, None), 8, with_mpi).unwrap().backends.cp, Mpi);
    assert!(file
        .launch(&flags(None, None), 8, NONE)
        .unwrap_err()
        .to_string()
        .contains("--features mpi"));
    let nodes = LaunchFlags { nnodes: 2, ..flag };
    let err = Config::default().launch(&nodes, 8, with_mpi).unwrap_err().to_string();
    assert!(err.contains("one mpirun on this host: --nnodes 2 needs --backend tcp"), "{err}");
}

/// The weights' element type defaults by device (bf16 on a GPU, f32 on the CPU); the file
/// and the flag choose otherwise, the flag over the file.
#[test]
fn the_dtype_defaults_to_bf16_on_the_gpu_and_f32_on_the_cpu() {
    let cfg = Config::default();
    let cpu = cfg.launch(&flags(None, None), 8, CUDA).unwrap();
    assert_eq!((cpu.device, cpu.dtype), (ComputeDevice::Cpu, ComputeDtype::F32));
    let gpu = LaunchFlags { device: Some(ComputeDevice::Cuda), ..flags(None, None) };
    assert_eq!(cfg.launch(&gpu, 8, CUDA).unwrap().dtype, ComputeDtype::Bf16);
    let file = Config::parse("[runtime]\ndtype = \"f16\"\n", "dtype.toml").unwrap();
    assert_eq!(file.launch(&gpu, 8, CUDA).unwrap().dtype, ComputeDtype::F16);
    let f32_flag = LaunchFlags { dtype: Some(ComputeDtype::F32), ..gpu };
    assert_eq!(file.launch(&f32_flag, 8, CUDA).unwrap().dtype, ComputeDtype::F32);
}

/// `--preallocate-sleep-memory` and `[runtime] preallocate_sleep_memory` each turn it on (it
/// is off by default), and the rank spec carries it to every rank, off when a spec lacks it.
#[test]
fn preallocating_sleep_memory_comes_from_the_flag_or_the_file() {
    let on = LaunchFlags { preallocate_sleep_memory: true, ..flags(None, None) };
    let default = Config::default();
    assert!(!default.launch(&flags(None, None), 8, NONE).unwrap().preallocate_sleep_memory);
    assert!(default.launch(&on, 8, NONE).unwrap().preallocate_sleep_memory);
    let file = Config::parse("[runtime]\npreallocate_sleep_memory = true\n", "p.toml").unwrap();
    assert!(file.launch(&flags(None, None), 8, NONE).unwrap().preallocate_sleep_memory);
    let err = format!(
        "{:#}",
        Config::parse("[runtime]\npreallocate_sleep_memory = 1\n", "p.toml").unwrap_err()
    );
    assert!(err.contains("preallocate_sleep_memory"), "{err}");
}

/// `--enforce-eager` and `[runtime] enforce_eager` each turn CUDA graphs off (they are on by
/// default); a value that is not a boolean is refused, naming the key.
#[test]
fn enforcing_eager_steps_comes_from_the_flag_or_the_file() {
    let on = LaunchFlags { enforce_eager: true, ..flags(None, None) };
    let default = Config::default();
    assert!(!default.launch(&flags(None, None), 8, NONE).unwrap().enforce_eager);
    assert!(default.launch(&on, 8, NONE).unwrap().enforce_eager);
    let file = Config::parse("[runtime]\nenforce_eager = true\n", "e.toml").unwrap();
    assert!(file.launch(&flags(None, None), 8, NONE).unwrap().enforce_eager);
    let err =
        format!("{:#}", Config::parse("[runtime]\nenforce_eager = 1\n", "e.toml").unwrap_err());
    assert!(err.contains("enforce_eager"), "{err}");
}

/// `kv_cache_memory` takes bytes, sizes with units and fractions, in the file and on the
/// command line (the flag wins), and refuses what is not a size, naming the key.
#[test]
fn the_kv_cache_settings_parse_and_bad_ones_name_their_key() {
    let parsed = |v: &str| v.parse::<KvMemory>();
    assert_eq!(parsed("1073741824"), Ok(KvMemory::Bytes(1 << 30)));
    assert_eq!(parsed("512MiB"), Ok(KvMemory::Bytes(512 << 20)));
    assert_eq!(parsed("2 GB"), Ok(KvMemory::Bytes(2_000_000_000)));
    assert_eq!(parsed("0.25"), Ok(KvMemory::Fraction(0.25)));
    for bad in ["0", "1.5", "-0.1", "lots", "GiB"] {
        assert!(parsed(bad).is_err(), "{bad} was taken");
    }
    assert_eq!(KvMemory::Fraction(0.5).bytes(8 << 30, 4), 1 << 30);
    assert_eq!(KvMemory::Bytes(123).bytes(8 << 30, 4), 123);

    let file = Config::parse(
        "[runtime]\nkv_cache_memory = \"64MiB\"\nblock_size = 32\nprefix_caching = false\nmax_num_seqs = 4\n",
        "kv.toml",
    )
    .unwrap();
    let s = file.launch(&flags(None, None), 8, NONE).unwrap();
    assert_eq!(
        (s.kv_cache_memory, s.block_size, s.prefix_caching, s.max_num_seqs),
        (Some(KvMemory::Bytes(64 << 20)), 32, false, 4)
    );
    let over = LaunchFlags {
        kv_cache_memory: Some(KvMemory::Fraction(0.1)),
        max_num_seqs: Some(2),
        ..flags(None, None)
    };
    let s = file.launch(&over, 8, NONE).unwrap();
    assert_eq!((s.kv_cache_memory, s.max_num_seqs), (Some(KvMemory::Fraction(0.1)), 2));
    let d = Config::default().launch(&flags(None, None), 8, NONE).unwrap();
    assert_eq!(
        (d.kv_cache_memory, d.block_size, d.prefix_caching, d.max_num_seqs),
        (None, 16, true, 32)
    );
    let no = LaunchFlags { no_prefix_caching: true, ..flags(None, None) };
    assert!(!Config::default().launch(&no, 8, NONE).unwrap().prefix_caching);

    for (text, key) in [
        ("[runtime]\nkv_cache_memory = 0\n", "kv_cache_memory"),
        ("[runtime]\nkv_cache_memory = 2.0\n", "kv_cache_memory"),
        ("[runtime]\nkv_cache_memory = \"much\"\n", "kv_cache_memory"),
        ("[runtime]\nblock_size = 12\n", "runtime.block_size"),
        ("[runtime]\nmax_num_seqs = 0\n", "runtime.max_num_seqs"),
    ] {
        let err = format!("{:#}", Config::parse(text, "bad.toml").unwrap_err());
        assert!(err.contains(key), "{text}: {err}");
    }
}

#[test]
fn models_tables_describe_a_server_of_several() {
    let text = r#"
[server]
memory_budget = "6GiB"

[[models]]
name = "chat"
model = "smollm2-135m-instruct"
pinned = true

[[models]]
name = "code"
model = "/models/code.gguf"
tp = 2
sleep_level = 2
"#;
    let c = Config::parse(text, "host.toml").unwrap();
    assert_eq!(c.server.memory_budget, Some(crate::host::table::MemoryBudget::Bytes(6 << 30)));
    assert_eq!(c.models.len(), 2);
    assert_eq!((c.models[0].pinned, c.models[0].sleep_level, c.models[0].tp), (true, 1, None));
    assert_eq!(
        (c.models[1].name.as_str(), c.models[1].tp, c.models[1].sleep_level),
        ("code", Some(2), 2)
    );
    let share = Config::parse("[server]\nmemory_budget = 0.5\n", "share.toml").unwrap();
    assert_eq!(share.server.memory_budget, Some(crate::host::table::MemoryBudget::Fraction(0.5)));

    for (text, message) in [
        (
            "[[models]]\nname = \"a\"\nmodel = \"x\"\n[[models]]\nname = \"a\"\nmodel = \"y\"\n",
            "`models[1].name` `a` is the name of an earlier model: each needs its own",
        ),
        (
            "[[models]]\nname = \"a\"\nmodel = \"x\"\nsleep_level = 3\n",
            "`models[0].sleep_level` must be 1 or 2, not 3",
        ),
        ("[[models]]\nname = \"a\"\nmodel = \"x\"\nlevel = 1\n", "unknown field `level`"),
        ("[server]\nmemory_budget = 2.5\n", "a share of the host's memory is in (0, 1], not 2.5"),
    ] {
        let err = format!("{:#}", Config::parse(text, "bad.toml").unwrap_err());
        assert!(err.contains(message), "{text}: {err}");
    }
}
