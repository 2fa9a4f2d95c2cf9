//! Built-in profiles by name: this host's (`host-2core-nested`, also `host`) and one per
//! machine class the seed threads measured on (`x86-server`, `arm64-server`), each a file in
//! `profiles/` with the published source of every number beside it, or `proxy: host` where no
//! figure was found.

use crate::profile::Profile;

const X86_SERVER: &str = include_str!("../profiles/x86-server.toml");
const ARM64_SERVER: &str = include_str!("../profiles/arm64-server.toml");

/// The names [`Profile::builtin`] knows, in the order help texts list them.
pub const BUILTIN_PROFILES: [&str; 4] = ["host-2core-nested", "host", "x86-server", "arm64-server"];

impl Profile {
    /// The built-in profile called `name` (one of [`BUILTIN_PROFILES`]); `None` for any other
    /// name. The shipped files are checked by a test, so a listed name always loads.
    pub fn builtin(name: &str) -> Option<Profile> {
        let text = match name {
            "host-2core-nested" | "host" => return Some(Profile::host_default()),
            "x86-server" => X86_SERVER,
            "arm64-server" => ARM64_SERVER,
            _ => return None,
        };
        Profile::from_toml(text).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every built-in profile loads, and every number in the machine profiles says where it
    /// came from: a publication, this host's figure labelled as a proxy, or a design choice.
    #[test]
    fn every_builtin_loads_and_every_number_has_a_source() {
        for name in BUILTIN_PROFILES {
            let p = Profile::builtin(name).unwrap_or_else(|| panic!("{name}"));
            p.validate().unwrap();
        }
        assert!(Profile::builtin("x86").is_none());
        for text in [X86_SERVER, ARM64_SERVER] {
            let p = Profile::from_toml(text).unwrap();
            let model = [
                &p.model.rmw_local,
                &p.model.line_transfer,
                &p.model.invalidate,
                &p.model.dram_miss,
                &p.model.handoff,
                &p.model.ipi_latency,
            ];
            for e in p.costs.values().chain(model) {
                let s = e.source.as_str();
                let labelled = ["published", "proxy: host", "from memory"];
                assert!(labelled.iter().any(|l| s.contains(l)), "{}: {s}", p.name);
            }
            assert_ne!(p.hash(), Profile::host_default().hash(), "{}", p.name);
        }
    }
}
