//! TEST ONLY. A tool parser that passes text through as content, except that a delta holding a
//! command word reaches for something the sandbox denies, the way a naive plugin would:
//!
//! - `OPEN_SOCKET`, `RESOLVE_NAME`, `OPEN_FILE`: a TCP connect, a DNS lookup or a file open,
//!   `expect`ed to work (so the plugin panics, printing to stderr, and traps);
//! - `PROBE_SANDBOX`: tries all three and reports each outcome as content instead;
//! - `SLEEP`: blocks on a timer (the sandbox has no time to wait for);
//! - `PRINT`: writes to stdout and stderr, which must keep working.
//!
//! A stream whose declared tools mention `OPEN_SOCKET` connects on its first non-empty delta,
//! so an HTTP test can arm it without controlling what the model writes.
//!
//! The host must end only the call that hit a denial, with a typed error, and never panic.

use std::fs::File;
use std::io::Write;
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use k3_plugin_sdk::{Event, Info, Plugin, PluginError, StreamingParser, ToolOptions, ToolParser};

/// The discard port on loopback: nothing in the sandbox may reach even that.
const TCP_TARGET: &str = "127.0.0.1:9";
const DNS_TARGET: (&str, u16) = ("example.com", 80);
const FILE_TARGET: &str = "/etc/passwd";

pub struct DeniedSocket {
    /// Connect on the first non-empty delta (the tools mention `OPEN_SOCKET`).
    armed: bool,
}

impl Plugin for DeniedSocket {
    const INFO: Info = Info::new(
        "testdata-denied-socket",
        "0.0.1",
        "test plugin that reaches for denied WASI interfaces on command",
    );
}

/// How each denied operation went, as one line (`tcp=...;dns=...;file=...`).
fn probe() -> String {
    let tcp = match TcpStream::connect(TCP_TARGET) {
        Ok(_) => "CONNECTED".to_string(),
        Err(e) => format!("{:?}", e.kind()),
    };
    let dns = match DNS_TARGET.to_socket_addrs() {
        Ok(addrs) => format!("RESOLVED({})", addrs.count()),
        Err(e) => format!("{:?}", e.kind()),
    };
    let file = match File::open(FILE_TARGET) {
        Ok(_) => "OPENED".to_string(),
        Err(e) => format!("{:?}", e.kind()),
    };
    format!("tcp={tcp};dns={dns};file={file}")
}

impl StreamingParser for DeniedSocket {
    fn feed(&mut self, delta: &str) -> Result<Vec<Event>, PluginError> {
        if delta.contains("OPEN_SOCKET") || (self.armed && !delta.is_empty()) {
            let stream = TcpStream::connect(TCP_TARGET).expect("connect to the discard port");
            drop(stream);
        }
        if delta.contains("RESOLVE_NAME") {
            let n = DNS_TARGET
                .to_socket_addrs()
                .expect("resolve a name")
                .count();
            std::hint::black_box(n);
        }
        if delta.contains("OPEN_FILE") {
            drop(File::open(FILE_TARGET).expect("open a host file"));
        }
        if delta.contains("PROBE_SANDBOX") {
            return Ok(vec![Event::Content(probe())]);
        }
        if delta.contains("SLEEP") {
            std::thread::sleep(Duration::from_millis(20));
            return Ok(vec![Event::Content("slept".into())]);
        }
        if delta.contains("PRINT") {
            println!("a line on stdout");
            eprintln!("a line on stderr");
            let _ = std::io::stdout().flush();
            return Ok(vec![Event::Content("printed".into())]);
        }
        Ok(if delta.is_empty() {
            vec![]
        } else {
            vec![Event::Content(delta.to_string())]
        })
    }

    fn finish(&mut self) -> Result<Vec<Event>, PluginError> {
        Ok(Vec::new())
    }
}

impl ToolParser for DeniedSocket {
    fn new(options: ToolOptions) -> Self {
        DeniedSocket {
            armed: options
                .tools_json
                .is_some_and(|tools| tools.contains("OPEN_SOCKET")),
        }
    }
}

k3_plugin_sdk::export_tool_parser!(DeniedSocket);
