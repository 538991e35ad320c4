//! Wire protocol between the host and the strata guest agent: framing, messages, and the async host-side client.
