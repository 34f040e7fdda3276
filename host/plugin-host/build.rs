//! Builds the default plugins (the `plugins/` workspace and the third-party example) for
//! `wasm32-wasip2` so the server finds them without a manual step, and records where they are.
//! Same commands as `scripts/build-plugins`. Set `K3_SKIP_PLUGIN_BUILD=1` to skip (packaging,
//! offline builds); a missing `wasm32-wasip2` target or a failed build only warns — the host
//! then reports the missing files at run time with the fix.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let manifest =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let root = manifest.join("../..");
    let plugins = root.join("plugins");
    let target_dir = plugins.join("target");
    let out = target_dir.join("wasm32-wasip2/release");
    println!("cargo:rustc-env=K3_BUILT_PLUGIN_DIR={}", out.display());
    println!("cargo:rerun-if-env-changed=K3_SKIP_PLUGIN_BUILD");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={}", root.join("wit").display());
    let example = root.join("examples/third-party-plugin");
    watch_workspace(&plugins);
    watch_crate(&example);
    if std::env::var_os("K3_SKIP_PLUGIN_BUILD").is_some() {
        return;
    }
    ensure_wasm_target();
    for manifest in [plugins.join("Cargo.toml"), example.join("Cargo.toml")] {
        if !manifest.exists() {
            continue;
        }
        if let Err(e) = build(&manifest, &target_dir) {
            println!(
                "cargo:warning=building wasm plugins ({}) failed: {e}",
                manifest.display()
            );
            println!(
                "cargo:warning=run scripts/build-plugins (needs `rustup target add wasm32-wasip2`)"
            );
        }
    }
}

/// A fresh machine has no `wasm32-wasip2` standard library: add it through rustup when rustup
/// manages the toolchain, so `cargo run -p k3serve -- serve` works as the README says.
fn ensure_wasm_target() {
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output();
    let Ok(out) = installed else { return }; // no rustup: the build below reports what is missing
    if String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.trim() == "wasm32-wasip2")
    {
        return;
    }
    println!("cargo:warning=adding the wasm32-wasip2 target (rustup) to build the default plugins");
    let _ = Command::new("rustup")
        .args(["target", "add", "wasm32-wasip2"])
        .status();
}

/// Watch sources only: the target directory lives inside `plugins/` and must not retrigger us.
fn watch_workspace(dir: &Path) {
    println!(
        "cargo:rerun-if-changed={}",
        dir.join("Cargo.toml").display()
    );
    println!(
        "cargo:rerun-if-changed={}",
        dir.join("Cargo.lock").display()
    );
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() && path.join("Cargo.toml").exists() {
                watch_crate(&path);
            }
        }
    }
}

fn watch_crate(dir: &Path) {
    for item in ["Cargo.toml", "src", "wit"] {
        let p = dir.join(item);
        if p.exists() {
            println!("cargo:rerun-if-changed={}", p.display());
        }
    }
}

fn build(manifest: &Path, target_dir: &Path) -> Result<(), String> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args([
        "build",
        "--release",
        "--target",
        "wasm32-wasip2",
        "--manifest-path",
    ])
    .arg(manifest)
    .arg("--target-dir")
    .arg(target_dir);
    // Settings meant for the outer (host) build must not leak into the wasm build.
    for var in [
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_RUSTFLAGS",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_PRIMARY_PACKAGE",
    ] {
        cmd.env_remove(var);
    }
    let output = cmd.output().map_err(|e| format!("cannot run cargo: {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(12).collect();
        Err(tail.into_iter().rev().collect::<Vec<_>>().join(" | "))
    }
}
