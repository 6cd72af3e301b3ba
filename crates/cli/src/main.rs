//! `tpctl`: launch, serve and put to sleep tensor/context-parallel LLM deployments.
#![forbid(unsafe_code)]

fn main() -> anyhow::Result<()> {
    anyhow::bail!(
        "tpctl has no commands yet: the launcher arrives with the CLI issue; \
         the libraries (mesh, collectives, vmm) are usable today"
    )
}
