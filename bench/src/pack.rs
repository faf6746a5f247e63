//! `kiln-bench pack`: packing a context into the canonical archive (what `kiln up` uploads) against
//! GNU tar writing a name-sorted archive of the same tree. Both write to a pipe that discards, so
//! what is measured is walking, reading and framing, not the disk.

use crate::util::{self, Contestant};
use anyhow::{bail, Result};
use kiln_core::archive::pack;
use kiln_core::digest::{digest_dir, walk_tree, WalkOptions};
use std::process::Command;
use std::time::Instant;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Number of small files in the tree.
    #[arg(long, default_value_t = 20_000)]
    files: usize,
    /// Size of each small file in bytes.
    #[arg(long, default_value_t = 4096)]
    size: usize,
    /// Measured runs per contestant (the median is reported).
    #[arg(long, default_value_t = 7)]
    runs: usize,
}

pub fn run(args: &Args) -> Result<()> {
    if util::which("tar").is_none() {
        bail!("tar is not on PATH; the baseline needs GNU tar");
    }
    let scratch = util::scratch_dir("kiln-bench-pack-")?;
    let tree = scratch.path().join("tree");
    eprintln!("generating {} files of {} bytes under {}", args.files, args.size, tree.display());
    crate::digest::generate_small(&tree, args.files, args.size)?;
    let (_, expected) = digest_dir(&tree, &WalkOptions::default())?;

    println!("## Archive pack\n");
    println!("{} files × {} bytes; {} runs each, medians; warm page cache.", args.files, args.size, args.runs);
    let mut contestants = vec![
        Contestant::new("kiln pack (walk + pack)", || {
            let started = Instant::now();
            let walked = walk_tree(&tree, &WalkOptions::default())?;
            let packed = pack(&walked, std::io::sink())?;
            let took = started.elapsed();
            if packed.digest != expected {
                bail!("packed digest {} differs from {expected}", packed.digest);
            }
            Ok(took)
        }),
        Contestant::new("tar --sort=name -cf - | cat > /dev/null", || {
            util::time_command(
                Command::new("sh").arg("-c").arg("tar --sort=name -cf - . | cat > /dev/null").current_dir(&tree),
            )
        }),
    ];
    util::rounds(&mut contestants, args.runs, 1, || Ok(()))?;
    util::print_table("Pack the small-file tree", &contestants);
    let vs_tar = util::speedup(contestants[1].median(), contestants[0].median());
    println!("- Kiln vs tar: {vs_tar:.2}× (no goal set; reported for comparison)");
    Ok(())
}
