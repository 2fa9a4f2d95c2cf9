//! One public path per item in each library: `slat`, `slat-addr`, `slat-dirty`,
//! `slat-migrate` (issue 25).
//!
//! A user (and a reader of a `use` line) must be able to tell where a type lives, so a public
//! item is reachable through exactly one path: `slat_dirty::Harvester`, not that and
//! `slat_dirty::harvest::Harvester`. The usual way to break this is `pub mod m;` plus
//! `pub use m::Item;`, or a public module re-exporting an item that has its own public path.
//!
//! The test parses each library's sources with `syn`, builds its module tree from
//! `src/lib.rs` (`#[cfg(test)]` modules skipped), and lists every public path to every item:
//! its definition, if every module on the way is `pub`, plus each `pub use` in a publicly
//! reachable module, following re-exports of re-exports and of whole modules. It fails on an
//! item with two or more paths, on a glob re-export (`pub use m::*`, which it cannot count),
//! and on a re-export of another workspace crate's item (its owner crate is its one path).
//! Re-exporting a whole external crate, as slat-dirty does with `vm_memory` for version
//! matching, is allowed. It lives here because this crate depends on all four libraries.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

/// A module of the library being checked.
#[derive(Default)]
struct Module {
    name: String,
    parent: Option<usize>,
    /// Declared `pub` (not `pub(crate)`).
    public: bool,
    children: BTreeMap<String, usize>,
    /// Items defined here, by name: whether each is `pub`.
    items: BTreeMap<String, bool>,
    uses: Vec<Use>,
}

/// One name a `use` brings into its module.
struct Use {
    public: bool,
    /// The path as written, e.g. `["crate", "format", "Ept"]`; the last segment is the name
    /// it refers to (`self` in a group is folded into its module's path).
    source: Vec<String>,
    /// The name it is known by here (after `as`); empty for a glob.
    name: String,
}

/// What a path resolves to.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Target {
    Module(usize),
    Item(usize, usize),
    /// Another crate; whether it is one of this workspace's.
    External(bool),
}

struct Crate {
    name: &'static str,
    modules: Vec<Module>,
    /// `(module, name)` of items by index, for `Target::Item`.
    item_keys: Vec<(usize, String)>,
}

fn visibility_is_pub(v: &syn::Visibility) -> bool {
    matches!(v, syn::Visibility::Public(_))
}

fn is_cfg_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg") && a.parse_args::<syn::Ident>().is_ok_and(|i| i == "test")
    })
}

fn flatten(tree: &syn::UseTree, prefix: &mut Vec<String>, public: bool, out: &mut Vec<Use>) {
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            flatten(&p.tree, prefix, public, out);
            prefix.pop();
        }
        syn::UseTree::Name(n) if n.ident == "self" => out.push(Use {
            public,
            source: prefix.clone(),
            name: prefix.last().cloned().unwrap_or_default(),
        }),
        syn::UseTree::Name(n) => {
            let mut source = prefix.clone();
            source.push(n.ident.to_string());
            out.push(Use {
                public,
                source,
                name: n.ident.to_string(),
            });
        }
        syn::UseTree::Rename(r) => {
            let mut source = prefix.clone();
            if r.ident != "self" {
                source.push(r.ident.to_string());
            }
            out.push(Use {
                public,
                source,
                name: r.rename.to_string(),
            });
        }
        syn::UseTree::Glob(_) => out.push(Use {
            public,
            source: prefix.clone(),
            name: String::new(),
        }),
        syn::UseTree::Group(g) => {
            for t in &g.items {
                flatten(t, prefix, public, out);
            }
        }
    }
}

impl Crate {
    fn load(name: &'static str, dir: &Path) -> Crate {
        let mut c = Crate {
            name,
            modules: vec![Module::default()],
            item_keys: Vec::new(),
        };
        let lib = dir.join("src/lib.rs");
        let items = parse(&lib);
        c.add_items(0, &items, &dir.join("src"));
        c
    }

