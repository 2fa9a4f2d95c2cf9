//! The engine's module layering, checked mechanically (`cargo modules` is not needed).
//!
//! Every module of `src/` belongs to a *node* (the longest node name that prefixes its module
//! path: `dirty/harvest.rs` is `dirty`, `dirty/ring.rs` is `dirty::ring`). [`ALLOWED`] lists,
//! for each node, the nodes it may use. The test reads every `crate::…`, `super::…` and
//! `self::…` path and every `use` of a child module in each file (comments and `#[cfg(test)]`
//! modules are skipped), resolves it to a node, and fails on any edge not listed. It also
//! checks that the allowed graph itself has no cycle, and that a type's inherent methods are
//! defined only in the node that declares it (or one listed in [`EXTENSIONS`]): a method added
//! to `Mmu` from above would be a dependency no path shows.
//!
//! The layers, lowest first:
//!
//! ```text
//! clock                                                  (the hooks time is charged through)
//! sync, config, format, stats, host_memory, test_hooks   (no engine state)
//! cmo                                                    (cache maintenance)
//! mmu        table, walk, lock, spte (the one update path), rmap, flush, zap, inspect
//! direct_map                                             (the host kernel's direct map)
//! dirty::bitmap                                          (a slot's bitmap)
//! memslot    the set, publishing, operations
//! dirty::ring                                            (per-vCPU rings of {slot, offset})
//! huge_page  split, recovery
//! dirty      mark, capability, enable, re-arm, harvest
//! age, fault
//! vm         the facade: Vm holds mmu + memslots + dirty log
//! vcpu, hw   Vcpu (bound to its Vm), the hardware walker's interface
//! lib        re-exports
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Each node and the nodes it may use (besides itself).
const ALLOWED: &[(&str, &[&str])] = &[
    ("clock", &[]),
    ("sync", &["clock"]),
    ("config", &[]),
    ("format", &["clock", "sync"]),
    ("stats", &["clock", "sync", "format"]),
    ("host_memory", &["format"]),
    ("test_hooks", &["sync"]),
    ("cmo", &["clock", "config", "stats"]),
    (
        "mmu",
        &[
            "clock",
            "sync",
            "config",
            "format",
            "stats",
            "test_hooks",
            "cmo",
        ],
    ),
    ("dirty::bitmap", &["clock", "sync"]),
    (
        "direct_map",
        &[
            "clock",
            "sync",
            "config",
            "format",
            "stats",
            "host_memory",
            "mmu",
        ],
    ),
    (
        "memslot",
        &[
            "clock",
            "sync",
            "format",
            "host_memory",
            "test_hooks",
            "mmu",
            "direct_map",
            "dirty::bitmap",
        ],
    ),
    ("dirty::ring", &["clock", "sync", "memslot"]),
    (
        "huge_page",
        &["sync", "config", "format", "stats", "mmu", "memslot"],
    ),
    (
        "dirty",
        &[
            "clock",
            "sync",
            "config",
            "format",
            "stats",
            "test_hooks",
            "mmu",
            "memslot",
            "dirty::bitmap",
            "dirty::ring",
            "huge_page",
        ],
    ),
    ("age", &["sync", "format", "mmu"]),
    (
        "fault",
        &[
            "clock",
            "sync",
            "config",
            "format",
            "stats",
            "cmo",
            "mmu",
            "direct_map",
            "memslot",
            "dirty",
        ],
    ),
    (
        "vm",
        &[
            "sync",
            "config",
            "format",
            "stats",
            "mmu",
            "direct_map",
            "memslot",
            "dirty",
            "age",
        ],
    ),
    (
        "vcpu",
        &[
            "sync", "format", "stats", "mmu", "memslot", "dirty", "fault", "vm",
        ],
    ),
    ("hw", &["sync", "format", "mmu", "vm"]),
    // The crate root only declares modules and re-exports them.
    (
        "lib",
        &[
            "clock",
            "sync",
            "config",
            "format",
            "stats",
            "host_memory",
            "test_hooks",
            "cmo",
            "mmu",
            "direct_map",
            "dirty::bitmap",
            "memslot",
            "dirty::ring",
            "huge_page",
            "dirty",
            "age",
            "fault",
            "vm",
            "vcpu",
            "hw",
        ],
    ),
];

