//! The library's modules depend on each other one way (lib.rs says the
//! order): no import loop between top-level modules, and the leaves
//! (`config`, `metrics`, `proto`) and the domain (`model`) import nothing
//! above them. Read from the source, so a new `use crate::…` that breaks the
//! layering fails here instead of in review.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top-level modules of the library, from `src/lib.rs`.
fn modules(src: &Path) -> Vec<String> {
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("read lib.rs");
    let mut modules: Vec<String> = lib
        .lines()
        .filter_map(|line| line.trim().strip_prefix("pub mod "))
        .map(|rest| rest.trim_end_matches(['{', ';', ' ']).to_owned())
        .collect();
    modules.sort();
    modules
}

fn rust_files(path: &Path, files: &mut Vec<PathBuf>) {
    if path.is_dir() {
        for entry in std::fs::read_dir(path).expect("read dir") {
            rust_files(&entry.expect("entry").path(), files);
        }
    } else if path.is_file() && path.extension().is_some_and(|ext| ext == "rs") {
        files.push(path.to_owned());
    }
}

/// Which other top-level modules each module's code names as `crate::x`
/// (comments left out).
fn dependencies(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let modules = modules(src);
    let mut graph = BTreeMap::new();
    for module in &modules {
        let mut files = Vec::new();
        rust_files(&src.join(module), &mut files);
        rust_files(&src.join(format!("{module}.rs")), &mut files);
        let mut used = BTreeSet::new();
        for file in files {
            let text = std::fs::read_to_string(&file).expect("read source");
            for line in text.lines() {
                let code = line.split("//").next().unwrap_or("");
                for (index, _) in code.match_indices("crate::") {
                    let name: String = code[index + "crate::".len()..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    if name != *module && modules.contains(&name) {
                        used.insert(name);
                    }
                }
            }
        }
        graph.insert(module.clone(), used);
    }
    graph
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn no_import_loop_between_top_level_modules() {
    let graph = dependencies(&src());
    // Depth-first search for a back edge; report the loop it closes.
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) {
        if done.contains(node) {
            return;
        }
        if let Some(start) = path.iter().position(|seen| seen == node) {
            panic!("import loop: {} -> {node}", path[start..].join(" -> "));
        }
        path.push(node.to_owned());
        for next in &graph[node] {
            visit(next, graph, path, done);
        }
        path.pop();
        done.insert(node.to_owned());
    }
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        visit(node, &graph, &mut Vec::new(), &mut done);
    }
}

#[test]
fn leaves_and_the_domain_import_nothing_above_them() {
    let graph = dependencies(&src());
    for leaf in ["config", "metrics", "supervisor"] {
        assert!(graph[leaf].is_empty(), "{leaf} imports {:?}", graph[leaf]);
    }
    let model: Vec<&String> = graph["model"].iter().collect();
    assert!(
        model.iter().all(|name| *name == "proto"),
        "model imports {model:?}; it may use only the generated protobuf types"
    );
    let store: Vec<&String> = graph["store"].iter().collect();
    assert!(
        store
            .iter()
            .all(|name| ["model", "config"].contains(&name.as_str())),
        "store imports {store:?}; it may use only the model and the config leaf"
    );
}

#[test]
fn the_scan_sees_real_dependencies() {
    // Guards the scanner itself: the actors certainly use the store.
    let graph = dependencies(&src());
    assert!(graph["actors"].contains("store"), "{graph:?}");
    assert!(graph["broker"].contains("actors"), "{graph:?}");
}

#[test]
fn the_metrics_leaf_names_every_status_as_the_model_does() {
    // `metrics` keeps its own copy of the status names so it imports
    // nothing; this keeps the copy equal to the domain's.
    let names: Vec<String> = taskbroker::model::ActivationStatus::ALL
        .iter()
        .map(|status| status.as_str().to_ascii_lowercase())
        .collect();
    assert_eq!(names, taskbroker::metrics::labels::ACTIVATION_STATUSES);
    for status in taskbroker::model::ActivationStatus::ALL {
        assert_eq!(
            taskbroker::metrics::labels::activation_status(status.as_str()),
            Some(status.as_str().to_ascii_lowercase().as_str())
        );
    }
}

#[test]
fn the_store_metrics_label_exactly_the_operations_the_store_actor_runs() {
    // Pre-created series for an operation nothing runs would stay at zero
    // forever; an operation without one would appear only once it ran.
    let mut actor: Vec<&str> = taskbroker::actors::store::OPERATIONS.to_vec();
    let mut labels: Vec<&str> = taskbroker::metrics::labels::STORE_OPERATIONS.to_vec();
    actor.sort_unstable();
    labels.sort_unstable();
    assert_eq!(actor, labels);
}
