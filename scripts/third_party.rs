//! The build's third-party files (listed in scripts/third-party.tsv): unpacked from pinned
//! crates.io packages into third_party/, after `cargo fetch --locked` when an archive is not
//! in cargo's cache yet, as scripts/fetch-sources.sh does. Included by build.rs and
//! ggml/build.rs with `#[path]`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One line of the list.
pub struct Entry {
    pub package: String,
    pub version: String,
    /// Path inside the package.
    pub member: String,
    /// Path under third_party/.
    pub dest: String,
}

/// The entries of `root`/scripts/third-party.tsv.
pub fn list(root: &Path) -> Result<Vec<Entry>, String> {
    let path = root.join("scripts/third-party.tsv");
    println!("cargo:rerun-if-changed={}", path.display());
    let text = fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    text.lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| match l.split('\t').map(str::trim).collect::<Vec<_>>()[..] {
            [package, version, member, dest] if !member.is_empty() && !dest.is_empty() && !dest.contains("..") => Ok(Entry {
                package: package.into(),
                version: version.into(),
                member: member.trim_matches('/').into(),
                dest: dest.into(),
            }),
            _ => Err(format!("{}: bad line '{l}' (package, version, path, destination, separated by tabs)", path.display())),
        })
        .collect()
}

/// Makes sure the files of the entries `want` accepts are in `root`/third_party, fetching
/// the pinned packages and unpacking what is missing.
pub fn ensure(root: &Path, want: impl Fn(&Entry) -> bool) -> Result<(), String> {
    let third_party = root.join("third_party");
    let missing: Vec<Entry> = list(root)?.into_iter().filter(|e| want(e) && !third_party.join(&e.dest).exists()).collect();
    if missing.iter().any(|e| find_archive(e).is_none()) {
        cargo_fetch(root)?;
    }
    for e in &missing {
        let archive = find_archive(e).ok_or_else(|| {
            format!(
                "`cargo fetch` did not bring {}-{}: is it pinned under [target.'cfg(any())'.dependencies] in Cargo.toml?",
                e.package, e.version
            )
        })?;
        unpack(&archive, e, &third_party)?;
    }
    Ok(())
}

fn cargo_home() -> PathBuf {
    std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cargo"))
}

/// The package's archive in cargo's download cache (any registry folder).
fn find_archive(e: &Entry) -> Option<PathBuf> {
    let name = format!("{}-{}.crate", e.package, e.version);
    fs::read_dir(cargo_home().join("registry/cache")).ok()?.flatten().map(|d| d.path().join(&name)).find(|p| p.is_file())
}

/// Downloads every package of Cargo.lock (checksums verified by cargo). The cargo running
/// this build holds no package-cache lock while build scripts run, so this does not wait
/// on it.
fn cargo_fetch(root: &Path) -> Result<(), String> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["fetch", "--locked", "--manifest-path"]).arg(root.join("Cargo.toml"));
    // The outer build's job server is not ours to use (fetch runs no jobs).
    for var in ["CARGO_MAKEFLAGS", "MAKEFLAGS", "MFLAGS"] {
        cmd.env_remove(var);
    }
    eprintln!("running {cmd:?}");
    let out = cmd.output().map_err(|e| format!("could not run cargo fetch: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "`cargo fetch --locked` failed ({}):\n{}\nThe build takes ggml and vocabularies from pinned crates.io \
             packages (scripts/third-party.tsv). Without network access, run scripts/fetch-sources.sh where there \
             is one and copy third_party/ over, or set GGML_SOURCE_DIR to a ggml tree of your own.",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// Extracts the entry's path from the archive and renames it into place (a concurrent
/// build that got there first wins).
fn unpack(archive: &Path, e: &Entry, third_party: &Path) -> Result<(), String> {
    let inner = format!("{}-{}/{}", e.package, e.version, e.member);
    let dest = third_party.join(&e.dest);
    let parent = dest.parent().unwrap_or(third_party);
    fs::create_dir_all(parent).map_err(|err| format!("cannot create {}: {err}", parent.display()))?;
    let staging = parent.join(format!(".unpack-{}-{}", e.package, std::process::id()));
    let _ = fs::remove_dir_all(&staging);
    fs::create_dir_all(&staging).map_err(|err| format!("cannot create {}: {err}", staging.display()))?;
    let status = Command::new("tar")
        .arg("-xzf")
        .arg(archive)
        .arg("-C")
        .arg(&staging)
        .arg(format!("--strip-components={}", inner.split('/').count() - 1))
        .arg(&inner)
        .status();
    let got = staging.join(inner.rsplit('/').next().unwrap_or_default());
    let result = match status {
        Ok(s) if s.success() && got.exists() => match fs::rename(&got, &dest) {
            Err(_) if dest.exists() => Ok(()),
            r => r.map_err(|err| format!("cannot move {} to {}: {err}", got.display(), dest.display())),
        },
        _ => Err(format!("could not unpack {inner} from {} (tar)", archive.display())),
    };
    let _ = fs::remove_dir_all(&staging);
    result
}
