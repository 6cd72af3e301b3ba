//! Process groups built from the mesh through the store, and [`init_parallel`].
//!
//! Every rank builds the same groups in the same order: its TP group (a row of the mesh), its
//! CP group (a column), then the control group (every rank), each with the backend chosen for
//! that axis. A group's first member leads its set-up: for `shm` it creates the segment and
//! publishes its path; for `tcp` every member publishes its listening address; for `nccl` it
//! makes the NCCL unique id and publishes it, and each member uses the CUDA device of
//! [`InitOptions::device`] (normally `cuda:LOCAL_RANK`, from [`Device::select`]); for `mpi`
//! the members meet at a store barrier, then make the group's MPI communicator.

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::mpi::MpiComm;
use crate::nccl::NcclCommunicator;
use crate::shm::{ShmComm, ShmOptions};
use crate::solo::Solo;
use crate::tcp::TcpComm;
use mesh::{AxisBackends, CommBackend, Device, DeviceMesh, Rendezvous, Store, StoreServer};
use std::net::{IpAddr, Ipv4Addr, UdpSocket};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How to lay out and connect the ranks.
#[derive(Debug, Clone)]
pub struct InitOptions {
    /// Tensor-parallel size; `None` picks `gcd(world, head_groups)`.
    pub tp: Option<usize>,
    /// KV-head groups of the model (the most TP ranks it can be split over).
    pub head_groups: usize,
    /// Communication backend per axis.
    pub backends: AxisBackends,
    /// The device this rank computes on.
    pub device: Device,
    /// Deadline of set-up steps and of every collective call.
    pub timeout: Duration,
    /// Segment sizes of `shm` groups; `None` sizes each group for its ranks and this
    /// machine's cores ([`ShmOptions::for_group`]).
    pub shm: Option<ShmOptions>,
}

impl Default for InitOptions {
    fn default() -> Self {
        InitOptions {
            tp: None,
            head_groups: 1,
            backends: AxisBackends::default(),
            device: Device::Cpu,
            timeout: crate::DEFAULT_TIMEOUT,
            shm: None,
        }
    }
}

/// The ranks of one job and the store that connects them; shared by every
/// [`ParallelContext`] made in this process.
#[derive(Debug)]
pub struct World {
    rendezvous: Rendezvous,
    store: Store,
    /// Rank 0 hosts the store; it stops when the world is dropped.
    _server: Option<StoreServer>,
    /// Unique per job (rank 0's pid and start time), so names never collide across jobs.
    token: String,
    /// Sets of groups made so far; every rank makes them in the same order.
    inits: AtomicU64,
}

impl World {
    /// Joins the world described by `rendezvous`: rank 0 starts the store, all connect.
    ///
    /// # Errors
    /// The store cannot be started or reached within `timeout`.
    pub fn join(rendezvous: Rendezvous, timeout: Duration) -> Result<World> {
        let (server, store) = mesh::rendezvous_store(&rendezvous, timeout)?;
        let token = if rendezvous.rank == 0 {
            let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
            let token = format!("{}-{:x}", std::process::id(), nanos.as_micros());
            store.set("tpctl/world-token", token.as_bytes())?;
            token
        } else {
            let value = store.wait(&["tpctl/world-token"], timeout)?.remove(0);
            String::from_utf8_lossy(&value).into_owned()
        };
        Ok(World { rendezvous, store, _server: server, token, inits: AtomicU64::new(0) })
    }

    /// Disconnects from the store; rank 0 then waits (at most `timeout`) for every other rank
    /// to disconnect before its server stops, so no rank loses the reply to its last call.
    pub fn close(self, timeout: Duration) {
        let World { store, _server: server, .. } = self;
        drop(store);
        if let Some(server) = server {
            server.drain(timeout);
        }
    }

    /// Where this rank sits in the job.
    pub fn rendezvous(&self) -> &Rendezvous {
        &self.rendezvous
    }

