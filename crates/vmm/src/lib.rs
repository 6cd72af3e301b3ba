//! Tagged virtual memory that releases and re-materializes physical memory at stable addresses.
