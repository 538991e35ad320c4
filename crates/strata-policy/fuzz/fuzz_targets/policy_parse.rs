//! Fuzz the policy parser and evaluator: no input may panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strata_policy::{CallKind, Policy, PolicySet, ToolCall};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    match Policy::parse(text) {
        Err(e) => assert!(e.line >= 1 && e.column >= 1),
        Ok(p) => {
            if let Ok(set) = PolicySet::new(None, Some(std::sync::Arc::new(p)), None) {
                let call = ToolCall {
                    tenant: "t".into(),
                    sandbox: None,
                    actor: "a".into(),
                    kind: CallKind::Exec { argv: vec![], shell: Some(text.chars().take(256).collect()) },
                };
                let _ = set.evaluate(&call);
            }
        }
    }
});
