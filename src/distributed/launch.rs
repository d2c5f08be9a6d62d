//! Where this process stands in a launched job: its rank, the world size, its device and the
//! rendezvous address, read from the variables the launchers set (torchrun, Slurm's `srun`,
//! Open MPI's `mpirun`).

use crate::{Error, Result};

/// The launcher a [`LaunchEnv`] was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// torchrun (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`).
    Torchrun,
    /// Open MPI's mpirun (`OMPI_COMM_WORLD_RANK`, `_SIZE`, `_LOCAL_RANK`).
    OpenMpi,
    /// Slurm's srun (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`).
    Slurm,
}

impl std::fmt::Display for Launcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Launcher::Torchrun => "torchrun",
            Launcher::OpenMpi => "mpirun (Open MPI)",
            Launcher::Slurm => "srun (Slurm)",
        })
    }
}

/// The default rendezvous port, as torchrun's `--master-port`.
pub const DEFAULT_PORT: u16 = 29500;

/// This process's place in a launched job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    pub launcher: Launcher,
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    pub world_size: usize,
    /// The rank within this machine: the CUDA device this process takes.
    pub local_rank: usize,
    /// Where rank 0 listens for the others.
    pub master_addr: String,
    /// The port rank 0 listens on (see [`LaunchEnv::from_vars`] for torchrun's agent store).
    pub port: u16,
    /// The job's id (`TORCHELASTIC_RUN_ID`, `SLURM_JOB_ID.SLURM_STEP_ID`; empty if none):
    /// the rendezvous refuses a rank of another job that reached the same port.
    pub job: String,
}

impl LaunchEnv {
    /// Reads the process environment; `Ok(None)` when no launcher set it (a plain run).
    ///
    /// ```
    /// use mantissa::distributed::LaunchEnv;
    /// // A plain `cargo test` is not launched by torchrun, srun or mpirun (unless it is).
    /// if let Some(env) = LaunchEnv::from_env()? {
    ///     println!("rank {} of {}", env.rank, env.world_size);
    /// }
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn from_env() -> Result<Option<LaunchEnv>> {
        LaunchEnv::from_vars(|k| std::env::var(k).ok())
    }

    /// Reads the variables `get` gives. torchrun's win over Open MPI's, which win over
    /// Slurm's (mpirun and torchrun run inside Slurm allocations). The rendezvous port is
    /// `MANTISSA_RDZV_PORT` when set; else `MASTER_PORT`, or `MASTER_PORT + 1` when torchrun's
    /// agent already serves its own store there (`TORCHELASTIC_USE_AGENT_STORE=True`); else
    /// 29500. Slurm and Open MPI set no master address: `MASTER_ADDR` when set, else the
    /// first node of `SLURM_JOB_NODELIST`, else the loopback address when every rank is on
    /// this machine.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>> {
        let has = |k: &str| get(k).is_some_and(|v| !v.trim().is_empty());
        let (launcher, rank, world, local) = if has("RANK") || has("WORLD_SIZE") {
            ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK")
        } else if has("OMPI_COMM_WORLD_RANK") {
            (
                "mpirun",
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
            )
        } else if has("SLURM_PROCID") && has("SLURM_NTASKS") {
            ("srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
        } else {
            return Ok(None);
        };
        let num = |k: &str| -> Result<usize> {
            let v = get(k).ok_or_else(|| {
                Error::invalid(
                    "LaunchEnv",
                    format!("launched by {launcher}, but {k} is not set"),
                )
            })?;
            v.trim().parse::<usize>().map_err(|_| {
                Error::invalid(
                    "LaunchEnv",
                    format!("{k}={v:?} is not a non-negative integer"),
                )
            })
        };
        let (rank_v, world_v) = (num(rank)?, num(world)?);
        // torchrun always sets LOCAL_RANK; a hand-set RANK/WORLD_SIZE may not.
        let local_v = match get(local) {
            Some(_) => num(local)?,
            None if world_v == 1 => 0,
            None => {
                return Err(Error::invalid(
                    "LaunchEnv",
                    format!("launched by {launcher}, but {local} is not set"),
                ))
            }
        };
        if world_v == 0 || rank_v >= world_v {
            return Err(Error::invalid(
                "LaunchEnv",
                format!("{rank}={rank_v} is not a rank of {world}={world_v}"),
            ));
        }
        let launcher = match launcher {
            "torchrun" => Launcher::Torchrun,
            "mpirun" => Launcher::OpenMpi,
            _ => Launcher::Slurm,
        };
        let port = |k: &str| -> Result<Option<u16>> {
            get(k)
                .map(|v| {
                    v.trim()
                        .parse::<u16>()
                        .ok()
                        .filter(|p| *p != 0)
                        .ok_or_else(|| {
                            Error::invalid("LaunchEnv", format!("{k}={v:?} is not a TCP port"))
                        })
                })
                .transpose()
        };
        let agent_store = get("TORCHELASTIC_USE_AGENT_STORE").as_deref() == Some("True");
        let port = match (port("MANTISSA_RDZV_PORT")?, port("MASTER_PORT")?) {
            (Some(p), _) => p,
            (None, Some(p)) if agent_store => p.checked_add(1).ok_or_else(|| {
                Error::invalid(
                    "LaunchEnv",
                    "MASTER_PORT=65535 leaves no port after torchrun's agent store; set MANTISSA_RDZV_PORT",
                )
            })?,
            (None, Some(p)) => p,
            (None, None) => DEFAULT_PORT,
        };
        let all_local = match launcher {
            Launcher::OpenMpi => get("OMPI_COMM_WORLD_LOCAL_SIZE")
                .and_then(|v| v.trim().parse::<usize>().ok())
                .is_some_and(|n| n == world_v),
            Launcher::Slurm => get("SLURM_NNODES").is_some_and(|v| v.trim() == "1"),
            Launcher::Torchrun => false,
        };
        let master_addr = match get("MASTER_ADDR").filter(|v| !v.trim().is_empty()) {
            Some(a) => a.trim().to_string(),
            None if world_v == 1 || all_local => "127.0.0.1".to_string(),
            None => match get("SLURM_JOB_NODELIST").or_else(|| get("SLURM_NODELIST")) {
                Some(list) if launcher == Launcher::Slurm => first_host(&list)?,
                _ => {
                    return Err(Error::invalid(
                        "LaunchEnv",
                        format!(
                            "launched by {launcher} over several machines, but MASTER_ADDR (the \
                             host of rank 0) is not set"
                        ),
                    ))
                }
            },
        };
        let job = match launcher {
            Launcher::Torchrun => get("TORCHELASTIC_RUN_ID").unwrap_or_default(),
            Launcher::Slurm => format!(
                "{}.{}",
                get("SLURM_JOB_ID").unwrap_or_default(),
                get("SLURM_STEP_ID").unwrap_or_default()
            ),
            Launcher::OpenMpi => get("OMPI_MCA_ess_base_jobid").unwrap_or_default(),
        };
        Ok(Some(LaunchEnv {
            job,
            launcher,
            rank: rank_v,
            world_size: world_v,
            local_rank: local_v,
            master_addr,
            port,
        }))
    }
}