    /// The job's key-value store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Builds one group of `members` (global ranks, this rank among them) named `name`.
    ///
    /// # Errors
    /// This rank is not a member, the backend cannot serve this group, or set-up fails.
    pub fn group(
        &self,
        backend: CommBackend,
        name: &str,
        members: &[usize],
        opts: &InitOptions,
    ) -> Result<Box<dyn Communicator>> {
        let me = self.rendezvous.rank;
        let rank =
            members.iter().position(|&m| m == me).ok_or_else(|| Error::BackendUnavailable {
                backend: backend.name(),
                reason: format!("rank {me} is not a member of group {name} {members:?}"),
            })?;
        let generation = self.inits.load(Ordering::Relaxed);
        let key = format!("tpctl/{}/g{generation}/{name}", self.token);
        let mut comm: Box<dyn Communicator> = match backend {
            _ if members.len() == 1 => Box::new(Solo::new(name)),
            CommBackend::Shm => Box::new(self.shm_group(&key, name, rank, members, opts)?),
            CommBackend::Tcp => Box::new(TcpComm::connect(
                &self.store,
                &key,
                name,
                rank,
                members.len(),
                self.listen_ip(),
                opts.timeout,
            )?),
            CommBackend::Nccl => {
                let Device::Cuda(device) = opts.device else {
                    return Err(Error::BackendUnavailable {
                        backend: "nccl",
                        reason: format!(
                            "group {name} runs on {}, not a CUDA device; use shm or tcp",
                            opts.device
                        ),
                    });
                };
                Box::new(NcclCommunicator::connect(
                    &self.store,
                    &key,
                    name,
                    rank,
                    members.len(),
                    device,
                    opts.timeout,
                )?)
            }
            CommBackend::Mpi => {
                let world = self.rendezvous.world_size;
                let (mpi_rank, mpi_size) = crate::mpi::world()?;
                if (mpi_rank, mpi_size) != (me, world) {
                    return Err(Error::BackendUnavailable {
                        backend: "mpi",
                        reason: format!(
                            "MPI sees this process as rank {mpi_rank} of {mpi_size}, the \
                             launcher's variables say rank {me} of {world}: start the ranks \
                             with mpirun"
                        ),
                    });
                }
                // `MPI_Comm_create_group` waits for every member without a deadline: they
                // meet here first, where the wait has one.
                self.store.barrier(&format!("{key}/mpi"), members.len(), opts.timeout)?;
                Box::new(MpiComm::create(name, members, opts.timeout)?)
            }
            CommBackend::Local => {
                return Err(Error::BackendUnavailable {
                    backend: "local",
                    reason: "connects threads of one process; rank processes need shm or tcp"
                        .to_owned(),
                })
            }
        };
        comm.set_timeout(opts.timeout);
        Ok(comm)
    }

    fn shm_group(
        &self,
        key: &str,
        name: &str,
        rank: usize,
        members: &[usize],
        opts: &InitOptions,
    ) -> Result<ShmComm> {
        let path_key = format!("{key}/shm-path");
        let mut comm = if rank == 0 {
            let file: String = format!("tpctl-{key}")
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' })
                .collect();
            let path = shm_dir().join(file);
            let shm = opts.shm.unwrap_or_else(|| ShmOptions::for_group(members.len()));
            let comm = ShmComm::create(&path, 0, members.len(), name, shm)?;
            self.store.set(&path_key, path.to_string_lossy().as_bytes())?;
            comm
        } else {
            let value = self.store.wait(&[&path_key], opts.timeout)?.remove(0);
            let path = PathBuf::from(String::from_utf8_lossy(&value).into_owned());
            ShmComm::open(&path, rank, name)?
        };
        comm.set_timeout(opts.timeout);
        let joined = comm.wait_for_peers();
        if rank == 0 {
            // Every member has mapped the segment (or failed): the name is no longer needed,
            // and unlinking now means a crash later cannot leak it.
            let value = self.store.get(&path_key)?.unwrap_or_default();
            let _ = std::fs::remove_file(String::from_utf8_lossy(&value).as_ref());
        }
        joined?;
        Ok(comm)
    }

    /// The address peers reach this rank on: loopback on one host, otherwise the local
    /// address of the route to the store.
    fn listen_ip(&self) -> IpAddr {
        if self.rendezvous.single_host() {
            return Ipv4Addr::LOCALHOST.into();
        }
        UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
            .and_then(|s| {
                s.connect(self.rendezvous.store_addr())?;
                s.local_addr()
            })
            .map(|a| a.ip())
            .unwrap_or(Ipv4Addr::UNSPECIFIED.into())
    }
}

fn shm_dir() -> PathBuf {
    let dev_shm = PathBuf::from("/dev/shm");
    if dev_shm.is_dir() {
        dev_shm
    } else {
        std::env::temp_dir()
    }
}

/// This rank's view of the parallel job: the mesh and one communicator per axis.
///
/// Made by [`init_parallel`]. With a world of one rank it is inert: every group is a
/// one-rank [`Solo`] group whose collectives are identities, and no store is started.
pub struct ParallelContext {
    world: Option<Arc<World>>,
    owns_world: bool,
    rank: usize,
    mesh: DeviceMesh,
    /// This rank's tensor-parallel group (its row of the mesh).
    pub tp: Box<dyn Communicator>,
    /// This rank's context-parallel group (its column of the mesh).
    pub cp: Box<dyn Communicator>,
    /// Every rank, for control messages (step agreement, sleep/wakeup), apart from the data.
    pub control: Box<dyn Communicator>,
}