/// Types whose inherent methods may also be defined outside their own node: `Vm::create_vcpu`
/// lives with `Vcpu`, which the facade `vm` cannot name without a cycle.
const EXTENSIONS: &[(&str, &str)] = &[("Vm", "vcpu")];

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in fs::read_dir(dir).expect("read src") {
        let p = e.expect("dir entry").path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// `src/dirty/mod.rs` → `["dirty"]`, `src/dirty/ring.rs` → `["dirty", "ring"]`, `lib.rs` → `[]`.
fn module_path(file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src_dir()).expect("under src");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().expect("file name");
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" {
        parts.push(stem.to_string());
    }
    parts
}

/// The node a module path belongs to: the longest declared node that prefixes it.
fn node_of(path: &[String]) -> Option<&'static str> {
    if path.is_empty() {
        return Some("lib");
    }
    ALLOWED
        .iter()
        .map(|(n, _)| *n)
        .filter(|n| *n != "lib")
        .filter(|n| {
            let segs: Vec<&str> = n.split("::").collect();
            segs.len() <= path.len() && segs.iter().zip(path).all(|(a, b)| *a == b)
        })
        .max_by_key(|n| n.len())
}

/// The file's code without comments and without its `#[cfg(test)]` module (which, at the end
/// of a file, uses `super::*` of the file's own module).
fn code_of(text: &str) -> String {
    let test_mod = ["#[cfg(test)]\nmod ", "#[cfg(all(test, not(loom)))]\nmod "]
        .iter()
        .filter_map(|m| text.find(m))
        .min();
    let text = match test_mod {
        Some(i) => &text[..i],
        None => text,
    };
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Splits code into identifiers and `::` tokens (everything else separates them; `{` is kept
/// because a group ends the path).
fn tokens(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut chars = code.chars().peekable();
    while let Some(c) = chars.next() {
        if is_ident(c) {
            cur.push(c);
            continue;
        }
        if !cur.is_empty() {
            out.push(std::mem::take(&mut cur));
        }
        if c == ':' && chars.peek() == Some(&':') {
            chars.next();
            out.push("::".into());
        } else if !c.is_whitespace() {
            out.push(c.to_string());
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// The module paths a file refers to: `crate::a::b…`, `super::…`, `self::…`, and
/// `use child::…` for a child module of the file's module (resolved to absolute paths).
/// `crate::Name` (a root re-export) is returned as `["<root re-export>"]`.
fn referenced_paths(file: &Path, module: &[String], code: &str) -> Vec<Vec<String>> {
    let toks = tokens(code);
    let children: BTreeSet<String> = child_modules(file);
    let mut out = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        let t = toks[i].as_str();
        let prev_is_path = i > 0 && toks[i - 1] == "::";
        let after_use = i > 0 && toks[i - 1] == "use";
        let starts_path = toks.get(i + 1).is_some_and(|n| n == "::");
        let base: Option<Vec<String>> = match t {
            _ if prev_is_path || !starts_path => None,
            "crate" => Some(Vec::new()),
            "self" => Some(module.to_vec()),
            "super" => {
                let mut m = module.to_vec();
                m.pop();
                Some(m)
            }
            _ if after_use && children.contains(t) => {
                let mut m = module.to_vec();
                m.push(t.to_string());
                Some(m)
            }
            _ => None,
        };
        let Some(mut path) = base else {
            i += 1;
            continue;
        };
        let mut j = i + 1;
        // Further `super::` segments, then module names (lower-case identifiers).
        while j + 1 < toks.len() && toks[j] == "::" {
            let seg = &toks[j + 1];
            if seg == "super" {
                path.pop();
            } else if seg.chars().next().is_some_and(|c| c.is_ascii_lowercase()) {
                path.push(seg.clone());
            } else {
                if path.is_empty() && t == "crate" {
                    path.push("<root re-export>".into());
                }
                break;
            }
            j += 2;
        }
        out.push(path);
        i = j;
    }
    out
}

/// Names of the modules a file declares as children (`mod x;` with a file of its own).
fn child_modules(file: &Path) -> BTreeSet<String> {
    let dir = if file
        .file_name()
        .is_some_and(|n| n == "mod.rs" || n == "lib.rs")
    {
        file.parent().expect("dir").to_path_buf()
    } else {
        file.with_extension("")
    };
    let mut out = BTreeSet::new();
    if let Ok(rd) = fs::read_dir(&dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.insert(p.file_name().unwrap().to_string_lossy().into_owned());
            } else if let Some(stem) = p.file_stem() {
                if p.extension().is_some_and(|x| x == "rs") && stem != "mod" && stem != "lib" {
                    out.insert(stem.to_string_lossy().into_owned());
                }
            }
        }
    }
    out
}

fn allowed() -> BTreeMap<&'static str, BTreeSet<&'static str>> {
    ALLOWED
        .iter()
        .map(|(n, deps)| (*n, deps.iter().copied().collect()))
        .collect()
}

#[test]
fn the_allowed_graph_is_acyclic() {
    let g = allowed();
    for deps in g.values() {
        for d in deps {
            assert!(
                g.contains_key(d),
                "`{d}` is used in ALLOWED but not declared"
            );
        }
    }
    // Kahn's algorithm: repeatedly remove nodes all of whose dependencies are removed.
    let mut done: BTreeSet<&str> = BTreeSet::new();
    loop {
        let ready: Vec<&str> = g
            .iter()
            .filter(|(n, deps)| !done.contains(*n) && deps.iter().all(|d| done.contains(d)))
            .map(|(n, _)| *n)
            .collect();
        if ready.is_empty() {
            break;
        }
        done.extend(ready);
    }
    let stuck: Vec<&str> = g.keys().filter(|n| !done.contains(*n)).copied().collect();
    assert!(
        stuck.is_empty(),
        "the allowed graph has a cycle among {stuck:?}"
    );
}

#[test]
fn every_module_uses_only_the_modules_below_it() {
    let g = allowed();
    let mut files = Vec::new();
    rust_files(&src_dir(), &mut files);
    files.sort();
    let mut violations = Vec::new();
    for file in &files {
        let module = module_path(file);
        let node = node_of(&module)
            .unwrap_or_else(|| panic!("{} belongs to no node of ALLOWED", file.display()));
        let code = code_of(&fs::read_to_string(file).expect("read"));
        for path in referenced_paths(file, &module, &code) {
            if path.first().is_some_and(|s| s == "<root re-export>") {
                if node != "lib" {
                    violations.push(format!(
                        "{}: uses a root re-export (`crate::Name`); name the module that defines it",
                        file.display()
                    ));
                }
                continue;
            }
            let Some(target) = node_of(&path) else {
                violations.push(format!(
                    "{}: `{}` belongs to no node",
                    file.display(),
                    path.join("::")
                ));
                continue;
            };
            if target != node && !g[node].contains(target) {
                violations.push(format!(
                    "{}: `{node}` may not use `{target}` (path `crate::{}`)",
                    file.display(),
                    path.join("::")
                ));
            }
        }
    }
    assert!(
        violations.is_empty(),
        "layering violations:\n{}",
        violations.join("\n")
    );
}

#[test]
fn inherent_methods_live_with_their_type() {
    let mut files = Vec::new();
    rust_files(&src_dir(), &mut files);
    // Where each struct or enum is declared.
    let mut home: BTreeMap<String, &'static str> = BTreeMap::new();
    let mut codes = Vec::new();
    for file in &files {
        let node = node_of(&module_path(file)).expect("node");
        let code = code_of(&fs::read_to_string(file).expect("read"));
        let toks = tokens(&code);
        for w in toks.windows(2) {
            if w[0] == "struct" || w[0] == "enum" {
                home.entry(w[1].clone()).or_insert(node);
            }
        }
        codes.push((file.clone(), node, toks));
    }
    let mut violations = Vec::new();
    for (file, node, toks) in &codes {
        for (i, t) in toks.iter().enumerate() {
            if t != "impl" {
                continue;
            }
            // `impl<…> Type<…> {` or `impl Type {`: an inherent impl has no `for`.
            let mut j = i + 1;
            if toks.get(j).is_some_and(|t| t == "<") {
                let mut depth = 0;
                while j < toks.len() {
                    match toks[j].as_str() {
                        "<" => depth += 1,
                        ">" => depth -= 1,
                        _ => {}
                    }
                    j += 1;
                    if depth == 0 {
                        break;
                    }
                }
            }
            let Some(ty) = toks.get(j) else { continue };
            let end = toks[j..].iter().position(|t| t == "{").map(|p| j + p);
            let has_for = end.is_some_and(|e| toks[j..e].iter().any(|t| t == "for"));
            if has_for {
                continue;
            }
            let Some(owner) = home.get(ty) else { continue };
            let extension = EXTENSIONS.iter().any(|(t, n)| t == ty && n == node);
            if owner != node && !extension {
                violations.push(format!(
                    "{}: methods of `{ty}` (declared in `{owner}`) are added in `{node}`",
                    file.display()
                ));
            }
        }
    }
    assert!(violations.is_empty(), "{}", violations.join("\n"));
}
