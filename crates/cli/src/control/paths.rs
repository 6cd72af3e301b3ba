//! Where control sockets live: one directory per user (mode 0700), one socket per deployment,
//! named after it; and which of them are live.

use anyhow::{bail, Context, Result};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{client, HostWire, Request};

/// The suffix of a control socket's file name.
pub const SUFFIX: &str = ".sock";

/// The longest path a Unix socket can have (`sun_path` less its terminating zero).
const MAX_SOCKET_PATH: usize = 107;

/// This user's directory of control sockets: `$XDG_RUNTIME_DIR/tpctl` when that variable
/// holds an absolute path, else `/tmp/tpctl-$UID`.
pub fn runtime_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from) {
        Some(dir) if dir.is_absolute() => dir.join("tpctl"),
        _ => PathBuf::from(format!("/tmp/tpctl-{}", nix::unistd::getuid())),
    }
}

/// The deployment name of a launch that gives none: unique to this launcher process.
pub fn default_name() -> String {
    format!("tpctl-{}", std::process::id())
}

/// Checks a deployment name: 1 to 64 letters, digits, `_`, `-` and `.`, not starting with a
/// dot.
///
/// # Errors
/// A message saying what is wrong with `name`.
pub fn check_name(name: &str) -> Result<()> {
    if name.is_empty()
        || name.len() > 64
        || name.starts_with('.')
        || !name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    {
        bail!(
            "`{name}` is not a deployment name: use 1 to 64 letters, digits, `_`, `-` and `.`, not starting with `.`"
        );
    }
    Ok(())
}

/// The socket of deployment `name` in `dir`.
///
/// # Errors
/// `name` is not a deployment name, or the path is too long for a Unix socket.
pub fn socket_path(dir: &Path, name: &str) -> Result<PathBuf> {
    check_name(name)?;
    let path = dir.join(format!("{name}{SUFFIX}"));
    if path.as_os_str().len() > MAX_SOCKET_PATH {
        bail!(
            "control socket path {} is longer than the {MAX_SOCKET_PATH} bytes a Unix socket allows: use a shorter --deployment name or XDG_RUNTIME_DIR",
            path.display()
        );
    }
    Ok(path)
}

/// Creates `dir` (and its parents) for sockets: mode 0700, owned by this user. An existing
/// directory of this user with a wider mode is narrowed to 0700.
///
/// # Errors
/// It cannot be created, is not a directory, or belongs to another user.
pub fn prepare_dir(dir: &Path) -> Result<()> {
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("creating the control socket directory {}", dir.display()))?;
    }
    let meta = std::fs::symlink_metadata(dir)
        .with_context(|| format!("reading the control socket directory {}", dir.display()))?;
    if !meta.is_dir() {
        bail!("{} is not a directory: cannot put control sockets in it", dir.display());
    }
    let uid = nix::unistd::getuid().as_raw();
    if meta.uid() != uid {
        bail!(
            "the control socket directory {} belongs to uid {}, not to this user (uid {uid})",
            dir.display(),
            meta.uid()
        );
    }
    if meta.mode() & 0o777 != 0o700 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("setting mode 0700 on {}", dir.display()))?;
    }
    Ok(())
}

/// What is at a socket path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Occupant {
    /// Nothing.
    Free,
    /// A socket a server accepts connections on.
    Live,
    /// A socket nobody listens on any more (its server died without removing it).
    Stale,
    /// Something that is not a socket.
    Other,
}

/// Looks at `path`: a live socket accepts a connection (which is closed at once).
pub fn occupant(path: &Path) -> Occupant {
    match std::fs::symlink_metadata(path) {
        Err(_) => Occupant::Free,
        Ok(m) if !m.file_type().is_socket() => Occupant::Other,
        Ok(_) => match UnixStream::connect(path) {
            Ok(_) => Occupant::Live,
            Err(_) => Occupant::Stale,
        },
    }
}

/// A deployment found in a runtime directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deployment {
    /// Its name.
    pub name: String,
    /// Its control socket.
    pub socket: PathBuf,
}