    /// Records `items` as the contents of module `m`, whose child files live in `dir`.
    fn add_items(&mut self, m: usize, items: &[syn::Item], dir: &Path) {
        for item in items {
            let (vis, ident) = match item {
                syn::Item::Const(i) => (&i.vis, &i.ident),
                syn::Item::Enum(i) => (&i.vis, &i.ident),
                syn::Item::Fn(i) => (&i.vis, &i.sig.ident),
                syn::Item::Static(i) => (&i.vis, &i.ident),
                syn::Item::Struct(i) => (&i.vis, &i.ident),
                syn::Item::Trait(i) => (&i.vis, &i.ident),
                syn::Item::Type(i) => (&i.vis, &i.ident),
                syn::Item::Union(i) => (&i.vis, &i.ident),
                syn::Item::Use(u) => {
                    let mut uses = Vec::new();
                    flatten(
                        &u.tree,
                        &mut Vec::new(),
                        visibility_is_pub(&u.vis),
                        &mut uses,
                    );
                    self.modules[m].uses.extend(uses);
                    continue;
                }
                // `bitflags!` and the like: a `pub struct Name` among the tokens.
                syn::Item::Macro(mac) => {
                    let text = mac.mac.tokens.to_string();
                    let words: Vec<&str> = text.split_whitespace().collect();
                    for w in words
                        .windows(3)
                        .filter(|w| w[0] == "pub" && w[1] == "struct")
                    {
                        let name = w[2].trim_end_matches(':').to_string();
                        self.modules[m].items.insert(name, true);
                    }
                    continue;
                }
                syn::Item::Mod(md) if !is_cfg_test(&md.attrs) => {
                    self.add_module(m, md, dir);
                    continue;
                }
                _ => continue,
            };
            self.modules[m]
                .items
                .insert(ident.to_string(), visibility_is_pub(vis));
        }
    }

    fn add_module(&mut self, parent: usize, md: &syn::ItemMod, dir: &Path) {
        let name = md.ident.to_string();
        let child = self.modules.len();
        self.modules.push(Module {
            name: name.clone(),
            parent: Some(parent),
            public: visibility_is_pub(&md.vis),
            ..Module::default()
        });
        self.modules[parent].children.insert(name.clone(), child);
        let child_dir = dir.join(&name);
        match &md.content {
            Some((_, items)) => self.add_items(child, items, &child_dir),
            None => {
                let flat = dir.join(format!("{name}.rs"));
                let file = if flat.exists() {
                    flat
                } else {
                    child_dir.join("mod.rs")
                };
                let items = parse(&file);
                self.add_items(child, &items, &child_dir);
            }
        }
    }

    fn item(&mut self, m: usize, name: &str) -> Target {
        let key = (m, name.to_string());
        let i = match self.item_keys.iter().position(|k| *k == key) {
            Some(i) => i,
            None => {
                self.item_keys.push(key);
                self.item_keys.len() - 1
            }
        };
        Target::Item(m, i)
    }

    /// Resolves `path`, written in module `m`. `depth` bounds chains of re-exports.
    fn resolve(&mut self, m: usize, path: &[String], depth: u32) -> Target {
        assert!(
            depth < 32,
            "{}: re-export chain too long at {path:?}",
            self.name
        );
        let (mut cur, rest) = match path[0].as_str() {
            "crate" => (0, &path[1..]),
            "self" => (m, &path[1..]),
            "super" => {
                let mut cur = m;
                let mut k = 0;
                while path.get(k).is_some_and(|s| s == "super") {
                    cur = self.modules[cur]
                        .parent
                        .expect("`super` above the crate root");
                    k += 1;
                }
                (cur, &path[k..])
            }
            first if self.modules[m].children.contains_key(first) => (m, path),
            // A name a `use` brought in (not `use some_crate;` itself, which is external).
            first
                if self.modules[m]
                    .uses
                    .iter()
                    .any(|u| u.name == first && u.source.len() > 1) =>
            {
                (m, path)
            }
            first => return Target::External(first.starts_with("slat")),
        };
        for (k, seg) in rest.iter().enumerate() {
            let last = k + 1 == rest.len();
            if let Some(&child) = self.modules[cur].children.get(seg) {
                cur = child;
                continue;
            }
            let via = self.modules[cur]
                .uses
                .iter()
                .find(|u| u.name == *seg)
                .map(|u| u.source.clone());
            let target = match via {
                Some(source) => self.resolve(cur, &source, depth + 1),
                None => self.item(cur, seg),
            };
            match target {
                Target::Module(next) if !last => cur = next,
                t if last => return t,
                t => panic!("{}: {path:?} goes through {t:?}", self.name),
            }
        }
        Target::Module(cur)
    }

    fn display(&self, m: usize) -> String {
        let mut parts = vec![];
        let mut cur = Some(m);
        while let Some(i) = cur {
            if i != 0 {
                parts.push(self.modules[i].name.clone());
            }
            cur = self.modules[i].parent;
        }
        parts.push(self.name.to_string());
        parts.reverse();
        parts.join("::")
    }

