//! Tool-call policy: rules, evaluation, audit chain, egress proxy.