/// The first host of a Slurm host list: `gpu[03-05,9],cpu1` gives `gpu03`.
fn first_host(list: &str) -> Result<String> {
    let bad = || {
        Error::invalid(
            "LaunchEnv",
            format!("SLURM_JOB_NODELIST={list:?} is not a host list; set MASTER_ADDR"),
        )
    };
    let list = list.trim();
    // The first entry ends at the first comma outside brackets.
    let mut depth = 0i32;
    let end = list
        .char_indices()
        .find(|&(_, c)| {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                _ => {}
            }
            c == ',' && depth == 0
        })
        .map_or(list.len(), |(i, _)| i);
    let first = &list[..end];
    let Some((prefix, rest)) = first.split_once('[') else {
        return match first.is_empty() {
            true => Err(bad()),
            false => Ok(first.to_string()),
        };
    };
    let range = rest.strip_suffix(']').ok_or_else(bad)?;
    let first_range = range.split(',').next().ok_or_else(bad)?;
    let start = first_range.split('-').next().ok_or_else(bad)?;
    if prefix.is_empty() || start.is_empty() || !start.chars().all(|c| c.is_ascii_digit()) {
        return Err(bad());
    }
    Ok(format!("{prefix}{start}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<Option<LaunchEnv>> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchEnv::from_vars(|k| m.get(k).cloned())
    }

    #[test]
    fn plain_run_is_not_launched() {
        assert_eq!(env(&[("PATH", "/bin")]).unwrap(), None);
    }

    #[test]
    fn torchrun_variables() {
        let e = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node7"),
            ("MASTER_PORT", "29600"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (e.launcher, e.rank, e.world_size, e.local_rank),
            (Launcher::Torchrun, 3, 4, 1)
        );
        assert_eq!((e.master_addr.as_str(), e.port), ("node7", 29600));
        // torchrun's agent holds MASTER_PORT with its own store: the next port.
        let e = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29600"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(e.port, 29601);
    }

    #[test]
    fn slurm_and_mpi_variables() {
        let e = env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_NODELIST", "gpu[03-05,9],cpu1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((e.launcher, e.rank, e.world_size), (Launcher::Slurm, 5, 8));
        assert_eq!((e.master_addr.as_str(), e.port), ("gpu03", DEFAULT_PORT));
        let e = env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (e.launcher, e.rank, e.local_rank),
            (Launcher::OpenMpi, 1, 1)
        );
        assert_eq!(e.master_addr, "127.0.0.1");
        assert_eq!(first_host("a1").unwrap(), "a1");
    }

    #[test]
    fn bad_values_are_named() {
        let msg = |p: &[(&str, &str)]| env(p).unwrap_err().to_string();
        assert!(
            msg(&[("RANK", "2"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")])
                .contains("RANK=2 is not a rank of WORLD_SIZE=2")
        );
        assert!(msg(&[("RANK", "x"), ("WORLD_SIZE", "2")]).contains("RANK=\"x\""));
        assert!(msg(&[("RANK", "1"), ("WORLD_SIZE", "2")]).contains("LOCAL_RANK is not set"));
        assert!(msg(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_PORT", "99999")
        ])
        .contains("not a TCP port"));
        assert!(msg(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ])
        .contains("MASTER_ADDR"));
        assert!(first_host("gpu[").is_err() && first_host("").is_err());
    }
}
