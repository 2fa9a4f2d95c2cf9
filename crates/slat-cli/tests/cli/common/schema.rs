//! Validation of the `--json` documents against `crates/slat-cli/schema/*.json` with the
//! `jsonschema` crate (draft 2020-12). The schemas refer to each other by file name
//! (`"$ref": "envelope.json"`); a retriever serves those names from the schema folder, and
//! nothing is fetched from anywhere else.

#![allow(dead_code)]

use jsonschema::{Retrieve, Uri};
use serde_json::Value;
use std::path::Path;

/// Where relative `$ref`s resolve: a name the retriever maps to the schema folder.
const BASE: &str = "https://slat.invalid/schema/";

/// The schema file `file` of `crates/slat-cli/schema/`.
pub fn load(file: &str) -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("schema")
        .join(file);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Serves `BASE<file>` from the schema folder.
struct SchemaFolder;

impl Retrieve for SchemaFolder {
    fn retrieve(
        &self,
        uri: &Uri<String>,
    ) -> Result<Value, Box<dyn std::error::Error + Send + Sync>> {
        let file = uri
            .as_str()
            .strip_prefix(BASE)
            .ok_or_else(|| format!("{uri}: not a slat schema"))?;
        Ok(load(file))
    }
}

fn errors_of(schema: &Value, doc: &Value) -> Vec<String> {
    let v = jsonschema::options()
        .with_base_uri(BASE)
        .with_retriever(SchemaFolder)
        .should_validate_formats(true)
        .build(schema)
        .unwrap_or_else(|e| panic!("bad schema: {e}"));
    let mut out = Vec::new();
    for e in v.iter_errors(doc) {
        explain(&e, "", &mut out);
    }
    out
}

/// One error, and for a `oneOf` or `anyOf` that no branch matched, why each branch failed (the
/// validator's own message says only that none did).
fn explain(e: &jsonschema::ValidationError<'_>, branch: &str, out: &mut Vec<String>) {
    out.push(format!("{branch}${}: {e}", e.instance_path()));
    use jsonschema::error::ValidationErrorKind as K;
    if let K::OneOfNotValid { context } | K::AnyOf { context } = e.kind() {
        for (i, errs) in context.iter().enumerate() {
            for inner in errs {
                explain(inner, &format!("{branch}[branch {i}] "), out);
            }
        }
    }
}

/// Errors of `doc` against schema file `file`, each with its JSON path.
pub fn errors(file: &str, doc: &Value) -> Vec<String> {
    errors_of(&serde_json::json!({ "$ref": file }), doc)
}

/// Errors of `doc` against `#/$defs/<def>` of schema file `file`.
pub fn def_errors(file: &str, def: &str, doc: &Value) -> Vec<String> {
    errors_of(
        &serde_json::json!({ "$ref": format!("{file}#/$defs/{def}") }),
        doc,
    )
}

/// Panics with every error of `doc` against schema file `file`.
pub fn validate(file: &str, doc: &Value) {
    let errs = errors(file, doc);
    assert!(errs.is_empty(), "{file}:\n{}\n{doc:#}", errs.join("\n"));
}