/// The live deployments with a socket in `dir`, by name. Stale sockets are left alone (the
/// next server on that path replaces them).
pub fn live_deployments(dir: &Path) -> Vec<Deployment> {
    let mut found: Vec<Deployment> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let file = e.file_name().into_string().ok()?;
            let name = file.strip_suffix(SUFFIX)?.to_owned();
            let socket = e.path();
            (check_name(&name).is_ok() && occupant(&socket) == Occupant::Live)
                .then_some(Deployment { name, socket })
        })
        .collect();
    found.sort_by(|a, b| a.name.cmp(&b.name));
    found
}

/// The socket a client talks to: `socket` when given, else deployment `name`'s in `dir`,
/// else the only live deployment in `dir`.
///
/// # Errors
/// The named deployment has no live socket, or there is no live deployment or more than one
/// (the message lists them).
pub fn resolve(dir: &Path, name: Option<&str>, socket: Option<&Path>) -> Result<PathBuf> {
    if let Some(socket) = socket {
        return Ok(socket.to_owned());
    }
    if let Some(name) = name {
        let path = socket_path(dir, name)?;
        return match occupant(&path) {
            Occupant::Live => Ok(path),
            Occupant::Free => {
                bail!("no deployment `{name}`: {} does not exist{}", path.display(), listing(dir))
            }
            Occupant::Stale => bail!(
                "deployment `{name}` is not running: nothing listens on {}{}",
                path.display(),
                listing(dir)
            ),
            Occupant::Other => bail!("{} is not a control socket", path.display()),
        };
    }
    let live = top_level(dir);
    match live.as_slice() {
        [one] => Ok(one.socket.clone()),
        [] => bail!(
            "no running tpctl deployment of this user (no live socket in {}): start one with `tpctl serve` or `tpctl run`, or give --socket PATH",
            dir.display()
        ),
        many => {
            let names: Vec<&str> = many.iter().map(|d| d.name.as_str()).collect();
            bail!(
                "{} deployments are running ({}): choose one with --deployment NAME",
                many.len(),
                names.join(", ")
            )
        }
    }
}

/// How long a client waits for a deployment's status when it looks for model hosts.
const HOST_PROBE: Duration = Duration::from_secs(10);

/// The live deployments a client may mean when it names none: a model host's models (named
/// `HOST-NAME`, listed in its table) are left out, so a host and its models read as one.
pub fn top_level(dir: &Path) -> Vec<Deployment> {
    let live = live_deployments(dir);
    let mut models: Vec<String> = Vec::new();
    for d in &live {
        let prefix = format!("{}-", d.name);
        // Only a deployment with others named after it may be a host: others are not asked.
        if live.iter().any(|e| e.name.starts_with(&prefix)) {
            if let Some(host) = host_table(&d.socket) {
                models.extend(host.models.into_iter().map(|m| m.deployment));
            }
        }
    }
    live.into_iter().filter(|d| !models.contains(&d.name)).collect()
}

/// The table of the model host at `socket`; `None` when it is not a host or does not answer.
pub fn host_table(socket: &Path) -> Option<HostWire> {
    client::call(socket, &Request::Status, HOST_PROBE).ok()?.host
}

/// The live model host one of whose models is deployment `name` (the host's deployment, a
/// dash, the model's name; its socket may be gone when the model failed), with its table.
pub fn host_of(dir: &Path, name: &str) -> Option<(Deployment, HostWire)> {
    live_deployments(dir)
        .into_iter()
        .filter(|d| name.starts_with(&format!("{}-", d.name)))
        .find_map(|d| {
            let table = host_table(&d.socket)?;
            table.models.iter().any(|m| m.deployment == name).then_some((d, table))
        })
}

/// ` (running: a, b)` for an error message, or nothing when none runs.
fn listing(dir: &Path) -> String {
    let live = live_deployments(dir);
    if live.is_empty() {
        String::new()
    } else {
        let names: Vec<&str> = live.iter().map(|d| d.name.as_str()).collect();
        format!(" (running: {})", names.join(", "))
    }
}
