//! A JSON-schema validator for the keywords `crates/slat-cli/schema/*.json` use (`type`,
//! `enum`, `const`, `required`, `properties`, `additionalProperties: false`, `items`,
//! `minimum`, `allOf`, `oneOf`, `$ref` to a file and to `#/$defs/...`); any other keyword is
//! refused, so a schema cannot rely on one it ignores (`common::schema`).

#![allow(dead_code)]

use serde_json::Value;
use std::path::Path;

/// The schema file `file` of `crates/slat-cli/schema/`.
pub fn load(file: &str) -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("schema")
        .join(file);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

const KEYWORDS: [&str; 16] = [
    "$schema",
    "$id",
    "$defs",
    "$ref",
    "title",
    "description",
    "type",
    "enum",
    "const",
    "required",
    "properties",
    "additionalProperties",
    "items",
    "minimum",
    "allOf",
    "oneOf",
];

fn type_ok(t: &str, v: &Value) -> bool {
    match t {
        "null" => v.is_null(),
        "boolean" => v.is_boolean(),
        "integer" => v.is_i64() || v.is_u64(),
        "number" => v.is_number(),
        "string" => v.is_string(),
        "array" => v.is_array(),
        "object" => v.is_object(),
        other => panic!("unknown type {other}"),
    }
}

/// Errors of `doc` against schema file `file`, each with its JSON path.
pub fn errors(file: &str, doc: &Value) -> Vec<String> {
    let mut errs = Vec::new();
    check(file, &load(file), doc, "$", &mut errs);
    errs
}

/// Panics with every error of `doc` against schema file `file`.
pub fn validate(file: &str, doc: &Value) {
    let errs = errors(file, doc);
    assert!(errs.is_empty(), "{file}:\n{}\n{doc:#}", errs.join("\n"));
}

/// Appends the errors of `v` against `schema` (a part of file `file`), each with its path.
pub fn check(file: &str, schema: &Value, v: &Value, path: &str, errs: &mut Vec<String>) {
    let obj = schema.as_object().expect("a schema is an object");
    for k in obj.keys() {
        assert!(
            KEYWORDS.contains(&k.as_str()),
            "{file}: keyword {k} not supported"
        );
    }
    if let Some(r) = obj.get("$ref").and_then(Value::as_str) {
        let (f, frag) = r.split_once('#').unwrap_or((r, ""));
        let f = if f.is_empty() { file } else { f };
        let root = load(f);
        let mut target = &root;
        for part in frag.split('/').filter(|p| !p.is_empty()) {
            target = &target[part];
        }
        assert!(!target.is_null(), "{file}: $ref {r} not found");
        check(f, target, v, path, errs);
    }
    for s in obj
        .get("allOf")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        check(file, s, v, path, errs);
    }
    if let Some(one) = obj.get("oneOf").and_then(Value::as_array) {
        let branches: Vec<Vec<String>> = one
            .iter()
            .map(|s| {
                let mut e = Vec::new();
                check(file, s, v, path, &mut e);
                e
            })
            .collect();
        let passing = branches.iter().filter(|e| e.is_empty()).count();
        if passing != 1 {
            errs.push(format!("{path}: matches {passing} of the oneOf schemas"));
        }
        if passing == 0 {
            // Say why each failed, so a broken field is named wherever it sits.
            for (i, e) in branches.iter().enumerate() {
                errs.extend(e.iter().map(|x| format!("(oneOf[{i}]) {x}")));
            }
        }
    }
    if let Some(t) = obj.get("type") {
        let ok = match t {
            Value::String(t) => type_ok(t, v),
            Value::Array(ts) => ts.iter().any(|t| type_ok(t.as_str().unwrap(), v)),
            _ => panic!("{file}: bad type"),
        };
        if !ok {
            errs.push(format!("{path}: {v} is not of type {t}"));
            return;
        }
    }
    if let Some(e) = obj.get("enum").and_then(Value::as_array) {
        if !e.contains(v) {
            errs.push(format!("{path}: {v} is not one of {e:?}"));
        }
    }
    if let Some(c) = obj.get("const") {
        if c != v {
            errs.push(format!("{path}: {v} is not {c}"));
        }
    }
    if let Some(m) = obj.get("minimum").and_then(Value::as_f64) {
        if v.as_f64().is_some_and(|x| x < m) {
            errs.push(format!("{path}: {v} is below {m}"));
        }
    }
    let Some(o) = v.as_object() else {
        if let (Some(items), Some(a)) = (obj.get("items"), v.as_array()) {
            for (i, x) in a.iter().enumerate() {
                check(file, items, x, &format!("{path}[{i}]"), errs);
            }
        }
        return;
    };
    for k in obj
        .get("required")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if !o.contains_key(k.as_str().unwrap()) {
            errs.push(format!("{path}: missing {k}"));
        }
    }
    let props = obj.get("properties").and_then(Value::as_object);
    for (k, s) in props.into_iter().flatten() {
        if let Some(x) = o.get(k) {
            check(file, s, x, &format!("{path}.{k}"), errs);
        }
    }
    if obj.get("additionalProperties") == Some(&Value::Bool(false)) {
        for k in o.keys() {
            if !props.is_some_and(|p| p.contains_key(k)) {
                errs.push(format!("{path}: unexpected property {k}"));
            }
        }
    }
}