impl std::fmt::Debug for ParallelContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParallelContext")
            .field("rank", &self.rank)
            .field("mesh", &self.mesh)
            .field("owns_world", &self.owns_world)
            .finish_non_exhaustive()
    }
}

impl ParallelContext {
    /// What this rank's data groups (TP and CP) hold on a device that a sleep can give back
    /// (the NCCL communicators among them; see [`crate::release`]), one handle per such
    /// group. Never the control group's: the sleep itself runs over it.
    pub fn device_resources(&self) -> Vec<Arc<dyn crate::DeviceResources>> {
        [&self.tp, &self.cp].into_iter().filter_map(|c| c.device_resources()).collect()
    }

    /// This rank's index in the world.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The mesh layout.
    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }

    /// The world (absent for an inert single-rank context).
    pub fn world(&self) -> Option<&Arc<World>> {
        self.world.as_ref()
    }

    /// Whether this context created the world and so owns its clean-up.
    pub fn owns_world(&self) -> bool {
        self.owns_world
    }

    /// Coordinated shutdown after success: when this context owns the world, every rank
    /// meets at a store barrier before rank 0's store stops. After a failure, drop the
    /// context instead: dropping never blocks.
    ///
    /// # Errors
    /// A rank does not reach the barrier before the deadline.
    pub fn shutdown(self, timeout: Duration) -> Result<()> {
        let ParallelContext { world, owns_world, tp, cp, control, .. } = self;
        drop((tp, cp, control));
        let (Some(world), true) = (world, owns_world) else { return Ok(()) };
        let n = world.inits.load(Ordering::Relaxed);
        world.store.barrier(
            &format!("tpctl/{}/shutdown{n}", world.token),
            world.rendezvous.world_size,
            timeout,
        )?;
        // Another context of this process may still use the world; then it closes it.
        if let Ok(world) = Arc::try_unwrap(world) {
            world.close(timeout);
        }
        Ok(())
    }
}

/// The world made by this process, if it is still alive.
static WORLD: Mutex<Weak<World>> = Mutex::new(Weak::new());

/// Sets up this rank's parallel context from the launcher's environment (torchrun, Slurm or
/// OpenMPI variables).
///
/// # Errors
/// See [`init_parallel_with`]; also a bad or contradictory environment.
pub fn init_parallel(opts: &InitOptions) -> Result<ParallelContext> {
    init_parallel_with(Rendezvous::from_env()?, opts)
}

/// Sets up this rank's parallel context: plans the mesh, joins the world (or reuses the one
/// this process already joined, without taking ownership), and builds the TP, CP and control
/// groups with the backends chosen per axis.
///
/// # Errors
/// The mesh does not fit the world, a backend does not suit the device or hosts, or a
/// peer does not show up in time.
pub fn init_parallel_with(rv: Rendezvous, opts: &InitOptions) -> Result<ParallelContext> {
    let mesh = mesh::plan_mesh(rv.world_size, opts.tp, opts.head_groups)?;
    if rv.world_size == 1 {
        return Ok(ParallelContext {
            world: None,
            owns_world: false,
            rank: 0,
            mesh,
            tp: Box::new(Solo::new("tp")),
            cp: Box::new(Solo::new("cp")),
            control: Box::new(Solo::new("control")),
        });
    }
    opts.backends.validate(opts.device, rv.single_host())?;
    let (world, owns_world) = {
        let mut slot = WORLD.lock().unwrap_or_else(|e| e.into_inner());
        match slot.upgrade() {
            Some(world) => {
                let same = world.rendezvous.rank == rv.rank
                    && world.rendezvous.world_size == rv.world_size;
                if !same {
                    return Err(Error::BackendUnavailable {
                        backend: "world",
                        reason: format!(
                            "this process already joined a world as rank {} of {}, not rank {} of {}",
                            world.rendezvous.rank, world.rendezvous.world_size, rv.rank, rv.world_size
                        ),
                    });
                }
                (world, false)
            }
            None => {
                let world = Arc::new(World::join(rv.clone(), opts.timeout)?);
                *slot = Arc::downgrade(&world);
                (world, true)
            }
        }
    };
    let rank = rv.rank;
    let (tp_rank, cp_rank) = mesh.coords(rank)?;
    let tp = world.group(
        opts.backends.tp,
        &format!("tp[cp={cp_rank}]"),
        &mesh.tp_group(cp_rank)?,
        opts,
    )?;
    let cp = world.group(
        opts.backends.cp,
        &format!("cp[tp={tp_rank}]"),
        &mesh.cp_group(tp_rank)?,
        opts,
    )?;
    let all: Vec<usize> = (0..rv.world_size).collect();
    let control = world.group(opts.backends.control, "control", &all, opts)?;
    world.inits.fetch_add(1, Ordering::Relaxed);
    Ok(ParallelContext { world: Some(world), owns_world, rank, mesh, tp, cp, control })
}
