//! The config file: defaults, full files, and the errors people will actually hit.

use super::*;

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
    assert_eq!(c.layout.backends.tp, mesh::Backend::Tcp);
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
        ("[layout.backends]\ntp = \"mpi\"\n", &["line 2", "local, shm, tcp or nccl"]),
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
}
