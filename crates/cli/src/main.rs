//! `tpctl`: launch, serve and put to sleep tensor/context-parallel LLM deployments.
#![forbid(unsafe_code)]

fn main() -> anyhow::Result<()> {
    anyhow::bail!(
        "tpctl has no commands yet: run/serve arrive with the session engine; \
         the libraries (mesh, collectives, vmm, layers) are usable today"
    )
}