    /// Every public path to every item, and the problems found on the way.
    fn public_paths(&mut self) -> (BTreeMap<Target, Vec<String>>, Vec<String>) {
        let mut problems = Vec::new();
        let mut reexports = Vec::new();
        for m in 0..self.modules.len() {
            for u in 0..self.modules[m].uses.len() {
                if !self.modules[m].uses[u].public {
                    continue;
                }
                let (source, name) = (
                    self.modules[m].uses[u].source.clone(),
                    self.modules[m].uses[u].name.clone(),
                );
                if name.is_empty() {
                    problems.push(format!("glob re-export in {}: {source:?}", self.display(m)));
                    continue;
                }
                let target = self.resolve(m, &source, 0);
                reexports.push((m, name, target));
            }
        }
        // Public paths of modules: through `pub mod` chains and module re-exports (a fixed
        // point: a module re-export may sit in a module reached only through another).
        let mut module_paths: Vec<Vec<String>> = vec![Vec::new(); self.modules.len()];
        module_paths[0].push(self.name.to_string());
        for _ in 0..self.modules.len() + 1 {
            let mut next: Vec<Vec<String>> = vec![Vec::new(); self.modules.len()];
            next[0].push(self.name.to_string());
            for (m, md) in self.modules.iter().enumerate().skip(1) {
                let parent = md.parent.expect("non-root module has a parent");
                if md.public {
                    next[m].extend(
                        module_paths[parent]
                            .iter()
                            .map(|p| format!("{p}::{}", md.name)),
                    );
                }
            }
            for (m, name, target) in &reexports {
                if let Target::Module(t) = target {
                    next[*t].extend(module_paths[*m].iter().map(|p| format!("{p}::{name}")));
                }
            }
            if next == module_paths {
                break;
            }
            module_paths = next;
        }
        let mut paths: BTreeMap<Target, Vec<String>> = BTreeMap::new();
        let defs: Vec<(usize, String, bool)> = self
            .modules
            .iter()
            .enumerate()
            .flat_map(|(m, md)| md.items.iter().map(move |(n, p)| (m, n.clone(), *p)))
            .collect();
        for (m, name, public) in defs {
            let t = self.item(m, &name);
            let entry = paths.entry(t).or_default();
            if public {
                entry.extend(module_paths[m].iter().map(|p| format!("{p}::{name}")));
            }
        }
        for (m, name, target) in reexports {
            let here: Vec<String> = module_paths[m]
                .iter()
                .map(|p| format!("{p}::{name}"))
                .collect();
            match target {
                Target::Item(..) => paths.entry(target).or_default().extend(here),
                Target::External(true) if !here.is_empty() => problems.push(format!(
                    "{} re-exports another workspace crate's item; use it from its owner",
                    here.join(", ")
                )),
                _ => {}
            }
        }
        (paths, problems)
    }
}

fn parse(file: &Path) -> Vec<syn::Item> {
    let text = fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    syn::parse_file(&text)
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        .items
}

fn library(dir: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(dir)
}

/// Checks one library and returns its paths, for the tests' spot checks.
fn check(name: &'static str, dir: &str) -> Vec<String> {
    let mut c = Crate::load(name, &library(dir));
    let (paths, mut problems) = c.public_paths();
    for p in paths.values().filter(|p| p.len() > 1) {
        problems.push(format!("reachable by {} paths: {}", p.len(), p.join(", ")));
    }
    assert!(problems.is_empty(), "{name}:\n{}", problems.join("\n"));
    paths.into_values().flatten().collect()
}

#[test]
fn slat_has_one_path_per_item() {
    let all = check("slat", "slat");
    let expected = [
        "slat::Vm",
        "slat::Ept",
        "slat::GuestMode",
        "slat::MemslotFlags",
    ];
    for p in expected
        .iter()
        .chain(&["slat::hw::pages_per_entry", "slat::hw::REQ_TLB_FLUSH"])
    {
        assert!(all.iter().any(|x| x == p), "{p} missing from {all:?}");
    }
}

#[test]
fn slat_addr_has_one_path_per_item() {
    let all = check("slat_addr", "slat-addr");
    assert!(all.iter().any(|x| x == "slat_addr::PAGE_SIZE"), "{all:?}");
}

#[test]
fn slat_dirty_has_one_path_per_item() {
    let all = check("slat_dirty", "slat-dirty");
    for p in [
        "slat_dirty::Harvester",
        "slat_dirty::Snapshot",
        "slat_dirty::log::DirtyRing",
    ] {
        assert!(all.iter().any(|x| x == p), "{p} missing from {all:?}");
    }
}

#[test]
fn slat_migrate_has_one_path_per_item() {
    let all = check("slat_migrate", "slat-migrate");
    for p in [
        "slat_migrate::Source",
        "slat_migrate::stream::Region",
        "slat_migrate::transport::Channel",
    ] {
        assert!(all.iter().any(|x| x == p), "{p} missing from {all:?}");
    }
}
